"""The draft head on eaglespec's CPU kernels: packed linear layers, one-call layers, and a whole
draft level in one C call (`draft_step`: fc, fused aux features, the head's layers, the draft LM
head and the level's top-k or law).

`pack_head` attaches a `PackedHead` to an `EagleDraftHead` (its `accel`); the paper's module keeps
its weights and its torch forward, which training and other devices use. A draft is only a
proposal, so a quantized head keeps decoding lossless: verification decides every token.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch
from torch import nn

from ..errors import EaglespecError
from ..spec.backend import DraftLevel
from ..spec.cache import KVCache
from ..spec.head import EagleDraftHead
from ..spec.rope import STATIC_ROPE, rope_table
from . import attention, kernels
from .lean import norm_eps, one_call_layers, write_slot
from .quant import (Bf16DotLinear, Bf16Linear, Int4DotLinear, Int4Linear, Int4Q8Linear, PackedLinear,
                    eager_fast_paths, int4_available, packed_linear_available, replace_linears)

HEAD_KINDS = ("packed", "int4", "bf16", "bf16-dot", "int4-dot", "int4-q8")


class PackedHead:
    """`spec.head.HeadKernels` on eaglespec's CPU kernels (see `pack_head`)."""

    def __init__(self, head: EagleDraftHead, kind: str, lean: bool, draft_lm: nn.Module | None):
        self.head, self.kind, self.lean, self.draft_lm = head, kind, lean, draft_lm
        self.ones = torch.ones(head.hidden_size)
        self._step: kernels.HeadSpec | bool | None = None  # `draft_step`'s C view (False: none; None: not yet)
        self._all_ids: torch.Tensor | None = None

    def rms_norm(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.ones, torch.finfo(x.dtype).eps)

    def causal_plan(self, batch: int, rows: int, length: int) -> Any:
        return attention.pack_plan(None, batch, rows, length) if batch * rows <= attention.MAX_EXACT_ROWS else None

    def unbind(self) -> None:
        self._step = None

    def step_spec(self) -> kernels.HeadSpec | None:
        """The head as `kernels.draft_step` runs it, or None: one-call layers (fp32, eaglespec's
        kernels for fc, fuse and the draft LM head), a static rope. Every input mode: the caller
        passes the token it reads, and `pack_head` zeroed an ablation's unused fc columns."""
        head = self.head
        if self._step is None:
            self._step = False
            lm = head.draft_lm_head if head.draft_lm_head is not None else \
                self.draft_lm if head.d2t is not None else head.lm_head
            mods = [head.fc, lm] + ([head.fuse] if head.fuse is not None else [])
            specs = [m.kernel_spec() if hasattr(m, "kernel_spec") else None for m in mods]
            emb = head.embed.weight if isinstance(head.embed, nn.Embedding) else None
            layers = [getattr(layer, "_one_call", None) for layer in head.layers]
            if (self.lean and kernels.draft_available() and None not in specs and None not in layers
                    and emb is not None
                    and emb.dtype == torch.float32 and emb.is_contiguous()
                    and getattr(head.rotary, "rope_type", "default") in STATIC_ROPE):
                final = head.norm  # EAGLE-3's norm before its own LM head
                self._step = kernels.HeadSpec(specs[0], specs[2] if head.fuse is not None else None, specs[1],
                                              emb.detach(), self.ones, torch.finfo(torch.float32).eps,
                                              len(head.aux_layers), layers, rope_table(head.rotary, emb, 1),
                                              None if final is None else final.weight.detach(),
                                              0.0 if final is None else norm_eps(final))
        return self._step or None

    def _identity(self) -> torch.Tensor:
        """The draft-id -> target-id map of a head over the whole vocabulary, made once."""
        if self._all_ids is None:
            self._all_ids = torch.arange(self.head.vocab_size)
        return self._all_ids

    def draft_step(self, features: torch.Tensor, tokens: list[int], positions: list[int], cache: Any,
                   plan: tuple[torch.Tensor, ...] | None = None, k: int = 0, temperature: float = 1.0,
                   first: int = 0, probs: bool = False) -> DraftLevel | None:
        """The head's forward on the rows of one sequence (features (1, M, W); plan: `attention.rows_plan`
        of their mask, None = causal) and, with k > 0, rows first..'s k best draft log-probabilities
        at `temperature` and their target ids (and with `probs` their whole draft law), all in one C
        call; None where that does not apply."""
        head, m = self.head, len(tokens)
        spec = self.step_spec()
        if spec is None or torch.is_grad_enabled() or features.shape[0] != 1 or m > attention.MAX_EXACT_ROWS \
                or not 0 <= k <= 64 or k > head.draft_vocab_size or not isinstance(cache, KVCache) \
                or len(cache.layers) != len(head.layers) or features.dtype != torch.float32:
            return None
        if min(tokens) < 0 or max(tokens) >= head.embed.weight.shape[0]:  # C reads the embedding row by id
            raise EaglespecError(f"token ids must be in 0..{head.embed.weight.shape[0] - 1}, got "
                                 f"{min(tokens)}..{max(tokens)}")
        slot = write_slot(cache.layers, 1, m)
        if slot is None:
            return None
        cos, sin = rope_table(head.rotary, features, max(positions) + 1)
        if cos.data_ptr() != spec.rope[0].data_ptr():
            spec.set_rope(cos, sin)
        k_bufs, v_bufs = cache.buffer_addresses()
        if head.draft_lm_head is not None:  # EAGLE-3's own LM head: its rows are d2t's, no context rows
            ids, ctx = head.d2t if head.d2t is not None else self._identity(), None
        elif head.d2t is not None:
            ids, ctx = head.draft_ids(), head.context_rows()
        else:
            ids, ctx = self._identity(), None
        out, vals, top, law = kernels.draft_step(spec, features[0].contiguous(), torch.tensor(tokens),
                                                 torch.tensor(positions), k_bufs, v_bufs, cache.layers[0].k_buf, slot,
                                                 plan, first, ctx, ids, 1.0 / temperature, k, probs)
        cache.set_length(slot + m)
        return DraftLevel(out[None], None if vals is None else vals.tolist(), None if top is None else top.tolist(),
                          law)


