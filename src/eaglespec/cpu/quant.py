"""Faster linear layers for a CPU target: weight-only int8 / int4 (gpt-fast's paths) and bf16, bf16 or
int4 weights with bf16-rounded inputs (bf16-dot, int4-dot), int4 weights with int8 inputs (int4-q8),
and fp32 pre-packing.

Decoding a small model on a CPU streams every weight once per forward; int8 weights stream a
quarter of fp32's bytes, int4 an eighth, bf16 half. Activations stay in the model's dtype (the -dot
kinds round each linear layer's input to bf16 inside the kernel, int4-q8 quantizes it to int8 per 32,
nothing else). A quantized target is its own vanilla: EAGLE stays lossless with respect to the
target as it runs, and the benchmark's vanilla uses the same quantized target, so speedup ratios
stay honest.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

import torch
from torch import nn

from ..errors import EaglespecError
from . import kernels
from .attention import register
from .fused import GATED_MLPS, FusedLinear, GatedMLP, _Part
from .lean import lean_decoder, lean_layers


@dataclass
class TargetKernels:
    """What this module did to a target model (`quantize_weights`, `pack_target`): read by the CPU
    backend, the cost curve's key and the benchmark."""

    quantization: str | None = None  # one of QUANTIZERS
    packed: bool = False  # fp32 linear layers pre-packed (`pack_target`)
    packed_kernel: str | None = None  # the kernel streaming them: `kernels.name()` or "oneDNN"
    exact_codes: int = 0  # fp32 layers streamed as their exact 4- / 8-bit codes


_TARGETS: "weakref.WeakKeyDictionary[nn.Module, TargetKernels]" = weakref.WeakKeyDictionary()


def target_kernels(model: nn.Module) -> TargetKernels:
    """What `quantize_weights` / `pack_target` did to `model` (all defaults: nothing)."""
    return _TARGETS.get(model) or TargetKernels()


