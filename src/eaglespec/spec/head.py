"""The EAGLE draft head: FC([f_j ; emb(t_{j+1})]) -> one decoder layer of the target's family.

Three architectures (``arch``), each drafted by the same engine:

- ``eagle1``: the paper's head exactly as official EAGLE lays it out: FC (with bias) over the
  feature and the token's embedding, one decoder layer whose first norm is left out (its input is
  already the FC's mix), no final norm; the target's LM head reads the predicted feature.
- ``eagle3``: EAGLE-3's head: FC (no bias) over three target layers' hidden states (low, mid, high;
  the target's last feature is not an input), one mid layer whose attention reads
  [norm(embedding) ; norm(hidden)] (width 2H), a final norm and the head's own LM head over a
  reduced draft vocabulary (``d2t``). It predicts a hidden state, not the target's feature, so it
  trains on the token loss alone, with training-time test.
- ``hybrid``: EAGLE-1's FC and a full decoder layer (input norm kept), plus an optional ``fuse``
  term that adds the projected aux layers (below).

Stored layout: the FC's input columns are [feature ; embedding] in every architecture (EAGLE-1's
files have [embedding ; feature]: `formats` permutes them on the way in and out).

The paper's head has one layer; ``num_layers`` > 1 stacks more (a capacity lever for small targets,
whose next feature is harder to extrapolate), and `grow` adds layers that start as the identity, so
a trained head keeps its predictions exactly while the new layers learn. Only ``fc`` and ``layers``
are trained and saved. The embedding and the LM head are the target's
own frozen modules, bound at load time and never copied into the checkpoint.

``aux_layers`` (EAGLE-3's feature fusion, optional) also feeds the head the target's hidden states
after those decoder layers (``output_hidden_states`` numbering: 0 = the embeddings): the top layer's
feature is specialised for the next token and has dropped context that the ones after it need.
They arrive concatenated after f_j (the caller passes width H * (1 + k)), each RMS-normalised (a
small model's residual stream has outliers in the ten thousands), and ``fuse`` adds their projection
to the FC output. Only the target computes them: a drafted node's input is the head's own
prediction (width H), which has none. ``fuse`` starts at zero, so a head given aux layers keeps its
predictions exactly until it trains.
"""

from __future__ import annotations

import copy
import json
import os
from functools import partial
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel

from ..errors import CheckpointError, EaglespecError, HeadMismatchError
from ..io import atomic_save_safetensors, atomic_write_json
from .formats import (HEAD_FORMAT, HEAD_FORMAT_VERSION, detect, eagle3_default_aux_layers, read_json, read_weights,
                      resolve, to_eaglespec)
from .rope import rope
from .tree import float_mask


class HeadKernels(Protocol):
    """What a backend attaches to a head it made faster (`EagleDraftHead.accel`, inference only).
    A draft is only a proposal, so these need not match torch bit for bit: verification keeps the
    output the target's."""

    kind: str  # what the backend chose, e.g. "int4-q8"
    lean: bool  # the head's layers run the backend's one-call forward (then the methods below apply)
    draft_lm: Callable[[torch.Tensor], torch.Tensor] | None  # the draft vocabulary's LM-head rows, packed

    def rms_norm(self, x: torch.Tensor) -> torch.Tensor:
        """x / rms(x) over the last dimension (the aux features' normalisation)."""

    def causal_plan(self, batch: int, rows: int, length: int) -> Any:
        """The attention plan of a causal block of `rows` new rows ending at `length`, or None."""

    def unbind(self) -> None:
        """The head was bound to a target again: forget what was derived from the old one."""


TRAINING_RECORD = "training.json"  # the training run's settings, steps, held-out evals and earlier runs
DRAFT_VOCABS = ("context", "head", "full")  # which tokens a loaded head may propose (see from_pretrained)
# What the head reads beside position j (paper Fig. 8): "feature+shifted_token" is EAGLE (f_j and
# t_{j+1}, the token drawn from f_j, which resolves the feature's uncertainty); the ablations are
# f_j with t_j (the token whose feature f_j is), f_j alone, and t_{j+1} alone (a token-level draft:
# the last known token, as a small language model reads it).
INPUT_MODES = ("feature+shifted_token", "feature+unshifted_token", "feature", "token")
ARCHS = ("hybrid", "eagle1", "eagle3")


