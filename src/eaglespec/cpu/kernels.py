"""CPU linear kernels for few rows (`skinny.c`), built on first use with the system's C compiler.

Speculative decoding sends 2-30 tokens through every linear layer where vanilla sends one. On a
small CPU torch's default fp32 kernel costs 1.6x a one-token step at 4 rows and 2x at 8 (its int4
kernel 2x at 8), which caps the tree the cost model can afford. `skinny.c` streams each weight once whatever the row count (up to ~16 rows) and is no
slower for one row: `linear` for fp32 weights (`quant.PackedLinear`), `linear_q4` for 4-bit ones
(`quant.Int4Linear`), `linear_bf16` for bf16 ones (`quant.Bf16Linear`), and with AVX512-BF16
`linear_bf16dot` / `linear_q4dot` for bf16 / 4-bit weights and bf16-rounded inputs
(`quant.Bf16DotLinear`, `quant.Int4DotLinear`), and with AVX512-VNNI `linear_q4q8` for 4-bit weights
and int8-quantized inputs (`quant.Int4Q8Linear`). Also `attend_rows`, row-exact attention.

The shared library is compiled once per machine into ``$EAGLESPEC_CACHE/kernels`` (a folder of this
user's that nobody else may write to), named by a hash of the source, the flags and the compiler,
written atomically, and rebuilt if it does not load. Where it cannot be
built or run (neither AVX-512 nor AVX2, no compiler, ``EAGLESPEC_SKINNY=0``) `available()` is False and callers
use torch's kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from functools import lru_cache
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch

from ..platform import cache_root, cpu_has

SOURCE = Path(__file__).with_name("skinny.c")
FLAGS = ["-O3", "-mfma", "-fopenmp", "-shared", "-fPIC", "-ffp-contract=off"]  # no fused a * b + c where torch rounds twice
ISA_FLAGS = {"avx512": "-mavx512f", "avx2": "-mavx2"}  # skinny.c picks its vector width from these
BLOCK = 32  # output columns per weight block (NR in skinny.c)


def isa() -> str | None:
    """The instruction set the kernels are built for here: "avx512", "avx2" (with FMA), or None.
    ``EAGLESPEC_SKINNY=avx2`` builds the AVX2 kernels on an AVX-512 CPU (to compare or test them)."""
    want = os.environ.get("EAGLESPEC_SKINNY", "1")
    if want == "0":
        return None
    if cpu_has("avx512f") and want != "avx2":
        return "avx512"
    return "avx2" if cpu_has("avx2") and cpu_has("fma") else None


COMPILE_TIMEOUT_S = 300


def build_flags(isa: str) -> list[str]:
    flags = [*FLAGS, ISA_FLAGS[isa]]
    if isa == "avx512" and cpu_has("avx512_bf16"):
        flags.append("-mavx512bf16")  # adds skinny_linear_bf16dot
    if isa == "avx512" and cpu_has("avx512_vnni") and cpu_has("avx512bw"):
        flags += ["-mavx512vnni", "-mavx512bw"]  # adds skinny_linear_q4q8
    return flags


def compiler() -> tuple[str, str]:
    """The C compiler ($CC, cc or gcc) and its version line, which the library's name includes: a
    library built by another compiler is another library."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    try:
        r = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"{cc} --version failed ({e})") from None
    return cc, (r.stdout.splitlines() or [""])[0]


