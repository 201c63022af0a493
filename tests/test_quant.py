"""Weight-only int8 target: close to fp32 per layer, and EAGLE stays exactly lossless w.r.t. it."""

from functools import partial

import pytest
import torch

from eaglespec import Engine
from eaglespec.cpu.quant import (FastRMSNorm, Int8Linear, fast_norms, pack_target, quantize_weights,
                                 target_kernels)

from conftest import good_head, tiny_target
from test_engine import PROMPTS, hf_greedy


def eagle_equals_vanilla(eng: Engine, batch: bool, n: int = 40) -> None:
    """Greedy EAGLE == the engine's vanilla == transformers' greedy on the same (quantized) target,
    with drafts really accepted; with `batch`, also for two prompts decoded together."""
    accepted = []
    for ids in PROMPTS:
        ref = eng.generate(ids, n, method="vanilla").token_ids
        assert ref == hf_greedy(eng.model, ids, n)
        out = eng.generate(ids, n)
        assert out.token_ids == ref
        accepted += out.stats.accept_lengths
    assert max(accepted) > 1
    if batch:
        assert [r.token_ids for r in eng.generate_batch(PROMPTS[:2], n)] == \
            [r.token_ids for r in eng.generate_batch(PROMPTS[:2], n, method="vanilla")]


def test_int8_linear_matches_dequantized_weight():
    lin = torch.nn.Linear(64, 96)
    q = Int8Linear(lin)
    x = torch.randn(5, 3, 64)
    torch.testing.assert_close(q(x), x @ q.weight.T + lin.bias, atol=1e-4, rtol=1e-4)
    assert (q.weight - lin.weight).abs().max() <= q.scales.max() / 2 + 1e-6  # rounding, per channel
    assert q.weight_int8.dtype == torch.int8
    ids = torch.tensor([95, 3, 3, 40])  # a context draft vocabulary dequantizes only its rows
    assert torch.equal(q.rows(ids), q.weight[ids])


def test_quantized_target_eagle_equals_its_own_vanilla():
    model = tiny_target("llama", seed=3)
    head = good_head(model)  # bound before quantizing: the head keeps the fp32 embedding / LM head
    quantize_weights(model, "int8")
    assert isinstance(model.lm_head, Int8Linear) and isinstance(model.model.layers[0].mlp.down_proj, Int8Linear)
    eng = Engine(model, head)
    for ids in PROMPTS:
        ref = hf_greedy(model, ids, 30)
        assert eng.generate(ids, 30, method="vanilla").token_ids == ref
        out = eng.generate(ids, 30)
        assert out.token_ids == ref
    assert max(out.stats.accept_lengths) > 1  # on the last prompt: stricter than the helper's any-prompt check


needs_skinny = pytest.mark.skipif(not __import__("eaglespec.cpu.kernels", fromlist=["x"]).available(),
                                  reason="the skinny kernel needs AVX-512F or AVX2 + FMA, and a C compiler")
needs_bf16dot = pytest.mark.skipif(not __import__("eaglespec.cpu.kernels", fromlist=["x"]).bf16dot_available(),
                                   reason="the bf16-dot kernel needs AVX512-BF16")
def engine_head_layer(fallback: type) -> type:
    """The class the `Engine` gives the head's layers: 4 bits where the dot kernels run (int4-q8 with
    AVX512-VNNI, else int4-dot), else `fallback`, the target's own kind."""
    from eaglespec.cpu.kernels import bf16dot_available, q4q8_available
    from eaglespec.cpu.quant import Int4DotLinear, Int4Q8Linear

    if not bf16dot_available():
        return fallback
    return Int4Q8Linear if q4q8_available() else Int4DotLinear


needs_q4q8 = pytest.mark.skipif(not __import__("eaglespec.cpu.kernels", fromlist=["x"]).q4q8_available(),
                                reason="needs eaglespec's AVX512-VNNI kernel")


@pytest.fixture(params=["avx512", "avx2"])
def kernel_isa(request, monkeypatch):
    """Each build of skinny.c this CPU runs (an AVX-512 CPU runs the AVX2 one too)."""
    from eaglespec.cpu import kernels
    from eaglespec.platform import cpu_has

    if not (cpu_has("avx512f") if request.param == "avx512" else cpu_has("avx2") and cpu_has("fma")):
        pytest.skip(f"this CPU has no {request.param}")
    monkeypatch.setenv("EAGLESPEC_SKINNY", "avx2" if request.param == "avx2" else "1")
    kernels._lib.cache_clear()
    if kernels.isa() != request.param or not kernels.available():
        pytest.skip(f"the {request.param} kernels do not build here")
    yield request.param
    monkeypatch.undo()
    kernels._lib.cache_clear()  # later tests see this machine's default kernels


@pytest.mark.parametrize("bias", [False, True])
def test_skinny_kernel_matches_torch_linear_at_every_row_count(bias, kernel_isa):
    from eaglespec.cpu import kernels

    torch.manual_seed(0)
    w = torch.randn(96, 77)  # 3 blocks of 32 outputs; K need not be a multiple of anything
    b = torch.randn(96) if bias else None
    packed = kernels.pack_weight(w)
    for m in [1, 2, 3, 4, 5, 11, 12, 13, 24, 25, 40]:  # across the passes over a block (12 or 3 rows)
        x = torch.randn(m, 77)
        torch.testing.assert_close(kernels.linear(x, packed, b), torch.nn.functional.linear(x, w, b),
                                   atol=1e-4, rtol=1e-4)
    x = torch.randn(8, 77 * 2)[:, ::2]  # a strided input is made contiguous, not misread
    torch.testing.assert_close(kernels.linear(x, packed, b), torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-4)
    x = torch.randn(30, 77)  # each row is summed in the same order whatever else is in the call:
    rows = torch.cat([kernels.linear(x[i:i + 1], packed, b) for i in range(30)])
    assert torch.equal(kernels.linear(x, packed, b), rows)  # verifying a tree = decoding it token by token
    with pytest.raises(ValueError, match="features"):
        kernels.linear(torch.randn(2, 76), packed)
    assert not kernels.fits(torch.randn(100, 77))  # not a multiple of 32 outputs: torch's kernels serve


def test_skinny_q4_kernel_is_its_dequantized_weight_at_every_row_count(kernel_isa):
    from eaglespec.cpu.quant import Int4Linear

    torch.manual_seed(1)
    lin = torch.nn.Linear(128, 96)
    q = Int4Linear(lin)
    assert q.skinny
    x = torch.randn(27, lin.in_features)
    with torch.no_grad():
        y = q(x)
        torch.testing.assert_close(y, x @ q.weight.T + lin.bias, atol=1e-4, rtol=1e-4)
        for k in (1, 2, 3, 4, 13):  # across the passes over a block (12 rows or 2)
            assert torch.equal(q(x[:k]), y[:k])