def _layer_config(target_config: PretrainedConfig, num_layers: int = 1) -> PretrainedConfig:
    cfg = copy.deepcopy(target_config)
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [cfg.layer_types[0]] * num_layers
    if getattr(cfg, "_attn_implementation", None) in (None, "flash_attention_2", "flex_attention"):
        cfg._attn_implementation = "sdpa"
    else:
        cfg._attn_implementation = _draft_attention(cfg._attn_implementation)
    return cfg


def _draft_attention(target_impl: str) -> str:
    # row-exact attention is for the target's verification; a draft does not need it
    return "eaglespec_sdpa" if target_impl == "eaglespec_exact" else target_impl


def _family_classes(cfg: PretrainedConfig) -> tuple[type[nn.Module], type[nn.Module]]:
    """The target family's decoder-layer and rotary-embedding classes, found without copying code."""
    with torch.device("meta"):
        base = AutoModel.from_config(cfg)
    if not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        raise HeadMismatchError(f"model family {cfg.model_type!r} has no decoder layers with rotary embeddings")
    return type(base.layers[0]), type(base.rotary_emb)


class Eagle3Layer(nn.Module):
    """EAGLE-3's mid layer: attention over [input_layernorm(embedding) ; hidden_norm(hidden)], whose
    residual is the hidden state, then the family's gated MLP. The family's own attention and MLP
    modules, with q/k/v widened to read 2H."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(attn, name)
            setattr(attn, name, nn.Linear(2 * old.in_features, old.out_features, bias=old.bias is not None))
        self.self_attn, self.mlp = attn, layer.mlp
        self.input_layernorm, self.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        self.hidden_norm = copy.deepcopy(layer.input_layernorm)

    def forward(self, hidden_states: torch.Tensor, embeds: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden_states)], dim=-1)
        kwargs.pop("position_ids", None)
        kwargs.pop("use_cache", None)
        out = self.self_attn(hidden_states=x, **kwargs)[0]
        h = hidden_states + out
        return h + self.mlp(self.post_attention_layernorm(h))


class EagleDraftHead(nn.Module):
    def __init__(self, target_config: PretrainedConfig, input_mode: str = "feature+shifted_token",
                 draft_vocab: torch.Tensor | None = None, num_layers: int = 1,
                 aux_layers: list[int] | None = None, arch: str = "hybrid", model_type: str | None = None):
        """A head for a target of `target_config` (its layer's config: a head read from another
        engine's layout has a Llama layer whatever its target; `model_type` then names the target's family)."""
        super().__init__()
        if input_mode not in INPUT_MODES:
            raise ValueError(f"input_mode must be one of {INPUT_MODES}, got {input_mode!r}")
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
        if arch != "hybrid" and (num_layers != 1 or input_mode != INPUT_MODES[0]):
            raise ValueError(f"arch {arch}: a head of one layer that reads {INPUT_MODES[0]}")
        if arch == "eagle1" and aux_layers:
            raise ValueError("an eagle1 head reads no aux layers (eagle3 and hybrid do)")
        if arch == "eagle3" and not aux_layers:
            aux_layers = eagle3_default_aux_layers(target_config.num_hidden_layers)
        self.arch = arch
        self.input_mode = input_mode
        self.layer_config = _layer_config(target_config, num_layers)
        self.hidden_size = target_config.hidden_size
        self.vocab_size = target_config.vocab_size
        self.model_type = model_type or target_config.model_type
        layer_cls, rotary_cls = _family_classes(self.layer_config)
        H = self.hidden_size
        self.layers = nn.ModuleList(layer_cls(self.layer_config, layer_idx=i) for i in range(num_layers))
        self.aux_layers: list[int] = []
        self.fuse: nn.Linear | None = None
        self.norm: nn.Module | None = None
        self.draft_lm_head: nn.Linear | None = None  # eagle3's own LM head (draft vocabulary rows)
        if arch == "eagle3":
            self.aux_layers = list(aux_layers)
            self.fc = nn.Linear(len(self.aux_layers) * H, H, bias=False)
            self.layers[0] = Eagle3Layer(self.layers[0])
            self.norm = copy.deepcopy(self.layers[0].post_attention_layernorm)
            rows = self.vocab_size if draft_vocab is None else draft_vocab.numel()
            self.draft_lm_head = nn.Linear(H, rows, bias=False)
        else:
            self.fc = nn.Linear(2 * H, H, bias=True)
            if arch == "eagle1":  # its input is the FC's mix already (official EAGLE has no such norm)
                self.layers[0].input_layernorm = nn.Identity()
            self.add_aux_layers(list(aux_layers or []))
        self.rotary = rotary_cls(config=self.layer_config)
        self._frozen: tuple[nn.Module, nn.Module] | None = None  # (embed_tokens, lm_head), not saved
        self._w_draft: torch.Tensor | None = None  # LM-head rows of the draft vocabulary, not saved
        self.accel: HeadKernels | None = None  # a backend's faster inference path (see `HeadKernels`)
        # Reduced draft vocabulary (FR-Spec / EAGLE-3 style): draft id -> target id. The head only
        # ever proposes these tokens, which keeps verification lossless and makes drafting cheaper.
        self.register_buffer("d2t", None if draft_vocab is None else draft_vocab.long().clone())
        # With a reduced vocabulary, also propose the tokens of the text being generated (add_context)
        self.context_vocab = False
        self._ctx_ids: torch.Tensor | None = None  # d2t, then the target ids added from the context
        self._w_ctx: torch.Tensor | None = None  # their LM-head rows
        self._known: set[int] | None = None  # target ids added
        self._d2t_ids: tuple[torch.Tensor, frozenset[int]] | None = None  # d2t and its ids as a set
        self.metadata: dict[str, Any] = {}

    # -- binding to the target ------------------------------------------------------------------
    def bind(self, target: PreTrainedModel) -> "EagleDraftHead":
        """Share the target's frozen embedding and LM head; check that the head fits the target."""
        check_fit(self.config_dict(), target.config)
        embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        if lm_head is None:
            raise HeadMismatchError("the target has no output embeddings (LM head)")
        self._frozen = (embed, lm_head)
        if self.accel is not None:
            self.accel.unbind()
        p = next(target.parameters())
        self.to(device=p.device, dtype=p.dtype)
        self.refresh_draft_weight()
        self.reset_context()
        return self

    def _lm_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """These target tokens' LM-head rows (a quantized LM head dequantizes only them)."""
        lm = self.lm_head
        if hasattr(lm, "rows"):
            return lm.rows(ids)
        return lm.weight.detach()[ids.to(lm.weight.device)]

    def warm_start(self, target: PreTrainedModel) -> "EagleDraftHead":
        """An untrained eagle3 head's LM head and final norm start as the target's (its rows of the
        draft vocabulary): the head then only has to learn to produce the target's last feature."""
        if self.draft_lm_head is not None:
            with torch.no_grad():
                self.draft_lm_head.weight.copy_(self.draft_weight() if self.d2t is not None else self.lm_head.weight)
                final = getattr(getattr(target, "model", target), "norm", None)
                if final is not None and getattr(final, "weight", None) is not None:
                    self.norm.weight.copy_(final.weight)
        return self

    def refresh_draft_weight(self) -> None:
        """Cache the LM-head rows of the draft vocabulary (after binding or moving the target)."""
        if self.d2t is not None and self._frozen is not None:
            self._w_draft = self._lm_rows(self.d2t)

    def set_draft_vocab(self, d2t: torch.Tensor) -> None:
        """A new draft vocabulary (target ids). The weights do not depend on it: no retraining needed
        (except an eagle3 head's: its LM head is its own, one row per draft token)."""
        if self.draft_lm_head is not None:
            raise EaglespecError("an eagle3 head's draft vocabulary is its LM head's rows: it cannot change")
        if self.accel is not None and self.accel.draft_lm is not None:
            raise RuntimeError("set the draft vocabulary before a backend packs the head")
        if self.accel is not None:
            self.accel.unbind()
        self.d2t = d2t.long().to(self.rotary.inv_freq.device)  # (a packed 4-bit fc keeps no weight)
        self.refresh_draft_weight()
        self.reset_context()

    # -- the context vocabulary -------------------------------------------------------------------
    def reset_context(self) -> None:
        """Forget the tokens `add_context` added (the engine calls it at every prefill)."""
        self._ctx_ids = self._w_ctx = self._known = None

    def add_context(self, tokens: torch.Tensor) -> None:
        """With `context_vocab`, let the draft also propose these target tokens (the prompt's and the
        generated text's). A text reuses its own rare words (names, terms from the question), which a
        frequency-ranked vocabulary misses; they cost one LM-head row each. A draft is only a proposal,
        so any vocabulary keeps verification lossless."""
        if not self.context_vocab or self.d2t is None or tokens.numel() == 0:
            return
        if self._d2t_ids is None or self._d2t_ids[0] is not self.d2t:  # once, not per prompt (~0.5 ms)
            self._d2t_ids = (self.d2t, frozenset(self.d2t.tolist()))
        if self._known is None:
            self._known = set()
        # a Python set, not unique() and a mask: a round adds a few tokens (~0.1 ms a round saved)
        new = sorted(set(tokens.flatten().tolist()) - self._d2t_ids[1] - self._known)
        if not new:
            return
        self._known.update(new)
        new = torch.tensor(new, device=self.d2t.device)
        rows = self._lm_rows(new)
        self._ctx_ids = torch.cat([self.d2t if self._ctx_ids is None else self._ctx_ids, new])
        self._w_ctx = rows if self._w_ctx is None else torch.cat([self._w_ctx, rows])

    def draft_ids(self) -> torch.Tensor:
        """Draft id -> target id: d2t, then the context's tokens."""
        return self.d2t if self._ctx_ids is None else self._ctx_ids

    def context_rows(self) -> torch.Tensor | None:
        """The LM-head rows of the context's tokens (after d2t's in the draft vocabulary), or None."""
        return self._w_ctx

    def draft_weight(self) -> torch.Tensor:
        """The LM-head rows of the trained draft vocabulary (d2t), as `logits` reads them."""
        if self._w_draft is None:
            self.refresh_draft_weight()
        return self._w_draft

    @property
    def draft_vocab_size(self) -> int:
        return self.vocab_size if self.d2t is None else self.d2t.numel()

    @property
    def embed(self) -> nn.Module:
        if self._frozen is None:
            raise RuntimeError("draft head is not bound to a target; call head.bind(target)")
        return self._frozen[0]

    @property
    def lm_head(self) -> nn.Module:
        if self._frozen is None:
            raise RuntimeError("draft head is not bound to a target; call head.bind(target)")
        return self._frozen[1]

    # -- the computation ------------------------------------------------------------------------
    def forward(
        self,
        features: torch.Tensor,  # (B, T, H): f_j
        tokens: torch.Tensor,  # (B, T): t_{j+token_offset}, aligned by the caller
        position_ids: torch.Tensor,  # (B, T)
        attention_mask: torch.Tensor | None = None,  # (B, 1, T, past + T) float, None = causal
        cache: Any = None,
        plan: tuple[torch.Tensor, ...] | None = None,  # attention.rows_plan of the mask, where the caller has it
    ) -> torch.Tensor:
        """Predicted next features f_hat_{j+1}, shape (B, T, H)."""
        lean = self.accel is not None and self.accel.lean and not torch.is_grad_enabled()
        aux = None
        if features.shape[-1] > self.hidden_size:  # the target's fused inputs ride after f_j
            features, aux = features[..., : self.hidden_size], features[..., self.hidden_size:]
        emb = self.embed(tokens).to(features.dtype)
        if self.arch == "eagle3":  # the target's layers through the FC, or the head's own last output
            h = features if aux is None else self.fc(aux)
            return self._layers(h, tokens.shape, position_ids, attention_mask, cache, None, embeds=emb)
        if self.input_mode == "feature":
            emb = torch.zeros_like(emb)
        elif self.input_mode == "token":
            features = torch.zeros_like(features)
        h = self.fc(torch.cat([features, emb], dim=-1))
        if aux is not None and self.fuse is not None:
            k = len(self.aux_layers)
            aux = aux.unflatten(-1, (k, self.hidden_size))
            if lean:  # the backend's, in one call (a draft need not match torch bit for bit)
                aux = self.accel.rms_norm(aux.contiguous())
            else:
                aux = nn.functional.rms_norm(aux, (self.hidden_size,))
            h = h + self.fuse(aux.flatten(-2))
        return self._layers(h, tokens.shape, position_ids, attention_mask, cache, plan if lean else None,
                            lean=lean)

    def _layers(self, h: torch.Tensor, shape: torch.Size, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, cache: Any, plan: tuple[torch.Tensor, ...] | None,
                lean: bool = False, **extra: Any) -> torch.Tensor:
        """The decoder layers on h, with a causal mask when none is given."""
        b, t = shape
        if attention_mask is None:
            past = cache.get_seq_length() if cache is not None else 0
            allowed = torch.ones(t, past + t, dtype=torch.bool, device=h.device).tril(past)
            attention_mask = float_mask(allowed, h.dtype)
            if lean:
                plan = self.accel.causal_plan(b, t, past + t)  # causal: no mask to read
        if plan is not None:
            extra["eaglespec_plan"] = plan
        cos_sin = rope(self.rotary, h, position_ids)
        for layer in self.layers:
            out = layer(
                h,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=cache is not None,
                cache_position=position_ids[0],
                position_embeddings=cos_sin,
                **extra,
            )
            h = out[0] if isinstance(out, tuple) else out
        return h

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def token_offset(self) -> int:
        """Which token `forward` reads beside f_j: t_{j + token_offset} (0 only for the unshifted
        ablation). Callers pass it: the training loss, and the decode loop for committed pairs and
        for tree nodes (t_{j+1} is a node's own token, t_j its parent's)."""
        return 0 if self.input_mode == "feature+unshifted_token" else 1

    def grow(self, num_layers: int) -> "EagleDraftHead":
        """Append decoder layers that start as the identity (attention and MLP output projections
        zero: both residual branches add nothing), so predictions are unchanged until they train."""
        if num_layers != self.num_layers and self.arch != "hybrid":
            raise EaglespecError(f"arch {self.arch} has one layer; only a hybrid head grows")
        if num_layers < self.num_layers:
            raise EaglespecError(f"cannot shrink a {self.num_layers}-layer head to {num_layers} layers")
        layer_cls = type(self.layers[0])
        self.layer_config = _layer_config(self.layer_config, num_layers)
        p = next(self.parameters())
        for i in range(self.num_layers, num_layers):
            layer = layer_cls(self.layer_config, layer_idx=i).to(device=p.device, dtype=p.dtype)
            with torch.no_grad():
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            self.layers.append(layer)
        return self

    def add_aux_layers(self, aux_layers: list[int]) -> "EagleDraftHead":
        """Feed the head these target layers' hidden states too; the new `fuse` starts at zero."""
        if list(aux_layers) == self.aux_layers:
            return self
        if self.arch != "hybrid":
            raise EaglespecError(f"arch {self.arch}: the aux layers are part of the architecture "
                                 f"({self.aux_layers or 'none'}); only a hybrid head adds them")
        if self.aux_layers:
            raise EaglespecError(f"this head already fuses layers {self.aux_layers}; cannot change them to {aux_layers}")
        if any(not isinstance(i, int) or i < 0 for i in aux_layers) or len(set(aux_layers)) != len(aux_layers):
            raise EaglespecError(f"aux layers must be distinct layer indices >= 0, got {aux_layers}")
        p = next(self.fc.parameters())
        self.aux_layers = list(aux_layers)
        self.fuse = nn.Linear(len(aux_layers) * self.hidden_size, self.hidden_size, bias=False).to(p.device, p.dtype)
        with torch.no_grad():
            self.fuse.weight.zero_()
        return self

    @property
    def feature_width(self) -> int:
        """Width of the target features this head reads: f_j, then the aux layers' hidden states."""
        return self.hidden_size * (1 + len(self.aux_layers))

    @property
    def predicts_features(self) -> bool:
        """Whether `forward` predicts the target's next feature (trained by regression on it), or,
        eagle3, a hidden state of its own that only its LM head reads."""
        return self.arch != "eagle3"

    def target_logits(self, features: torch.Tensor) -> torch.Tensor:
        """The target's logits over the draft vocabulary from its own features (training's soft labels)."""
        if self.d2t is None:
            return self.lm_head(features)
        return torch.nn.functional.linear(features, self.draft_weight().to(features.dtype))

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Draft logits over the draft vocabulary (the full one unless reduced): map ids with `d2t`."""
        if self.draft_lm_head is not None:
            return self.draft_lm_head(self.norm(features))
        if self.d2t is None:
            return self.lm_head(features)
        if self._w_draft is None or self._w_draft.device != features.device or self._w_draft.dtype != features.dtype:
            self.refresh_draft_weight()
        if self.accel is not None and self.accel.draft_lm is not None:
            out = self.accel.draft_lm(features)
        else:
            out = torch.nn.functional.linear(features, self._w_draft.to(features.dtype))
        if self._w_ctx is not None:
            out = torch.cat([out, torch.nn.functional.linear(features, self._w_ctx.to(features.dtype))], -1)
        return out

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else self.draft_ids()[draft_ids]

    def to_target_probs(self, q: torch.Tensor) -> torch.Tensor:
        """(R, draft vocab) probabilities -> (R, target vocab), zero outside the draft vocabulary."""
        if self.d2t is None:
            return q
        ids = self.draft_ids()
        return torch.zeros(q.shape[0], self.vocab_size, dtype=q.dtype, device=q.device).index_copy_(1, ids, q)

    # -- save / load ----------------------------------------------------------------------------
    def config_dict(self) -> dict[str, Any]:
        target_cfg = self.layer_config.to_dict()
        return {
            "format": HEAD_FORMAT,
            "format_version": HEAD_FORMAT_VERSION,
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "input_mode": self.input_mode,
            "draft_vocab_size": None if self.d2t is None else int(self.d2t.numel()),
            "aux_layers": self.aux_layers,
            "arch": self.arch,
            "layer_config": target_cfg,
        }

    def save_pretrained(self, path: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
        """config.json, model.safetensors (the weights in `dtype` if given, e.g. bfloat16 to ship half
        the bytes: loading casts them to the target's dtype) and the training record."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().to("cpu").contiguous()
                 for k, v in self.state_dict().items() if not k.startswith("rotary.")}
        atomic_save_safetensors(state, path / "model.safetensors")
        atomic_write_json(self.config_dict(), path / "config.json")
        if self.metadata:  # how it was trained: beside the configuration, not in it
            atomic_write_json(self.metadata, path / TRAINING_RECORD)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, target: PreTrainedModel | None = None,
                        draft_vocab: str = "context") -> "EagleDraftHead":
        """A head folder in eaglespec's layout or another engine's (`formats`: official EAGLE-1,
        SafeAILab EAGLE-3, speculators), or a hub repo id in the local cache.
        draft_vocab: "context" = the draft vocabulary the head was trained with, plus each
        generation's prompt and text tokens (`add_context`); "head" = the trained one alone; "full" =
        every target token (its LM head is the target's, so no retraining: higher acceptance,
        costlier drafting)."""
        if draft_vocab not in DRAFT_VOCABS:
            raise ValueError(f"draft_vocab must be one of {DRAFT_VOCABS}, got {draft_vocab!r}")
        path = resolve(path)  # a folder, or a hub repo id in the local cache
        layout = detect(path)  # eaglespec's own, or official EAGLE-1, SafeAILab EAGLE-3, speculators
        if layout == "eaglespec":
            cfg, state, record = read_head_config(path), read_weights(path), read_training_record(path)
        else:
            cfg, state = to_eaglespec(path, layout, None if target is None else target.config)
            record = {"imported_from": layout}
        if target is not None:
            check_fit(cfg, target.config)
        layer_cfg_dict = dict(cfg["layer_config"])
        model_type = layer_cfg_dict.pop("model_type", cfg["model_type"])
        try:
            layer_cfg = AutoConfig.for_model(model_type, **layer_cfg_dict)
        except (ValueError, TypeError, KeyError) as e:
            raise CheckpointError(f"{path / 'config.json'}: layer_config is not a {model_type!r} config ({e})") from None
        layer_cfg._attn_implementation = "sdpa" if target is None else _draft_attention(target.config._attn_implementation)
        weights = path / "model.safetensors" if layout == "eaglespec" else path
        d2t = state.get("d2t")
        if d2t is not None and (d2t.dim() != 1 or d2t.numel() == 0 or d2t.is_floating_point()
                                or int(d2t.min()) < 0 or int(d2t.max()) >= cfg["vocab_size"]):
            raise CheckpointError(f"{weights}: d2t is not a valid draft-to-target id map")
        # one-layer heads written before `layers` existed name their layer "layer."
        state = {("layers.0." + k[6:] if k.startswith("layer.") else k): v for k, v in state.items()}
        aux_layers = cfg.get("aux_layers") or []
        if not isinstance(aux_layers, list) or not all(isinstance(i, int) and i >= 0 for i in aux_layers):
            raise CheckpointError(f"{path / 'config.json'}: aux_layers must be a list of layer indices")
        num_layers = getattr(layer_cfg, "num_hidden_layers", 1) or 1
        if num_layers != len({k.split(".")[1] for k in state if k.startswith("layers.")}):
            raise CheckpointError(f"{weights}: the config's {num_layers} layers are not the file's")
        arch = cfg.get("arch", "hybrid")
        if arch not in ARCHS:
            raise CheckpointError(f"{path / 'config.json'}: arch must be one of {ARCHS}, got {arch!r}")
        make = partial(cls, layer_cfg, input_mode=cfg.get("input_mode", "feature+shifted_token"), draft_vocab=d2t,
                       num_layers=int(num_layers), aux_layers=aux_layers, arch=arch, model_type=cfg["model_type"])
        with torch.device("meta"):  # the config's shapes, checked against the file's before anything is allocated
            own = {k: v.shape for k, v in make().state_dict().items() if not k.startswith("rotary.")}
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        if missing or unexpected:
            raise CheckpointError(f"{weights}: wrong tensors (missing {missing[:3]}, unexpected {unexpected[:3]})")
        for k, v in state.items():
            if v.shape != own[k]:
                raise CheckpointError(f"{weights}: tensor {k} has shape {tuple(v.shape)}, expected {tuple(own[k])}")
        head = make()
        head.metadata = record
        head.load_state_dict(state, strict=False)
        head.set_draft_policy(draft_vocab)
        if target is not None:
            head.bind(target)
        return head

    def set_draft_policy(self, draft_vocab: str) -> None:
        """Which tokens the head proposes (see `from_pretrained`). An eagle3 head's LM head has rows
        for its trained vocabulary alone: it proposes exactly those."""
        if self.draft_lm_head is not None:
            return
        if draft_vocab == "full":
            self.d2t = None
        self.context_vocab = draft_vocab == "context"


