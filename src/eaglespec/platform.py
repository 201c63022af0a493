"""Facts about the machine and where eaglespec keeps its files. Imports nothing of eaglespec's."""

from __future__ import annotations

import json
import os
import platform as _platform
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version as installed
from pathlib import Path


def cache_root() -> Path:
    """Converted models, kernels and cost curves: ``$EAGLESPEC_CACHE`` or ``~/.cache/eaglespec``."""
    return Path(os.environ.get("EAGLESPEC_CACHE", Path.home() / ".cache" / "eaglespec"))


@lru_cache(maxsize=1)
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_name() -> str:
    """The CPU model as /proc/cpuinfo names it (the platform's guess elsewhere)."""
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return _platform.processor() or _platform.machine()


def cpu_kind() -> str:
    """The CPU model with its microarchitecture where /proc/cpuinfo's name leaves it out: some
    clouds name every EPYC "AMD EPYC", while Zen 4 and Zen 5 hosts differ a lot in speed."""
    name = cpu_name()
    fields = dict(line.split(":", 1) for line in _cpuinfo().splitlines()[:30] if ":" in line)
    family = fields.get("cpu family\t", "").strip()
    model = fields.get("model\t\t", "").strip()
    if "AMD" in name and family.isdigit() and model.isdigit():
        m = int(model)
        zen4 = 0x10 <= m <= 0x1F or 0x60 <= m <= 0xAF
        zen = {25: "Zen 4" if zen4 else "Zen 3", 26: "Zen 5", 23: "Zen 2"}.get(int(family))
        if zen and zen not in name:
            return f"{name} ({zen})"
    return name


def cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists this CPU feature flag (e.g. ``avx512_vnni``)."""
    return flag in _cpuinfo().split()


# transformers releases eaglespec is tested with: [lower, upper). Its attention interface, cache
# layers and GGUF loader are what the engine and the kernels hook into, and those change across
# major versions.
TRANSFORMERS_RANGE = ((4, 57), (5, 0))


def unsupported_transformers(version: str | None = None) -> str | None:
    """Why the installed transformers cannot run eaglespec, in one line; None when it can."""
    if version is None:
        try:
            version = installed("transformers")
        except PackageNotFoundError:
            return "transformers is not installed (pip install 'transformers>=4.57.6,<5')"
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    (lo, hi), got = TRANSFORMERS_RANGE, tuple(parts)
    if not lo <= got < hi:
        return (f"transformers {version} is not supported: eaglespec needs >= {lo[0]}.{lo[1]} and < {hi[0]}.{hi[1]} "
                f"(pip install 'transformers>={lo[0]}.{lo[1]},<{hi[0]}'); run other engines in their own environment")
    return None


SHIPPED_HEADS = Path(__file__).resolve().parent / "heads"


SHIPPED_ARCHS = ("hybrid", "eagle1", "eagle3")  # heads/<model> is the default head, heads/<model>-<arch> the others


def default_head(model: str, head: str | None = None) -> str | None:
    """The head to use: `head` itself (a folder or hub id), or the head shipped in the package for a
    registered model (`head` None: the default one; "eagle1" / "eagle3" / "hybrid": that
    architecture's, unless a folder of that name exists), or None where none is shipped."""
    if head is not None and (head not in SHIPPED_ARCHS or Path(head).exists()):
        return head
    default = SHIPPED_HEADS / model.lower()
    if not (default / "config.json").is_file():
        default = None
    if head is None:
        return None if default is None else str(default)
    named = SHIPPED_HEADS / f"{model.lower()}-{head}"
    if (named / "config.json").is_file():
        return str(named)
    if default is not None and _shipped_arch(default) == head:
        return str(default)
    return None


def _shipped_arch(folder: Path) -> str:
    return json.loads((folder / "config.json").read_text()).get("arch", "hybrid")  # heads older than arch: hybrid