@pytest.mark.parametrize("bias", [False, True])
def test_skinny_bf16_kernel_is_the_fp32_kernel_on_the_rounded_weight_bitwise(bias, kernel_isa):
    """Widening bf16 to fp32 is exact, so the bf16 kernel must give the fp32 kernel's very sums on
    the rounded weight, at every row count (hence row by row too: a tree verifies like single steps)."""
    from eaglespec.cpu import kernels
    from eaglespec.cpu.quant import Bf16Linear

    torch.manual_seed(2)
    lin = torch.nn.Linear(77, 96, bias=bias)
    q = Bf16Linear(lin)
    rounded = lin.weight.detach().to(torch.bfloat16).float()
    assert not torch.equal(rounded, lin.weight) and torch.equal(q.weight, rounded)
    assert q.packed.dtype == torch.bfloat16 and q.packed.numel() == lin.weight.numel()
    ref = kernels.pack_weight(rounded)
    b = None if lin.bias is None else lin.bias.detach()
    x = torch.randn(40, 77)
    with torch.no_grad():
        for m in [1, 2, 3, 4, 11, 12, 13, 25, 40]:
            assert torch.equal(q(x[:m]), kernels.linear(x[:m], ref, b))
        torch.testing.assert_close(q(x), torch.nn.functional.linear(x, rounded, b), atol=1e-4, rtol=1e-4)
        assert torch.equal(q(x.view(5, 8, 77)).view(40, 96), q(x))
    ids = torch.tensor([95, 3, 3, 40])  # a context draft vocabulary reads only its rows
    assert torch.equal(q.rows(ids), rounded[ids])


@needs_skinny
def test_bf16_target_with_a_draft_vocabulary_of_no_whole_blocks():
    """A draft vocabulary of 50 tokens (not a multiple of 32) keeps a packed fp32 draft LM head."""
    from eaglespec.cpu.quant import Bf16Linear, PackedLinear

    model = tiny_target("llama", seed=6)
    head = good_head(model)
    head.set_draft_vocab(torch.arange(50))
    quantize_weights(model, "bf16")
    eng = Engine(model, head, tree="chain:3")
    # every head drafts in 4 bits where the CPU has the dot kernels (its layers too); the draft LM head
    # of 50 rows (no whole blocks of 32) stays fp32
    assert type(head.accel.draft_lm) is PackedLinear and type(head.fc) is engine_head_layer(Bf16Linear)
    for ids in PROMPTS:
        assert eng.generate(ids, 30).token_ids == eng.generate(ids, 30, method="vanilla").token_ids


@needs_skinny
def test_a_packed_head_without_a_draft_vocabulary_takes_one_later():
    """A 4-bit packed layer keeps no fp32 weight: a new draft vocabulary must not look for one."""
    model = tiny_target("llama", seed=6)
    head = good_head(model)
    pack_target(model)
    eng = Engine(model, head, tree="chain:3")  # packs the head
    assert head.accel is not None and head.accel.draft_lm is None
    head.set_draft_vocab(torch.arange(64))
    assert head.draft_vocab_size == 64
    for ids in PROMPTS:
        assert eng.generate(ids, 30).token_ids == eng.generate(ids, 30, method="vanilla").token_ids


def test_bf16_rejects_layers_it_cannot_block():
    from eaglespec.errors import EaglespecError
    from eaglespec.cpu.quant import Bf16DotLinear, Bf16Linear

    with pytest.raises(EaglespecError, match="divisible by 32"):
        Bf16Linear(torch.nn.Linear(64, 40))
    with pytest.raises(EaglespecError, match="even input sizes"):
        Bf16DotLinear(torch.nn.Linear(77, 64))


@needs_bf16dot
@pytest.mark.parametrize("bias", [False, True])
def test_bf16dot_kernel_sums_rounded_inputs_and_weights_and_each_row_alone(bias):
    """bf16-dot: the sums of bf16(x) * bf16(w), to fp32 rounding, and at every row count (across the
    passes of 12 rows) each row's bits are those of the row computed alone: a tree verifies like steps."""
    from eaglespec.cpu.quant import Bf16DotLinear

    torch.manual_seed(3)
    lin = torch.nn.Linear(78, 96, bias=bias)
    q = Bf16DotLinear(lin)
    rounded = lin.weight.detach().to(torch.bfloat16).float()
    assert torch.equal(q.weight, rounded) and q.packed.dtype == torch.bfloat16
    x = torch.randn(40, 78)
    xr = x.to(torch.bfloat16).double()
    want = xr @ rounded.double().T + (0 if lin.bias is None else lin.bias.detach().double())
    with torch.no_grad():
        y = q(x)
        torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-5)
        assert (y.double() - (x.double() @ rounded.double().T)).abs().max() > 1e-4  # the input really was rounded
        alone = torch.cat([q(x[i:i + 1]) for i in range(40)])
        for m in [1, 2, 11, 12, 13, 25, 40]:
            assert torch.equal(q(x[:m]), alone[:m])
        assert torch.equal(q(x.view(5, 8, 78)).view(40, 96), y)


@needs_bf16dot
def test_dot_kernels_round_inputs_as_torch_does():
    """The -dot kernels round fp32 inputs to bf16 themselves: to nearest, ties to even, as
    `.to(torch.bfloat16)`. Through an identity weight each output is its rounded input, ties included
    (which random inputs almost never hit)."""
    from eaglespec.cpu.quant import Bf16DotLinear

    lin = torch.nn.Linear(32, 32, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(32))
    ulp = 2.0 ** -7  # bf16's spacing at 1
    ties = torch.tensor([1 + ulp / 2, 1 + 3 * ulp / 2, -(1 + ulp / 2), -(1 + 3 * ulp / 2), 3 * 2.0 ** 100 * (1 + ulp / 2)])
    x = torch.cat([ties, torch.randn(27) * torch.logspace(-30, 30, 27)]).view(1, 32)
    with torch.no_grad():
        y = Bf16DotLinear(lin)(x)
    assert torch.equal(y, x.to(torch.bfloat16).float())
    assert y[0, 0] == 1 and y[0, 1] == 1 + 2 * ulp  # ties to even: down, then up
    from eaglespec.cpu import kernels

    with pytest.raises(TypeError, match="fp32 inputs"):  # the kernel would read bf16 bytes as floats
        kernels.linear_bf16dot(x.to(torch.bfloat16), Bf16DotLinear(lin).packed)


def assert_input_kernel(q: torch.nn.Module, x: torch.Tensor, want: torch.Tensor, w: torch.Tensor) -> None:
    """A kernel that rounds or quantizes its input (40 x 96 -> 160): `want` to fp32 rounding, not the
    exact product (the input really changed), and at every row count (across the passes of 6 rows)
    each row's bits those of the row computed alone."""
    with torch.no_grad():
        y = q(x)
        torch.testing.assert_close(y.double(), want, atol=2e-5, rtol=1e-5)
        assert (y.double() - (x.double() @ w.T)).abs().max() > 1e-3
        alone = torch.cat([q(x[i:i + 1]) for i in range(40)])
        for m in [1, 2, 5, 6, 7, 13, 40]:
            assert torch.equal(q(x[:m]), alone[:m])
        assert torch.equal(q(x.view(5, 8, 96)).view(40, 160), y)