def private_dir(path: Path) -> Path:
    """`path`, made if missing with mode 0700, and refused unless this user owns it and nobody else
    may write to it: a library loaded from there runs as this user."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise RuntimeError(f"{path} is not a private folder of this user (owner uid {st.st_uid}, mode "
                           f"{st.st_mode & 0o777:o}); set EAGLESPEC_CACHE to one")
    return path


def library_name(flags: list[str], cc: str, version: str) -> str:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, version, *flags]).encode()).hexdigest()[:16]
    return f"skinny-{digest}.so"


def _safe_to_load(lib: Path) -> bool:
    st = lib.stat()
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _build(out_dir: Path, isa: str, rebuild: bool = False) -> Path:
    """The kernels' shared library for this source, flags and compiler: built once into a private
    folder (named by a digest of all three, written atomically), rebuilt when asked (a library that
    failed to load) or when the file there is not this user's alone."""
    flags = build_flags(isa)
    cc, version = compiler()
    out_dir = private_dir(out_dir)
    lib = out_dir / library_name(flags, cc, version)
    if lib.exists() and not rebuild and _safe_to_load(lib):
        return lib
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        try:
            r = subprocess.run([cc, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True,
                               timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{cc} took more than {COMPILE_TIMEOUT_S} s") from None
        if r.returncode:
            raise RuntimeError(f"{cc} failed: {r.stderr.strip()[:500]}")
        os.chmod(tmp, 0o700)
        os.replace(tmp, lib)  # atomic: a concurrent process sees the old state or the whole library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _load(target: str) -> ctypes.CDLL:
    """The library, rebuilt once if the cached file does not load (truncated, or another machine's)."""
    lib = _build(cache_root() / "kernels", target)
    try:
        return ctypes.CDLL(str(lib))
    except OSError:
        return ctypes.CDLL(str(_build(cache_root() / "kernels", target, rebuild=True)))


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    target = isa()
    if target is None:
        return None
    try:
        lib = _load(target)
    except (OSError, RuntimeError) as e:
        warnings.warn(f"eaglespec: its {target} kernels are unavailable ({e}); using torch's kernels")
        return None
    fn = lib.skinny_linear
    fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    fn.restype = None
    q4 = lib.skinny_linear_q4
    q4.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    q4.restype = None
    for dot in ("skinny_linear_q4dot", "skinny_linear_q4dot_f32", "skinny_linear_q4q8", "skinny_linear_q8",
                "skinny_linear_q8g16"):
        if hasattr(lib, dot):
            getattr(lib, dot).argtypes, getattr(lib, dot).restype = q4.argtypes, None
    for extra in ("skinny_linear_bf16", "skinny_linear_bf16dot", "skinny_linear_bf16dot_f32"):
        if hasattr(lib, extra):
            getattr(lib, extra).argtypes = fn.argtypes
            getattr(lib, extra).restype = None
    P, L = ctypes.c_void_p, ctypes.c_long
    if hasattr(lib, "decoder_stack"):
        lib.decoder_stack.argtypes = [P, L, P, L, L, L, P, P, P, P, L, L, L, L, L, L, P, P, P, P, P, ctypes.c_int]
        lib.decoder_stack.restype = None
    if hasattr(lib, "draft_step"):
        lib.draft_step.argtypes = [P, P, L, L, P, P, P, P, L, L, L, L, L, L, P, P, P, P, P, P, L, P, L, P,
                                   ctypes.c_float, L, P, P, P, ctypes.c_int]
        lib.draft_step.restype = None
    lib.kv_compact.argtypes = [P, L, L, L, L, L, L, P, L, P, P]
    lib.kv_compact.restype = None
    lib.argmax_rows.argtypes, lib.argmax_rows.restype = [P, L, L, P], ctypes.c_int
    lib.draw_rows.argtypes, lib.draw_rows.restype = [P, L, L, L, P, P], ctypes.c_int
    lib.residual_law.argtypes, lib.residual_law.restype = [P, P, L, P], ctypes.c_double
    lib.rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_float,
                             ctypes.c_void_p]
    lib.rms_norm.restype = None
    if hasattr(lib, "attend_rows"):
        lib.attend_rows.argtypes = [P, L, L, L, P, P, L, L, L, L, L, L, P, P, P, P, P, ctypes.c_float, P, ctypes.c_int]
        lib.attend_rows.restype = None
    return lib


def name() -> str:
    """How reports and cost curves name these kernels: "skinny" (AVX-512) or "skinny-avx2"."""
    return "skinny" if isa() == "avx512" else f"skinny-{isa()}"


def available() -> bool:
    """Whether the skinny kernels run here (x86-64 with AVX-512F, or AVX2 and FMA, and a C compiler)."""
    return _lib() is not None


def bf16dot_available() -> bool:
    """Whether `linear_bf16dot` runs here (the AVX-512 kernels on a CPU with AVX512-BF16)."""
    return available() and hasattr(_lib(), "skinny_linear_bf16dot")


def q4q8_available() -> bool:
    """Whether `linear_q4q8` runs here (the AVX-512 kernels on a CPU with AVX512-VNNI)."""
    return available() and hasattr(_lib(), "skinny_linear_q4q8")


def fits(weight: torch.Tensor) -> bool:
    """Whether a weight can use the kernel: fp32 on the CPU with a multiple of 32 output rows."""
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2 \
        and weight.shape[0] % BLOCK == 0


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) -> (N / 32, K, 32): each block of 32 output rows transposed (skinny.c's layout)."""
    n, k = weight.shape
    return weight.detach().reshape(n // BLOCK, BLOCK, k).transpose(1, 2).contiguous()


def _run(fn: ctypes._CFuncPtr, x: torch.Tensor, k: int, n: int, weights: tuple[torch.Tensor, ...],
         bias: torch.Tensor | None, pairs: bool = False) -> torch.Tensor:
    """Every kernel takes (x, M, K, *weights, N, bias, y, threads). `pairs`: K counts pairs of inputs
    (the -dot kernels' _f32 entry points, which round fp32 x to bf16 themselves)."""
    m, kx = x.shape
    if x.dtype != torch.float32:
        raise TypeError(f"the kernels take fp32 inputs, got {x.dtype}")
    if kx != (2 * k if pairs else k):
        raise ValueError(f"input has {kx} features, the weight expects {2 * k if pairs else k}")
    x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.float32)
    fn(x.data_ptr(), m, k, *(w.data_ptr() for w in weights), n, None if bias is None else bias.data_ptr(),
       y.data_ptr(), torch.get_num_threads())
    return y


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ w.T + bias for a 2-D fp32 x (M, K), with `packed` = pack_weight(w)."""
    if torch.compiler.is_compiling():  # an opaque op for inductor, which fuses the small ops around it
        return torch.ops.eaglespec.skinny_linear(x, packed, bias)
    return _run(_lib().skinny_linear, x, packed.shape[1], packed.shape[0] * BLOCK, (packed,), bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim of a contiguous fp32 CPU x, row by row."""
    y = torch.empty_like(x)
    _lib().rms_norm(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], weight.data_ptr(), eps, y.data_ptr())
    return y