def read_training_record(path: Path) -> dict[str, Any]:
    """How a head was trained (`TRAINING_RECORD` beside its config; heads that kept it in the config's
    "metadata" are read too); {} when it says nothing."""
    record = Path(path) / TRAINING_RECORD
    try:
        data = json.loads(record.read_text()) if record.is_file() else read_head_config(Path(path)).get("metadata")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{record}: not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def read_head_config(path: Path) -> dict[str, Any]:
    cfg_path = path / "config.json"
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such head folder")
    cfg = read_json(cfg_path)
    if not isinstance(cfg, dict) or cfg.get("format") != HEAD_FORMAT:
        raise CheckpointError(f"{cfg_path}: not an eaglespec draft head (no \"format\": \"{HEAD_FORMAT}\")")
    version = cfg.get("format_version", 0)
    if not isinstance(version, int) or isinstance(version, bool):
        raise CheckpointError(f"{cfg_path}: format_version must be an integer, got {version!r}")
    if version > HEAD_FORMAT_VERSION:
        raise CheckpointError(f"{cfg_path}: format version {version} is newer than this eaglespec")
    for key, kind in (("model_type", str), ("hidden_size", int), ("vocab_size", int), ("layer_config", dict)):
        if key not in cfg:
            raise CheckpointError(f"{cfg_path}: missing field {key!r}")
        if not isinstance(cfg[key], kind) or isinstance(cfg[key], bool) or (kind is int and cfg[key] < 1):
            raise CheckpointError(f"{cfg_path}: {key} must be a{' positive' if kind is int else ''} "
                                  f"{kind.__name__}, got {cfg[key]!r}")
    return cfg


def check_fit(head_cfg: dict[str, Any], target_config: PretrainedConfig) -> None:
    diffs = []
    for key, want in (("model_type", target_config.model_type), ("hidden_size", target_config.hidden_size),
                      ("vocab_size", target_config.vocab_size)):
        if head_cfg[key] != want:
            diffs.append(f"{key}: head {head_cfg[key]!r} vs target {want!r}")
    deepest = max(head_cfg.get("aux_layers") or [0])
    if deepest > target_config.num_hidden_layers:
        diffs.append(f"aux layer {deepest} vs the target's {target_config.num_hidden_layers} layers")
    if diffs:
        raise HeadMismatchError("draft head does not fit the target model (" + "; ".join(diffs) + ")")
