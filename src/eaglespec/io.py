"""File helpers. Atomic writes: write to a temporary file in the same folder, then rename over the target."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save_file


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's (or a folder's entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """`write` a temporary file beside `path`, flush it to the disk, rename it over `path`, and flush
    the folder: after a crash `path` holds the old content or the whole new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        fsync_path(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes files private; these are ordinary outputs
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(text: str, path: str | os.PathLike) -> None:
    def w(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)
    _atomic(path, w)


def atomic_write_json(obj: Any, path: str | os.PathLike) -> None:
    atomic_write_text(json.dumps(obj, indent=2) + "\n", path)


def atomic_save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike,
                            metadata: dict[str, str] | None = None) -> None:
    _atomic(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    _atomic(path, lambda tmp: torch.save(obj, tmp))


def short_path(path: str | os.PathLike) -> str:
    """A path as reports and shipped metadata show it: relative to the working folder when inside
    it, else with the home folder as ~ (no machine-specific prefixes in committed files)."""
    p, cwd, home = str(path), str(Path.cwd()), str(Path.home())
    if p.startswith(cwd + os.sep):
        return p[len(cwd) + 1:]
    return "~" + p[len(home):] if p == home or p.startswith(home + os.sep) else p
