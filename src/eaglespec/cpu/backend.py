"""`spec.backend.Backend` on eaglespec's x86 kernels (`skinny.c`).

Greedy picks, sampling draws and residual laws in C (the same laws as torch's), the KV cache
compacted in one call for every layer, row-exact attention plans made once per forward, and the
head's draft levels in one C call each. Every override returns what the torch default would, or
declines and lets it run: tokens never depend on the backend.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..spec.backend import Backend, DraftLevel
from ..spec.cache import KVCache
from ..spec.head import EagleDraftHead
from . import attention, kernels, lean
from .head import PackedHead, head_kind_for, pack_head
from .quant import target_kernels


def compact_rows(cache: KVCache, dst: list[int], src: int, keeps: list[list[int]]) -> None:
    """`KVCache.compact_rows`, every layer's rows in one `kernels.kv_compact` call where the buffers
    allow it (fp32 CPU buffers alike in shape, ascending keeps moving down)."""
    bufs = cache.uniform_buffers() if kernels.available() else None
    if bufs is not None and all(d <= src and k == sorted(k) and (not k or k[0] >= 0) for d, k in zip(dst, keeps)):
        kernels.kv_compact(*bufs, dst, src, keeps)
        cache.set_length(max(d + len(k) for d, k in zip(dst, keeps)))
        return
    cache.compact_rows(dst, src, keeps)


class CpuBackend(Backend):
    """The kernels for one target model on the CPU (see the module's docstring)."""

    name = "cpu"

    def __init__(self, model: nn.Module):
        cfg = model.config
        p = next(model.parameters())
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # row-exact attention on skinny.c's kernel: its plan is made once per forward, outside any
        # compiled graph (see attention.pack_plan), instead of by the first layer
        self.plan_rows = ((getattr(cfg, "_attn_implementation", None) == attention.NAME
                           or lean.one_call_layers(model.get_decoder()))
                          and attention.kernel_fits(p.dtype, p.device, head_dim))

    def prepare(self, model: nn.Module, head: EagleDraftHead | None) -> None:
        """A CPU-tuned target gets a CPU-tuned head: drafting must stay cheap next to a fast step
        (`pack_head` first keeps another choice)."""
        done = target_kernels(model)
        if head is not None and (done.quantization or done.packed):
            pack_head(head, head_kind_for(done.quantization))

    def describe(self, model: nn.Module, head: EagleDraftHead | None) -> dict[str, Any]:
        done = target_kernels(model)
        info: dict[str, Any] = {"quantization": done.quantization, "kernels": "packed" if done.packed else None}
        if (done.packed_kernel or "").startswith("skinny"):
            info["packed_kernel"] = done.packed_kernel
        if done.exact_codes:
            info["exact_codes"] = done.exact_codes
        if lean.one_call_layers(model.get_decoder()):
            info["one_call"] = True
        accel = head.accel if head is not None else None
        if isinstance(accel, PackedHead):
            info["head_kernels"] = accel.kind
            info["head_layer_kernel"] = type(head.fc).__name__
            if accel.step_spec() is not None:
                info["draft_step"] = True
        return info

    def argmax(self, logits: torch.Tensor) -> list | int:
        return kernels.argmax(logits)

    def draw(self, p: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
        return kernels.draw(p, u)

    def residual_law(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor | None | bool:
        return kernels.residual_law(p, q)

    def compact_rows(self, cache: KVCache, dst: list[int], src: int, keeps: list[list[int]]) -> None:
        compact_rows(cache, dst, src, keeps)

    def forward_kwargs(self, mask: torch.Tensor | None, batch: int, rows: int, past: int,
                       seen: list[list[int]] | None) -> dict[str, Any]:
        if not self.plan_rows or rows > attention.MAX_EXACT_ROWS:
            return {}
        plan = (attention.rows_plan(past, seen) if seen is not None and batch == 1
                else attention.pack_plan(mask, batch, rows, past + rows))
        return {"eaglespec_plan": plan}

    def rows_plan(self, prefix: int, seen: list[list[int]]) -> Any:
        return attention.rows_plan(prefix, seen)

    def draft_step(self, head: EagleDraftHead, features: torch.Tensor, tokens: list[int], positions: list[int],
                   cache: KVCache, plan: Any = None, k: int = 0, temperature: float = 1.0, first: int = 0,
                   probs: bool = False) -> DraftLevel | None:
        if not isinstance(head.accel, PackedHead):
            return None
        return head.accel.draft_step(features, tokens, positions, cache, plan, k, temperature, first, probs)
