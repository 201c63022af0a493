"""eaglespec: lossless EAGLE speculative decoding for Hugging Face causal language models."""

from .engine import Engine, GenerationOutput, GenerationStats
from .errors import EaglespecError
from .head import EagleDraftHead
from .models import load_target
from .verify import SamplingParams

__all__ = ["Engine", "GenerationOutput", "GenerationStats", "EaglespecError", "EagleDraftHead", "load_target",
           "SamplingParams"]
__version__ = "0.1.0"
