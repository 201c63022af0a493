"""Linear layers that read the same input, fused into one matmul (q/k/v, the MLP's gate/up)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class FusedLinear(nn.Module):
    """Several linear layers that read the same input, as one matmul (q/k/v, MLP gate/up).

    transformers calls `q_proj(x)`, `k_proj(x)`, `v_proj(x)` one after the other on the same
    tensor; each is replaced by a `_Part` that asks this module for its slice, and the fused
    product is computed once per input tensor. One int4 call instead of three saves ~15 % of a
    decode step here (per-call overhead and better use of the kernel).
    """

    def __init__(self, layers: list[nn.Linear], make: Callable[[nn.Linear], nn.Module]):
        super().__init__()
        lin = nn.Linear(layers[0].in_features, sum(m.out_features for m in layers), bias=layers[0].bias is not None)
        with torch.no_grad():
            lin.weight.copy_(torch.cat([m.weight for m in layers]))
            if lin.bias is not None:
                lin.bias.copy_(torch.cat([m.bias for m in layers]))
        self.fused = make(lin)
        self.splits = [m.out_features for m in layers]
        self._last: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None

    def part(self, x: torch.Tensor, i: int) -> torch.Tensor:
        if self._last is None or self._last[0] is not x:  # holding x keeps its identity unique
            self._last = (x, self.fused(x).split(self.splits, dim=-1))
        out = self._last[1][i]
        if i == len(self.splits) - 1:
            self._last = None  # every part served: do not keep activations alive
        return out


class _Part(nn.Module):
    def __init__(self, fused: FusedLinear, i: int):
        super().__init__()
        self._fused = [fused]  # a plain list: not registered twice as a submodule
        self.i = i
        self.in_features, self.out_features = fused.fused.in_features, fused.splits[i]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fused[0].part(x, self.i)


GATED_MLPS = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP")  # forward: down(act(gate(x)) * up(x))


class GatedMLP(nn.Module):
    """transformers' gated MLP, down(act(gate(x)) * up(x)), calling gate and up as one fused layer
    directly: the same kernels and numbers as `_Part`s, without their round trip (about a third of
    an MLP call's time on one token)."""

    def __init__(self, mlp: nn.Module, gate_up: FusedLinear):
        super().__init__()
        self.gate_up, self.down_proj, self.act_fn = gate_up.fused, mlp.down_proj, mlp.act_fn
        self.split = gate_up.splits[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up(x)
        return self.down_proj(self.act_fn(gu[..., :self.split]) * gu[..., self.split:])
