"""Verification math: logits processing, greedy acceptance, multi-round speculative sampling.

Pure functions of tensors and lists. The engine calls them; tests check them exhaustively.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import EaglespecError
from .backend import TORCH, Backend


# Below this, logits / temperature can overflow to inf (NaN after softmax); greedy decoding
# (temperature 0) is what such a temperature asks for anyway.
MIN_TEMPERATURE = 1e-3
SEEDS = range(-(2**63), 2**64)  # what a torch generator takes; Python ints are unbounded


@dataclass(frozen=True)
class SamplingParams:
    """What vanilla decoding would do with the target's logits. temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_p, self.top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
            and math.isfinite(temperature) and (temperature == 0 or temperature >= MIN_TEMPERATURE)):
        raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {temperature}")
    if not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not (isinstance(top_k, int) and top_k >= 0):
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k}")


def target_probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (the order of transformers' generate), then softmax.

    Works on (..., V) in float32. Vanilla sampling and verification both use this one function,
    which is what makes sampling lossless by construction.
    """
    logits = logits.float()
    if sp.temperature != 1.0:  # x / 1 is x: a pass over the vocabulary saved, the same bits
        logits = logits / sp.temperature
    if sp.top_k > 0 and sp.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sp.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sp.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop the low tail whose total mass is <= 1 - top_p; always keep the best token
        drop_sorted = cum <= (1.0 - sp.top_p)
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def greedy_accept(target_argmax: list[int], tokens: list[int], children: list[list[int]]) -> tuple[list[int], int]:
    """Longest root-to-node path whose tokens equal the target's argmax at their parent.

    Returns (accepted node indices, excluding the root; bonus token from the last accepted node).
    """
    path: list[int] = []
    node = 0
    while True:
        want = target_argmax[node]
        nxt = next((c for c in children[node] if tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


def sample_token(p: torch.Tensor, generator: torch.Generator | None = None, backend: Backend = TORCH) -> int:
    """One draw from p (V,), non-negative, not necessarily normalised, by inverse CDF in float64
    (torch.multinomial is ~30x slower over a 49k vocabulary on a CPU; a sampled step pays it once
    per token), or by the backend's `draw` of the same law. Zero entries are never drawn: u is kept
    below the total even where a generator's interval is closed."""
    u = torch.rand(1, generator=generator, dtype=torch.float64, device=p.device)
    drawn = backend.draw(p[None], u[None])
    if drawn is not None:
        return int(drawn[0, 0])
    c = p.double().cumsum(-1)
    total = c[-1:]
    if not bool(torch.isfinite(total).all()) or float(total) <= 0.0:  # else the search would answer V
        raise EaglespecError("cannot sample: the distribution has no finite positive mass (NaN or inf logits)")
    u = u * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return int(torch.searchsorted(c, u, right=True))


def renormalise(x: torch.Tensor) -> torch.Tensor | None:
    """x / x.sum(), or None when nothing is left. The divisor stays a tensor: CUDA divides by a
    Python number as x * (1 / number), and 1 / a subnormal total is inf in float32 (NaN, then a
    failed draw), where a tensor divisor is a true division."""
    total = x.sum()
    return x / total if float(total) > 0.0 else None


def speculative_step(
    p: torch.Tensor,
    cand_tokens: list[int],
    cand_q: list[torch.Tensor | None],
    generator: torch.Generator | None = None,
    backend: Backend = TORCH,
) -> tuple[int | None, int]:
    """Algorithm 1 of the paper (multi-round speculative sampling) at one tree position.

    p: target distribution (V,). cand_tokens[i] was drawn from cand_q[i] (None = one-hot on the
    token, i.e. chosen deterministically). Siblings are tried in order; after a rejection
    p <- norm(max(0, p - q_i)). Returns (index of the accepted candidate or None, token).
    If siblings were drawn without replacement, each cand_q[i] must already be the renormalised
    distribution it was actually drawn from.
    """
    p = p.float()
    for i, (tok, q) in enumerate(zip(cand_tokens, cand_q)):
        q_tok = 1.0 if q is None else float(q[tok])
        p_tok = float(p[tok])
        r = float(torch.rand((), generator=generator, device=p.device))
        if q_tok > 0 and r < p_tok / q_tok:
            return i, tok
        nxt = False if q is None else backend.residual_law(p, q)  # False: torch computes it
        if nxt is False:
            if q is None:
                residual = p.clone()
                residual[tok] = 0.0
            else:
                residual = (p - q.float()).clamp_min(0.0)
            nxt = renormalise(residual)
        if nxt is None:
            # p <= q everywhere means p == q (both sum to 1): acceptance was certain up to rounding
            continue
        p = nxt
    return None, sample_token(p, generator, backend)


def sample_accept(
    probs: torch.Tensor,
    tokens: list[int],
    children: list[list[int]],
    q: list[torch.Tensor | None],
    generator: torch.Generator | None = None,
    backend: Backend = TORCH,
) -> tuple[list[int], int]:
    """Walk the tree from the root, running `speculative_step` at each node's children.

    probs: (n, V) processed target distributions at every node; tokens / q per node.
    Returns (accepted node indices excluding the root, bonus token).
    """
    path: list[int] = []
    node = 0
    while True:
        kids = children[node]
        if not kids:
            return path, sample_token(probs[node], generator, backend)
        idx, tok = speculative_step(probs[node], [tokens[c] for c in kids], [q[c] for c in kids], generator, backend)
        if idx is None:
            return path, tok
        node = kids[idx]
        path.append(node)
