"""Row-exact attention: each query row gets the same floating-point result whatever else is in the batch.

Greedy EAGLE equals vanilla decoding only if verifying a token inside a tree computes the same
logits as decoding it alone. Linear layers are row-independent, but a fused attention kernel
run over M query rows can round differently from the same kernel over one row (~1e-7 in fp32).
fp32 shrugs that off; a target with bf16 activations (the int4 kernels) amplifies it to whole
bf16 ulps, which flips near-tied argmaxes within a few hundred tokens.

So for short query blocks (decode steps, tree verification) every row is computed by its own
one-row SDPA call over exactly the keys it may see, gathered in order (prefix, then ancestors):
the very call vanilla decoding makes at that position. Long blocks (prompt prefill) take the
usual batched kernel; vanilla and EAGLE prefill the same prompt, so they still agree.
Registered with transformers as attn_implementation="eaglespec_exact".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "eaglespec_exact"
MAX_EXACT_ROWS = 64  # query blocks up to this size take the row-by-row path

_plan_memo: tuple[object, tuple, list] | None = None  # (mask, key shape, plan): one plan per forward


def _plan(mask: torch.Tensor | None, b: int, m: int, length: int) -> list[tuple[int, int, int, torch.Tensor | None]]:
    """Per (batch row, query row): (b, i, n, idx): attend to keys[:n] if idx is None, else keys[idx]."""
    if mask is None:  # causal over the cache: row i sees everything up to its own position
        return [(r, i, length - m + i + 1, None) for r in range(b) for i in range(m)]
    allowed = mask[:, 0, :, :length] if mask.dtype == torch.bool else mask[:, 0, :, :length] > torch.finfo(mask.dtype).min / 2
    allowed = allowed.expand(b, m, length)
    counts = allowed.sum(-1)
    prefix_like = (allowed == (torch.arange(length, device=mask.device) < counts[..., None])).all(-1)
    counts, prefix_like = counts.tolist(), prefix_like.tolist()
    plan = []
    for r in range(b):
        for i in range(m):
            idx = None if prefix_like[r][i] else allowed[r, i].nonzero().squeeze(-1)
            plan.append((r, i, counts[r][i], idx))
    return plan


def exact_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention interface: query (B, H, M, d), key/value (B, Hkv, L, d) -> (B, M, H, d)."""
    b, h, m, d = query.shape
    if m > MAX_EXACT_ROWS:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    global _plan_memo
    length = key.shape[2]
    shape = (b, m, length)
    if _plan_memo is not None and _plan_memo[0] is attention_mask and _plan_memo[1] == shape:
        plan = _plan_memo[2]
    else:
        plan = _plan(attention_mask, b, m, length)
        _plan_memo = (attention_mask, shape, plan)  # holding the mask keeps its id unique
    gqa = key.shape[1] != h
    out = query.new_empty(b, m, h, value.shape[-1])
    for r, i, n, idx in plan:
        if idx is None:
            k, v = key[r:r + 1, :, :n], value[r:r + 1, :, :n]
        else:
            k, v = key[r:r + 1].index_select(2, idx), value[r:r + 1].index_select(2, idx)
        o = F.scaled_dot_product_attention(query[r:r + 1, :, i:i + 1], k, v, scale=scaling, enable_gqa=gqa)
        out[r, i] = o[0, :, 0]
    return out, None


def register() -> str:
    """Make attn_implementation="eaglespec_exact" known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, exact_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
