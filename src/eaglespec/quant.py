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


def packed_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Module):
    """fp32 linear whose weight is reordered once for oneDNN's GEMM.

    torch's default CPU linear repacks the weight on every call when more than one token goes
    through it, which makes verifying 2-26 tokens cost 1.7-3x a one-token step on this machine;
    a pre-packed weight streams once. Measured on 2 EPYC cores: SmolLM2's LM head, 1 token
    14.7 -> 7.8 ms, 26 tokens 46 -> 17 ms.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # kept (shared): a tied embedding and the draft head read it
        self.bias = linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self.packed,
                                               None if self.bias is None else self.bias.detach(), "none", [], "")
        return y.view(*shape[:-1], self.out_features)


def pack_linears(module: nn.Module) -> nn.Module:
    """Replace every fp32 CPU `nn.Linear` inside `module` by a `PackedLinear`, in place."""
    if not packed_linear_available():
        return module
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu":
                setattr(parent, name, PackedLinear(child))
    return module


def pack_target(model: nn.Module) -> nn.Module:
    """Pack the decoder's linear layers and the LM head of a causal LM (outputs equal up to float rounding)."""
    pack_linears(model.get_decoder())
    head = model.get_output_embeddings()
    if type(head) is nn.Linear and packed_linear_available():
        model.set_output_embeddings(PackedLinear(head))
    model.config.eaglespec_kernels = "packed"
    return model
