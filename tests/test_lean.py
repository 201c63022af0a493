"""The lean decoder-layer forward (`eaglespec.cpu.lean`): transformers' numbers bit for bit, in fewer calls;
and the whole layer as one C call: close to them, and a tree row equal to a decode step bit for bit."""

import pytest
import torch

from eaglespec.cpu import CpuBackend, kernels, lean, pack_head
from eaglespec.errors import EaglespecError
from eaglespec.spec.cache import KVCache
from eaglespec import Engine
from eaglespec.cpu.lean import lean_layers
from eaglespec.cpu.quant import pack_target, quantize_weights

from conftest import good_head, tiny_target

needs_skinny = pytest.mark.skipif(not kernels.available(), reason="eaglespec's AVX-512 / AVX2 kernels are not built here")
needs_layer = pytest.mark.skipif(not kernels.layer_available(), reason="eaglespec's AVX-512 kernels are not built here")
TREE = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]]).bool()
IDS = [3, 17, 40, 5, 99, 23, 8, 61, 2, 30]


@pytest.fixture
def per_module(monkeypatch):
    monkeypatch.setattr(lean, "ONE_CALL", False)


def make(family: str, kind: str):
    model = tiny_target(family, device="cpu")
    head = good_head(model)  # from the layers as transformers made them
    if kind == "packed":
        pack_target(model)
    else:
        if kind.endswith("-dot") and not kernels.bf16dot_available():
            pytest.skip("no AVX512-BF16 here")
        if kind == "int4-q8" and not kernels.q4q8_available():
            pytest.skip("no AVX512-VNNI here")
        quantize_weights(model, kind)
    return model, head


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
def test_lean_layers_give_transformers_numbers_bit_for_bit(family, kind, per_module):
    model, head = make(family, kind)
    assert all("forward" in layer.__dict__ for layer in model.model.layers)  # pack_target / quantize_weights did it
    assert lean_layers(model.model) == 2  # and again is harmless
    tree, ids = TREE, IDS
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


def path_logits(model, ids: list[int], tokens: list[int], node: int) -> torch.Tensor:
    """Logits of tree node `node` computed as vanilla decoding would: prefill, then its path one token per step."""
    path = [j for j in range(TREE.shape[0]) if TREE[node, j]]
    cache = KVCache(64)
    model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    model(torch.tensor([[7]]), past_key_values=cache, use_cache=True, position_ids=torch.tensor([[len(ids)]]))
    for depth, j in enumerate(path):
        out = model(torch.tensor([[tokens[j]]]), past_key_values=cache, use_cache=True,
                    position_ids=torch.tensor([[len(ids) + 1 + depth]])).logits
    return out[0, -1]


