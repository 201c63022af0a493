"""Weight-only int8 target: close to fp32 per layer, and EAGLE stays exactly lossless w.r.t. it."""

import torch

from eaglespec.engine import Engine
from eaglespec.quant import Int8Linear, quantize_int8

from conftest import good_head, tiny_target
from test_engine import PROMPTS, hf_greedy


def test_int8_linear_matches_dequantized_weight():
    lin = torch.nn.Linear(64, 96)
    q = Int8Linear(lin)
    x = torch.randn(5, 3, 64)
    torch.testing.assert_close(q(x), x @ q.weight.T + lin.bias, atol=1e-4, rtol=1e-4)
    assert (q.weight - lin.weight).abs().max() <= q.scales.max() / 2 + 1e-6  # rounding, per channel
    assert q.weight_int8.dtype == torch.int8


def test_quantized_target_eagle_equals_its_own_vanilla():
    model = tiny_target("llama", seed=3)
    head = good_head(model)  # bound before quantizing: the head keeps the fp32 embedding / LM head
    quantize_int8(model)
    assert isinstance(model.lm_head, Int8Linear) and isinstance(model.model.layers[0].mlp.down_proj, Int8Linear)
    eng = Engine(model, head)
    for ids in PROMPTS:
        ref = hf_greedy(model, ids, 30)
        assert eng.generate(ids, 30, method="vanilla").token_ids == ref
        out = eng.generate(ids, 30)
        assert out.token_ids == ref
    assert max(out.stats.accept_lengths) > 1


def test_packed_target_eagle_equals_its_own_vanilla():
    from eaglespec.quant import PackedLinear, pack_target, packed_linear_available

    if not packed_linear_available():
        import pytest
        pytest.skip("oneDNN not available")
    model = tiny_target("qwen2", seed=4)
    ref_model = tiny_target("qwen2", seed=4)
    head = good_head(model)
    pack_target(model)
    assert isinstance(model.lm_head, PackedLinear)
    x = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, ref_model(x).logits, atol=1e-4, rtol=1e-4)
    eng = Engine(model, head)  # packs the head too
    assert head._packed_draft is None and isinstance(head.fc, PackedLinear)
    for ids in PROMPTS:
        ref = hf_greedy(model, ids, 30)
        assert eng.generate(ids, 30, method="vanilla").token_ids == ref
        assert eng.generate(ids, 30).token_ids == ref
        assert eng.generate_batch([ids, PROMPTS[0]], 30)[0].token_ids == ref