@needs_bf16dot
@pytest.mark.parametrize("bias", [False, True])
def test_int4dot_kernel_sums_rounded_inputs_and_int4_weights_and_each_row_alone(bias):
    """int4-dot: the sums of bf16(x) * (q * scale + minimum) (Int4Linear's very codes), to fp32
    rounding, and at every row count (across the passes of 6 rows) each row's bits are those of the
    row computed alone."""
    from eaglespec.errors import EaglespecError
    from eaglespec.cpu.quant import Int4DotLinear, Int4Linear

    torch.manual_seed(4)
    lin = torch.nn.Linear(96, 160, bias=bias)
    q, ref = Int4DotLinear(lin), Int4Linear(lin)
    assert torch.equal(q._q, ref._q) and q.skinny
    w = ref.weight.double()
    torch.testing.assert_close(q.weight.double(), w, atol=1e-6, rtol=0)  # 128 + q, shifted minimum: the same weight
    x = torch.randn(40, 96)
    want = x.to(torch.bfloat16).double() @ w.T + (0 if lin.bias is None else lin.bias.detach().double())
    assert_input_kernel(q, x, want, w)
    with pytest.raises(EaglespecError, match="int4-dot needs"):
        Int4DotLinear(torch.nn.Linear(64, 40))  # outputs not in blocks of 32


@needs_q4q8
@pytest.mark.parametrize("bias", [False, True])
def test_int4q8_kernel_sums_int8_inputs_and_int4_weights_and_each_row_alone(bias):
    """int4-q8: each group of 32 inputs of a row quantized to d * round(x / d), d = max |x| / 127, and
    summed against Int4Linear's very codes, to fp32 rounding; at every row count (across the passes of
    6 rows) each row's bits are those of the row computed alone."""
    from eaglespec.errors import EaglespecError
    from eaglespec.cpu.quant import Int4Linear, Int4Q8Linear

    torch.manual_seed(4)
    lin = torch.nn.Linear(96, 160, bias=bias)
    q, ref = Int4Q8Linear(lin), Int4Linear(lin)
    assert q.skinny and q.scale.dtype == q.minimum.dtype == torch.float16
    w = q.weight.double()  # codes for fp16 scales and minima: within half a step of the weight
    g = q._q.view(160, 3, 32).double()
    s, m = (t.transpose(1, 2).reshape(160, 3, 1).double() for t in (q.scale, q.minimum))
    assert torch.equal(w, (g * s + m).view(160, 96))
    assert ((w - lin.weight.double()).view(160, 3, 32).abs() <= 0.501 * s + 1e-4).all()
    assert (w - ref.weight.double()).abs().max() < 0.02  # at most a code apart from Int4Linear's
    x = torch.randn(40, 96)
    x[3, :32] = 0.0  # a group of zeros: d = 0
    g = x.view(40, 3, 32)
    amax = g.abs().amax(-1, keepdim=True)
    xq = torch.round(g * torch.where(amax > 0, 127.0 / amax, 0.0)).clamp(-127, 127)
    xhat = (xq * (amax / 127.0)).view(40, 96)
    want = xhat.double() @ w.T + (0 if lin.bias is None else lin.bias.detach().double())
    assert_input_kernel(q, x, want, w)
    with pytest.raises(EaglespecError, match="int4-q8 needs"):
        Int4Q8Linear(torch.nn.Linear(64, 40))  # outputs not in blocks of 32


@needs_skinny
@pytest.mark.parametrize("kind,tree", [("bf16", "paper"), ("bf16", "dynamic:4,3,10"),
                                       pytest.param("bf16-dot", "paper", marks=needs_bf16dot),
                                       pytest.param("bf16-dot", "dynamic:4,3,10", marks=needs_bf16dot),
                                       pytest.param("int4-dot", "paper", marks=needs_bf16dot),
                                       pytest.param("int4-dot", "dynamic:4,3,10", marks=needs_bf16dot),
                                       pytest.param("int4-q8", "paper", marks=needs_q4q8),
                                       pytest.param("int4-q8", "dynamic:4,3,10", marks=needs_q4q8)])
def test_bf16_target_eagle_equals_its_own_vanilla(kind, tree):
    from eaglespec.cpu.quant import Bf16DotLinear, Bf16Linear, Int4DotLinear, Int4Q8Linear

    model = tiny_target("llama", seed=6)
    head = good_head(model)
    quantize_weights(model, kind)
    assert target_kernels(model).quantization == kind and target_kernels(model).packed_kernel.startswith("skinny")
    eng = Engine(model, head, tree=tree)  # packs the head the same way
    cls = {"bf16": Bf16Linear, "bf16-dot": Bf16DotLinear, "int4-dot": Int4DotLinear, "int4-q8": Int4Q8Linear}[kind]
    assert type(model.lm_head) is cls
    # every head drafts in 4 bits where the CPU has the dot kernels, its own layers too
    assert type(head.fc) is engine_head_layer(cls)
    assert any(type(m).__name__ == "FusedLinear" for m in model.modules())  # q/k/v, gate/up as one call each
    eagle_equals_vanilla(eng, batch=tree == "paper")


@needs_skinny
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["packed", "int4", "bf16", pytest.param("bf16-dot", marks=needs_bf16dot),
                                  pytest.param("int4-dot", marks=needs_bf16dot), pytest.param("int4-q8", marks=needs_q4q8)])
def test_fused_projections_give_the_unfused_bits(family, kind):
    """q/k/v and gate/up as one call each (`_Part`s, `GatedMLP`): every output column is summed by
    the same instructions as in its own layer, so the model's logits do not move by a bit."""
    from eaglespec.cpu.quant import GatedMLP

    ids = torch.tensor([[5, 9, 17, 33, 2, 8, 11, 40]])
    logits = []
    for fuse in (True, False):
        model = tiny_target(family, seed=8)
        model = pack_target(model, fuse=fuse) if kind == "packed" else quantize_weights(model, kind, fuse=fuse)
        if not fuse:
            fast_norms(model.get_decoder())  # fuse also swaps the norms: compare the projections alone
        assert all(type(layer.mlp) is GatedMLP for layer in model.model.layers) == fuse
        with torch.no_grad():
            logits.append(torch.cat([model(ids).logits, model(ids[:, :1]).logits], 1))
    assert torch.equal(*logits)


@needs_skinny
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fast_rms_norm_is_transformers_norm_row_by_row(family):
    """FastRMSNorm: within float rounding of transformers' norm, each row's bits independent of the
    rows beside it (tree rows = one-by-one rows), and the original forward for anything it does not
    take (bf16, a non-contiguous view). The fused targets use it in every layer."""
    model = tiny_target(family, seed=3)
    norm = model.model.layers[0].input_layernorm
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2)
    fast = FastRMSNorm(norm)
    x = torch.randn(2, 9, model.config.hidden_size) * 3
    with torch.no_grad():
        want, got = norm(x), fast(x)
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
        rows = torch.cat([fast(x[:, i:i + 1].contiguous()) for i in range(x.shape[1])], 1)
        assert torch.equal(rows, got)
        assert torch.equal(fast(x[:, ::2]), norm(x[:, ::2]))  # a strided view: the original forward
        xb = x.bfloat16()
        assert torch.equal(fast(xb), norm(xb))
    fused = quantize_weights(tiny_target(family, seed=3), "bf16")
    assert sum(isinstance(m, FastRMSNorm) for m in fused.modules()) == 2 * fused.config.num_hidden_layers + 1


def test_skinny_build_failure_is_an_error_naming_the_compiler(tmp_path, monkeypatch):
    from eaglespec.cpu import kernels

    monkeypatch.setenv("CC", "false")
    with pytest.raises(RuntimeError, match="false failed"):
        kernels._build(tmp_path, "avx2")
    assert list(tmp_path.iterdir()) == []  # no half-written library left behind