@needs_layer
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["packed", "int4", "bf16", "bf16-dot", "int4-dot", "int4-q8"])
def test_one_call_layers_close_to_transformers_and_tree_rows_exact(family, kind):
    model, head = make(family, kind)
    assert all(layer._one_call is not None for layer in model.model.layers)
    tokens = [9, 11, 12, 13, 14]
    with torch.inference_mode():
        calls = []
        real = kernels.decoder_stack
        try:  # count the one-call layers that ran
            kernels.decoder_stack = lambda layers, *a: calls.append(layers.numel()) or real(layers, *a)
            one = run(model, IDS, TREE)
        finally:
            kernels.decoder_stack = real
        assert calls == [2, 2]  # both layers in one call, on the decode step and the tree block (the prefill allocates)
        lean.ONE_CALL = False
        try:
            per_module_out = run(model, IDS, TREE)
        finally:
            lean.ONE_CALL = True
        for a, b in zip(one[1:], per_module_out[1:]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert torch.equal(one[0], per_module_out[0])  # a prefill takes the per-module path
        for node in range(TREE.shape[0]):  # every tree row is what decoding its path one by one gives
            assert torch.equal(one[2][0, node], path_logits(model, IDS, tokens, node))
    eng = Engine(model, head, tree="paper")
    out = eng.generate(IDS, 40, method="eagle")
    assert out.stats.tau > 1
    assert out.token_ids == eng.generate(IDS, 40, method="vanilla").token_ids


@needs_layer
@pytest.mark.parametrize("kind", ["packed", "int4-dot"])
def test_one_call_decoder_feeds_hooks_and_falls_back_where_it_must(kind):
    """The decoder's one-call path splits its C call where a forward pre-hook (the head's aux-layer
    tap) reads a layer's input, hands the hook a copy, and steps aside for what it does not do."""
    from eaglespec.models import HiddenStateTap

    model, head = make("llama", kind)
    tap = HiddenStateTap.of(model.model, [1])
    seen = {}
    for on in (True, False):
        lean.ONE_CALL = on
        try:
            with torch.inference_mode():
                cache = KVCache(64)
                model.model(input_ids=torch.tensor([IDS]), past_key_values=cache, use_cache=True)
                tap._seen.clear()
                with tap.capture([1]):
                    out = model.model(input_ids=torch.tensor([[7, 8]]), position_ids=torch.tensor([[10, 11]]),
                                      past_key_values=cache, use_cache=True)
                seen[on] = (tap.read(out, [1])[0].clone(), out.last_hidden_state, cache.get_seq_length())
        finally:
            lean.ONE_CALL = True
    torch.testing.assert_close(seen[True][0], seen[False][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(seen[True][1], seen[False][1], rtol=1e-4, atol=1e-4)
    assert seen[True][2] == seen[False][2] == len(IDS) + 2
    with torch.inference_mode():  # positions for one row of a batch of two, a 2D padding mask: handled alike
        outs = {}
        for on in (True, False):
            lean.ONE_CALL = on
            try:
                cache = KVCache(64)
                model.model(input_ids=torch.tensor([IDS, IDS]), past_key_values=cache, use_cache=True)
                step = model.model(input_ids=torch.tensor([[7], [9]]), position_ids=torch.tensor([[10]]),
                                   past_key_values=cache, use_cache=True).last_hidden_state
                padded = model.model(input_ids=torch.tensor([[3], [4]]), position_ids=torch.tensor([[11], [11]]),
                                     attention_mask=torch.ones(2, 12, dtype=torch.long), past_key_values=cache,
                                     use_cache=True).last_hidden_state
                outs[on] = (step, padded)
            finally:
                lean.ONE_CALL = True
        for a, b in zip(outs[True], outs[False]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    with torch.inference_mode():  # hidden states asked for: transformers' own forward answers
        cache = KVCache(64)
        out = model.model(input_ids=torch.tensor([IDS]), past_key_values=cache, use_cache=True)
        out = model.model(input_ids=torch.tensor([[7]]), position_ids=torch.tensor([[10]]), past_key_values=cache,
                          use_cache=True, output_hidden_states=True)
        assert len(out.hidden_states) == 3


def test_rope_table_gives_the_rotary_modules_numbers():
    """`lean.rope` reads a table made by the module itself: the same bits for any positions, the
    table growing as they do; with autograd, or a rope type whose angles move with the length, the
    module answers."""
    model = tiny_target("llama", device="cpu", max_pos=4096)
    rotary, x = model.model.rotary_emb, torch.zeros(1, 1, 64)
    with torch.inference_mode():
        for pos in ([[0, 1, 2]], [[1023, 5, 77], [1500, 2, 3]], [[3000]]):
            p = torch.tensor(pos)
            mine, theirs = lean.rope(rotary, x, p), rotary(x, p)
            assert all(torch.equal(a, b) for a, b in zip(mine, theirs)) and mine[0].shape == theirs[0].shape
        assert rotary._eaglespec_table[0].shape[1] >= 3001
    fresh = tiny_target("llama", device="cpu").model.rotary_emb
    lean.rope(fresh, x, torch.tensor([[4]]))  # autograd on: the module itself, no table
    assert not hasattr(fresh, "_eaglespec_table")
    fresh.rope_type = "dynamic"
    with torch.inference_mode():
        lean.rope(fresh, x, torch.tensor([[4]]))
    assert not hasattr(fresh, "_eaglespec_table")


@needs_layer
def test_packed_head_close_to_its_unpacked_self():
    """The packed head's lean forward (one-call layer, the causal plan made without a mask, the fused
    layers' norm in C, the rope table) predicts what the plain head does: a context block, then a
    tree level under its mask."""
    import copy

    model = tiny_target("llama", device="cpu")
    head = good_head(model).add_aux_layers([0, 1])
    pack_target(model)
    torch.manual_seed(0)
    with torch.no_grad():
        head.fuse.weight.normal_(0, 0.05)
    packed = copy.deepcopy(head)
    packed.bind(model)
    pack_head(packed, "packed")
    assert packed.accel.lean
    h = model.config.hidden_size
    outs = {}
    with torch.inference_mode():
        for name, hd in (("plain", head), ("packed", packed)):
            cache, g = KVCache(64), torch.Generator().manual_seed(1)
            feats = torch.randn(1, 6, 3 * h, generator=g)
            ctx = hd(feats, torch.tensor([IDS[:6]]), torch.arange(6)[None], None, cache)
            more = hd(feats[:, :2], torch.tensor([IDS[6:8]]), torch.arange(6, 8)[None], None, cache)
            mask = torch.zeros(1, 1, 5, 13)
            mask[0, 0, :, 8:] = torch.where(TREE, 0.0, float("-inf"))
            pos = torch.tensor([[8, 9, 9, 10, 10]])
            tree = hd(torch.randn(1, 5, h, generator=g), torch.tensor([IDS[:5]]), pos, mask, cache)
            outs[name] = (ctx, more, tree)
    for a, b in zip(outs["plain"], outs["packed"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@needs_layer
@pytest.mark.skipif(not kernels.draft_available(), reason="eaglespec's AVX-512 kernels are not built here")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_draft_step_is_the_packed_head_s_forward_and_its_top_k(family, monkeypatch):
    """`draft_step` (the head as one C call) gives the packed head's features and head-cache entries
    bit for bit, for a context block (aux features fused, causal) and a tree level (its plan), and the
    k best draft log-probabilities at a temperature over a reduced vocabulary plus context rows, with
    their target ids, as torch's log_softmax and topk give them, and the whole draft law as softmax
    gives it; and the engine's drafted rounds take it, their output still vanilla decoding's (the
    sampling law on this path: test_engine's test_sampling_law_on_the_draft_step)."""
    from eaglespec.cpu.attention import rows_plan

    model = tiny_target(family, device="cpu")
    head, plain = good_head(model).add_aux_layers([0, 1]), good_head(model)
    pack_target(model)
    torch.manual_seed(0)
    with torch.no_grad():
        head.fuse.weight.normal_(0, 0.05)
    head.set_draft_vocab(torch.arange(0, 128, 2))  # the even ids; the context adds odd ones
    head.context_vocab = True
    pack_head(head, "packed")
    assert head.accel.step_spec() is not None
    h, temp, k = model.config.hidden_size, 0.7, 3
    g = torch.Generator().manual_seed(1)
    feats, block, level = torch.randn(1, 8, 3 * h, generator=g), torch.randn(1, 2, 3 * h, generator=g), torch.randn(1, 5, h, generator=g)
    seen = [[j for j in range(5) if TREE[i, j]] for i in range(5)]
    mask = torch.zeros(1, 1, 5, 15)
    mask[0, 0, :, 10:] = torch.where(TREE, 0.0, float("-inf"))
    caches = KVCache(64), KVCache(64)
    with torch.inference_mode():
        for cache in caches:
            head.reset_context()
            head.add_context(torch.tensor(IDS))
            head(feats, torch.tensor([IDS[:8]]), torch.arange(8)[None], None, cache)  # allocates the cache

        def torch_top(f):
            best = torch.topk(torch.log_softmax(head.logits(f[0]).float() / temp, -1), k, dim=-1)
            return best.values, head.to_target_ids(best.indices).tolist()

        ref = head(block, torch.tensor([[4, 7]]), torch.tensor([[8, 9]]), None, caches[0])
        out, vals, ids, law = head.accel.draft_step(block, [4, 7], [8, 9], caches[1], None, k, temp, first=1, probs=True)
        assert torch.equal(out, ref)
        want_v, want_i = torch_top(ref[:, 1:])
        assert ids == want_i
        torch.testing.assert_close(law, torch.softmax(head.logits(ref[0, 1:]).float() / temp, -1), rtol=1e-5, atol=1e-7)
        odd = [i for row in ids for i in row if i % 2]
        torch.testing.assert_close(torch.tensor(vals), want_v, rtol=1e-6, atol=1e-5)
        pos = [10, 11, 11, 12, 12]
        ref = head(level, torch.tensor([IDS[:5]]), torch.tensor([pos]), mask, caches[0], plan=rows_plan(10, seen))
        out, vals, ids, law = head.accel.draft_step(level, IDS[:5], pos, caches[1], rows_plan(10, seen), k, temp)
        assert torch.equal(out, ref) and law is None
        want_v, want_i = torch_top(ref)
        assert ids == want_i and odd + [i for row in ids for i in row if i % 2]  # context rows among the best
        torch.testing.assert_close(torch.tensor(vals), want_v, rtol=1e-6, atol=1e-5)
        assert caches[0].get_seq_length() == caches[1].get_seq_length() == 15
        for a, b in zip(caches[0].layers, caches[1].layers):
            assert torch.equal(a.k_buf[:, :, :15], b.k_buf[:, :, :15]) and torch.equal(a.v_buf[:, :, :15], b.v_buf[:, :, :15])
        assert head.accel.draft_step(level, IDS[:5], pos, KVCache(64)) is None  # a cache not yet allocated
        for bad in (-1, model.config.vocab_size):  # C reads embedding rows by id: never past the table
            with pytest.raises(EaglespecError, match="token ids must be in"):
                head.accel.draft_step(level, IDS[:4] + [bad], pos, caches[1], rows_plan(10, seen), k, temp)
        assert caches[1].get_seq_length() == 15
    with torch.inference_mode():
        assert CpuBackend(model).draft_step(plain, level, IDS[:5], pos, caches[1]) is None  # not packed: forward's job
    taken = []
    step = head.accel.draft_step
    monkeypatch.setattr(head.accel, "draft_step", lambda *a, **kw: taken.append(step(*a, **kw)) or taken[-1])
    for tree in ("dynamic:3,3,8", [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]):  # a static tree's levels too
        taken.clear()
        eng = Engine(model, head, tree=tree)
        out = eng.generate(IDS, 40)
        assert out.token_ids == eng.generate(IDS, 40, method="vanilla").token_ids and max(out.stats.accept_lengths) > 1
        assert taken[0] is None and None not in taken[1:]  # all after the prompt's in C
        assert all(t.ids is not None for t in taken[1:])  # with their best tokens


@needs_layer
@pytest.mark.skipif(not kernels.draft_available(), reason="eaglespec's AVX-512 kernels are not built here")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_draft_step_runs_the_pure_architectures(family, arch):
    """EAGLE-1's head (no input norm) and EAGLE-3's (fc over the aux features alone, a mid layer that
    also reads the embedding, a final norm before its own LM head) draft in one C call too: the
    packed head's features, best tokens and draft law for a context block and a tree level, and the
    engine's rounds take it with output still vanilla decoding's."""
    from eaglespec.cpu.attention import rows_plan

    from conftest import trained_head

    model = tiny_target(family, device="cpu")
    head = trained_head(model, arch, [IDS[:4]], steps=20)
    even = torch.arange(0, model.config.vocab_size, 2)  # a draft vocabulary: the even ids
    if arch == "eagle3":  # its own LM head's rows
        head.d2t = even
        rows = torch.nn.Linear(model.config.hidden_size, len(even), bias=False)
        with torch.no_grad():
            rows.weight.copy_(head.draft_lm_head.weight[::2])
        head.draft_lm_head = rows
    else:  # the target's LM-head rows
        head.set_draft_vocab(even)
    pack_target(model)
    pack_head(head, "packed")
    assert head.accel.step_spec() is not None
    h, temp, k = model.config.hidden_size, 0.7, 3
    w = h * (1 + len(head.aux_layers))
    g = torch.Generator().manual_seed(1)
    feats, block, level = torch.randn(1, 8, w, generator=g), torch.randn(1, 2, w, generator=g), torch.randn(1, 5, h, generator=g)
    seen = [[j for j in range(5) if TREE[i, j]] for i in range(5)]
    mask = torch.zeros(1, 1, 5, 15)
    mask[0, 0, :, 10:] = torch.where(TREE, 0.0, float("-inf"))
    caches = KVCache(64), KVCache(64)
    close = dict(rtol=1e-4, atol=1e-4)  # EAGLE-3's torch layer is transformers' (its SiLU, its rounding)
    with torch.inference_mode():
        for cache in caches:
            head(feats, torch.tensor([IDS[:8]]), torch.arange(8)[None], None, cache)  # allocates the cache
        pos = [10, 11, 11, 12, 12]
        for rows, toks, p, m, plan in ((block, [4, 7], [8, 9], None, None),
                                       (level, IDS[:5], pos, mask, rows_plan(10, seen))):
            ref = head(rows, torch.tensor([toks]), torch.tensor([p]), m, caches[0], plan=plan)
            out, vals, ids, law = head.accel.draft_step(rows, toks, p, caches[1], plan, k, temp, probs=True)
            torch.testing.assert_close(out, ref, **close)
            want = torch.softmax(head.logits(ref[0]).float() / temp, -1)
            torch.testing.assert_close(law, want, **close)
            assert ids == head.to_target_ids(torch.topk(want, k, -1).indices).tolist()
            torch.testing.assert_close(torch.tensor(vals), torch.topk(want, k, -1).values.log(), **close)
        for a, b in zip(caches[0].layers, caches[1].layers):
            torch.testing.assert_close(a.k_buf[:, :, :15], b.k_buf[:, :, :15], **close)
    taken = []
    step = head.accel.draft_step
    head.accel.draft_step = lambda *a, **kw: taken.append(step(*a, **kw)) or taken[-1]
    eng = Engine(model, head, tree="dynamic:3,3,8")
    out = eng.generate(IDS[:4], 40)
    assert out.token_ids == eng.generate(IDS[:4], 40, method="vanilla").token_ids and max(out.stats.accept_lengths) > 1
    assert taken and None not in taken[1:]
