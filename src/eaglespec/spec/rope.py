"""Rotary embeddings read from a table of every position, for inference."""

from __future__ import annotations

import torch
from torch import nn

STATIC_ROPE = ("default", "linear", "llama3")  # rope types whose angles depend on the position only


def rope(rotary: nn.Module, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary(x, position_ids)` read from a table of every position so far: the module's own output
    for positions 0..P-1, computed once (each angle is one product, so a row is the same whatever the
    batch), instead of ~7 torch ops per forward. Rope types whose angles move with the sequence
    length, and autograd, call the module."""
    if getattr(rotary, "rope_type", "default") not in STATIC_ROPE or torch.is_grad_enabled():
        return rotary(x, position_ids)
    cos, sin = rope_table(rotary, x, int(position_ids.max()) + 1)
    return cos[position_ids], sin[position_ids]


def rope_table(rotary: nn.Module, x: torch.Tensor, need: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope`'s cos and sin tables, (P, D) with P >= need, for a static rope type (grown by doubling)."""
    table = getattr(rotary, "_eaglespec_table", None)
    if table is None or table[0].shape[1] < need or table[0].dtype != x.dtype or table[0].device != x.device:
        size = max(need, 2 * table[0].shape[1] if table is not None else 1024)
        table = rotary(x, torch.arange(size, device=x.device)[None])
        rotary._eaglespec_table = table
    return table[0][0], table[1][0]
