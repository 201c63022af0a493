"""The lean decoder-layer forward (`eaglespec.lean`): transformers' numbers bit for bit, in fewer calls."""

import pytest
import torch

from eaglespec import kernels
from eaglespec.cache import KVCache
from eaglespec.engine import Engine
from eaglespec.lean import lean_layers
from eaglespec.quant import pack_target, quantize_weights

from conftest import good_head, tiny_target

needs_skinny = pytest.mark.skipif(not kernels.available(), reason="eaglespec's AVX-512 / AVX2 kernels are not built here")


def lean_off(model) -> callable:
    """Take the lean forwards off (back to transformers' own); returns a function that puts them back."""
    saved = {layer: layer.__dict__.pop("forward") for layer in model.model.layers if "forward" in layer.__dict__}
    return lambda: [layer.__dict__.__setitem__("forward", f) for layer, f in saved.items()]


def run(model, ids: list[int], tree: torch.Tensor) -> list[torch.Tensor]:
    """Logits of a prefill, one decode step, and a 5-token block under a tree mask, on one cache."""
    cache, n = KVCache(64), len(ids)
    outs = [model(torch.tensor([ids]), past_key_values=cache, use_cache=True).logits]
    outs.append(model(torch.tensor([[7]]), past_key_values=cache, use_cache=True,
                      position_ids=torch.tensor([[n]])).logits)
    mask = torch.zeros(1, 1, 5, n + 6)
    mask[0, 0, :, n + 1:] = torch.where(tree, 0.0, float("-inf"))
    pos = torch.tensor([[n + 1, n + 2, n + 2, n + 3, n + 3]])
    outs.append(model(torch.tensor([[9, 11, 12, 13, 14]]), past_key_values=cache, use_cache=True,
                      attention_mask=mask, position_ids=pos).logits)
    return outs


@needs_skinny
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["packed", "int4"])
def test_lean_layers_give_transformers_numbers_bit_for_bit(family, kind):
    model = tiny_target(family, device="cpu")
    head = good_head(model)  # from the layers as transformers made them
    pack_target(model) if kind == "packed" else quantize_weights(model, kind)
    assert all("forward" in layer.__dict__ for layer in model.model.layers)  # pack_target / quantize_weights did it
    assert lean_layers(model.model) == 2  # and again is harmless
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]]).bool()
    ids = [3, 17, 40, 5, 99, 23, 8, 61, 2, 30]
    with torch.inference_mode():
        lean = run(model, ids, tree)
        on = lean_off(model)
        theirs = run(model, ids, tree)
        on()
    for a, b in zip(lean, theirs):
        assert torch.equal(a, b)
    eng = Engine(model, head, tree="paper")
    out = eng.generate(ids, 30, method="eagle")
    assert out.stats.tau > 1  # trees were verified and accepted
    on = lean_off(model)
    assert out.token_ids == eng.generate(ids, 30, method="vanilla").token_ids
    on()


def test_only_layers_it_reproduces_and_not_when_training():
    model = tiny_target("llama", device="cpu")
    assert lean_layers(model.model) == 0  # q/k/v not fused: transformers' forward stays
    if not kernels.available():
        return
    pack_target(model)
    layer = model.model.layers[0]
    model.train()
    x = torch.randn(1, 4, 64, requires_grad=True)
    pe = model.model.rotary_emb(x, torch.arange(4)[None])
    y = layer(x, position_embeddings=pe)  # falls back to transformers' forward, which autograd can follow
    y.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
