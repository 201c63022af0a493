"""What the decode loop asks of the hardware, with plain-torch answers.

The loop (`spec.engine`) and the verification math (`spec.verify`) call a `Backend` for the few
things a device can do faster than generic torch: picking greedy tokens, drawing samples, the
residual law of a rejected draft, compacting the KV cache, planning attention over a tree, and
running a whole draft level in one call. Every method has a torch answer here, so the paper's
algorithm runs and is tested on any device; a faster backend (`eaglespec.cpu.CpuBackend`, or a
CUDA one) subclasses this one and overrides what it does better. A backend may decline a call
(`draw`, `residual_law`, `draft_step` answer None / False) and the caller falls back to torch.

The invariants: `argmax` is torch's (the first index of a tied maximum); `draw` and
`residual_law` compute the same law as their torch fallbacks; `compact_rows` leaves the cache as
`KVCache.compact_rows` would. So a backend changes speed, never which tokens come out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

if TYPE_CHECKING:
    from .cache import KVCache
    from .head import EagleDraftHead


class DraftLevel(NamedTuple):
    """A draft level run in one call (`Backend.draft_step`): the rows' new features (1, M, H); with
    k > 0 each asked row's k best draft log-probabilities and their target ids, best first; with
    probs its whole draft law over the draft vocabulary (rows, draft ids), as the head's `logits`
    and a softmax give it."""
    features: torch.Tensor
    logprobs: list[list[float]] | None
    ids: list[list[int]] | None
    probs: torch.Tensor | None


class Backend:
    """Plain torch on any device."""

    name = "torch"

    def prepare(self, model: nn.Module, head: "EagleDraftHead | None") -> None:
        """Called once per engine: make the head fit this backend (e.g. pack its weights)."""

    def describe(self, model: nn.Module, head: "EagleDraftHead | None") -> dict[str, Any]:
        """What sets this backend's speed on this model (keys a machine's cost curve)."""
        return {}

    def argmax(self, logits: torch.Tensor) -> list | int:
        """``logits.argmax(-1).tolist()``."""
        return logits.argmax(-1).tolist()

    def draw(self, p: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
        """Per row of p (R, V; >= 0, unnormalised) k = u.shape[1] inverse-CDF draws without
        replacement by the uniforms u (R, k) float64, or None to let the caller draw with torch."""
        return None

    def residual_law(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor | None | bool:
        """norm(max(0, p - q)); None where no mass is left; False to let the caller compute it."""
        return False

    def compact_rows(self, cache: "KVCache", dst: list[int], src: int, keeps: list[list[int]]) -> None:
        """Row b's cache entries src + keeps[b][i] -> dst[b] + i in every layer."""
        cache.compact_rows(dst, src, keeps)

    def forward_kwargs(self, mask: torch.Tensor | None, batch: int, rows: int, past: int,
                       seen: list[list[int]] | None) -> dict[str, Any]:
        """Extra keywords for a target forward of `rows` new tokens per sequence after `past` cached
        ones (`seen`: for one sequence, which new rows each row sees, as `mask` says)."""
        return {}

    def rows_plan(self, prefix: int, seen: list[list[int]]) -> Any:
        """An attention plan for draft rows that see `prefix` cached entries and then `seen`'s, for
        `draft_step` and the head's forward; None where the backend has none."""
        return None

    def draft_step(self, head: "EagleDraftHead", features: torch.Tensor, tokens: list[int], positions: list[int],
                   cache: "KVCache", plan: Any = None, k: int = 0, temperature: float = 1.0, first: int = 0,
                   probs: bool = False) -> DraftLevel | None:
        """The head's forward on the rows of one sequence and, with k > 0, rows first..'s k best
        draft tokens (with `probs`, their whole law) in one call; None: the loop runs `head` and
        `head.logits` itself."""
        return None


TORCH = Backend()