def test_kernel_cache_is_private_keyed_by_the_compiler_and_rebuilt_when_corrupt(tmp_path, monkeypatch):
    """The library lives in a folder only this user may write (a planted library would run as them),
    its name changes with the compiler, and a corrupt or unsafe file is rebuilt, not loaded."""
    import os

    from eaglespec.cpu import kernels

    if not kernels.cpu_has("avx2"):
        pytest.skip("needs AVX2")
    flags = kernels.build_flags("avx2")
    assert kernels.library_name(flags, "cc", "gcc 12") != kernels.library_name(flags, "cc", "gcc 13")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(RuntimeError, match="not a private folder"):
        kernels._build(shared, "avx2")
    monkeypatch.setenv("EAGLESPEC_CACHE", str(tmp_path / "cache"))
    lib = kernels._build(tmp_path / "cache" / "kernels", "avx2")
    assert (lib.parent.stat().st_mode & 0o777) == 0o700
    lib.write_bytes(b"not a library")
    assert kernels._load("avx2") is not None and lib.stat().st_size > 1000  # rebuilt, then loaded
    lib.chmod(0o666)  # writable by others: not trusted, built again
    before = lib.stat().st_ino
    assert kernels._build(lib.parent, "avx2") == lib and lib.stat().st_ino != before
    assert not lib.stat().st_mode & 0o022 and os.access(lib, os.R_OK)


