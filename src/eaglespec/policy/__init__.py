"""How much to draft: cost curves and their live refit, the gate, `auto` sizing, the lookup budget
and the tree sampled requests draft with (`AutoPolicy`), plugged into `eaglespec.spec` through
its `DraftPolicy` interface."""

from .auto import AutoPolicy
from .costmodel import CostProfile, DraftGate, LiveCosts

__all__ = ["AutoPolicy", "CostProfile", "DraftGate", "LiveCosts"]