GROUP = 32  # inputs per 4-bit scale/minimum group (skinny_linear_q4)


def fits_q4(out_features: int, in_features: int) -> bool:
    return out_features % BLOCK == 0 and in_features % GROUP == 0


def pack_q4(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Codes q (N, K) in 0..15 and per-group scale, minimum (N, K / 32) -> skinny_linear_q4's layout:
    (N / 32, K, 16) bytes (column j low nibble, column 16 + j high) and (N / 32, K / 32, 32) fp32 twice."""
    n, k = q.shape
    blocks = q.to(torch.uint8).reshape(n // BLOCK, BLOCK, k).transpose(1, 2)  # (N/32, K, 32)
    codes = (blocks[..., :16] | (blocks[..., 16:] << 4)).contiguous()
    return codes, _per_block(scale), _per_block(minimum)


def _per_block(t: torch.Tensor) -> torch.Tensor:
    """Per-group values (N, K / 32) -> fp32 (N / 32, K / 32, 32): a block's 32 columns side by side."""
    n, groups = t.shape
    return t.float().reshape(n // BLOCK, BLOCK, groups).transpose(1, 2).contiguous()


def linear_q4(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ w.T + bias for a 2-D fp32 x (M, K) and w = q * scale + minimum packed by `pack_q4`."""
    if torch.compiler.is_compiling():
        return torch.ops.eaglespec.skinny_linear_q4(x, codes, scale, minimum, bias)
    return _run(_lib().skinny_linear_q4, x, codes.shape[1], codes.shape[0] * BLOCK, (codes, scale, minimum), bias)


def pack_q8(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Codes q (N, K) in 0..255 and per-group scale, minimum (N, K / G) for groups G of 32 or 16 inputs
    -> skinny_linear_q8's (or _q8g16's) layout: (N / 32, K, 32) bytes and (N / 32, K / G, 32) fp32 twice."""
    n, k = q.shape
    return q.to(torch.uint8).reshape(n // BLOCK, BLOCK, k).transpose(1, 2).contiguous(), _per_block(scale), \
        _per_block(minimum)


def linear_q8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ w.T + bias for a 2-D fp32 x (M, K) and w = q * scale + minimum packed by `pack_q8` (its
    groups of 32 or 16 inputs read from the scales' shape)."""
    fn = _lib().skinny_linear_q8g16 if scale.shape[1] * 16 == codes.shape[1] else _lib().skinny_linear_q8
    return _run(fn, x, codes.shape[1], codes.shape[0] * BLOCK, (codes, scale, minimum), bias)


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) -> bf16 (N / 32, K, 32): `pack_weight`'s layout, rounded to bf16 (skinny_linear_bf16)."""
    return pack_weight(weight.detach().to(torch.bfloat16))


def linear_bf16(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ w.T + bias for a 2-D fp32 x (M, K), with `packed` = pack_bf16(w): fp32 sums of the
    bf16-rounded weight, which the kernel widens to fp32 exactly."""
    if torch.compiler.is_compiling():
        return torch.ops.eaglespec.skinny_linear_bf16(x, packed, bias)
    return _run(_lib().skinny_linear_bf16, x, packed.shape[1], packed.shape[0] * BLOCK, (packed,), bias)


def pack_bf16dot(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) -> bf16 (N / 32, K / 2, 32, 2): per block of 32 rows and pair of inputs, each row's two
    weights side by side (skinny_linear_bf16dot). K must be even."""
    n, k = weight.shape
    w = weight.detach().to(torch.bfloat16).reshape(n // BLOCK, BLOCK, k // 2, 2)
    return w.transpose(1, 2).contiguous()


def linear_bf16dot(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = bf16(x) @ w.T + bias for a 2-D fp32 x (M, K), with `packed` = pack_bf16dot(w): x is rounded
    to bf16 (to nearest even), then products of pairs are summed in fp32."""
    if torch.compiler.is_compiling():
        return torch.ops.eaglespec.skinny_linear_bf16dot(x, packed, bias)
    # (M, K / 2) pairs in the order of `packed`, rounded to bf16 by the kernel
    return _run(_lib().skinny_linear_bf16dot_f32, x, packed.shape[1], packed.shape[0] * BLOCK, (packed,), bias,
                pairs=True)


def pack_q4dot(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Codes q (N, K) in 0..15 and per-group scale, minimum (N, K / 32) -> skinny_linear_q4dot's layout:
    (N / 32, K / 2, 32) bytes (byte 2j + t of pair step p: input 2p + t of column j in the low nibble, of
    column 16 + j in the high one), the scale and minimum - 128 * scale as (N / 32, K / 32, 32) fp32."""
    n, k = q.shape
    blocks = q.to(torch.uint8).reshape(n // BLOCK, BLOCK, k // 2, 2).transpose(1, 2)  # (N/32, K/2, 32, 2)
    half = BLOCK // 2
    codes = (blocks[:, :, :half] | (blocks[:, :, half:] << 4)).reshape(n // BLOCK, k // 2, BLOCK).contiguous()
    return codes, _per_block(scale), _per_block(minimum.float() - 128 * scale.float())


def linear_q4dot(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, shifted_min: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = bf16(x) @ w.T + bias for a 2-D fp32 x (M, K), w = q * scale + minimum packed by `pack_q4dot`
    (its `shifted_min` is minimum - 128 * scale): x rounded to bf16, then summed against 128 + q."""
    if torch.compiler.is_compiling():
        return torch.ops.eaglespec.skinny_linear_q4dot(x, codes, scale, shifted_min, bias)
    return _run(_lib().skinny_linear_q4dot_f32, x, codes.shape[1], codes.shape[0] * BLOCK,
                (codes, scale, shifted_min), bias, pairs=True)


Q4Q8_STEP = 4  # inputs per packed k step of the q4q8 kernel (VPDPBUSD sums quads)


def pack_q4q8(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Codes q (N, K) in 0..15 and per-group scale, minimum (N, K / 32) -> skinny_linear_q4q8's layout:
    (N / 32, K / 4, 64) bytes (byte 4j + t of quad step p: input 4p + t of column j in the low nibble, of
    column 16 + j in the high one), the scale and minimum as (N / 32, K / 32, 32) fp16."""
    n, k = q.shape
    blocks = q.to(torch.uint8).reshape(n // BLOCK, BLOCK, k // Q4Q8_STEP, Q4Q8_STEP).transpose(1, 2)  # (N/32, K/4, 32, 4)
    half = BLOCK // 2
    codes = (blocks[:, :, :half] | (blocks[:, :, half:] << 4)).reshape(n // BLOCK, k // Q4Q8_STEP, 2 * BLOCK).contiguous()
    return codes, _per_block(scale).half(), _per_block(minimum).half()


def linear_q4q8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = q8(x) @ w.T + bias for a 2-D fp32 x (M, K), w = q * scale + minimum packed by `pack_q4q8`:
    each group of 32 inputs of a row quantized to d * int8 (d = its max |x| / 127), then summed
    against the codes in int32 (VPDPBUSD) and scaled per group in fp32."""
    if torch.compiler.is_compiling():
        return torch.ops.eaglespec.skinny_linear_q4q8(x, codes, scale, minimum, bias)
    return _run(_lib().skinny_linear_q4q8, x, codes.shape[1] * Q4Q8_STEP, codes.shape[0] * BLOCK, (codes, scale, minimum),
                bias)


def attention_available() -> bool:
    """Whether `attend_rows` runs here (the AVX-512 kernels)."""
    return _lib() is not None and hasattr(_lib(), "attend_rows")


def attend_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: tuple[torch.Tensor, ...],
                scale: float) -> torch.Tensor:
    """Row-exact attention (skinny.c's attend_rows): query (B, H, M, D) fp32, key / value (B, Hkv, L, D)
    with contiguous rows of D; plan = int64 (batch, query, n, offsets, tails) from `attention.pack_plan`.
    Returns (B, M, H, D)."""
    if torch.compiler.is_compiling():
        return torch.ops.eaglespec.attend_rows(query, key, value, *plan, scale)
    b, h, m, d = query.shape
    q = query.transpose(1, 2).contiguous()
    out = torch.empty_like(q)
    pb, pi, pn, po, pt = plan
    _lib().attend_rows(q.data_ptr(), m, h, d, key.data_ptr(), value.data_ptr(), key.shape[1], key.stride(0),
                       key.stride(1), value.stride(0), value.stride(1), pb.numel(), pb.data_ptr(), pi.data_ptr(),
                       pn.data_ptr(), po.data_ptr(), pt.data_ptr(), scale, out.data_ptr(), torch.get_num_threads())
    return out


class LinearSpec(NamedTuple):
    """A linear layer as `decoder_layer` calls it: the kernel ("f32", "bf16", "q4", "bf16dot", "q4dot", "q4q8", "q8",
    "q8g16"),
    K as that kernel counts inputs (pairs for the -dot kinds), N outputs, its packed operands, a bias."""
    kind: str
    k: int
    n: int
    operands: tuple[torch.Tensor, ...]
    bias: torch.Tensor | None


_LIN_KINDS = {"f32": 0, "bf16": 1, "q4": 2, "bf16dot": 3, "q4dot": 4, "q4q8": 5, "q8": 6, "q8g16": 7}  # skinny.c's LIN_*


class _Lin(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_long), ("K", ctypes.c_long), ("N", ctypes.c_long), ("w0", ctypes.c_void_p),
                ("w1", ctypes.c_void_p), ("w2", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Lin), ("o", _Lin), ("gate_up", _Lin), ("down", _Lin), ("norm1", ctypes.c_void_p),
                ("norm2", ctypes.c_void_p), ("nq", ctypes.c_long), ("nkv", ctypes.c_long), ("D", ctypes.c_long),
                ("inter", ctypes.c_long), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("hnorm", ctypes.c_void_p)]


def _lin(spec: LinearSpec) -> _Lin:
    ptrs = [t.data_ptr() for t in spec.operands] + [None] * (3 - len(spec.operands))
    bias = None if spec.bias is None else spec.bias.data_ptr()
    return _Lin(_LIN_KINDS[spec.kind], spec.k, spec.n, *ptrs, bias)


def layer_available() -> bool:
    """Whether `decoder_layer` / `decoder_stack` run here (the AVX-512 kernels)."""
    return _lib() is not None and hasattr(_lib(), "decoder_stack")


@dataclass
class LayerSpec:
    """A decoder layer's weights, laid out for skinny.c's `decoder_layer` (built once per layer; it
    holds the tensors whose addresses the C struct records). norm1 None: no input norm (EAGLE-1's
    draft layer); hidden_norm: EAGLE-3's mid layer (q/k/v read [norm1(embedding) ; hidden_norm(x)],
    which only `draft_step` passes)."""
    qkv: LinearSpec
    o: LinearSpec
    gate_up: LinearSpec
    down: LinearSpec
    norm1: torch.Tensor | None
    norm2: torch.Tensor
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scale: float
    hidden_norm: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.inter = self.gate_up.n // 2
        ptr = lambda t: None if t is None else t.data_ptr()
        self._struct = _Layer(_lin(self.qkv), _lin(self.o), _lin(self.gate_up), _lin(self.down), ptr(self.norm1),
                              self.norm2.data_ptr(), self.heads, self.kv_heads, self.head_dim, self.inter,
                              self.eps, self.scale, ptr(self.hidden_norm))
        self.address = ctypes.addressof(self._struct)
        self.addresses = torch.tensor([self.address])  # `decoder_stack`'s list, of this layer alone


def decoder_layer(spec: LayerSpec, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_buf: torch.Tensor,
                  v_buf: torch.Tensor, slot: int, plan: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """One Llama / Qwen2 decoder layer on x (B, M, H) fp32 (skinny.c's `decoder_layer`): returns the
    layer's output, having written the rows' keys and values into k_buf / v_buf (B, Hkv, max_len, D)
    at positions slot.. slot + M - 1 (v_buf shaped as k_buf). cos, sin: (B, M, D); plan:
    `attention.pack_plan` over the cache after the write. A stack of one (`decoder_stack`)."""
    out = x.clone(memory_format=torch.contiguous_format)  # in place on a copy: hooks may hold the input
    decoder_stack(spec.addresses, out, cos, sin, torch.tensor([k_buf.data_ptr()]), torch.tensor([v_buf.data_ptr()]),
                  k_buf, slot, plan)
    return out


class _Head(ctypes.Structure):
    _fields_ = [("fc", _Lin), ("fuse", _Lin), ("lm", _Lin), ("embed", ctypes.c_void_p), ("aux_norm", ctypes.c_void_p),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("layers", ctypes.c_void_p), ("H", ctypes.c_long),
                ("naux", ctypes.c_long), ("nlayers", ctypes.c_long), ("D", ctypes.c_long), ("aux_eps", ctypes.c_float),
                ("final_norm", ctypes.c_void_p), ("final_eps", ctypes.c_float)]


def draft_available() -> bool:
    """Whether `draft_step` runs here (the AVX-512 kernels)."""
    return _lib() is not None and hasattr(_lib(), "draft_step")


@dataclass
class HeadSpec:
    """An EAGLE draft head laid out for skinny.c's `draft_step` (built once per packed head; it holds
    the tensors whose addresses the C struct records). fuse None: no aux features; `rope` the (P, D)
    cos and sin tables by position, replaceable with `set_rope` when they grow; final_norm (and its
    eps): an EAGLE-3 head (fc over the aux features alone, the norm before its own LM head)."""
    fc: LinearSpec
    fuse: LinearSpec | None
    lm: LinearSpec
    embed: torch.Tensor
    aux_norm: torch.Tensor
    aux_eps: float
    naux: int
    layers: list[LayerSpec]
    rope: tuple[torch.Tensor, torch.Tensor]
    final_norm: torch.Tensor | None = None
    final_eps: float = 0.0

    def __post_init__(self) -> None:
        none = _Lin(-1, 0, 0, None, None, None, None)
        self._addresses = torch.tensor([layer.address for layer in self.layers])
        self._struct = _Head(_lin(self.fc), none if self.fuse is None else _lin(self.fuse), _lin(self.lm),
                             self.embed.data_ptr(), self.aux_norm.data_ptr(), 0, 0, self._addresses.data_ptr(),
                             self.embed.shape[1], self.naux, len(self.layers), self.layers[0].head_dim, self.aux_eps,
                             None if self.final_norm is None else self.final_norm.data_ptr(), self.final_eps)
        self.set_rope(*self.rope)

    def set_rope(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.rope = (cos.contiguous(), sin.contiguous())
        self._struct.cos, self._struct.sin = self.rope[0].data_ptr(), self.rope[1].data_ptr()


def draft_step(spec: HeadSpec, feat: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
               k_bufs: torch.Tensor, v_bufs: torch.Tensor, like: torch.Tensor, slot: int,
               plan: tuple[torch.Tensor, ...] | None, first: int = 0, ctx: torch.Tensor | None = None,
               ids: torch.Tensor | None = None, inv_temp: float = 1.0, k: int = 0, probs: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The draft head over M rows of one sequence (skinny.c's `draft_step`): feat (M, W) fp32
    contiguous, tokens and positions (M,) int64, the head cache's layer buffers as `decoder_stack`
    takes them, plan None = causal. Returns the new features (M, H) and, with k > 0, rows first..'s
    k best log-probabilities (M - first, k) and target ids (`ids` maps draft ids; `ctx` adds rows
    after the draft LM head's), and with `probs` their whole draft law (M - first, draft vocabulary)."""
    m, h = feat.shape[0], spec.embed.shape[1]
    out = torch.empty(m, h)
    vals = torch.empty(m - first, k) if k else None
    top = torch.empty(m - first, k, dtype=torch.long) if k else None
    pb, pi, pn, po, pt = plan if plan is not None else (None,) * 5
    nctx = 0 if ctx is None else ctx.shape[0]
    law = torch.empty(m - first, spec.lm.n + nctx) if k and probs else None
    _lib().draft_step(ctypes.addressof(spec._struct), feat.data_ptr(), m, feat.shape[1], tokens.data_ptr(),
                      positions.data_ptr(), k_bufs.data_ptr(), v_bufs.data_ptr(), like.stride(0), like.stride(1),
                      like.stride(0), like.stride(1), slot, 0 if plan is None else pb.numel(),
                      *(None if t is None else t.data_ptr() for t in (pb, pi, pn, po, pt)), out.data_ptr(), first,
                      None if ctx is None else ctx.data_ptr(), nctx, None if ids is None else ids.data_ptr(),
                      inv_temp, k, None if vals is None else vals.data_ptr(), None if top is None else top.data_ptr(),
                      None if law is None else law.data_ptr(), torch.get_num_threads())
    return out, vals, top, law


def argmax(x: torch.Tensor) -> list | int:
    """`x.argmax(-1).tolist()` (the first index of each row's maximum), on skinny.c's vectorized scan
    for fp32 CPU rows (torch's is scalar: ~17 us a 49k-token row); torch's where a row holds a NaN."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] == 0 or _lib() is None:
        return x.argmax(-1).tolist()
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.long)
    if not _lib().argmax_rows(rows.data_ptr(), rows.shape[0], rows.shape[1], out.data_ptr()):
        return x.argmax(-1).tolist()
    return out.view(x.shape[:-1]).tolist()


def draw(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """Per row of p (R, V; fp32, >= 0, unnormalised) k = u.shape[1] inverse-CDF draws without
    replacement, draw j by its uniform u[r, j] (float64, in [0, 1)) from the row without the earlier
    draws (skinny.c's `draw_rows`, sums in double); where a row has no mass left, its lowest
    undrawn indices. None where it cannot run (not an fp32 CPU tensor, k > V, a negative, NaN or
    infinite entry): the caller draws with torch. Returns (R, k) int64."""
    if p.dtype != torch.float32 or p.device.type != "cpu" or _lib() is None or u.shape[1] > p.shape[-1]:
        return None
    rows, u = p.reshape(-1, p.shape[-1]).contiguous(), u.to(torch.float64).contiguous()
    out = torch.empty(u.shape, dtype=torch.long)
    if not _lib().draw_rows(rows.data_ptr(), rows.shape[0], rows.shape[1], u.shape[1], u.data_ptr(), out.data_ptr()):
        return None
    return out


def residual_law(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor | None | bool:
    """max(0, p - q), renormalised (skinny.c's `residual_law`, one pass and the sum in double), for
    fp32 CPU vectors of one size; None where no mass is left; False where it cannot run (the
    caller computes it with torch)."""
    if p.dtype != torch.float32 or q.dtype != torch.float32 or p.device.type != "cpu" or q.device.type != "cpu" \
            or p.shape != q.shape or _lib() is None:
        return False
    p, q = p.contiguous(), q.contiguous()
    out = torch.empty_like(p)
    return out if _lib().residual_law(p.data_ptr(), q.data_ptr(), p.numel(), out.data_ptr()) > 0.0 else None


def kv_compact(ptrs: torch.Tensor, like: torch.Tensor, dst: list[int], src: int, keeps: list[list[int]]) -> None:
    """In every buffer (B, H, max_len, D) fp32 contiguous, shaped as `like`, whose addresses `ptrs`
    (int64) lists: batch row b's rows src + keeps[b][j] move to dst[b] + j, in place (skinny.c's
    `kv_compact`). keeps ascending, dst <= src."""
    b, h, _, d = like.shape
    flat = torch.tensor([x for k in keeps for x in k] or [0])
    offsets = [0]
    for k in keeps:
        offsets.append(offsets[-1] + len(k))
    dsts, offs = torch.tensor(dst), torch.tensor(offsets)
    _lib().kv_compact(ptrs.data_ptr(), ptrs.numel(), b, h, d, like.stride(0), like.stride(1), dsts.data_ptr(), src,
                      flat.data_ptr(), offs.data_ptr())


def decoder_stack(layers: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_bufs: torch.Tensor,
                  v_bufs: torch.Tensor, like: torch.Tensor, slot: int, plan: tuple[torch.Tensor, ...]) -> None:
    """Consecutive decoder layers on x (B, M, H) fp32 contiguous, in place (skinny.c's
    `decoder_stack`): `layers` holds their `LayerSpec.address`es, `k_bufs` / `v_bufs` the addresses
    of their cache buffers, int64; `like` is one of those buffers (they share shape and strides).
    Otherwise as `decoder_layer`."""
    b, m, h = x.shape
    pb, pi, pn, po, pt = plan
    _lib().decoder_stack(layers.data_ptr(), layers.numel(), x.data_ptr(), b, m, h, cos.data_ptr(), sin.data_ptr(),
                         k_bufs.data_ptr(), v_bufs.data_ptr(), like.stride(0), like.stride(1), like.stride(0),
                         like.stride(1), slot, pb.numel(), pb.data_ptr(), pi.data_ptr(), pn.data_ptr(), po.data_ptr(),
                         pt.data_ptr(), torch.get_num_threads())


# The same kernels as torch custom ops, for `torch.compile` (models.compile_decoder): eager calls
# go straight to ctypes above, since a custom op's dispatch costs more than the call itself.
def _register_packed_op(name: str, eager: Callable) -> None:
    """A custom op for a kernel taking (x, packed, bias), whose output has packed.shape[0] * BLOCK columns."""
    def op(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return eager(x, packed, bias)  # runs eagerly: the ctypes path

    op = torch.library.custom_op(f"eaglespec::{name}", op, mutates_args=())

    @op.register_fake
    def _(x, packed, bias):
        return x.new_empty(x.shape[0], packed.shape[0] * BLOCK)


for _name, _eager in (("skinny_linear", linear), ("skinny_linear_bf16", linear_bf16),
                      ("skinny_linear_bf16dot", linear_bf16dot)):
    _register_packed_op(_name, _eager)


def _register_q4_op(name: str, eager: Callable) -> None:
    """A custom op for a 4-bit kernel taking (x, codes, scale, minimum, bias)."""
    def op(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
           bias: Optional[torch.Tensor]) -> torch.Tensor:
        return eager(x, codes, scale, minimum, bias)

    op = torch.library.custom_op(f"eaglespec::{name}", op, mutates_args=())

    @op.register_fake
    def _(x, codes, scale, minimum, bias):
        return x.new_empty(x.shape[0], codes.shape[0] * BLOCK)


_register_q4_op("skinny_linear_q4", linear_q4)
_register_q4_op("skinny_linear_q4dot", linear_q4dot)
_register_q4_op("skinny_linear_q4q8", linear_q4q8)


@torch.library.custom_op("eaglespec::attend_rows", mutates_args=())
def _attend_rows_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: torch.Tensor,
                    row: torch.Tensor, n: torch.Tensor, offsets: torch.Tensor, tails: torch.Tensor,
                    scale: float) -> torch.Tensor:
    return attend_rows(query, key, value, (batch, row, n, offsets, tails), scale)


@_attend_rows_op.register_fake
def _(query, key, value, batch, row, n, offsets, tails, scale):
    b, h, m, d = query.shape
    return query.new_empty(b, m, h, d)