def test_a_kernel_that_cannot_be_built_falls_back_to_torch_with_a_warning(tmp_path, monkeypatch):
    from eaglespec.cpu import kernels

    monkeypatch.setenv("EAGLESPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    monkeypatch.setattr(kernels, "isa", lambda: "avx2")
    kernels._lib.cache_clear()
    try:
        with pytest.warns(UserWarning, match="unavailable"):
            assert not kernels.available()
        lin = torch.nn.Linear(64, 96)
        from eaglespec.cpu.quant import Int4Linear, PackedLinear

        assert not PackedLinear(lin).skinny and not Int4Linear(lin).skinny  # torch's / oneDNN's kernels serve
    finally:
        kernels._lib.cache_clear()  # later tests see this machine's real answer


@needs_skinny
def test_packed_linear_runs_skinny_for_any_row_count_and_torch_for_training(monkeypatch):
    from eaglespec.cpu import kernels
    from eaglespec.cpu.quant import PackedLinear

    lin = torch.nn.Linear(64, 96)
    p = PackedLinear(lin)
    assert p.skinny
    calls = []
    real = kernels.linear
    monkeypatch.setattr(kernels, "linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    with torch.no_grad():
        for m in (1, 7, 64, 65, 300):
            x = torch.randn(1, m, 64)
            torch.testing.assert_close(p(x), lin(x), atol=1e-4, rtol=1e-4)
        # a prefill's rows are summed as a step sums each of them alone
        x = torch.randn(300, 64)
        assert torch.equal(p(x)[123], p(x[123:124])[0])
    assert calls[:5] == [1, 7, 64, 65, 300]
    x = torch.randn(5, 64, requires_grad=True)
    p(x).sum().backward()  # training needs autograd: torch's linear, not the kernel
    assert len(calls) == 7 and x.grad is not None
    assert not PackedLinear(torch.nn.Linear(64, 100)).skinny  # 100 outputs: oneDNN's packing instead


def exact_weight(n: int, k: int, bits: int | str, seed: int = 0) -> torch.Tensor:
    """A dequantized GGUF weight: per group of 32 inputs, 4-bit codes * an fp16 scale + an fp16 minimum
    (bits 4: Q4_1; codes 0 and 15 in every group, as Q4_1's rounding puts them), Q4_K's or Q6_K's
    (bits "4k", "6k"; see the branches), or signed codes * an
    fp16 scale, each group (bits 8) Q8_0 (+-127 in it), Q5_0 (-16 in it) or Q4_0 (-8 in it), computed
    in fp32 as gguf's dequantizer does (the product is exact)."""
    g = torch.Generator().manual_seed(seed)
    groups = (n, k // 32, 1)
    scale = (torch.rand(groups, generator=g) * 0.02 + 1e-3).half().float()
    if bits == "4k":  # Q4_K: w = (d * sc) * q - dmin * m, fp16 d and dmin per 256 inputs, 6-bit sc and m per 32
        blocks = (n, k // 256, 1, 1)
        d, dmin = ((torch.rand(blocks, generator=g) * 1e-3 + 1e-5).half().float() for _ in range(2))
        sc, m = (torch.randint(0, 64, (n, k // 256, 8, 1), generator=g).float() for _ in range(2))
        sc[:, 0, 0] = 0  # a group of one value
        q = torch.randint(0, 16, (n, k // 256, 8, 32), generator=g).float()
        q[:, :, 1:4].clamp_(3, 15)  # groups without code 0: their minimum is not their smallest weight
        q[:, -1, -1] = torch.tensor([0.0, 2.0, 15.0]).repeat(11)[:32]  # smallest step two codes
        return ((d * sc) * q - dmin * m).view(n, k)
    if bits == "6k":  # Q6_K: w = (d * sc) * q, an fp16 d (per 256 inputs; per row here), 8-bit sc per 16, q in -32..31
        d = (torch.rand(n, 1, 1, generator=g) * 1e-3 + 1e-5).half().float()
        sc = torch.randint(-128, 128, (n, k // 16, 1), generator=g).float()
        return ((d * sc) * torch.randint(-32, 32, (n, k // 16, 16), generator=g).float()).view(n, k)
    if bits == 4:
        q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
        q[..., 0], q[..., 1] = 0, 15
        return (q * scale + (torch.randn(groups, generator=g) * 0.05).half().float()).view(n, k)
    top = torch.tensor([127.0, 16.0, 8.0])[torch.randint(0, 3, groups, generator=g)]  # Q8_0, Q5_0, Q4_0 groups
    q = torch.minimum(torch.floor(torch.rand(n, k // 32, 32, generator=g) * (2 * top + 1)) - top, top - (top < 127).float())
    q[..., :1] = -top
    return (q * scale).view(n, k)


@pytest.mark.parametrize("bits", [4, "4k", 8, "6k"])
def test_exact_codes_give_the_fp32_kernel_s_bits_and_only_for_exact_weights(bits, kernel_isa):
    from eaglespec.cpu import kernels
    from eaglespec.cpu.quant import ExactInt4Linear, ExactInt8Linear

    make = ExactInt4Linear if bits in (4, "4k") else ExactInt8Linear
    lin = torch.nn.Linear(512 if bits == "4k" else 128, 96)  # Q4_K: whole super-blocks of 256 inputs
    with torch.no_grad():
        lin.weight.copy_(exact_weight(96, lin.in_features, bits))
    layer = make.of(lin)
    assert layer is not None and getattr(layer, "group", 32) == (16 if bits == "6k" else 32)
    if bits in (8, "6k"):
        assert ExactInt4Linear.of(lin) is None  # 4-bit codes only where every group is one
    packed = kernels.pack_weight(lin.weight)
    x = torch.randn(27, lin.in_features)
    with torch.no_grad():
        for m in (1, 2, 5, 12, 13, 27):  # across the passes over a block
            assert torch.equal(layer(x[:m]), kernels.linear(x[:m], packed, lin.bias.detach()))
        exact = lin.weight.clone()
        for row in (5, 70):  # in the first block of 32 rows (checked first) and past it
            lin.weight.copy_(exact)
            lin.weight[row, 40] = torch.nextafter(lin.weight[row, 40], torch.tensor(1.0))  # one bit off: not codes
            assert make.of(lin) is None
    assert make.of(torch.nn.Linear(100, 96)) is None  # no whole groups of 32 inputs: the fp32 kernel keeps it


@needs_skinny
def test_packed_target_streams_exact_codes_with_the_fp32_bits(monkeypatch):
    from eaglespec.cpu import quant
    from eaglespec.cpu.quant import ExactInt4Linear, ExactInt8Linear

    def dequantized_gguf() -> torch.nn.Module:  # layer 0 Q4_1, layer 1 signed codes (down Q6_K's), the LM head Q8_0
        model = tiny_target("llama", seed=6)
        with torch.no_grad():
            for i, (name, lin) in enumerate((n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)):
                bits = 4 if ".layers.0." in name else "6k" if name.endswith("layers.1.mlp.down_proj") else 8
                lin.weight.copy_(exact_weight(*lin.weight.shape, bits, seed=i))
        return model

    model, ref = dequantized_gguf(), dequantized_gguf()  # (bits 8: the Q8_0 / Q5_0 / Q4_0 groups of Qwen2.5's GGUF)
    head = good_head(model)
    pack_target(model)
    monkeypatch.setattr(quant, "EXACT_CODES", False)
    pack_target(ref)
    assert isinstance(model.lm_head, ExactInt8Linear) and target_kernels(ref).exact_codes == 0
    four, eight = (sum(isinstance(m, kind) for m in model.model.layers.modules()) for kind in (ExactInt4Linear, ExactInt8Linear))
    assert four == eight == 4 and target_kernels(model).exact_codes == four + eight + 1  # q/k/v, o, gate/up, down
    assert model.model.layers[1].mlp.down_proj.group == 16
    from eaglespec.cpu.lean import one_call_layers
    assert one_call_layers(model.model) == one_call_layers(ref.model)  # 8-bit codes in the one-call layers too
    x = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref(x).logits)
    eng, eng_ref = Engine(model, head), Engine(ref, None)
    for ids in PROMPTS:
        want = eng_ref.generate(ids, 30, method="vanilla").token_ids
        assert eng.generate(ids, 30, method="vanilla").token_ids == want == eng.generate(ids, 30).token_ids


def use_kernel(kernel: str, monkeypatch) -> None:
    """"skinny": eaglespec's kernels (skip where they do not run); anything else ("onednn" for
    fp32, "torch" for int4): the fallback they leave to where they are unavailable."""
    from eaglespec.cpu import kernels

    if kernel != "skinny":
        monkeypatch.setattr(kernels, "available", lambda: False)
    elif not kernels.available():
        pytest.skip("the skinny kernel is not available here")


@pytest.mark.parametrize("kernel", ["skinny", "onednn"])
def test_packed_target_eagle_equals_its_own_vanilla(kernel, monkeypatch):
    from eaglespec.cpu.quant import PackedLinear, pack_target, packed_linear_available

    use_kernel(kernel, monkeypatch)
    if not packed_linear_available():
        pytest.skip("oneDNN not available")
    model = tiny_target("qwen2", seed=4)
    ref_model = tiny_target("qwen2", seed=4)
    head = good_head(model)
    pack_target(model)
    assert isinstance(model.lm_head, PackedLinear)
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert {m.skinny for m in layers} == {kernel == "skinny"}
    x = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, ref_model(x).logits, atol=1e-4, rtol=1e-4)
    eng = Engine(model, head)  # packs the head too: int4-dot where it runs (a draft need not be exact)
    from eaglespec.cpu.kernels import bf16dot_available, q4q8_available

    dot = kernel == "skinny" and bf16dot_available()
    want = ("int4-q8" if q4q8_available() else "int4-dot") if dot else "packed"
    assert head.accel.draft_lm is None and head.accel.kind == want
    assert isinstance(head.fc, engine_head_layer(PackedLinear) if kernel == "skinny" else PackedLinear)
    for ids in PROMPTS:
        ref = hf_greedy(model, ids, 30)
        assert eng.generate(ids, 30, method="vanilla").token_ids == ref
        assert eng.generate(ids, 30).token_ids == ref
        assert eng.generate_batch([ids, PROMPTS[0]], 30)[0].token_ids == ref


# -- int4 + row-exact attention -----------------------------------------------------------------------
needs_int4 = __import__("pytest").mark.skipif(not __import__("eaglespec.cpu.quant", fromlist=["x"]).int4_available(),
                                              reason="torch has no CPU int4 kernel")


@needs_int4
@pytest.mark.parametrize("kernel", ["skinny", "torch"])
def test_int4_linear_is_its_dequantized_weight_and_row_independent(kernel, monkeypatch):
    from eaglespec.cpu.quant import Int4Linear

    use_kernel(kernel, monkeypatch)
    lin = torch.nn.Linear(64, 96)
    q = Int4Linear(lin)
    assert q.skinny == (kernel == "skinny")
    x = torch.randn(7, 64)
    if q.skinny:  # fp32 activations: the dequantized weight is exactly what is multiplied
        torch.testing.assert_close(q(x), x @ q.weight.T + lin.bias, atol=1e-5, rtol=1e-5)
    else:
        ref = x.bfloat16().float() @ q.weight.T + lin.bias
        torch.testing.assert_close(q(x), ref, atol=0.05, rtol=0.02)  # bf16 activations and output
    assert (q.weight - lin.weight).abs().max() < (lin.weight.abs().max() * 2 / 15)  # 4-bit rounding
    ids = torch.tensor([95, 3, 3, 40])  # a context draft vocabulary dequantizes only its rows
    assert torch.equal(q.rows(ids), q.weight[ids])
    y = q(x)
    for k in (1, 2, 5):  # a row's result never depends on the other rows
        assert torch.equal(q(x[:k]), y[:k])


@pytest.mark.parametrize("path", [pytest.param("kernel", marks=pytest.mark.skipif(
    not __import__("eaglespec.cpu.kernels", fromlist=["x"]).attention_available(), reason="needs AVX-512")), "sdpa"])
def test_exact_attention_rows_equal_single_row_calls_where_sdpa_does_not(path, monkeypatch):
    """A tree's query rows, computed together, must equal the one-row calls vanilla decoding makes
    over the keys each row sees (prefix + ancestors, contiguous). Fused SDPA misses by ~1e-7,
    which bf16 activations turn into whole ulps on a real model. Both exact paths: skinny.c's
    attend_rows, and one SDPA call per row where that kernel does not run."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from eaglespec.cpu import kernels
    from eaglespec.cpu.attention import exact_attention
    from eaglespec.spec.tree import float_mask, prefix_tree_mask

    if path == "sdpa":
        monkeypatch.setattr(kernels, "attention_available", lambda: False)
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    p, d = 130, 64
    allowed = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    q = torch.randn(1, 4, 4, d)
    k, v = torch.randn(1, 2, p + 4, d), torch.randn(1, 2, p + 4, d)
    mask = float_mask(prefix_tree_mask(allowed, p), torch.float32)

    def solo(i: int) -> torch.Tensor:  # vanilla: this node's ancestors sit right after the prefix
        keep = torch.cat([torch.arange(p), p + allowed[i].nonzero().squeeze(-1)])
        return exact_attention(module, q[:, :, i:i + 1], k[:, :, keep], v[:, :, keep], None)[0][0, 0]

    exact = exact_attention(module, q, k, v, mask)[0][0]
    assert all(torch.equal(exact[i], solo(i)) for i in range(4))
    fused = sdpa_attention_forward(module, q, k, v, mask)[0][0]
    assert not all(torch.equal(fused[i], solo(i)) for i in range(4))  # the test can tell the difference
    torch.testing.assert_close(fused, exact)
    # a cache buffer's view (longer than the keys in use) and two batch rows with their own masks
    buf_k, buf_v = torch.randn(2, 2, p + 40, d), torch.randn(2, 2, p + 40, d)
    buf_k[0, :, :p + 4], buf_v[0, :, :p + 4] = k[0], v[0]
    q2 = torch.cat([q, torch.randn(1, 4, 4, d)])
    mask2 = torch.cat([mask, float_mask(prefix_tree_mask(allowed.tril(), p), torch.float32)])
    both = exact_attention(module, q2, buf_k[:, :, :p + 4], buf_v[:, :, :p + 4], mask2)[0]
    assert torch.equal(both[0], exact)
    torch.testing.assert_close(both[1], sdpa_attention_forward(module, q2, buf_k[:, :, :p + 4],
                                                               buf_v[:, :, :p + 4], mask2)[0][1])


def test_packed_plan_is_the_row_plan():
    """pack_plan (whole-tensor ops) lists, for every query row, the keys _plan's loop finds: the prefix
    run, then the rest in order; causal (no mask), trees over a prefix, bool and float masks, batch 2."""
    from eaglespec.cpu.attention import _plan, pack_plan
    from eaglespec.spec.tree import float_mask, prefix_tree_mask

    g = torch.Generator().manual_seed(3)
    for trial in range(20):
        m, p = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(0, 12, (1,), generator=g))
        trees = []
        for _ in range(2):  # random trees: each node sees itself and a random earlier node's ancestors
            allowed = torch.eye(m, dtype=torch.bool)
            for i in range(1, m):
                allowed[i] |= allowed[int(torch.randint(0, i, (1,), generator=g))]
            trees.append(prefix_tree_mask(allowed, p))
        mask = torch.stack(trees)[:, None]  # (2, 1, m, p + m)
        if trial % 2:
            mask = float_mask(torch.stack(trees), torch.float32)
        for msk in (mask, None):
            rows = _plan(msk, 2, m, p + m)
            pb, pi, pn, po, pt = pack_plan(msk, 2, m, p + m)
            for r, (b, i, n, tail) in enumerate(rows):
                assert (int(pb[r]), int(pi[r]), int(pn[r])) == (b, i, n)
                assert pt[po[r]:po[r + 1]].tolist() == ([] if tail is None else tail.tolist())


def test_rows_plan_is_the_packed_plan_of_the_tree_mask():
    """rows_plan builds from a tree's ancestor lists (or a draft level's) the very arrays pack_plan
    reads from the mask: random trees over random prefixes, a chain (all in the prefix run), a plain step."""
    import random

    from eaglespec.cpu.attention import pack_plan, rows_plan
    from eaglespec.spec.tree import build_tree, float_mask, prefix_tree_mask

    rng = random.Random(0)
    specs = ["chain:4", "chain:0", "paper"]
    for _ in range(60):
        paths = set()
        for _ in range(rng.randint(1, 10)):
            p = []
            for _ in range(rng.randint(1, 4)):
                p.append(rng.randint(0, 2))
                paths.add(tuple(p))
        specs.append([list(p) for p in paths])
    for spec in specs:
        tree, prefix = build_tree(spec), rng.randint(0, 40)
        mask = float_mask(prefix_tree_mask(tree.ancestor_mask, prefix), torch.float32)
        want = pack_plan(mask, 1, tree.n, prefix + tree.n)
        assert all(torch.equal(a, b) for a, b in zip(rows_plan(prefix, tree.ancestors), want)), spec
        assert tree.ancestor_mask.tolist() == [[j in a for j in range(tree.n)] for a in tree.ancestors]


@pytest.mark.skipif(not __import__("eaglespec.cpu.kernels", fromlist=["x"]).attention_available(), reason="needs AVX-512")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_engine_plans_exact_attention_once_per_forward_with_the_layers_own_bits(family, monkeypatch):
    """The engine packs attend_rows' plan before the forward (so a compiled decoder needs no
    data-dependent code inside) and hands it to every layer; the result must be the bits the layers
    get planning for themselves from the mask transformers gives them: a tree over a cache, batch 2."""
    from eaglespec.cpu import attention
    from eaglespec.spec.cache import KVCache
    from eaglespec.spec.tree import float_mask, prefix_tree_mask

    model = tiny_target(family, seed=7)
    model.set_attn_implementation(attention.register())
    eng = Engine(model, None)
    assert eng.backend.plan_rows
    planned = []
    real = attention.pack_plan
    monkeypatch.setattr(attention, "pack_plan", lambda *a: planned.append(a[1:]) or real(*a))
    allowed = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    prompt = torch.tensor([[5, 9, 17, 33, 2, 8], [7, 3, 21, 4, 6, 10]])
    tree = torch.tensor([[40, 41, 42], [50, 51, 52]])
    mask = float_mask(prefix_tree_mask(allowed, 6), torch.float32).expand(2, -1, -1, -1)
    pos = torch.tensor([[6, 7, 7]] * 2)
    outs, calls = [], []
    with torch.no_grad():
        for engine_plans in (True, False):
            cache = KVCache(32)
            eng.decoder(input_ids=prompt, past_key_values=cache, use_cache=True)
            planned.clear()
            if engine_plans:
                outs.append(eng._forward(tree, pos, cache, mask))
            else:
                outs.append(eng.decoder(input_ids=tree, position_ids=pos, attention_mask=mask, past_key_values=cache,
                                        use_cache=True).last_hidden_state)
            calls.append(list(planned))
    assert calls == [[(2, 3, 9)]] * 2  # batch 2, 3 rows, 9 keys: once per forward, by the engine / the first layer
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_gqa_sdpa_equals_transformers_sdpa_bitwise(family):
    """"eaglespec_sdpa" skips transformers' K/V copy for grouped heads; the outputs must not move by
    a single bit: a ragged batch (padding mask), a tree mask over a cache, plain causal prefill."""
    from eaglespec.cpu.attention import GQA_NAME, register
    from eaglespec.spec.cache import KVCache
    from eaglespec.spec.tree import float_mask, prefix_tree_mask

    register()
    ref = tiny_target(family, seed=4)
    ours = tiny_target(family, seed=4)
    ours.set_attn_implementation(GQA_NAME)
    assert ours.config._attn_implementation == GQA_NAME
    assert ref.config.num_key_value_heads < ref.config.num_attention_heads  # grouped: the copy is real
    ids = torch.tensor([[5, 9, 17, 33, 2, 8, 11], [7, 3, 21, 0, 0, 0, 0]])
    att = torch.tensor([[1] * 7, [1, 1, 1, 0, 0, 0, 0]])
    allowed = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    outs = []
    with torch.no_grad():
        for m in (ref, ours):
            o = [m(ids, attention_mask=att).logits, m(ids[:1]).logits]
            cache = KVCache(32)
            m.get_decoder()(input_ids=ids[:1], past_key_values=cache, use_cache=True)
            mask = float_mask(prefix_tree_mask(allowed, 7), torch.float32)
            o.append(m(torch.tensor([[40, 41, 42]]), attention_mask=mask, position_ids=torch.tensor([[7, 8, 8]]),
                       past_key_values=cache, use_cache=True).logits)
            outs.append(o)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@pytest.mark.parametrize("family,kind,kernel", [
    pytest.param("llama", "int4", "torch", marks=needs_int4), pytest.param("qwen2", "int4", "torch", marks=needs_int4),
    pytest.param("llama", "int4", "skinny", marks=needs_int4), pytest.param("llama", "bf16-dot", "skinny", marks=needs_bf16dot),
    pytest.param("qwen2", "bf16-dot", "skinny", marks=needs_bf16dot),
    pytest.param("llama", "int4-dot", "skinny", marks=needs_bf16dot),
    pytest.param("qwen2", "int4-dot", "skinny", marks=needs_bf16dot),
    pytest.param("llama", "int4-q8", "skinny", marks=needs_q4q8),
    pytest.param("qwen2", "int4-q8", "skinny", marks=needs_q4q8)])
def test_quantized_tree_rows_equal_one_by_one_decoding_bitwise(family, kind, kernel, monkeypatch):
    """The property EAGLE needs with bf16 activations (torch's int4 kernel) or bf16-rounded inputs
    (bf16-dot): a token verified inside a tree gets exactly the hidden state it gets when decoded
    alone after its ancestors. The skinny int4 kernel keeps fp32 activations and fused SDPA, so
    there it holds to fp32 rounding."""
    from eaglespec.spec.cache import KVCache
    from eaglespec.spec.tree import float_mask, prefix_tree_mask

    use_kernel(kernel, monkeypatch)
    model = tiny_target(family, seed=5)
    quantize_weights(model, kind)
    exact = kernel == "torch" or kind.endswith("-dot") or kind == "int4-q8"
    assert (model.config._attn_implementation == "eaglespec_exact") == exact
    dec = model.get_decoder()
    prompt = torch.tensor([[5, 9, 17, 33, 2, 8]])
    a, b, c = 40, 41, 42  # tree: a -> b, and a -> c (c is b's sibling)
    allowed = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    with torch.no_grad():
        cache = KVCache(64)
        dec(input_ids=prompt, past_key_values=cache, use_cache=True)
        p = prompt.shape[1]
        tree = dec(input_ids=torch.tensor([[a, b, c]]), position_ids=torch.tensor([[p, p + 1, p + 1]]),
                   attention_mask=float_mask(prefix_tree_mask(allowed, p), torch.float32), past_key_values=cache,
                   use_cache=True).last_hidden_state[0]
        solo = []
        for path in ([a, b], [a, c]):
            cache = KVCache(64)
            dec(input_ids=prompt, past_key_values=cache, use_cache=True)
            for j, t in enumerate(path):
                solo.append(dec(input_ids=torch.tensor([[t]]), position_ids=torch.tensor([[p + j]]),
                                past_key_values=cache, use_cache=True).last_hidden_state[0, 0])
    same = torch.equal if exact else partial(torch.allclose, atol=1e-5, rtol=1e-5)
    assert same(tree[0], solo[0]) and same(tree[1], solo[1]) and same(tree[2], solo[3])


@needs_int4
@pytest.mark.parametrize("tree,kernel", [("paper", "skinny"), ("chain:3", "skinny"), ("dynamic:4,3,10", "skinny"),
                                         ("paper", "torch")])
def test_int4_target_eagle_equals_its_own_vanilla(tree, kernel, monkeypatch):
    use_kernel(kernel, monkeypatch)
    model = tiny_target("llama", seed=6)
    head = good_head(model)
    quantize_weights(model, "int4")
    eng = Engine(model, head, tree=tree)  # packs the head: int4-dot where the CPU has it, else int4 too
    from eaglespec.cpu.quant import Int4Linear

    assert head.accel.draft_lm is None and type(head.fc) is engine_head_layer(Int4Linear)
    assert {m.skinny for m in model.modules() if type(m).__name__ == "Int4Linear"} == {kernel == "skinny"}
    eagle_equals_vanilla(eng, batch=tree != "dynamic:4,3,10")


@needs_int4
def test_int4_rejects_layers_it_cannot_group():
    from eaglespec.errors import EaglespecError
    from eaglespec.cpu.quant import Int4Linear

    with pytest.raises(EaglespecError, match="divisible by 32"):
        Int4Linear(torch.nn.Linear(40, 64))


def test_compiled_target_greedy_equals_its_vanilla():
    """`--compile`: EAGLE on a torch.compile'd decoder reproduces that decoder's own greedy decoding
    (its reference, since compiled kernels round differently), and the compiled graphs really ran."""
    import torch._dynamo

    from eaglespec.models import compile_decoder

    torch._dynamo.reset()
    try:
        model = tiny_target("llama", layers=1)
        head = good_head(model)
        eager = Engine(model, None).generate(PROMPTS[0], 24, method="vanilla").token_ids
        compile_decoder(model)
        before = torch._dynamo.utils.counters["frames"]["ok"]
        vanilla = Engine(model, None).generate(PROMPTS[0], 24, method="vanilla").token_ids
        for tree in ("paper", "chain:2"):
            assert Engine(model, head, tree=tree).generate(PROMPTS[0], 24).token_ids == vanilla, tree
        assert torch._dynamo.utils.counters["frames"]["ok"] > before
        assert vanilla == eager  # tiny logits have wide margins: the rounding difference never flips a token here
    finally:
        torch._dynamo.reset()  # compiled graphs must not leak into later tests, pass or fail


def test_load_target_packs_by_default_exactly_where_the_skinny_kernel_runs(tiny_dirs, monkeypatch):
    from eaglespec.cpu import kernels
    from eaglespec.errors import EaglespecError
    from eaglespec.models import load_target
    from eaglespec.cpu.quant import PackedLinear

    def packed(**kw) -> bool:
        model, _ = load_target(str(tiny_dirs / "model"), **kw)
        return isinstance(model.lm_head, PackedLinear)

    assert packed() == kernels.available()
    assert not packed(packed=False)
    assert not packed(quantize="int8")  # a quantized target has its own kernels
    if kernels.available():
        model, _ = load_target(str(tiny_dirs / "model"), quantize="bf16")
        assert type(model.lm_head).__name__ == "Bf16Linear" and target_kernels(model).quantization == "bf16"
    monkeypatch.setattr(kernels, "available", lambda: False)
    assert not packed()  # oneDNN's packing is slower for one token on some CPUs: only when asked
    with pytest.raises(EaglespecError, match="bf16.*eaglespec's kernels"):
        load_target(str(tiny_dirs / "model"), quantize="bf16")
    monkeypatch.setattr(kernels, "bf16dot_available", lambda: False)
    for kind in ("bf16-dot", "int4-dot"):
        with pytest.raises(EaglespecError, match=f"{kind}.*AVX512-BF16"):
            load_target(str(tiny_dirs / "model"), quantize=kind)


@needs_skinny
@pytest.mark.parametrize("quantize", ["none", "int4", "bf16", pytest.param("bf16-dot", marks=needs_bf16dot),
                                      pytest.param("int4-dot", marks=needs_bf16dot),
                                      pytest.param("int4-q8", marks=needs_q4q8)])
def test_compiled_target_on_the_skinny_kernels_greedy_equals_its_vanilla(tiny_dirs, quantize):
    """`--compile` with eaglespec's kernels (custom ops to inductor): EAGLE equals that model's own
    vanilla, and the kernels really ran inside the compiled graphs."""
    import torch._dynamo

    from eaglespec.cpu import kernels
    from eaglespec.models import compile_decoder, load_target
    from eaglespec.cpu.quant import Bf16DotLinear, Bf16Linear, Int4DotLinear, Int4Linear, Int4Q8Linear, PackedLinear

    torch._dynamo.reset()
    try:
        if quantize != "none":  # the head binds the fp32 embedding / LM head, before quantizing
            model, _ = load_target(str(tiny_dirs / "model"), packed=False)
            head = good_head(model)
            # what load_target(quantize=..., compile=True) does
            quantize_weights(model, quantize, fuse=False)
            compile_decoder(model)
        else:
            model, _ = load_target(str(tiny_dirs / "model"), compile=True)
            head = good_head(model)
        kind = {"none": PackedLinear, "int4": Int4Linear, "bf16": Bf16Linear, "bf16-dot": Bf16DotLinear,
                "int4-dot": Int4DotLinear, "int4-q8": Int4Q8Linear}[quantize]
        assert all(getattr(m, "skinny", True) for m in model.modules() if isinstance(m, kind)) and any(
            isinstance(m, kind) for m in model.model.layers.modules())
        before = torch._dynamo.utils.counters["frames"]["ok"]
        calls = []
        real = kernels._run
        kernels._run = lambda *a, **kw: calls.append(1) or real(*a, **kw)
        try:
            vanilla = Engine(model, None).generate(PROMPTS[0], 16, method="vanilla").token_ids
        finally:
            kernels._run = real
        assert torch._dynamo.utils.counters["frames"]["ok"] > before  # compiled graphs ran
        assert calls  # and they call the custom ops, which run the kernels
        if quantize in ("none", "int4-dot"):  # EAGLE-3 fusion: aux hidden states from a compiled decoder
            head.add_aux_layers([1])
        for tree in ("paper", "chain:2"):
            assert Engine(model, head, tree=tree).generate(PROMPTS[0], 16).token_ids == vanilla, tree
        # whole graphs: row-exact attention (the -dot kinds) takes the engine's plan, no data-dependent code
        assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    finally:
        torch._dynamo.reset()


def test_kernels_argmax_is_torch_s_first_maximum(kernel_isa):
    """`kernels.argmax` (greedy decoding's and verification's pick) is torch's argmax exactly: the first
    index of a tied maximum, rows of any width (a vector's tail, the whole vector or inside one), any
    leading shape, all -inf, and torch's answer where a row holds a NaN."""
    from eaglespec.cpu import kernels

    g = torch.Generator().manual_seed(0)
    for shape in [(49152,), (1, 1, 49152), (2, 5, 300), (3, 37), (1, 15), (4, 16), (2, 33)]:
        x = torch.randn(*shape, generator=g)
        assert kernels.argmax(x) == x.argmax(-1).tolist()
        x = torch.randint(0, 3, shape, generator=g).float()  # ties everywhere: the first one wins
        assert kernels.argmax(x) == x.argmax(-1).tolist()
    x = torch.zeros(4, 100)
    x[1, 50] = x[1, 70] = 1.0
    x[2] = float("-inf")
    x[3, 17] = float("nan")
    assert kernels.argmax(x) == x.argmax(-1).tolist() == [0, 50, 0, 17]
    assert isinstance(kernels.argmax(torch.randn(40, generator=g)), int)


def test_kernels_draw_is_the_inverse_cdf_without_replacement(kernel_isa):
    """`kernels.draw` (sampled decoding's token, sampled drafts' siblings): one draw is torch's
    cumsum / searchsorted pick for the same uniform (values whose sums are exact, so rounding cannot
    part them), on rows of any width; k draws follow the law of drawing without replacement (chi-square
    over every ordered triple of a 6-token row); zero-probability tokens come only once no mass is
    left, lowest index first; and a negative, NaN or infinite entry hands the row back to torch."""
    from scipy.stats import chisquare

    from eaglespec.cpu import kernels

    g = torch.Generator().manual_seed(0)
    for v in [1, 5, 16, 17, 1023, 1024, 1025, 3000, 49152]:
        for _ in range(20):
            p = torch.randint(0, 8, (v,), generator=g).float() * (torch.rand(v, generator=g) < 0.3) / 8
            p[torch.randint(0, v, (1,), generator=g)] = 0.5
            u = torch.rand(1, 1, generator=g, dtype=torch.float64)
            c = p.double().cumsum(-1)
            assert int(kernels.draw(p[None], u)) == int(torch.searchsorted(c, u[0] * c[-1], right=True))
    q = torch.tensor([0.5, 0.2, 0.0, 0.15, 0.1, 0.05])
    n = 60_000
    picks = kernels.draw(q.expand(n, 6), torch.rand(n, 3, generator=g, dtype=torch.float64))
    seqs = [(a, b, c) for a in range(6) for b in range(6) for c in range(6) if len({a, b, c}) == 3 and 2 not in (a, b, c)]

    def law(seq):
        out, left = 1.0, 1.0
        for t in seq:
            out, left = out * float(q[t]) / left, left - float(q[t])
        return out

    counts = {s: 0 for s in seqs}
    for row in picks.tolist():
        counts[tuple(row)] += 1  # a KeyError: a zero-probability token drawn while mass was left
    want = [law(s) for s in seqs]
    assert chisquare([counts[s] for s in seqs], [w * n / sum(want) for w in want]).pvalue > 1e-3
    assert kernels.draw(torch.tensor([[0.0, 0.0, 1.0, 0.0]]), torch.rand(1, 3, dtype=torch.float64)).tolist() == [[2, 0, 1]]
    for bad in [-1.0, float("nan"), float("inf")]:
        assert kernels.draw(torch.tensor([[0.5, bad, 0.5]]), torch.rand(1, 1, dtype=torch.float64)) is None


def test_kernels_residual_law_is_torch_s(kernel_isa):
    """`kernels.residual_law` (a rejected draft's residual) is max(0, p - q) renormalised, as torch
    computes it to float rounding; None where nothing is left (p = q); False where it cannot run."""
    from eaglespec.cpu import kernels
    from eaglespec.spec.verify import renormalise

    g = torch.Generator().manual_seed(0)
    for v in [3, 16, 49152]:
        p, q = (torch.randn(2, v, generator=g) * 3).softmax(-1)
        torch.testing.assert_close(kernels.residual_law(p, q), renormalise((p - q).clamp_min(0.0)))
        assert kernels.residual_law(p, p.clone()) is None
    assert kernels.residual_law(p.double(), q.double()) is False