def pack_head(head: EagleDraftHead, kind: str = "packed") -> EagleDraftHead:
    """Faster CPU kernels for the head's linear layers and its draft LM head (inference only):
    "packed" = fp32 pre-packed (`quant.PackedLinear`), "int4" = `quant.Int4Linear`, "bf16" =
    `quant.Bf16Linear`, "bf16-dot" = `quant.Bf16DotLinear`, "int4-dot" = `quant.Int4DotLinear`,
    "int4-q8" = `quant.Int4Q8Linear` (int4-dot where AVX512-VNNI is missing). Packed once: a head
    that has kernels keeps them."""
    if kind not in HEAD_KINDS:
        raise ValueError(f"kind must be one of {HEAD_KINDS}, got {kind!r}")
    if next(head.parameters()).device.type != "cpu" or head.accel is not None:
        return head
    if kind == "int4-q8" and not kernels.q4q8_available():
        kind = "int4-dot"
    fits: Callable[[nn.Linear], bool] = lambda m: True
    if kind == "int4" and int4_available():
        make = partial(Int4Linear, keep_weight=False)
    elif kind in ("bf16", "bf16-dot", "int4-dot", "int4-q8") and kernels.available():
        # int4-dot / int4-q8: the head's layers and its draft LM head (rows of the target's) in 4
        # bits, bf16-dot where a layer's shape does not fit them. A draft round reads the head's
        # weights from memory after the target's forward has evicted them from the caches, so fewer
        # bytes make a cheaper round at the same acceptance
        make = Bf16DotLinear if kind != "bf16" and kernels.bf16dot_available() else Bf16Linear
        if make is Bf16Linear:
            kind = "bf16"
        fits = lambda m: m.weight.shape[0] % kernels.BLOCK == 0 and (make is Bf16Linear or m.weight.shape[1] % 2 == 0)
        if kind in ("int4-dot", "int4-q8") and make is Bf16DotLinear:
            q4 = partial(Int4Q8Linear if kind == "int4-q8" else Int4DotLinear, keep_weight=False)
            make = lambda m, bf16=make: q4(m) if kernels.fits_q4(*m.weight.shape) else bf16(m)
    elif packed_linear_available():
        make, kind = PackedLinear, "packed"
        fits = lambda m: m.weight.dtype == torch.float32
    else:
        return head
    if head.input_mode in ("feature", "token"):
        # an ablation zeroes one input; zeroing its fc columns gives the same outputs (every product
        # with it is an exact zero), so the packed fc and the C draft step run every input mode
        H = head.hidden_size
        with torch.no_grad():
            unused = slice(H, 2 * H) if head.input_mode == "feature" else slice(0, H)
            head.fc.weight[:, unused].zero_()
    lean = False
    if kernels.available():  # fused q/k/v and gate/up, fast norms, lean (one-call) layers, as the target's
        eager_fast_paths(head, lambda m: make(m) if fits(m) else m)
        lean = one_call_layers(head) and next(head.parameters()).dtype == torch.float32
    replace_linears(head, make, lambda m: type(m) is nn.Linear and fits(m))
    draft_lm = None
    if head.d2t is not None and head.draft_lm_head is None:  # rows of the target's LM head
        w = head.draft_weight()
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight = nn.Parameter(w.float(), requires_grad=False)
        # the 4-bit and bf16 kernels want whole blocks of rows; a draft vocabulary need not have them
        whole = kind in ("bf16", "bf16-dot", "int4-dot", "int4-q8")
        draft_lm = (PackedLinear if whole and lin.out_features % kernels.BLOCK else make)(lin)
    head.accel = PackedHead(head, kind, lean, draft_lm)
    return head


def head_kind_for(target_kind: str | None) -> str:
    """The head kind that drafts fastest beside a target of this kind: 4 bits where the CPU has the
    dot kernels (int4-q8 where AVX512-VNNI runs it, else int4-dot: a quarter of fp32's bytes at the
    same acceptance), else the target's own kind."""
    if kernels.bf16dot_available():
        return "int4-q8"
    return target_kind if target_kind in ("int4", "bf16", "bf16-dot", "int4-dot") else "packed"
