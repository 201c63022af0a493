"""Other engines that run eaglespec's heads: where they live on this machine, and the head
conversions that need them (GGUF for llama.cpp). `spec.formats` writes the layouts that need nothing
but eaglespec."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from .errors import EaglespecError
from .platform import cache_root
from .spec.formats import export_head

GGUF_TYPES = {None: "f32", torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def engines_dir() -> Path:
    """Where `scripts/engines.sh` puts the other engines: llama.cpp's source and build, vLLM's venv."""
    return cache_root() / "engines"


def llama_cpp_dir() -> Path:
    """llama.cpp's source tree: ``$EAGLESPEC_LLAMA_CPP``, else the one `scripts/engines.sh` unpacked."""
    return Path(os.environ.get("EAGLESPEC_LLAMA_CPP", engines_dir() / "llama.cpp"))


def llama_cpp_eagle3_gap(model_type: str) -> str | None:
    """Why the llama.cpp source tree (`llama_cpp_dir`) cannot draft EAGLE-3 for a target of this
    family, in one line; None when it can, or when the tree has no graph file of that name to read.
    Its EAGLE-3 drafting reads the target's hidden states at the head's layers, which a family's
    graph provides only where it records each layer's input (``t_layer_inp``); without them the
    drafting aborts ("layer input tensor is null")."""
    graph = llama_cpp_dir() / "src" / "models" / f"{model_type.replace('_', '-')}.cpp"
    if graph.is_file() and "t_layer_inp" not in graph.read_text(errors="replace"):
        return (f"llama.cpp's {model_type} graph ({graph.name}) records no layer inputs, which its EAGLE-3 drafting "
                "reads (it would abort: 'layer input tensor is null'); its llama and qwen3 graphs do")
    return None


def export_gguf(head, target_dir: str | os.PathLike, out: str | os.PathLike, target_config=None,
                dtype: torch.dtype | None = None) -> Path:
    """`head` (an eagle3 head) as a GGUF that llama.cpp's EAGLE-3 drafting reads (``-md``), written
    by llama.cpp's own converter from the speculators layout; `target_dir` is the target's
    Hugging Face folder (its tokenizer and config go into the GGUF). Returns the file."""
    if getattr(head.layer_config, "attention_bias", False) or head.layer_config.model_type != "llama":
        raise EaglespecError(f"llama.cpp's EAGLE-3 head is a Llama layer without biases; this head's layer is "
                             f"{head.layer_config.model_type}'s with attention biases (train a new eagle3 head: "
                             "eaglespec trains them as Llama layers for every target)")
    convert = llama_cpp_dir() / "convert_hf_to_gguf.py"
    if not convert.is_file():
        raise EaglespecError(f"{convert}: missing; GGUF export runs llama.cpp's converter (bash scripts/engines.sh "
                             "llama.cpp unpacks it, or set EAGLESPEC_LLAMA_CPP to a llama.cpp source tree)")
    if dtype not in GGUF_TYPES:
        raise EaglespecError(f"gguf export writes {', '.join(t for t in GGUF_TYPES.values())} weights, not {dtype}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gguf = out / "head.gguf"
    with tempfile.TemporaryDirectory() as tmp:
        export_head(head, "speculators", tmp, target=target_config)
        run = subprocess.run([sys.executable, str(convert), tmp, "--target-model-dir", str(target_dir),
                              "--outfile", str(gguf), "--outtype", GGUF_TYPES[dtype]],
                             capture_output=True, text=True)
    if run.returncode != 0 or not gguf.is_file():
        tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
        raise EaglespecError(f"llama.cpp's converter failed: {tail[0][:300]}")
    return gguf
