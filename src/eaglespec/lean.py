"""A lean forward for transformers' Llama / Qwen2 decoder layers, for eager CPU decoding.

On a 2-core CPU a SmolLM2 int4-dot step spends ~3 ms in the kernels and ~9 ms around them: per
layer, 13 module calls, two deprecation wrappers, the q/k/v parts' round trip, two rotary
embeddings of ~7 torch ops each and their transposes. The forward installed here computes the
same thing with the same modules, weights, kernels and attention function, and the same
elementwise operations in the same order (q and k are rotated together, one op for both), so it
gives transformers' numbers bit for bit (tested) in fewer calls. It is bound to each layer
instance: the layers stay transformers' own modules (hooks, state dict, attention type), and a
layer this does not recognise keeps its forward.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import rotate_half  # Qwen2's is the same function

# Mistral's layers look alike, but pass the config's sliding window to attention: not here (untested)
LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer")


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


def fits(layer: nn.Module) -> bool:
    """A layer whose forward `lean_forward` reproduces: a known family, q/k/v fused, the gated MLP
    fused (`quant.GatedMLP`), no sliding window."""
    from .quant import GatedMLP

    attn = getattr(layer, "self_attn", None)
    return (type(layer).__name__ in LAYERS and attn is not None and hasattr(attn, "fused_q_k_v")
            and isinstance(getattr(layer, "mlp", None), GatedMLP) and getattr(attn, "sliding_window", None) is None)


def lean_layers(decoder: nn.Module) -> int:
    """Bind `lean_forward` to every decoder layer that `fits`; returns how many."""
    n = 0
    for layer in getattr(decoder, "layers", []):
        if fits(layer):
            cfg = layer.self_attn.config
            layer._lean_heads = (cfg.num_attention_heads, cfg.num_key_value_heads)
            layer.forward = types.MethodType(lean_forward, layer)
            n += 1
    return n
