"""The paper's algorithm on torch and transformers alone: the draft head, trees, verification,
the KV cache, the hidden-state tap and the decode loop, with the interfaces a backend
(`Backend`) and a drafting policy (`DraftPolicy`) implement."""

from .backend import Backend, DraftLevel
from .engine import ContinuousBatch, Engine, GenerationOutput, GenerationStats
from .head import EagleDraftHead
from .policy import DraftPolicy, Prediction
from .verify import SamplingParams

__all__ = ["Backend", "ContinuousBatch", "DraftLevel", "DraftPolicy", "EagleDraftHead", "Engine", "GenerationOutput",
           "GenerationStats", "Prediction", "SamplingParams"]
