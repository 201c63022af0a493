"""Weight-only int8 linear layers: a faster target on memory-bound CPUs (gpt-fast's int8 path).

Decoding a small model on a CPU streams every weight once per forward; int8 weights stream a
quarter of fp32's bytes. Activations stay in the model's dtype. A quantized target is its own
vanilla: EAGLE stays lossless with respect to the target as it runs, and the benchmark's vanilla
uses the same quantized target, so speedup ratios stay honest.
"""

from __future__ import annotations

import torch
from torch import nn


class Int8Linear(nn.Module):
    """y = x @ (int8 weight * per-output-channel scale).T + bias."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_int8", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale.to(linear.weight.dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (for code that slices it, e.g. a reduced draft vocabulary)."""
        return self.weight_int8.to(self.scales.dtype) * self.scales[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        if x2.device.type == "cpu" or x2.dtype in (torch.bfloat16, torch.float16):
            y = torch.ops.aten._weight_int8pack_mm(x2, self.weight_int8, self.scales.to(x2.dtype))
        else:  # no fused kernel for this device/dtype: dequantize on the fly
            y = x2 @ self.weight.to(x2.dtype).T
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


def quantize_int8(model: nn.Module, lm_head: bool = True) -> nn.Module:
    """Replace the decoder's linear layers (and the LM head) by `Int8Linear`, in place.

    The input embedding stays as it is (a lookup reads one row, not the whole matrix), so a tied
    LM head gets its own int8 copy.
    """
    decoder = model.get_decoder()
    for name, module in list(decoder.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, Int8Linear(child))
    if lm_head and isinstance(model.get_output_embeddings(), nn.Linear):
        model.set_output_embeddings(Int8Linear(model.get_output_embeddings()))
        model.config.tie_word_embeddings = False  # stop transformers re-tying it to the embedding
    model.config.eaglespec_quantization = "int8"
    return model
