"""A lean forward for transformers' Llama / Qwen2 decoder layers, for eager CPU decoding.

On a 2-core CPU a SmolLM2 int4-dot step spends ~3 ms in the kernels and ~9 ms around them: per
layer, 13 module calls, two deprecation wrappers, the q/k/v parts' round trip, two rotary
embeddings of ~7 torch ops each and their transposes. The forward installed here computes the
same thing with the same modules, weights, kernels and attention function, and the same
elementwise operations in the same order (q and k are rotated together, one op for both), so it
gives transformers' numbers bit for bit (tested) in fewer calls. It is bound to each layer
instance: the layers stay transformers' own modules (hooks, state dict, attention type), and a
layer this does not recognise keeps its forward.

Where eaglespec's AVX-512 kernels run and every linear layer of a layer is one of them, a decode
step or a draft tree (up to `attention.MAX_EXACT_ROWS` rows) goes further: the whole layer is one C
call (`kernels.decoder_layer`), norms, RoPE, cache write, row-exact attention, SiLU and residuals
included. Those numbers are no longer transformers' bit for bit (its SiLU's exp differs in the last
bits; RoPE and the residual adds are rounded as torch rounds them), but every row is still computed
alone, so a tree row equals a decode step and EAGLE equals vanilla decoding exactly (tested). Set
``lean.ONE_CALL = False`` (or ``EAGLESPEC_ONE_CALL=0``) for the per-module path. When every layer
of a decoder can, `lean_decoder` goes one step further: embedding, rotary, then all layers in one C
call (`kernels.decoder_stack`, split only where a hook reads a layer's input), then the final norm.
"""

from __future__ import annotations

import os
import types

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.llama.modeling_llama import rotate_half  # Qwen2's is the same function

from ..spec.cache import KVCache
from ..spec.rope import rope
from . import attention, kernels
from .fused import GatedMLP

# Mistral's layers look alike, but pass the config's sliding window to attention: not here (untested)
LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer")
ONE_CALL = os.environ.get("EAGLESPEC_ONE_CALL", "1") != "0"  # the whole layer in one C call where it can


def lean_forward(self: nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, past_key_values=None, use_cache: bool | None = False,
                 cache_position: torch.Tensor | None = None,
                 position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs) -> torch.Tensor:
    """transformers' decoder layer forward (pre-norm attention + gated MLP, RoPE), flattened."""
    attn = self.self_attn
    attend = ALL_ATTENTION_FUNCTIONS.get(attn.config._attn_implementation)
    if attend is None or self.training:  # "eager", or training: transformers' own forward
        return type(self).forward(self, hidden_states, attention_mask, position_ids, past_key_values, use_cache,
                                  cache_position, position_embeddings, **kwargs)
    if self._one_call is not None and ONE_CALL and not torch.is_grad_enabled():
        out = _one_call(self, hidden_states, attention_mask, past_key_values, position_embeddings, kwargs)
        if out is not None:
            return out
    b, m, _ = hidden_states.shape
    nq, nkv = self._lean_heads
    heads = attn.fused_q_k_v.fused.forward(self.input_layernorm.forward(hidden_states)).view(b, m, -1, attn.head_dim)
    cos, sin = position_embeddings
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    qk = heads[:, :, :nq + nkv]
    qk = (qk * cos) + (rotate_half(qk) * sin)  # the rotary embedding of q and k at once, elementwise as theirs
    q, k, v = qk[:, :, :nq].transpose(1, 2), qk[:, :, nq:].transpose(1, 2), heads[:, :, nq + nkv:].transpose(1, 2)
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, attn.layer_idx, {"sin": sin, "cos": cos, "cache_position": cache_position})
    out, _ = attend(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling, **kwargs)
    hidden_states = hidden_states + attn.o_proj.forward(out.reshape(b, m, -1).contiguous())
    return hidden_states + self.mlp.forward(self.post_attention_layernorm.forward(hidden_states))


