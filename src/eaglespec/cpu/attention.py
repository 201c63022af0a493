"""Row-exact attention: each query row gets the same floating-point result whatever else is in the batch.

Greedy EAGLE equals vanilla decoding only if verifying a token inside a tree computes the same
logits as decoding it alone. Linear layers are row-independent, but a fused attention kernel
run over M query rows can round differently from the same kernel over one row (~1e-7 in fp32).
fp32 shrugs that off; a target with bf16 activations (the int4 kernels) amplifies it to whole
bf16 ulps, which flips near-tied argmaxes within a few hundred tokens.

So for short query blocks (decode steps, tree verification) every row is computed over exactly
the keys it may see, in order (prefix, then ancestors), the way vanilla decoding computes that
position: in one call to skinny.c's `attend_rows` for the whole block (fp32, AVX-512: one fixed
sequence of operations per row and key list), else by one one-row SDPA call per row. Long blocks
(prompt prefill) take the usual batched kernel; vanilla and EAGLE prefill the same prompt, so they
still agree.
Registered with transformers as attn_implementation="eaglespec_exact".

Also here: "eaglespec_sdpa", transformers' SDPA without its K/V copy. Whenever a mask is given
(tree verification, ragged batches, every draft step of the head), transformers repeats each
key/value head for its query group (`repeat_kv`) before calling SDPA, copying the whole KV cache
on every layer of every step; on CPU that copy took as long as the attention itself (batched
decoding: 44 % of the time). SDPA's own `enable_gqa` reads the grouped cache in place and gives
bitwise the same result. `load_target` uses it on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kernels

NAME = "eaglespec_exact"
GQA_NAME = "eaglespec_sdpa"
MAX_EXACT_ROWS = 64  # query blocks up to this size take the row-by-row path

_plan_memo: tuple | None = None  # (mask, key shape, plan): one plan per forward where no eaglespec_plan comes


def _allowed(mask: torch.Tensor, b: int, m: int, length: int) -> torch.Tensor:
    """(B, M, length) bool: which keys each query row may see under a 4D bool or additive float mask."""
    allowed = mask[:, 0, :, :length] if mask.dtype == torch.bool else mask[:, 0, :, :length] > torch.finfo(mask.dtype).min / 2
    return allowed.expand(b, m, length)


def _plan(mask: torch.Tensor | None, b: int, m: int, length: int) -> list[tuple[int, int, int, torch.Tensor | None]]:
    """Per (batch row, query row): (b, i, n, tail). tail None: attend to keys[:n]. Otherwise the row
    sees keys[:n] followed by keys[tail] (a tree node: its prefix, then its ancestors' slots)."""
    if mask is None:  # causal over the cache: row i sees everything up to its own position
        return [(r, i, length - m + i + 1, None) for r in range(b) for i in range(m)]
    allowed = _allowed(mask, b, m, length)
    counts = allowed.sum(-1)
    prefix_like = (allowed == (torch.arange(length, device=mask.device) < counts[..., None])).all(-1)
    counts, prefix_like = counts.tolist(), prefix_like.tolist()
    plan = []
    for r in range(b):
        for i in range(m):
            if prefix_like[r][i]:
                plan.append((r, i, counts[r][i], None))
                continue
            idx = allowed[r, i].nonzero().squeeze(-1)
            run = int((idx == torch.arange(idx.numel(), device=idx.device)).cumprod(0).sum())
            plan.append((r, i, run, idx[run:]))
    return plan


def kernel_fits(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """skinny.c's attend_rows: fp32 on the CPU, head size a multiple of 16 up to 256 (and rows of keys
    and values contiguous, which `_kernel_fits` checks per call)."""
    return (dtype == torch.float32 and torch.device(device).type == "cpu" and head_dim % 16 == 0
            and head_dim <= 256 and kernels.attention_available())


def _layout_fits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    d = query.shape[-1]
    return (query.dtype == key.dtype == value.dtype and value.shape[-1] == d and key.stride(-1) == value.stride(-1) == 1
            and key.stride(-2) == value.stride(-2) == d)


def _kernel_fits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    return _layout_fits(query, key, value) and kernel_fits(query.dtype, query.device, query.shape[-1])


def pack_plan(mask: torch.Tensor | None, b: int, m: int, length: int) -> tuple[torch.Tensor, ...]:
    """attend_rows' int64 arrays (batch, query, n, tail offsets, tails) for `m` new rows of a
    `length`-key cache under `mask`. `Engine` computes it once per forward, outside any compiled
    graph, and hands it to every layer as the ``eaglespec_plan`` keyword."""
    rows = torch.arange(b * m)
    if mask is None:  # causal: row i sees the first length - m + i + 1 keys
        return (rows // m, rows % m, length - m + 1 + rows % m, torch.zeros(b * m + 1, dtype=torch.long),
                torch.zeros(1, dtype=torch.long))
    # _plan's rows, in a few whole-tensor ops (its loop cost ~30 us per tree row on every forward)
    allowed = _allowed(mask, b, m, length).reshape(b * m, length).cpu()
    n = allowed.long().cumprod(-1).sum(-1)  # the leading run of visible keys: the prefix
    tail = allowed & (torch.arange(length) >= n[:, None])  # what a row sees after it: its ancestors
    offsets = torch.zeros(b * m + 1, dtype=torch.long)
    offsets[1:] = tail.sum(-1).cumsum(0)
    flat = tail.nonzero()[:, 1]  # row-major: each row's positions in order
    return rows // m, rows % m, n, offsets, flat if flat.numel() else torch.zeros(1, dtype=torch.long)


def rows_plan(prefix: int, seen: list[list[int]]) -> tuple[torch.Tensor, ...]:
    """`pack_plan`'s arrays for one sequence whose m new rows each see the first `prefix` keys and
    then the new rows `seen[i]` (ascending indices into the m, e.g. a tree node's ancestors and
    itself): what `pack_plan` reads from that mask, built from the lists (a tree or a draft level
    knows them) without a mask: ~20 us instead of ~55 on every forward."""
    n, offsets, flat = [], [0], []
    for cols in seen:
        run = 0
        while run < len(cols) and cols[run] == run:  # the leading run of visible keys
            run += 1
        n.append(prefix + run)
        flat += [prefix + c for c in cols[run:]]
        offsets.append(len(flat))
    m = len(seen)
    return (torch.zeros(m, dtype=torch.long), torch.arange(m), torch.tensor(n, dtype=torch.long),
            torch.tensor(offsets, dtype=torch.long), torch.tensor(flat or [0], dtype=torch.long))


def plan_for(mask: torch.Tensor | None, b: int, m: int, length: int, packed: bool = True) -> tuple | list:
    """`pack_plan` (or with packed=False `_plan`'s rows) of this forward's mask, made by the first
    layer that asks and reused by the others (same mask object, same shape)."""
    global _plan_memo
    shape = (b, m, length)
    if _plan_memo is not None and _plan_memo[0] is mask and _plan_memo[1] == shape \
            and isinstance(_plan_memo[2], tuple) == packed:
        return _plan_memo[2]
    plan = pack_plan(mask, b, m, length) if packed else _plan(mask, b, m, length)
    _plan_memo = (mask, shape, plan)  # holding the mask keeps its id unique
    return plan


def exact_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention interface: query (B, H, M, d), key/value (B, Hkv, L, d) -> (B, M, H, d)."""
    b, h, m, d = query.shape
    if m > MAX_EXACT_ROWS:
        return gqa_sdpa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling)
    scale = scaling if scaling is not None else d ** -0.5
    packed = kwargs.get("eaglespec_plan")
    if packed is not None and _layout_fits(query, key, value):  # the engine checked the rest; compiles too
        return kernels.attend_rows(query, key, value, packed, scale), None
    packed = plan_for(attention_mask, b, m, key.shape[2], _kernel_fits(query, key, value))
    if isinstance(packed, tuple):  # pack_plan's arrays; a list is _plan's rows, for one SDPA call each
        return kernels.attend_rows(query, key, value, packed, scale), None
    plan = packed
    gqa = key.shape[1] != h
    out = query.new_empty(b, m, h, value.shape[-1])
    for r, i, n, tail in plan:
        if tail is None:
            k, v = key[r:r + 1, :, :n], value[r:r + 1, :, :n]
            out[r, i] = F.scaled_dot_product_attention(query[r:r + 1, :, i:i + 1], k, v, scale=scaling,
                                                       enable_gqa=gqa)[0, :, 0]
            continue
        # A tree node: move its few ancestors' keys right after its prefix, in place, attend over
        # the contiguous keys[:n + t], and put the slots back; gathering prefix + ancestors into a
        # new tensor instead copied the whole prefix for every node on every layer.
        t = tail.numel()
        k_anc, v_anc = key[r, :, tail], value[r, :, tail]  # copies (advanced indexing): overlap-safe
        k_old, v_old = key[r, :, n:n + t].clone(), value[r, :, n:n + t].clone()
        key[r, :, n:n + t], value[r, :, n:n + t] = k_anc, v_anc
        out[r, i] = F.scaled_dot_product_attention(query[r:r + 1, :, i:i + 1], key[r:r + 1, :, :n + t],
                                                   value[r:r + 1, :, :n + t], scale=scaling, enable_gqa=gqa)[0, :, 0]
        key[r, :, n:n + t], value[r, :, n:n + t] = k_old, v_old
    return out, None


def gqa_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, with grouped K/V read in place (no `repeat_kv` copy)."""
    if attention_mask is not None and attention_mask.ndim == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    if is_causal is None:
        is_causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=is_causal, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make attn_implementation "eaglespec_exact" and "eaglespec_sdpa" known to transformers
    (idempotent); returns the first."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    for name, fn in ((NAME, exact_attention), (GQA_NAME, gqa_sdpa_attention)):
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, sdpa_mask)
    return NAME
