"""eaglespec: lossless EAGLE speculative decoding for Hugging Face causal language models.

Layers, each importing only those below it: `platform` (machine facts, cache folders); `spec`
(the paper's algorithm on torch); `cpu` (a backend) and `policy` (how much to draft), which plug
into `spec`; `models` (the registry, `load_target`, and `Engine`, which wires them together);
then training (`train`), benchmarks (`bench`), the server and the CLI.
"""

from importlib import import_module
from typing import Any

from .errors import EaglespecError

# loaded on first use, so that `eaglespec --help` and a refused transformers version answer in one line
_LAZY = {"Engine": "models", "ContinuousBatch": "spec", "load_target": "models", "EagleDraftHead": "spec", "GenerationOutput": "spec",
         "GenerationStats": "spec", "SamplingParams": "spec"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'eaglespec' has no attribute {name!r}")


__all__ = ["ContinuousBatch", "Engine", "GenerationOutput", "GenerationStats", "EaglespecError", "EagleDraftHead", "load_target",
           "SamplingParams"]
__version__ = "0.1.0"