def _one_call(self: nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, cache,
              position_embeddings: tuple[torch.Tensor, torch.Tensor], kwargs: dict) -> torch.Tensor | None:
    """The layer as one `kernels.decoder_layer` call, or None where it does not apply (a long block,
    another cache, a cache layer not yet allocated: the first forward allocates it)."""
    b, m, _ = hidden_states.shape
    idx = self.self_attn.layer_idx
    if b * m > attention.MAX_EXACT_ROWS or not isinstance(cache, KVCache) or hidden_states.dtype != torch.float32 \
            or len(cache.layers) <= idx:
        return None
    layer = cache.layers[idx]
    slot = write_slot([layer], b, m)
    if slot is None:
        return None
    cos, sin, plan = _rows_inputs(position_embeddings, attention_mask, kwargs, b, m, slot)
    out = kernels.decoder_layer(self._one_call, hidden_states, cos, sin, layer.k_buf, layer.v_buf, slot, plan)
    layer._set_length(slot + m)
    return out


def write_slot(layers: list, b: int, m: int) -> int | None:
    """Where m new rows of b sequences go in these cache layers (one position for all of them), or
    None where the one-call kernels cannot write them: a layer not yet allocated (the first forward
    allocates it), lengths apart, another batch size, a cache not fp32, values shaped unlike keys
    (the kernels read both with the keys' strides)."""
    first = layers[0]
    if not all(lay.is_initialized and lay.length == first.length for lay in layers) or first.k_buf.shape[0] != b \
            or first.k_buf.dtype != torch.float32 or first.v_buf.shape != first.k_buf.shape:
        return None
    if first.length + m > first.max_len:
        raise RuntimeError(f"KV cache full: {first.length + m} > max_len {first.max_len}")
    return first.length


def _rows_inputs(position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: torch.Tensor | None,
                 kwargs: dict, b: int, m: int, slot: int) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """cos and sin as B x M contiguous rows (positions may be shared by a batch's rows), and the
    attention plan (the engine's, else this forward's, made once) over the cache after the write."""
    cos, sin = (t.expand(b, m, -1).float().contiguous() for t in position_embeddings)
    return cos, sin, kwargs.get("eaglespec_plan") or attention.plan_for(attention_mask, b, m, slot + m)


def norm_eps(norm: nn.Module) -> float:
    """An RMSNorm's epsilon (`eps` on eaglespec's fast norms, `variance_epsilon` on transformers'), -1 if none."""
    return float(getattr(norm, "eps", getattr(norm, "variance_epsilon", -1.0)))


def one_call_spec(layer: nn.Module) -> kernels.LayerSpec | None:
    """The layer's weights for `kernels.decoder_layer`, if it can run as one call: eaglespec's kernels
    for all four linear layers (fused q/k/v, o, fused gate/up, down), fp32 norms of one eps, SiLU,
    head size a multiple of 16 up to 256 (the attention kernel's). Draft layers too: without an input
    norm (EAGLE-1's) or with EAGLE-3's `hidden_norm`."""
    if not kernels.layer_available() or not hasattr(getattr(layer.self_attn, "fused_q_k_v", None), "fused"):
        return None
    attn, mlp, cfg = layer.self_attn, layer.mlp, layer.self_attn.config
    linears = (attn.fused_q_k_v.fused, attn.o_proj, getattr(mlp, "gate_up", None), getattr(mlp, "down_proj", None))
    specs = [lin.kernel_spec() if hasattr(lin, "kernel_spec") else None for lin in linears]
    first = None if isinstance(layer.input_layernorm, nn.Identity) else layer.input_layernorm
    hidden = getattr(layer, "hidden_norm", None)
    norms = [n for n in (first, layer.post_attention_layernorm, hidden) if n is not None]
    eps = {norm_eps(n) for n in norms}
    d = attn.head_dim
    if (None in specs or getattr(cfg, "hidden_act", None) != "silu" or len(eps) != 1 or min(eps) < 0
            or hidden is not None and first is None
            or any(n.weight.dtype != torch.float32 for n in norms) or d % 16 or d > 256
            or getattr(attn, "attention_dropout", 0.0) and attn.training):
        return None
    nq, nkv = layer._lean_heads
    weight = lambda n: None if n is None else n.weight.detach()
    return kernels.LayerSpec(*specs, weight(first), weight(layer.post_attention_layernorm), nq, nkv, d, eps.pop(),
                             float(attn.scaling), weight(hidden))


def one_call_layers(module: nn.Module) -> bool:
    """Whether some layer inside `module` runs as one C call (the switch `ONE_CALL` on)."""
    return ONE_CALL and any(getattr(m, "_one_call", None) is not None for m in module.modules())