def _record(model: nn.Module, **done) -> None:
    _TARGETS[model] = replace(target_kernels(model), **done)


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
        """The dequantized weight (the forward's fallback where no fused kernel serves)."""
        return self.weight_int8.to(self.scales.dtype) * self.scales[:, None]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of `weight`, dequantizing only them."""
        ids = ids.to(self.scales.device)
        return self.weight_int8[ids].to(self.scales.dtype) * self.scales[ids, None]

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


class Int4Linear(nn.Module):
    """y = x @ dequant(int4 weight).T + bias, with per-group (along K) scale and minimum.

    w = q * scale + min, q in 0..15, groups of `group_size` input channels: the same affine form as
    the GGUF Q4_1 blocks our models ship in, so a Q4_1 weight round-trips almost exactly.
    With AVX-512 or AVX2 the codes go to eaglespec's kernel (`kernels.linear_q4`: fp32 activations, the
    weight dequantized in registers as q * scale + min in fp32, streamed once for a whole draft
    tree). Elsewhere torch's CPU kernel serves; it wants bf16 activations (fp32 ones take a 10x
    slower path), and the output is cast back. Either way each output row depends on its own
    input row only (checked in the tests), so verifying many tokens gives the same numbers as
    decoding them one by one.
    """

    # the kernel and its packing (availability looked up per call: tests patch it); subclasses round or
    # quantize the input inside theirs
    spec_kind, kind_name, code_offset = "q4", "int4", 0
    pack, kernel = staticmethod(kernels.pack_q4), staticmethod(kernels.linear_q4)
    needs = staticmethod(lambda: kernels.available())
    half_scales = False  # Int4Q8Linear: scale and minimum in fp16, as GGUF's Q4_1 keeps them
    min_scale = 2.0 ** -14  # with half_scales: fp16's smallest normal
    inputs_per_step = 1  # inputs per packed k step as the C layer counts K (int4-q8 packs quads)

    def __init__(self, linear: nn.Linear, group_size: int = 32, keep_weight: bool = True,
                 codes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        """``codes``: the layer's own (q, scale, minimum) per group, as `exact_codes` finds them; by
        default they are fitted to the weight (scale = range / 15)."""
        super().__init__()
        w = linear.weight.detach().float()
        n, k = w.shape
        if k % group_size:
            raise EaglespecError(f"int4 needs input sizes divisible by {group_size}; a linear layer has {k}")
        self.in_features, self.out_features, self.group_size = k, n, group_size
        if codes is not None:
            q, scale, lo = codes
            q = q.to(torch.int32)
        else:
            g = w.view(n, k // group_size, group_size)
            lo, hi = g.amin(-1), g.amax(-1)
            scale = ((hi - lo) / 15).clamp_min(1e-8)
            if self.half_scales:  # codes for the rounded scale and minimum (fp16's smallest normal at least)
                scale, lo = scale.clamp_min(self.min_scale).half().float(), lo.half().float()
            q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
        fits = kernels.fits_q4(n, k) and group_size == kernels.GROUP
        self.skinny = fits and self.needs()
        if self.spec_kind != "q4" and not self.skinny:
            raise EaglespecError(f"{self.kind_name} needs eaglespec's {self.cpu_feature} kernel and a {n} x {k} layer "
                                 f"in whole blocks of {kernels.BLOCK} outputs and {kernels.GROUP} inputs")
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self._q = q.to(torch.uint8) if keep_weight else None
        if self.skinny:  # the dot kernel's minimum is stored shifted: minimum - 128 * scale
            codes, sp, mp = self.pack(q, scale, lo)
            self.register_buffer("codes", codes)
            self.register_buffer("scale", sp)
            self.register_buffer("minimum", mp)
            # the kernel's operands as plain references: a decode step makes ~120 of these calls,
            # and module attribute lookups were a measurable share of one
            self._operands = (codes, sp, mp, None if self.bias is None else self.bias.detach().float())
            return
        self.register_buffer("weight_int4", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        # the kernel dequantizes (q - 8) * scale + zero, so zero = min + 8 * scale; layout (K/g, N, 2)
        self.register_buffer("scales_and_zeros",
                             torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous().to(torch.bfloat16))

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight, exactly what the kernel multiplies by (up to bf16 rounding)."""
        return self.rows(torch.arange(self.out_features))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of `weight`, dequantizing only them."""
        if self._q is None:
            raise RuntimeError("this Int4Linear was built with keep_weight=False")
        ids = ids.to(self._q.device)
        q = self._q[ids].view(ids.numel(), -1, self.group_size).float()
        if self.skinny:  # (N/32, K/g, 32) -> (N, K/g, 1)
            s, m = (t.transpose(1, 2).reshape(self.out_features, -1, 1)[ids].float() for t in (self.scale, self.minimum))
            w = torch.addcmul(m, q + self.code_offset, s)  # q * s + m, one rounding, as the q4 kernel's fma
        else:
            sz = self.scales_and_zeros.float().transpose(0, 1)[ids]  # (n, K/g, 2)
            w = (q - 8) * sz[..., :1] + sz[..., 1:]
        return w.view(ids.numel(), self.in_features)

    def kernel_spec(self) -> kernels.LinearSpec | None:
        """This layer as `kernels.decoder_layer` calls it (eaglespec's kernel only)."""
        if not self.skinny:
            return None
        codes, sp, mp, bias = self._operands
        return kernels.LinearSpec(self.spec_kind, codes.shape[1] * self.inputs_per_step, self.out_features,
                                  (codes, sp, mp), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.skinny:
            x2 = x.reshape(-1, shape[-1])
            y = self.kernel(x2 if x2.dtype == torch.float32 else x2.float(), *self._operands)
            return (y if x.dtype == torch.float32 else y.to(x.dtype)).view(*shape[:-1], self.out_features)
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.weight_int4, self.group_size, self.scales_and_zeros)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


class Int4DotLinear(Int4Linear):
    """int4 weights (`Int4Linear`'s codes, scales and minima) and the input rounded to bf16
    (`kernels.linear_q4dot`, AVX512-BF16): the codes become bf16 128 + q with two integer
    instructions, VDPBF16PS sums x * (128 + q) exactly per product, and the scale and minimum are
    applied once per group of 32 inputs. A one-token step streams int4's bytes with little
    arithmetic, and a tree's rows share the unpacking. Rows are summed alike whatever their number."""

    spec_kind, kind_name, code_offset, cpu_feature = "q4dot", "int4-dot", 128, "AVX512-BF16"
    pack, kernel = staticmethod(kernels.pack_q4dot), staticmethod(kernels.linear_q4dot)
    needs = staticmethod(lambda: kernels.bf16dot_available())


class Int4Q8Linear(Int4Linear):
    """int4 weights (`Int4Linear`'s form, its scale and minimum in fp16) and the input quantized to int8
    per group of 32 (`kernels.linear_q4q8`, AVX512-VNNI), as llama.cpp's Q4 x Q8 CPU path does: VPDPBUSD sums
    the codes against the int8 input exactly in int32, four products per lane per instruction (twice
    int4-dot's multiply-adds), and the scales come in once per group. Scale and minimum are fp16 (a
    step streams 0.625 bytes per weight, not int4-dot's 0.75). Rows are quantized and summed alike
    whatever their number."""

    spec_kind, kind_name, cpu_feature, half_scales = "q4q8", "int4-q8", "AVX512-VNNI", True
    inputs_per_step = kernels.Q4Q8_STEP
    pack, kernel = staticmethod(kernels.pack_q4q8), staticmethod(kernels.linear_q4q8)
    needs = staticmethod(lambda: kernels.q4q8_available())


def _codes_candidate(linear: nn.Linear, of: Callable[[nn.Linear], nn.Module | None]) -> torch.Tensor | None:
    """The weight, if it is one the exact-code kernels could hold: fp32 on the CPU, finite, in whole
    blocks of 32 outputs and groups of 32 inputs, with eaglespec's kernels built here, and its first
    block of rows codes by `of` (so that an fp32 checkpoint's layer, which is no codes, costs a
    block's check at load, ~1 ms, not the whole layer's, ~40-90 ms for 4.4 M weights)."""
    w = linear.weight.detach()
    if w.dtype != torch.float32 or w.device.type != "cpu" or not kernels.available() or not kernels.fits_q4(*w.shape):
        return None
    if w.shape[0] > kernels.BLOCK:
        block = nn.Linear(w.shape[1], kernels.BLOCK, bias=False)
        block.weight = nn.Parameter(w[: kernels.BLOCK], requires_grad=False)
        if of(block) is None:
            return None
    return w if torch.isfinite(w).all() else None


MAX_SPAN = 16  # codes a group's smallest step may span (2 in the rare Q4_K group of real weights)
CODE_ROWS = 4096  # output rows per search in exact_codes


def exact_codes(w: torch.Tensor, group: int, top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Codes q (N, K) in 0..top and fp32 scale, minimum (N, K / group) with q * scale + minimum == w
    for every weight, the product exact in fp32 (so that the kernels' fused multiply-add rounds as
    this check does), or None where w is no such weight.

    A dequantized GGUF weight is one: per group its values are codes times a scale (Q8_0, Q5_0, Q4_0,
    Q6_K per 16) or codes times a scale minus a minimum, rounded once (Q4_1, Q4_K). A group's scale is
    its smallest step between distinct values divided by the codes that step spans (1, 2, ...: the
    first that reproduces the group), its minimum its smallest value; the format itself need not be
    known. Rows are searched `CODE_ROWS` at a time (a sort's copies of a whole LM head would take
    gigabytes)."""
    parts = []
    for start in range(0, w.shape[0], CODE_ROWS):
        part = _exact_codes(w[start:start + CODE_ROWS], group, top)
        if part is None:
            return None
        parts.append(part)
    codes, scale, minimum = zip(*parts)
    return torch.cat(codes), torch.cat(scale), torch.cat(minimum)


def _exact_codes(w: torch.Tensor, group: int, top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo = g.amin(-1, keepdim=True)
    steps = g.sort(-1).values.diff(dim=-1)
    step = torch.where(steps > 0, steps, torch.inf).amin(-1, keepdim=True).view(-1, 1)
    g, lo = g.view(-1, group), lo.view(-1, 1)
    scale, codes = torch.zeros_like(lo), torch.zeros_like(g)  # a group of one value: code 0, scale 0
    todo = (~step.isinf()).view(-1).nonzero().view(-1)
    for span in range(1, MAX_SPAN + 1):
        if not todo.numel():
            break
        s, x, m = step[todo] / span, g[todo], lo[todo]
        q = ((x - m) / s).round()
        exact = (q.double() * s.double() == (q * s).double()) & (q * s + m == x) & (q <= top)
        fits = exact.all(-1)
        if span == 1 and not fits.any():  # no group is codes: an fp32 checkpoint's weight, rejected at once
            return None
        scale[todo[fits]], codes[todo[fits]] = s[fits], q[fits]
        todo = todo[~fits]
    if todo.numel():
        return None
    return codes.view(n, k), scale.view(n, k // group), lo.view(n, k // group)


class ExactInt4Linear(Int4Linear):
    """An fp32 layer whose every weight is a 4-bit code times a scale plus a minimum per group of 32
    inputs (`exact_codes`): a dequantized GGUF Q4_1 / Q4_0 weight (every decoder layer of our fp32
    SmolLM2) or Q4_K (half of Qwen2.5-Coder's down projections). Stored as those codes, scales and
    minima and run on the int4 kernel (`kernels.linear_q4`), which dequantizes in registers to the
    same fp32 weights (q * scale is exact, + minimum rounds once) and sums each row in the fp32
    kernel's order: the fp32 layer's output bit for bit from ~0.75 bytes a weight instead of 4. `of`
    builds one only where that holds for every weight; the fp32 target is unchanged, its forward
    streams a fifth of the bytes."""

    kind_name = "int4-exact"

    @classmethod
    def of(cls, linear: nn.Linear) -> "ExactInt4Linear | None":
        """The layer as exact codes, or None where some weight is not one (or the kernel cannot run it)."""
        w = _codes_candidate(linear, cls.of)
        codes = None if w is None else exact_codes(w, kernels.GROUP, 15)
        if codes is None:
            return None
        layer = cls(linear, keep_weight=True, codes=codes)
        exact = layer.skinny and torch.equal(layer.weight, w)
        layer._q = None  # the codes live on in the packed buffers; nothing reads decoder weights
        return layer if exact else None


class ExactInt8Linear(nn.Module):
    """`ExactInt4Linear` for 8-bit codes, with a scale and minimum per 32 inputs (a dequantized GGUF
    Q8_0, Q5_0 or Q4_0: SmolLM2's embedding, which its LM head shares; Qwen2.5's LM head and most of
    its layers) or per 16 (Q6_K: the other half of Qwen2.5-Coder's down projections). Run on
    `kernels.linear_q8`: the fp32 layer's output bit for bit from 1.25 bytes a weight (1.5 per 16).
    An LM head keeps its fp32 `weight` (a tied embedding's, whose rows the draft head reads); a
    decoder layer keeps only the codes."""

    GROUPS = (32, 16)  # inputs per scale and minimum, tried in this order (fewer bytes first)

    def __init__(self, linear: nn.Linear, codes: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 keep_weight: bool = True):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # an LM head's: shared with a tied embedding, the draft head reads its rows; a decoder layer's: dropped
        self.weight = linear.weight if keep_weight else None
        self.bias = linear.bias
        self.group = self.in_features // codes[1].shape[1]
        self._operands = (*kernels.pack_q8(*codes), None if self.bias is None else self.bias.detach().float())

    @classmethod
    def of(cls, linear: nn.Linear, keep_weight: bool = True) -> "ExactInt8Linear | None":
        """The layer as exact 8-bit codes, or None where some weight is not one (or the kernel cannot run it)."""
        w = _codes_candidate(linear, cls.of)
        if w is None:
            return None
        codes = next((c for c in (exact_codes(w, group, 255) for group in cls.GROUPS) if c is not None), None)
        return None if codes is None else cls(linear, codes, keep_weight)

    def kernel_spec(self) -> kernels.LinearSpec:
        """This layer as `kernels.decoder_layer` calls it."""
        codes, sp, mp, bias = self._operands
        return kernels.LinearSpec("q8" if self.group == 32 else "q8g16", codes.shape[1], self.out_features,
                                  (codes, sp, mp), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype != torch.float32 or x2.requires_grad:  # autograd (training reads the LM head) or another dtype
            if self.weight is None:
                raise RuntimeError("this ExactInt8Linear keeps only its codes: fp32 inputs without autograd")
            y = nn.functional.linear(x2, self.weight.detach().to(x2.dtype), self.bias)
        else:
            y = kernels.linear_q8(x2, *self._operands)
        return y.view(*shape[:-1], self.out_features)


def exact_or_packed(linear: nn.Linear) -> nn.Module:
    """An fp32 linear layer for eaglespec's kernels: `ExactInt4Linear` where its weights are exact
    4-bit codes, else `ExactInt8Linear` where they are exact 8-bit ones, else
    `PackedLinear`. Each gives the same output bits."""
    return ExactInt4Linear.of(linear) or ExactInt8Linear.of(linear, keep_weight=False) or PackedLinear(linear)


class Bf16Linear(nn.Module):
    """y = x @ bf16(w).T + bias: weight-only bf16 (`kernels.linear_bf16`), fp32 activations and sums.

    Half fp32's weight bytes per forward, and nothing to dequantize but a 16-bit shift. The kernel
    is fp32's own, reading the rounded weight, so each output row depends on its own input row only
    and a tree verifies to the numbers a one-token step gives, exactly as with fp32 weights.
    """

    pack, kernel, pairs = staticmethod(kernels.pack_bf16), staticmethod(kernels.linear_bf16), False
    spec_kind = "bf16"

    def __init__(self, linear: nn.Linear):
        super().__init__()
        n, k = linear.weight.shape
        if n % kernels.BLOCK or (self.pairs and k % 2):
            raise EaglespecError(f"bf16 needs output sizes divisible by {kernels.BLOCK}"
                                 f"{' and even input sizes' if self.pairs else ''}; a linear layer is {n} x {k}")
        self.in_features, self.out_features = k, n
        self.register_buffer("packed", self.pack(linear.weight))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float().clone(), requires_grad=False)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the bf16 weight, as fp32: (N/32, K, 32) (or (N/32, K/2, 32, 2)) -> (N, K)."""
        w = self.packed.transpose(1, 2).reshape(self.out_features, self.in_features)
        return w[ids.to(w.device)].float()

    @property
    def weight(self) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features))

    def kernel_spec(self) -> kernels.LinearSpec:
        """This layer as `kernels.decoder_layer` calls it."""
        return kernels.LinearSpec(self.spec_kind, self.packed.shape[1], self.out_features, (self.packed,), self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        y = self.kernel(x2 if x2.dtype == torch.float32 else x2.float(), self.packed, self.bias)
        return (y if x.dtype == torch.float32 else y.to(x.dtype)).view(*shape[:-1], self.out_features)


class Bf16DotLinear(Bf16Linear):
    """y = bf16(x) @ bf16(w).T + bias (`kernels.linear_bf16dot`, AVX512-BF16): the input is rounded to
    bf16 as well, and the kernel sums exact products of pairs in fp32 (VDPBF16PS), half the
    multiply-adds of `Bf16Linear`. A one-token step streams the same bytes; a tree, whose verify
    the arithmetic limits, gets cheaper. Rows are still summed alike whatever their number."""

    pack, kernel, pairs = staticmethod(kernels.pack_bf16dot), staticmethod(kernels.linear_bf16dot), True
    spec_kind = "bf16dot"


RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")  # weight * x * rsqrt(mean(x^2) + eps)


class FastRMSNorm(nn.Module):
    """transformers' RMSNorm in one `kernels.rms_norm` call (fp32 CPU rows) instead of ~6 small torch
    ops: ~19 -> ~9 µs per call (module call included), 61 calls per SmolLM2 step. Within a few ulps
    of the original (~3e-7 relative); rows are independent of the row count, which is what
    lossless trees need. Anything else goes to the original forward."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.inner = norm
        self.weight, self.eps = norm.weight, float(norm.variance_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or self.weight.dtype != torch.float32 or x.device.type != "cpu" \
                or not x.is_contiguous() or torch.is_grad_enabled() and x.requires_grad:
            return self.inner(x)
        return kernels.rms_norm(x, self.weight, self.eps)


def fast_norms(decoder: nn.Module) -> None:
    """Replace the decoder's RMSNorms (per layer, and the final one) by `FastRMSNorm`, in place."""
    if not kernels.available():
        return
    for parent in list(decoder.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ in RMS_NORMS and hasattr(child, "variance_epsilon"):
                setattr(parent, name, FastRMSNorm(child))


def eager_fast_paths(decoder: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> None:
    """Fewer, bigger calls per decoder layer for eager decoding, in place: q/k/v and gate/up fused
    (`make` builds the fused linear), `FastRMSNorm`s and lean layers (`lean.lean_layers`). Not for
    `torch.compile`: the fused parts share a cache by tensor identity that the compiler need not see.
    The decoder's other linear layers become `make`'s too, so that a lean layer can see all of its kernels."""
    fuse_projections(decoder, make)
    replace_linears(decoder, make)
    fast_norms(decoder)
    lean_layers(decoder)
    lean_decoder(decoder)


def fuse_projections(decoder: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> None:
    """Fuse q/k/v and gate/up of every decoder layer that has them (Llama, Qwen2, Mistral, ...)."""
    groups = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
    for layer in getattr(decoder, "layers", []):
        for holder_name, names in groups:
            holder = getattr(layer, holder_name, None)
            parts = [getattr(holder, n, None) for n in names]
            if holder is None or not all(type(m) is nn.Linear for m in parts):
                continue
            if len({m.in_features for m in parts}) != 1 or len({m.bias is None for m in parts}) != 1:
                continue
            fused = FusedLinear(parts, make)
            if holder_name == "mlp" and type(holder).__name__ in GATED_MLPS:
                layer.mlp = GatedMLP(holder, fused)
                continue
            holder.add_module("fused_" + "_".join(n.split("_")[0] for n in names), fused)
            for i, n in enumerate(names):
                setattr(holder, n, _Part(fused, i))


def int4_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


QUANTIZERS = ("int8", "int4", "bf16", "bf16-dot", "int4-dot", "int4-q8")


def fastest_quantizer() -> str:
    """The fastest lossless CPU target: int4-q8 where AVX512-VNNI runs it, else
    int4-dot where AVX512-BF16 does, else int4."""
    return "int4-q8" if kernels.q4q8_available() else "int4-dot" if kernels.bf16dot_available() else "int4"


def quantize_weights(model: nn.Module, kind: str = "int8", lm_head: bool = True, fuse: bool = True) -> nn.Module:
    """Replace the decoder's linear layers (and the LM head) by `Int8Linear`, `Int4Linear`, `Bf16Linear`,
    `Bf16DotLinear`, `Int4DotLinear` or `Int4Q8Linear` (`kind` = one of QUANTIZERS), in place.

    The input embedding stays as it is (a lookup reads one row, not the whole matrix), so a tied
    LM head gets its own quantized copy. ``fuse``: `eager_fast_paths` (q/k/v and gate/up as one
    matmul each, fast norms, lean layers; a model for `torch.compile` keeps them apart).
    """
    make = dict(zip(QUANTIZERS, (Int8Linear, Int4Linear, Bf16Linear, Bf16DotLinear, Int4DotLinear, Int4Q8Linear)))[kind]
    inner = partial(make, keep_weight=False) if kind.startswith("int4") else make  # nothing reads decoder weights
    decoder = model.get_decoder()
    if kind != "int8" and fuse:
        eager_fast_paths(decoder, inner)
    replace_linears(decoder, inner, lambda lin: isinstance(lin, nn.Linear))
    if lm_head and isinstance(model.get_output_embeddings(), nn.Linear):
        model.set_output_embeddings(make(model.get_output_embeddings()))
        model.config.tie_word_embeddings = False  # stop transformers re-tying it to the embedding
    torch_int4 = kind == "int4" and not all(m.skinny for m in model.modules() if isinstance(m, Int4Linear))
    if torch_int4 or kind.endswith("-dot") or kind == "int4-q8":
        # bf16 activations (torch's int4 kernel) or inputs rounded to bf16 (the -dot kinds) or int8 turn attention's
        # ~1e-7 differences between a tree and a step into whole bf16 ulps: row-exact attention
        model.set_attn_implementation(register())
    _record(model, quantization=kind, packed_kernel=kernels.name() if kind != "int8" and not torch_int4 else None)
    return model


def packed_linear_available() -> bool:
    return kernels.available() or (torch.backends.mkldnn.is_available()
                                    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinear(nn.Module):
    """fp32 linear whose weight is reordered once for a CPU kernel that streams it once per call.

    torch's default CPU linear is tuned for big matrices: sending 2-26 tokens through it (a draft
    tree) costs 1.5-2x a one-token step. With AVX-512 or AVX2 the weight is laid out for `kernels`
    (`skinny.c`); elsewhere it is pre-packed for oneDNN, which also streams it once for a few rows.
    The kernel serves a prefill too (no slower than torch's there), and every row is then summed as
    a decode step sums it, which is what keeps a tree row equal to a decode step.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # kept (shared): a tied embedding and the draft head read it
        self.bias = linear.bias
        self.skinny = kernels.available() and kernels.fits(linear.weight)
        if self.skinny:
            self.packed = kernels.pack_weight(linear.weight)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)

    def kernel_spec(self) -> kernels.LinearSpec | None:
        """This layer as `kernels.decoder_layer` calls it (eaglespec's kernel only, not oneDNN's)."""
        if not self.skinny:
            return None
        return kernels.LinearSpec("f32", self.in_features, self.out_features, (self.packed,), self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        bias = None if self.bias is None else self.bias.detach()
        if not self.skinny:
            y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, bias, "none", [], "")
        elif x2.dtype == torch.float32 and not x2.requires_grad:
            y = kernels.linear(x2, self.packed, bias)
        else:
            y = nn.functional.linear(x2, self.weight.detach(), bias)
        return y.view(*shape[:-1], self.out_features)


def replace_linears(module: nn.Module, make: Callable[[nn.Linear], nn.Module],
                    pred: Callable[[nn.Module], bool] = lambda m: type(m) is nn.Linear) -> nn.Module:
    """Replace every child inside `module` for which `pred` holds (plain `nn.Linear`s) by `make(child)`, in place."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if pred(child):
                setattr(parent, name, make(child))
    return module


def pack_linears(module: nn.Module, make: Callable[[nn.Linear], nn.Module] = PackedLinear) -> nn.Module:
    """Replace every fp32 CPU `nn.Linear` inside `module` by `make(it)` (a `PackedLinear`), in place."""
    if not packed_linear_available():
        return module
    return replace_linears(module, make, lambda m: type(m) is nn.Linear and m.weight.dtype == torch.float32
                           and m.weight.device.type == "cpu")


EXACT_CODES = os.environ.get("EAGLESPEC_EXACT_CODES", "1") != "0"  # fp32 layers as their exact 4- / 8-bit codes where they are


def pack_target(model: nn.Module, fuse: bool = True) -> nn.Module:
    """Pack the decoder's linear layers and the LM head of a causal LM (outputs equal up to float
    rounding), each decoder layer as exact 4-bit codes and the LM head as exact 8-bit ones where its
    weights are (`ExactInt4Linear`, `ExactInt8Linear`: a dequantized GGUF's; the same output bits; not
    with ``fuse=False``, for `torch.compile`). ``fuse``: `eager_fast_paths` on eaglespec's kernel,
    as for the quantized targets (the same bits as unfused); not for `torch.compile` (see
    `quantize_weights`)."""
    make = exact_or_packed if EXACT_CODES and fuse else PackedLinear
    if fuse and kernels.available():
        eager_fast_paths(model.get_decoder(), make)
    pack_linears(model.get_decoder(), make)
    head = model.get_output_embeddings()
    if type(head) is nn.Linear and packed_linear_available():
        exact = ExactInt8Linear.of(head) if EXACT_CODES and fuse else None
        model.set_output_embeddings(exact or PackedLinear(head))
    skinny = any(getattr(m, "skinny", False) for m in model.modules())
    exact = sum(isinstance(m, (ExactInt4Linear, ExactInt8Linear)) for m in model.modules())
    _record(model, packed=True, packed_kernel=kernels.name() if skinny else "oneDNN", exact_codes=exact)
    return model