def fits(layer: nn.Module) -> bool:
    """A layer whose forward `lean_forward` reproduces: a known family, q/k/v fused, the gated MLP
    fused (`quant.GatedMLP`), no sliding window."""
    attn = getattr(layer, "self_attn", None)
    return (type(layer).__name__ in LAYERS and attn is not None and hasattr(attn, "fused_q_k_v")
            and isinstance(getattr(layer, "mlp", None), GatedMLP) and getattr(attn, "sliding_window", None) is None)


def lean_decoder_forward(self: nn.Module, input_ids: torch.Tensor | None = None,
                         attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                         past_key_values=None, inputs_embeds: torch.Tensor | None = None,
                         cache_position: torch.Tensor | None = None, use_cache: bool | None = None, **kwargs):
    """transformers' decoder forward, or where it applies (`_stack_call`) the layers as one C call."""
    out = _stack_call(self, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, kwargs)
    if out is not None:
        return out
    return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                              cache_position=cache_position, use_cache=use_cache, **kwargs)


def _stack_call(self: nn.Module, input_ids, attention_mask, position_ids, cache, inputs_embeds,
                kwargs: dict) -> BaseModelOutputWithPast | None:
    """A decode step or a tree (up to MAX_EXACT_ROWS rows) with explicit positions, on a KVCache
    every layer of which is allocated alike, no outputs asked beyond the last hidden state; else None."""
    if (not ONE_CALL or self.training or torch.is_grad_enabled() or input_ids is None or inputs_embeds is not None
            or position_ids is None or not isinstance(cache, KVCache) or set(kwargs) - {"eaglespec_plan"}
            or attention_mask is not None and attention_mask.dim() != 4):  # a 2D padding mask: transformers'
        return None
    b, m = input_ids.shape
    layers = cache.layers
    if b * m > attention.MAX_EXACT_ROWS or len(layers) != len(self.layers):
        return None
    slot = write_slot(layers, b, m)
    if slot is None:
        return None
    h = self.embed_tokens(input_ids)
    if h.dtype != torch.float32:
        return None
    cos, sin, plan = _rows_inputs(rope(self.rotary_emb, h, position_ids.expand(b, m)), attention_mask, kwargs, b, m, slot)
    x = h.contiguous()  # a fresh tensor: the layers update it in place
    k_bufs, v_bufs = cache.buffer_addresses()
    start = 0
    for i in [i for i, layer in enumerate(self.layers) if layer._forward_pre_hooks] + [len(layers)]:
        if i > start:
            kernels.decoder_stack(self._stack[start:i], x, cos, sin, k_bufs[start:i], v_bufs[start:i], layers[0].k_buf,
                                  slot, plan)
        if i < len(layers):  # a hook (the aux layers' tap) reads this layer's input: give it a copy
            layer = self.layers[i]
            for key, hook in layer._forward_pre_hooks.items():
                args = (x.clone(),)
                hook(layer, args, {}) if key in layer._forward_pre_hooks_with_kwargs else hook(layer, args)
        start = i
    for lay in layers:
        lay.length = slot + m
    return BaseModelOutputWithPast(last_hidden_state=self.norm(x), past_key_values=cache)


def lean_decoder(decoder: nn.Module) -> bool:
    """Bind `lean_decoder_forward` to a Llama / Qwen2 decoder whose every layer runs as one call."""
    layers = getattr(decoder, "layers", None)
    if not layers or any(getattr(layer, "_one_call", None) is None for layer in layers) \
            or not all(hasattr(decoder, a) for a in ("embed_tokens", "rotary_emb", "norm")):
        return False
    decoder._stack = torch.tensor([layer._one_call.address for layer in layers])
    decoder.forward = types.MethodType(lean_decoder_forward, decoder)
    return True


def lean_layers(decoder: nn.Module) -> int:
    """Bind `lean_forward` to every decoder layer that `fits`; returns how many."""
    n = 0
    for layer in getattr(decoder, "layers", []):
        lean = fits(layer)
        # EAGLE-3's mid layer keeps its forward (it also reads the embeddings); the head's one-call
        # draft step (`kernels.draft_step`) runs it
        eagle3 = hasattr(layer, "hidden_norm") and isinstance(getattr(layer, "mlp", None), GatedMLP)
        if lean or eagle3:
            cfg = layer.self_attn.config
            layer._lean_heads = (cfg.num_attention_heads, cfg.num_key_value_heads)
            layer._one_call = one_call_spec(layer)
        if lean:
            layer.forward = types.MethodType(lean_forward, layer)
            n += 1
    return n
