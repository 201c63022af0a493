"""End to end: EAGLE's output equals vanilla decoding, token for token (greedy, fp32), and its
sampling law equals the target's."""

import itertools

import pytest
import torch
from scipy.stats import chisquare

from eaglespec.spec.cache import KVCache
from eaglespec.spec.engine import ContinuousBatch
from eaglespec.policy.costmodel import CostProfile, DraftGate, LiveCosts
from eaglespec import Engine
from eaglespec.spec.policy import Prediction, ratio
from eaglespec.errors import EaglespecError
from eaglespec.spec.head import EagleDraftHead
from eaglespec.spec.tree import build_tree
from eaglespec.spec.verify import SamplingParams, target_probs

from conftest import good_head, tiny_target

PROMPTS = [[5, 9, 17, 33, 2], [7], [100, 3, 3, 3, 3, 3, 3, 3, 64, 12, 90, 4]]


def hf_greedy(model, ids, n, eos=None):
    x = torch.tensor([ids], device=model.device)
    out = model.generate(x, max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0,
                         repetition_penalty=None, attention_mask=torch.ones_like(x))
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("tree", ["paper", "chain:1", "chain:4", [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]],
                                  "dynamic", "dynamic:3,2,6", "dynamic:6,3,40"])
def test_greedy_equals_vanilla_and_hf(tiny_pair, tree):
    model, head = tiny_pair
    eng = Engine(model, head, tree=tree)
    for ids in PROMPTS:
        ref = hf_greedy(model, ids, 40)
        van = eng.generate(ids, 40, method="vanilla")
        eag = eng.generate(ids, 40, method="eagle")
        assert van.token_ids == ref
        assert eag.token_ids == ref
        assert eag.stats.new_tokens == 40 and eag.finish_reason == "length"
    assert max(eag.stats.accept_lengths) > 1  # drafts were really accepted


def test_verification_runs_the_lm_head_over_the_rows_the_walk_reads(tiny_pair):
    """`NodeRows` computes a node with its first-child chain on first use, once; the engine's rounds
    on the paper tree (26 rows, a top path of 6) run the target's LM head over the top path and the
    nodes acceptance reaches off it, never over the whole tree, and stay vanilla's, greedy and sampled."""
    from eaglespec.spec.engine import NodeRows, first_child_chain

    children = [[1, 2], [3], [4], [], []]  # 0 -> 1 -> 3 and 0 -> 2 -> 4
    calls = []
    rows = NodeRows(lambda nodes: calls.append(list(nodes)) or [10 * n for n in nodes], children, {1: -1})
    assert first_child_chain(0, children) == [0, 1, 3]
    assert (rows[0], rows[3], rows[1]) == (0, 30, -1) and calls == [[0, 3]]  # 1 was ready
    assert rows[2] == 20 and rows[4] == 40 and calls == [[0, 3], [2, 4]]

    model, head = tiny_pair
    eng = Engine(model, head, tree="paper")
    lm_head, sizes = eng.lm_head, []
    eng.lm_head = lambda x: sizes.append(x.shape[0]) or lm_head(x)
    for ids in PROMPTS:
        eag = eng.generate(ids, 30, method="eagle")
        assert eag.token_ids == eng.generate(ids, 30, method="vanilla").token_ids == hf_greedy(model, ids, 30)
    assert max(eag.stats.accept_lengths) > 1 and sizes and max(sizes) == 6  # the top path, not 26 rows
    sizes.clear()
    eng.generate(PROMPTS[0], 30, SamplingParams(temperature=1.0), seed=0)
    assert max(sizes) == 6


@pytest.mark.parametrize("tree", ["paper", "dynamic:3,2,6"])
def test_two_layer_head(tiny_pair, tree):
    """A head grown to two layers (the second perturbed so it matters): its cache holds both layers
    (a prefix then the rest with the cache equals one pass), greedy output is still vanilla's, and
    drafts are still accepted."""
    model, head = tiny_pair
    head.grow(2)
    with torch.no_grad():
        head.layers[1].self_attn.o_proj.weight.normal_(0, 0.05)
        head.layers[1].mlp.down_proj.weight.normal_(0, 0.05)
    ids = torch.tensor([PROMPTS[0]], device=model.device)
    f = model.model(input_ids=ids).last_hidden_state
    pos = torch.arange(ids.shape[1], device=model.device)[None]
    tok = torch.roll(ids, -1, 1)
    with torch.no_grad():
        whole = head(f, tok, pos)
        cache, cut = KVCache(64), 3
        parts = [head(f[:, :cut], tok[:, :cut], pos[:, :cut], cache=cache),
                 head(f[:, cut:], tok[:, cut:], pos[:, cut:], cache=cache)]
        single = EagleDraftHead(model.config).bind(model)
        single.load_state_dict(head.state_dict(), strict=False)  # the first layer alone differs
    assert len(cache.layers) == 2
    torch.testing.assert_close(torch.cat(parts, 1), whole, atol=1e-3, rtol=1e-5)  # outputs reach ~200
    assert not torch.allclose(single(f, tok, pos), whole, atol=1e-3)
    eng = Engine(model, head, tree=tree)
    for ids in PROMPTS:
        eag = eng.generate(ids, 40, method="eagle")
        assert eag.token_ids == hf_greedy(model, ids, 40)
    assert max(eag.stats.accept_lengths) > 1


def synthetic_costs(per_token: float, level: float) -> CostProfile:
    sizes = [1, 2, 4, 8, 16, 32, 64]
    return CostProfile(sizes, [1.0 + per_token * (n - 1) for n in sizes], level, 0, {})


@pytest.mark.parametrize("per_token,level", [(0.02, 0.05), (0.6, 0.3), (5.0, 0.1)])
def test_auto_tree_greedy_equals_hf(tiny_pair, per_token, level):
    """`auto` sizes every round from a cost curve; cheap verification -> big trees, dear -> none."""
    model, head = tiny_pair
    eng = Engine(model, head, tree="auto", costs=synthetic_costs(per_token, level))
    for ids in PROMPTS:
        eag = eng.generate(ids, 40, method="eagle")
        assert eag.token_ids == hf_greedy(model, ids, 40)
    if per_token < 0.1:
        assert max(eag.stats.accept_lengths) > 2
    if per_token > 1:
        assert max(eag.stats.accept_lengths) == 1  # verifying any draft costs more than it can gain


def gate_curve() -> CostProfile:
    """The gate tests' curve: a plain step 1 s (1 token per second), 2 tokens 1.5 s, 8 tokens 4.5 s,
    a draft level 0.25 s."""
    return CostProfile([1, 2, 8], [1.0, 1.5, 4.5], 0.25, 0, {})


class EveryThirdRoundDrafts(DraftGate):
    """A scripted gate: draft, plain, plain, draft, ... (what it observes is still recorded)."""
    turn = 0

    def draft(self) -> bool:
        self.turn += 1
        return self.turn % 3 == 1


def plain_until_probe(gate, seconds: float = 1.0) -> int:
    """Plain steps (each timed at `seconds`) until the gate drafts again."""
    n = 0
    while not gate.draft():
        gate.observe_plain(seconds)
        n += 1
    return n


def test_draft_gate_pauses_drafting_that_loses_and_probes_again():
    prof = gate_curve()  # the curve's plain step: 1 token per second
    gate = DraftGate(prof, warmup=4, pause=4, max_pause=16)
    assert gate.rate() == float("inf") and gate.plain_rate() == 1.0
    for _ in range(4):  # 2 tokens in 2.75 s (3 levels, 2 nodes, timed as modelled): a loss, judged from the 4th
        assert gate.draft()
        gate.observe(2, 3, 2, 2.75)
    assert plain_until_probe(gate) == 4  # four plain steps, then a probe: the head's backlog, then a round
    gate.observe(1, 3, 2, 9.0, backlog=True)  # not counted: the feed's cost is the switch's
    assert gate.draft() and gate.shut
    gate.observe(2, 3, 2, 2.75)  # the probe loses: a longer pause
    assert plain_until_probe(gate) == 8  # each plain step also fades the rounds that shut the gate
    gate.observe(1, 3, 2, 9.0, backlog=True)
    gate.observe(8, 2, 8, 5.0)  # deep acceptance on a big tree: 8 tokens in 5 s
    assert gate.rate() > 1.0 and all(gate.draft() for _ in range(5))  # reopened ...
    assert gate.pause == 8  # ... with the pause halved, not reset: a lucky probe would shut again soon
    gate.observe(8, 2, 8, 5.0)
    assert gate.pause == 4


def test_a_new_prompt_opens_the_gate_and_keeps_what_a_plain_step_costs(tiny_pair):
    """Drafting lost on one text: the next prompt still drafts its first round (the gate forgets the
    drafted rounds, not the plain steps it timed nor how long its pause grew)."""
    model, head = tiny_pair
    eng = Engine(model, head, tree="auto", costs=CostProfile([1, 2, 64], [1e-6, 1.0, 2.0], 0.1, 0, {}))
    eng.generate(PROMPTS[1], 40, method="eagle")
    gate = eng.policy.gate
    assert gate.skip > 0 and gate.shut and gate.plain_steps > 0  # shut where drafting loses
    plain_rate, pause = gate.plain_rate(), gate.pause
    assert pause > gate.base  # probes lost too
    stream = eng.stream(PROMPTS[0], 40, method="eagle")
    next(stream)  # the prompt is in
    assert eng.policy.gate is gate and gate.draft() and not gate.shut and gate.rounds == 0
    assert gate.plain_rate() == plain_rate and gate.pause == pause  # should it lose again, probes stay rare


def test_draft_gate_judges_a_probe_with_the_rounds_before_it():
    """One round's tokens are noisy: a probe that merely beats the stay-open bar among rounds that
    lost does not reopen the gate, however long the pause faded them; a probe must show drafting
    winning outright."""
    gate = DraftGate(gate_curve(), warmup=4, pause=4, max_pause=32)
    for _ in range(4):  # 2 tokens in 3 s: 0.67 tokens/s against the plain step's 1
        gate.observe(2, 3, 2, 3.0)
    for _ in range(3):  # shut; each probe loses and doubles the pause: 4, 8, 16 plain steps
        plain_until_probe(gate)
        gate.observe(2, 3, 2, 3.0, backlog=True)
        gate.observe(2, 3, 2, 3.0)
    assert plain_until_probe(gate) == 32
    gate.observe(2, 3, 2, 3.0, backlog=True)
    gate.observe(3, 3, 2, 2.0)  # a lucky probe: 1.5 tokens/s, above the stay-open bar alone
    assert gate.margin < gate.rate() < 1.0 and gate.shut and plain_until_probe(gate) == 32


def test_draft_gate_times_both_sides_by_the_clock():
    """Drafted rounds and plain steps count the seconds they took (within 2x of the curve either
    way), so a curve that overrates the plain step (a busy host when it was measured) cannot keep
    drafting that really loses; a plain step is timed for real once the warm-up is in, and again
    every `refresh` drafted rounds."""
    prof = gate_curve()
    for seconds, counted in ((0.5, 0.875), (1.0, 1.0), (2.0, 2.0), (1000.0, 3.5)):  # modelled: 1.75 s
        gate = DraftGate(prof, warmup=9)
        gate.observe(3, 1, 2, seconds)
        assert gate.cost == counted
    gate = DraftGate(prof, warmup=2, refresh=3)
    for _ in range(2):
        assert gate.draft()
        gate.observe(2, 1, 2, 1.0)  # 2 tokens/s against the curve's 1: a win
    assert plain_until_probe(gate, 0.6) == 2  # two plain steps, timed: 1.67 tokens/s, a loss to 2
    assert gate.plain_rate() == pytest.approx(1 / 0.6)
    gate.observe(2, 1, 2, 1.0)
    assert gate.draft() and gate.skip == 0
    gate.observe(2, 1, 2, 1.0)
    assert gate.draft()
    gate.observe(2, 1, 2, 1.0)
    assert not gate.draft()  # three drafted rounds since: one plain step to refresh the rate
    gate.observe_plain(0.5)  # 2 tokens/s now
    assert gate.draft()
    gate.observe(2, 1, 2, 3.0)  # and a slow round tips the decayed sums ...
    assert gate.rate() < gate.margin * gate.plain_rate()
    assert not gate.draft() and gate.skip == gate.base - 1  # ... so the gate shuts


def test_draft_gate_leaves_backlog_rounds_out_and_judges_keep_rounds():
    """The first round of a prompt and a probe after plain steps first feed the head every token
    since its last draft (at int4-q8 a new prompt's first round cost ~2 ms beyond that feed): such a
    round is not counted. A new text is judged once `keep` rounds are in, not on its first one."""
    gate = DraftGate(gate_curve(), warmup=2, keep=3.0)
    gate.observe(3, 1, 2, 30.0, backlog=True)
    assert gate.rounds == gate.cost == gate.tokens == 0 and gate.drafted == 1
    for _ in range(3):
        gate.observe(1, 1, 2, 1.75)  # 0.57 tokens/s against the curve's plain 1: a loss ...
        assert not gate.shut  # ... judged only with three rounds' weight in (1, 1.9, 2.71)
    gate.observe(1, 1, 2, 1.75)
    assert gate.shut
    gate.new_text()
    gate.observe(3, 1, 2, 30.0, backlog=True)
    for _ in range(3):
        gate.observe(1, 1, 2, 1.75)
        assert not gate.shut


def test_auto_tree_goes_plain_where_drafting_loses_and_stays_lossless(tiny_pair):
    """A cost curve whose one-token step is nearly free: no drafted round can beat it, so after the
    gate's warm-up `auto` takes plain steps (not counted as rounds), and the output stays vanilla's."""
    model, head = tiny_pair
    eng = Engine(model, head, tree="auto", costs=CostProfile([1, 2, 64], [1e-6, 1.0, 2.0], 0.1, 0, {}))
    out = eng.generate(PROMPTS[1], 40, method="eagle")
    assert out.stats.plain_steps > 20 and 4 <= out.stats.rounds == len(out.stats.accept_lengths)
    assert len(out.token_ids) == 40 == 1 + sum(out.stats.accept_lengths) + out.stats.plain_steps
    assert out.token_ids == hf_greedy(model, PROMPTS[1], 40)
    cheap = Engine(model, head, tree="auto", costs=synthetic_costs(0.02, 0.05))  # drafting pays: plain only
    assert cheap.generate(PROMPTS[1], 40, method="eagle").stats.plain_steps == 4  # to time a plain step


def test_auto_tree_measures_and_caches_costs(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLESPEC_CACHE", str(tmp_path))
    model, head = tiny_pair
    eng = Engine(model, head, tree="auto")
    out = eng.generate(PROMPTS[0], 10)
    assert out.token_ids == hf_greedy(model, PROMPTS[0], 10)
    files = list((tmp_path / "costs").glob("*.json"))
    assert len(files) == 1 and eng.policy.costs.draft_level_s > 0 and len(eng.policy.costs.verify_s) == len(eng.policy.costs.sizes)
    again = Engine(model, head, tree="auto")
    again.generate(PROMPTS[0], 2)
    assert again.policy.costs == eng.policy.costs  # read back, not measured again


def test_cost_measurement_runs_without_autograd_whoever_calls(tiny_pair):
    """`eaglespec profile` calls `measure` outside the engine's inference mode: with autograd on, the
    head (trainable weights) timed ~4x its real draft cost, and `auto` trees built on that curve
    shrank."""
    from eaglespec.policy.costmodel import measure

    model, head = tiny_pair
    eng = Engine(model, head, tree="auto")
    seen = []
    hooks = [m.register_forward_hook(lambda *_: seen.append(torch.is_inference_mode_enabled()))
             for m in (head, eng.model.get_decoder())]
    try:
        measure(eng, sizes=(1, 2), context=8, repeats=1)
    finally:
        for h in hooks:
            h.remove()
    assert seen and all(seen)


def test_live_costs_refit_the_curve_to_the_forwards_rounds_time():
    """A curve measured on a busy host (3x the real step, a third of the real cost per token): the
    timed forwards of a few rounds, of whatever sizes, bring verify(n) to what forwards really cost;
    rounds that all verify one size move its level, not the curve's slope."""
    busy = synthetic_costs(1.0 / 9, 0.1)  # verify(n) = 1 + (n - 1) / 9 s
    live = LiveCosts(busy)
    assert live.verify(1) == pytest.approx(1.0) and live.verify(10) == pytest.approx(2.0)
    assert live.draft_level_s == busy.draft_level_s
    true = lambda n: 1 / 3 + (n - 1) / 3  # noqa: E731
    for n in (2, 3, 5, 2, 4, 3, 6, 2) * 3:
        live.observe(n, true(n))
    for n, rel in ((1, 0.15), (4, 0.02), (10, 0.05)):  # one below the sizes seen, one in, one above
        assert live.verify(n) == pytest.approx(true(n), rel=rel)
    assert live.best_size([0.5] * 8, 0.0)[0] < busy.best_size([0.5] * 8, 0.0)[0]  # dearer nodes: a smaller tree
    one = LiveCosts(busy)
    for _ in range(50):
        one.observe(4, 0.5)
    assert one.verify(4) == pytest.approx(0.5, rel=0.05) and one.b == pytest.approx(1 / 9, rel=0.05)
    flat = LiveCosts(busy)
    for n in (2, 6, 3, 8) * 10:
        flat.observe(n, 0.5 - 0.01 * n)  # noise that makes more tokens look cheaper
    assert flat.b == 0.0 and flat.verify(8) == flat.verify(1) > 0


def test_auto_tree_refits_a_wrong_cached_curve_and_stays_lossless(tiny_pair, tmp_path, monkeypatch, always_draft):
    """A curve cached while the CPU was busy (here 100x too slow) is refitted by the rounds' own
    forwards (not measured again: the cache keeps it); a curve given to the engine is kept as it is."""
    monkeypatch.setenv("EAGLESPEC_CACHE", str(tmp_path))
    model, head = tiny_pair
    eng = Engine(model, head, tree="auto")
    eng.generate(PROMPTS[0], 2)  # measures and caches the true curve
    path = next((tmp_path / "costs").glob("*.json"))
    true = CostProfile.load(path)
    busy = CostProfile(true.sizes, [100 * t for t in true.verify_s], 100 * true.draft_level_s, true.context,
                       true.machine)
    busy.save(path)
    eng = Engine(model, head, tree="auto")
    out = eng.generate(PROMPTS[1], 60)
    assert out.token_ids == hf_greedy(model, PROMPTS[1], 60)
    assert out.stats.rounds >= 16 and eng.policy.costs == busy == CostProfile.load(path)
    assert eng.policy.live.verify(2) < 10 * true.verify(2) < busy.verify(2) / 5
    given = Engine(model, head, tree="auto", costs=busy)
    given.generate(PROMPTS[1], 20)
    assert not given.policy.refit and given.policy.live is busy


def reduced_head(model, head, d2t: torch.Tensor, context: bool) -> EagleDraftHead:
    """`head`'s weights with draft vocabulary `d2t` (and the context vocabulary if `context`)."""
    small = EagleDraftHead(model.config, draft_vocab=d2t).bind(model)
    small.load_state_dict(head.state_dict(), strict=False)
    small.context_vocab = context
    return small.eval()


def test_target_tokens_outside_draft_vocabulary(tiny_pair):
    """A reduced draft vocabulary that lacks the target's favourite tokens never proposes them,
    and the output is still exactly the target's."""
    model, head = tiny_pair
    ids = PROMPTS[0]
    ref = hf_greedy(model, ids, 40)
    banned = sorted(set(ref))[: len(set(ref)) // 2]
    d2t = torch.tensor([t for t in range(model.config.vocab_size) if t not in banned])
    small = reduced_head(model, head, d2t, context=False)
    for tree in ("paper", "dynamic"):
        eag = Engine(model, small, tree=tree).generate(ids, 40)
        assert eag.token_ids == ref
        assert max(eag.stats.accept_lengths) > 1


def test_full_draft_vocabulary_at_load(tiny_pair, tmp_path):
    """A head trained on a reduced vocabulary, loaded with draft_vocab="full", proposes every target
    token through the target's own LM head (no retraining), and stays lossless."""
    model, head = tiny_pair
    small = reduced_head(model, head, torch.arange(0, model.config.vocab_size, 3), context=False)
    small.save_pretrained(tmp_path / "h")
    x = torch.randn(4, model.config.hidden_size, device=model.device)
    full_logits = model.get_output_embeddings()(x)
    ref = hf_greedy(model, PROMPTS[0], 40)
    for choice, size in (("context", small.d2t.numel()), ("head", small.d2t.numel()),
                         ("full", model.config.vocab_size)):
        back = EagleDraftHead.from_pretrained(tmp_path / "h", model, draft_vocab=choice).eval()
        assert back.draft_vocab_size == size and back.context_vocab == (choice == "context")
        want = full_logits if choice == "full" else full_logits[:, small.d2t]
        torch.testing.assert_close(back.logits(x), want)
        assert Engine(model, back, tree="paper").generate(PROMPTS[0], 40).token_ids == ref
    with pytest.raises(ValueError, match="draft_vocab"):
        EagleDraftHead.from_pretrained(tmp_path / "h", model, draft_vocab="half")


def test_context_vocabulary_adds_the_texts_tokens(tiny_pair):
    """add_context appends LM-head rows for tokens outside d2t (once each), maps the new draft ids
    to them, and reset_context forgets them; without context_vocab it does nothing."""
    model, head = tiny_pair
    V = model.config.vocab_size
    small = reduced_head(model, head, torch.arange(0, V, 2), context=True)
    x = torch.randn(3, model.config.hidden_size, device=model.device)
    full = model.get_output_embeddings()(x)
    small.add_context(torch.tensor([7, 4, 7, 9, 4]))  # 4 is in d2t already
    assert small.logits(x).shape[-1] == V // 2 + 2
    torch.testing.assert_close(small.logits(x)[:, V // 2:], full[:, [7, 9]])
    assert small.to_target_ids(torch.tensor([1, V // 2, V // 2 + 1])).tolist() == [2, 7, 9]
    q = torch.softmax(small.logits(x), -1)
    qt = small.to_target_probs(q)
    torch.testing.assert_close(qt[:, [7, 9]], q[:, V // 2:])
    torch.testing.assert_close(qt.sum(-1), torch.ones(3, device=model.device))
    small.add_context(torch.tensor([9, 7]))
    assert small.logits(x).shape[-1] == V // 2 + 2
    small.reset_context()
    torch.testing.assert_close(small.logits(x), full[:, ::2])
    small.add_context(torch.tensor([11, 3, 11, 8] * 20))  # a prompt's many tokens, then a round's few
    small.add_context(torch.tensor([3, 5, 13]))
    assert small.to_target_ids(torch.arange(V // 2, V // 2 + 4)).tolist() == [3, 11, 5, 13]
    torch.testing.assert_close(small.logits(x)[:, V // 2:], full[:, [3, 11, 5, 13]])
    small.reset_context()
    small.context_vocab = False
    small.add_context(torch.tensor([7]))
    assert small.logits(x).shape[-1] == V // 2


@pytest.mark.parametrize("tree", ["paper", "dynamic"])
def test_context_vocabulary_proposes_what_the_text_used(tiny_pair, tree):
    """A draft vocabulary lacking every token the target emits never gets a draft accepted; with
    the context vocabulary, tokens join as the text uses them and drafts are accepted. Both equal
    the target's greedy output; so does a ragged batch."""
    model, head = tiny_pair
    ids = PROMPTS[2]
    ref = hf_greedy(model, ids, 40)
    d2t = torch.tensor([t for t in range(model.config.vocab_size) if t not in set(ref)])
    plain, ctx = (Engine(model, reduced_head(model, head, d2t, c), tree=tree).generate(ids, 40) for c in (False, True))
    assert plain.token_ids == ctx.token_ids == ref
    assert max(plain.stats.accept_lengths) == 1
    assert max(ctx.stats.accept_lengths) > 1
    if tree == "paper":
        outs = Engine(model, reduced_head(model, head, d2t, True), tree=tree).generate_batch(PROMPTS, 30)
        assert [o.token_ids for o in outs] == [hf_greedy(model, p, 30) for p in PROMPTS]


def test_context_vocabulary_adds_each_outside_token_once_per_text(tiny_pair):
    """Only tokens outside the draft vocabulary join it, once each; a new text starts from the
    draft vocabulary alone, and a new draft vocabulary is the one consulted."""
    model, head = tiny_pair
    small = reduced_head(model, head, torch.tensor([0, 2, 4, 6]), context=True)
    small.add_context(torch.tensor([2, 5, 5, 7]))
    small.add_context(torch.tensor([7, 4, 9]))
    assert small.draft_ids().tolist() == [0, 2, 4, 6, 5, 7, 9]
    assert small.logits(torch.randn(1, model.config.hidden_size)).shape[-1] == 7
    small.reset_context()
    small.add_context(torch.tensor([9]))
    assert small.draft_ids().tolist() == [0, 2, 4, 6, 9]
    small.set_draft_vocab(torch.tensor([1, 9]))
    small.add_context(torch.tensor([9, 2]))
    assert small.draft_ids().tolist() == [1, 9, 2]


def test_sampling_law_with_context_vocabulary():
    """Tokens join the draft vocabulary mid-generation (the prompt's first, then the sampled ones):
    the output law is still the target's."""
    V, model, head, sp = law_setup()
    ids = [2, 5, 3]
    law = exact_three_token_law(model, ids, sp).flatten()
    small = reduced_head(model, head, torch.tensor([0, 2, 4, 6]), context=True)
    eng = Engine(model, small, tree=[[0], [1], [0, 0], [0, 1], [1, 0]], draft_sampling="sample")
    assert_law(lambda s: eng.generate(ids, 3, sampling=sp, seed=s).token_ids, law, V, 3000)


@pytest.fixture
def always_draft(monkeypatch):
    """`auto` drafts every round (no `DraftGate` plain steps): for tests about what drafting does."""
    monkeypatch.setattr(DraftGate, "draft", lambda self: True)


@pytest.mark.parametrize("tree", ["chain:1+lookup", "paper+lookup:4", "auto+lookup"])
def test_prompt_lookup_grafts_stay_lossless(tree, always_draft):
    """Prompt-lookup guesses grafted onto a weak head's tree: greedy output is still vanilla's, and
    the guesses really get accepted on repetitive text."""
    model = tiny_target("llama", seed=3)
    head = good_head(model)
    with torch.no_grad():  # a poor head, so that the guesses add what the head misses
        head.fc.bias.copy_(torch.empty(head.fc.bias.shape).normal_(0, 2.0, generator=torch.Generator().manual_seed(0)))
    eng = Engine(model, head, tree=tree, costs=synthetic_costs(0.02, 0.05))
    used = 0
    for ids in PROMPTS + [[5, 9, 17, 33, 2] * 4]:
        eag = eng.generate(ids, 60, method="eagle")
        assert eag.token_ids == hf_greedy(model, ids, 60)
        used += eag.stats.lookup_tokens
        assert eag.stats.lookup_tokens < sum(eag.stats.accept_lengths) - eag.stats.rounds + 1
    assert used > 0


def test_prompt_lookup_sees_the_tokens_of_plain_steps():
    """Lookup matches the text as it is: the tokens `DraftGate`'s plain steps emitted are in the
    history it searches, in order (they were missing, so a probe matched stale text)."""
    model = tiny_target("llama", seed=3)
    eng = Engine(model, good_head(model), tree="auto+lookup", costs=synthetic_costs(0.02, 0.05))
    eng.policy.gate = EveryThirdRoundDrafts(eng.policy.costs)
    seen, graft = [], eng._graft
    eng._graft = lambda draft, history, *a: seen.append(list(history)) or graft(draft, history, *a)
    ids = PROMPTS[0]
    out = eng.generate(ids, 30, method="eagle")
    assert out.stats.plain_steps > 0 and len(seen) > 2
    for h in seen:
        assert h == ids + out.token_ids[: len(h) - len(ids)]
    assert len(seen[-1]) > len(seen[1]) + 2  # the history grew across plain steps


def test_draft_gate_is_told_the_head_levels_each_round_ran(tiny_pair):
    """The gate models a drafted round as its head levels plus its verification: the levels it is
    told are the draft LM head's calls that round, not the verified tree's depth."""
    model, head = tiny_pair
    # every level drafted, few nodes verified (each costs 0.6 steps): the tree is shallower than the draft
    eng = Engine(model, head, tree="auto", costs=synthetic_costs(0.6, 0.001))
    eng.policy.another_level = lambda *args: True
    calls, seen = [0], []
    real_logits = head.logits

    def counting(f):
        calls[0] += 1
        return real_logits(f)

    head.logits = counting
    try:
        gate = eng.policy.gate_for(1)
        real_observe = gate.observe

        def observe(tokens, levels, nodes, seconds, backlog=False):
            seen.append((levels, calls[0], nodes))
            calls[0] = 0
            real_observe(tokens, levels, nodes, seconds, backlog)

        gate.observe = observe
        gate.observe_plain = lambda seconds: calls.__setitem__(0, 0)
        for ids in PROMPTS:
            eng.generate(ids, 24)
    finally:
        del head.logits
    assert seen and all(levels == n for levels, n, _ in seen)
    assert any(levels > nodes for levels, _, nodes in seen)  # deeper than any tree of that many nodes


def test_calibration_compares_what_the_head_predicted_with_what_was_accepted(tiny_pair):
    """The prediction travels with its tree: the overall ratio, and per sibling rank for sampled
    trees (clamped to [0.05, 2]); a dynamic tree's rounds feed it, a static tree's do not."""
    model, head = tiny_pair
    eng = Engine(model, head, tree="auto", costs=synthetic_costs(0.001, 0.05))
    chain = build_tree("chain:2")
    for _ in range(400):  # the head expects 2 tokens, the target takes 1
        eng.policy.observe_accepted(chain, [1], Prediction(2.0))
    assert abs(eng.policy.calib_ratio() - 0.5) < 0.02
    siblings = build_tree([[0], [1]])  # node 2 is the root's second-ranked child
    for _ in range(400):
        eng.policy.observe_accepted(siblings, [2], Prediction(1.0, [0.8, 0.2]))
    assert eng.policy.rank_ratio(0) == 0.05 and eng.policy.rank_ratio(1) == 2.0
    fresh = Engine(model, head, tree="auto", costs=synthetic_costs(0.001, 0.05))
    fresh.generate(PROMPTS[0], 20)
    assert fresh.policy.calibration != [1.0, 1.0]
    static = Engine(model, head, tree="chain:3")
    static.generate(PROMPTS[0], 20)
    assert static.policy.calibration == [1.0, 1.0]


def test_lookup_budget_follows_costs_and_acceptance(tiny_pair):
    """`auto` sizes the graft: cheap verification -> the whole chain, dear -> none; misses lower a
    position's rate, and a position no longer proposed drifts back to its prior."""
    model, head = tiny_pair
    cheap = Engine(model, head, tree="auto+lookup", costs=synthetic_costs(0.001, 0.05))
    dear = Engine(model, head, tree="auto+lookup", costs=synthetic_costs(5.0, 0.05))
    now = cheap.clock()
    for eng in (cheap, dear):
        eng.policy.start()  # a text begins: the policy takes its cost curve
    assert cheap.policy.lookup_budget(8, 4, 1.0, now) >= 6 and dear.policy.lookup_budget(8, 4, 1.0, now) == 0
    policy, tree = cheap.policy, build_tree("chain:2")
    for _ in range(200):  # both guesses proposed, both rejected
        policy.observe_lookup(tree, [], [tree.paths[1], tree.paths[2]])
    rates = policy.lookup_rates(6)
    assert rates[0] < 0.05 and rates[1] < 0.05
    assert rates[5] <= rates[0]  # a later guess needs the earlier ones
    for _ in range(400):  # only the first proposed (and rejected): the second forgets its misses
        policy.observe_lookup(tree, [], [tree.paths[1]])
    assert policy.lookup_rates(1)[0] < 0.05 and ratio(policy.lookup_hits[1], 0.01) > 0.3
    policy.start()  # a new text: its guesses are judged afresh, from the prior
    assert policy.lookup_rates(2) == [policy._lookup_prior(0), policy._lookup_prior(1)]


@pytest.mark.parametrize("seed", range(6))
def test_greedy_many_seeds_random_heads(seed):
    model = tiny_target("llama" if seed % 2 else "qwen2", seed=seed, attn_scale=0.2 + 0.1 * seed)
    head = good_head(model)
    with torch.no_grad():  # perturb the head so acceptance is partial
        head.fc.bias.normal_(0, 0.3 * seed)
    eng = Engine(model, head)
    ids = torch.randint(2, 128, (3 + seed * 5,), generator=torch.Generator().manual_seed(seed)).tolist()
    assert eng.generate(ids, 50, method="eagle").token_ids == hf_greedy(model, ids, 50)


def test_eos_inside_accepted_path(tiny_pair):
    model, head = tiny_pair
    eng = Engine(model, head)
    ids = PROMPTS[0]
    base = eng.generate(ids, 60, method="vanilla")
    # make a token that the eagle run accepts mid-path the EOS, then compare with HF's stopping
    eag = eng.generate(ids, 60, method="eagle")
    long_rounds = [i for i, a in enumerate(eag.stats.accept_lengths) if a >= 3]
    assert long_rounds
    r = long_rounds[0]
    pos = sum(eag.stats.accept_lengths[:r]) + 1 + 1  # second token of that round, inside the accepted path
    eos = base.token_ids[pos]
    stop = base.token_ids.index(eos)
    out = eng.generate(ids, 60, method="eagle", eos_token_ids=[eos])
    assert out.token_ids == base.token_ids[: stop + 1] == hf_greedy(model, ids, 60, eos=eos)
    assert out.finish_reason == "eos"


def test_max_new_tokens_mid_path(tiny_pair):
    model, head = tiny_pair
    eng = Engine(model, head)
    full = eng.generate(PROMPTS[0], 60, method="vanilla").token_ids
    for n in range(1, 20):
        out = eng.generate(PROMPTS[0], n, method="eagle")
        assert out.token_ids == full[:n]
        assert out.stats.new_tokens == n


def test_context_limit_stops_cleanly():
    model = tiny_target("llama", max_pos=40)
    eng = Engine(model, good_head(model))
    ids = list(range(2, 32))
    e = eng.generate(ids, 100, method="eagle")
    v = eng.generate(ids, 100, method="vanilla")
    assert e.token_ids == v.token_ids
    assert e.finish_reason == v.finish_reason == "context"
    assert len(ids) + len(e.token_ids) == 41  # the last token needs no position of its own


def test_stats(tiny_pair):
    model, head = tiny_pair
    out = Engine(model, head).generate(PROMPTS[2], 30, method="eagle")
    s = out.stats
    assert s.rounds == len(s.accept_lengths)
    assert 1 + sum(s.accept_lengths) >= 30
    assert s.tau > 1
    assert s.alpha_total[0] == s.rounds
    assert all(0 <= a <= 1 for a in s.n_alpha if a is not None)
    assert s.draft_time_s > 0 and s.verify_time_s > 0


def test_cache_compaction_equals_fresh_prefill(tiny_pair):
    """After an accepted path is compacted, the cache equals a fresh prefill of the same tokens."""
    model, head = tiny_pair
    eng = Engine(model, head)
    ids = PROMPTS[2]
    cache = KVCache(128)
    eng.target_forward(ids, 0, cache)
    # verify a paper tree with arbitrary tokens, then keep one root-to-node path
    tree = eng.tree
    node_tokens = torch.randint(2, 128, (tree.n,), generator=torch.Generator().manual_seed(0)).tolist()
    from eaglespec.spec.tree import float_mask, prefix_tree_mask
    allowed = prefix_tree_mask(tree.ancestor_mask, len(ids)).to(model.device)
    eng.target_forward(node_tokens, len(ids), cache, float_mask(allowed, torch.float32),
                tree.position_offsets.to(model.device) + len(ids))
    keep = [0, 1, 5, 13, 21]
    cache.compact(len(ids), torch.tensor(keep, device=model.device))
    fresh = KVCache(128)
    eng.target_forward(ids + [node_tokens[i] for i in keep], 0, fresh)
    assert cache.get_seq_length() == fresh.get_seq_length() == len(ids) + len(keep)
    for a, b in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("one_call", [True, False])
def test_compact_rows_moves_each_rows_entries(one_call, monkeypatch):
    """Ragged batch rows: row b's entries src + keep[b][i] land at dst[b] + i in every layer, the
    rest of the buffer untouched; the kernels' one call (every layer at once) and the per-layer path alike."""
    from eaglespec.cpu import kernels
    from eaglespec.cpu.backend import compact_rows

    if one_call and not kernels.available():
        pytest.skip("eaglespec's kernels are not built here")
    g = torch.Generator().manual_seed(1)
    cache = KVCache(40)
    for i in range(3):
        k, v = torch.randn(2, 2, 30, 8, generator=g), torch.randn(2, 2, 30, 8, generator=g)
        cache.update(k, v, i)
    before = [(layer.k_buf.clone(), layer.v_buf.clone()) for layer in cache.layers]
    dst, src, keeps = [17, 20], 20, [[0, 2, 3, 7], [0, 1]]
    (compact_rows(cache, dst, src, keeps) if one_call else cache.compact_rows(dst, src, keeps))
    assert cache.get_seq_length() == 22
    for layer, (k0, v0) in zip(cache.layers, before):
        for new, old in ((layer.k_buf, k0), (layer.v_buf, v0)):
            expect = old.clone()
            for b, (d, keep) in enumerate(zip(dst, keeps)):
                expect[b, :, d:d + len(keep)] = old[b, :, [src + i for i in keep]]
            assert torch.equal(new, expect)


def test_bad_requests(tiny_pair):
    model, head = tiny_pair
    eng = Engine(model, head)
    with pytest.raises(EaglespecError, match="empty"):
        eng.generate([], 5)
    with pytest.raises(EaglespecError, match="token ids must be in 0..127"):
        eng.generate([3, 128], 5)  # the C draft path must never see an id past the embedding
    with pytest.raises(EaglespecError, match="token ids"):
        eng.generate([-1, 3], 5)
    with pytest.raises(EaglespecError, match="max_new_tokens"):
        eng.generate([3], 0)
    with pytest.raises(EaglespecError, match="context"):
        eng.generate(list(range(600)), 5)
    with pytest.raises(EaglespecError, match="head"):
        Engine(model).generate([3], 5, method="eagle")


# -- sampling: the law of the first three tokens equals the target's, enumerated exactly ----------
def exact_three_token_law(model, ids, sp):
    V = model.config.vocab_size
    with torch.no_grad():
        seqs = torch.tensor([ids + list(t) for t in itertools.product(range(V), repeat=2)], device=model.device)
        logits = model(seqs).logits.float()
        p1 = target_probs(logits[0, len(ids) - 1], sp)
        p2 = target_probs(logits[:, len(ids)].view(V, V, V)[:, 0], sp)  # p(t2 | t1)
        p3 = target_probs(logits[:, len(ids) + 1], sp).view(V, V, V)  # p(t3 | t1, t2)
    return (p1[:, None, None] * p2[:, :, None] * p3).cpu()


@pytest.mark.parametrize("draft_sampling,tree", [("topk", [[0], [1], [0, 0], [0, 1], [1, 0]]),
                                                 ("sample", [[0], [1], [0, 0], [0, 1], [1, 0]]),
                                                 ("topk", "dynamic:3,2,6"),
                                                 ("sample", "dynamic:3,3,7"), ("sample", "dynamic:3,3,0")])
def test_sampling_law_of_first_three_tokens(draft_sampling, tree):
    V, model, head, sp = law_setup()
    ids = [2, 5, 3]
    law = exact_three_token_law(model, ids, sp).flatten()
    # dynamic:3,3,0 is auto; with free verification every frontier node draws top_k siblings
    eng = Engine(model, head, tree=tree, draft_sampling=draft_sampling, costs=synthetic_costs(0.0, 0.0))
    assert_law(lambda s: eng.generate(ids, 3, sampling=sp, seed=s).token_ids, law, V, 4000)


def test_auto_samples_with_one_drafted_token_on_a_cpu_unless_told_otherwise(monkeypatch):
    """`auto[+lookup]` on a CPU drafts one sampled token a round at T > 0 (another engine's chain:1,
    whose law is tested above), and its own tree at T = 0; `sampled_tree` names another tree or
    (None) keeps `auto`'s; a bad one fails when the engine is made."""
    V, model, head, sp = law_setup()
    eng = Engine(model, head, tree="auto+lookup", costs=synthetic_costs(0.0, 0.0))
    assert eng.sampled_tree == "chain:1"
    trees = []
    verify = Engine._verify

    def spy(self, rows, draft, *a):
        trees.append(draft.tree.n)
        return verify(self, rows, draft, *a)

    monkeypatch.setattr(Engine, "_verify", spy)
    out = eng.generate([2, 5, 3], 24, sampling=sp, seed=0)
    assert set(trees) == {2} and out.stats.rounds > 0 and out.stats.lookup_tokens == 0  # root + one draft
    trees.clear()
    eng.generate([2, 5, 3], 24)
    assert max(trees) > 2  # greedy: auto's own trees, with free verification as big as they come
    trees.clear()
    keep = Engine(model, head, tree="auto", costs=synthetic_costs(0.0, 0.0), sampled_tree=None)
    keep.generate([2, 5, 3], 24, sampling=sp, seed=0)
    assert max(trees) > 2
    assert Engine(model, head, tree="dynamic:3,3,0").sampled_tree is None  # only the `auto` preset
    assert Engine(model, head, tree="paper").sampled_tree is None
    assert Engine(model, head, tree="auto", sampled_tree="chain:2").sampled_tree == "chain:2"
    with pytest.raises(ValueError):
        Engine(model, head, tree="auto", sampled_tree="bushy")


def test_the_engine_tells_the_gate_which_rounds_feed_the_heads_backlog():
    """The first round (the prompt) and a probe after plain steps feed the head every token since
    its last draft; the engine says so, and times every round."""
    class Recording(DraftGate):
        def __init__(self, profile):
            super().__init__(profile)
            self.turn, self.seen = 0, []

        def draft(self) -> bool:
            self.turn += 1
            return self.turn not in (3, 4)  # draft, draft, plain, plain, draft, draft, ...

        def observe(self, tokens, levels, nodes, seconds, backlog=False):
            self.seen.append((backlog, seconds))
            super().observe(tokens, levels, nodes, seconds, backlog)

    V, model, head, sp = law_setup()
    eng = Engine(model, head, tree="dynamic:3,3,0", costs=synthetic_costs(0.0, 0.0))
    eng.policy.gate = Recording(eng.policy.costs)
    out = eng.generate([2, 5, 3], 12, sampling=SamplingParams(), seed=0)
    seen = eng.policy.gate.seen
    assert out.stats.plain_steps == 2 and len(seen) >= 4
    assert [b for b, _ in seen] == [True, False, True] + [False] * (len(seen) - 3)
    assert all(s > 0 for _, s in seen)


def test_sampling_law_with_plain_steps_between_drafted_rounds():
    """`DraftGate` may turn any round of an `auto` tree into a plain step (vanilla's draw) and back:
    the law of the output stays the target's. A scripted gate: draft, plain, plain, draft, ..."""
    V, model, head, sp = law_setup()
    ids = [2, 5, 3]
    law = exact_three_token_law(model, ids, sp).flatten()
    eng = Engine(model, head, tree="dynamic:3,3,0", costs=synthetic_costs(0.0, 0.0))
    eng.policy.gate = EveryThirdRoundDrafts(eng.policy.costs)
    plain = assert_law_of(eng, ids, sp, law, V, 4000, lambda st: st.plain_steps)
    assert 0 < sum(p > 0 for p in plain) < len(plain)  # both kinds of rounds made first tokens


def law_setup() -> tuple[int, torch.nn.Module, object, SamplingParams]:
    """The law tests' target: 8 tokens, flattened distributions (every branch matters), a good head."""
    V = 8
    model = tiny_target("llama", seed=11, vocab=V)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.3)
    return V, model, good_head(model), SamplingParams(temperature=0.9, top_p=0.95, top_k=6)


def assert_law_of(eng: Engine, ids: list[int], sp: SamplingParams, law: torch.Tensor, V: int, n: int,
                  stat) -> list:
    """`assert_law` on n three-token generations of `eng` (seeds 0..n-1); returns each one's `stat(stats)`."""
    seen = []

    def draw(seed: int) -> list[int]:
        out = eng.generate(ids, 3, sampling=sp, seed=seed)
        seen.append(stat(out.stats))
        return out.token_ids

    assert_law(draw, law, V, n)
    return seen


def assert_law(sample, law: torch.Tensor, V: int, n: int) -> None:
    """n draws of three tokens (`sample(seed)`) follow `law` over V**3 outcomes (chi-square)."""
    counts = torch.zeros(V ** 3)
    for s in range(n):
        t = sample(s)
        counts[t[0] * V * V + t[1] * V + t[2]] += 1
    keep = law > 0
    assert counts[~keep].sum() == 0
    # pool rare outcomes so every expected count is >= 5
    exp, obs = law[keep] * n, counts[keep]
    big = exp >= 5
    f_obs = torch.cat([obs[big], obs[~big].sum()[None]]).numpy()
    f_exp = torch.cat([exp[big], exp[~big].sum()[None]]).numpy()
    assert chisquare(f_obs, f_exp).pvalue > 1e-3


def test_auto_draws_sampled_drafts_at_most_sampled_auto_depth_levels_deep(monkeypatch):
    """With free verification `auto` grows deep trees; sampled drafts stop at SAMPLED_AUTO_DEPTH
    levels (every drawn node is verified), greedy ones do not."""
    from eaglespec.policy import auto

    V, model, head, sp = law_setup()
    eng = Engine(model, head, tree="auto", costs=synthetic_costs(0.0, 0.0), sampled_tree=None)
    depths = []
    verify = eng._verify
    monkeypatch.setattr(eng, "_verify", lambda rows, draft, *a: depths.append(draft.tree.max_depth)
                        or verify(rows, draft, *a))
    eng.generate([2, 5, 3], 40, sampling=sp, seed=0)
    assert max(depths) == auto.SAMPLED_AUTO_DEPTH == 3
    depths.clear()
    eng.generate([2, 5, 3], 40)
    assert max(depths) > 3


@pytest.mark.parametrize("tree", ["dynamic:3,3,7", [[0], [1], [0, 0], [0, 1], [1, 0]]])
def test_sampling_law_on_the_draft_step(monkeypatch, tree):
    """Sampled drafts drawn from the law `draft_step` computes in C (a packed target and head, a
    32-token vocabulary: the C kernels' smallest block), in a dynamic tree and in a static one: the
    output's law is still the target's."""
    from eaglespec.cpu import kernels
    from eaglespec.cpu.quant import pack_target

    if not kernels.draft_available():
        pytest.skip("eaglespec's AVX-512 kernels are not built here")
    V = 32
    model = tiny_target("llama", seed=11, vocab=V)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.3)  # flat enough that every branch matters
    head = good_head(model)
    pack_target(model)
    head.set_draft_vocab(torch.arange(V))
    sp, ids = SamplingParams(temperature=0.9, top_p=0.95, top_k=6), [2, 5, 3]  # law_setup's: 216 outcomes
    law = exact_three_token_law(model, ids, sp).flatten()
    eng = Engine(model, head, tree=tree, costs=synthetic_costs(0.0, 0.0))
    laws = []
    step = eng.head.accel.draft_step
    monkeypatch.setattr(eng.head.accel, "draft_step", lambda *a, **kw: laws.append(step(*a, **kw)) or laws[-1])
    accepted = assert_law_of(eng, ids, sp, law, V, 3000, lambda st: max(st.accept_lengths or [0]))
    assert any(t is not None and t.probs is not None for t in laws)  # the draws came from C's law
    assert max(accepted) > 1


@pytest.mark.parametrize("draft_sampling,tree", [("sample", "chain:1+lookup:3"), ("sample", "dynamic:3,3,0+lookup")])
def test_sampling_law_with_prompt_lookup_grafts(draft_sampling, tree):
    """Lookup guesses are deterministic proposals next to sampled (or top-k) drafts: the law of the
    output is still the target's, and the guesses were really accepted."""
    V, model, head, sp = law_setup()
    ids = [v for x in range(V) for v in (3, x, 4)] + [3]  # 3 -> anything -> 4: every first token has a match
    law = exact_three_token_law(model, ids, sp).flatten()
    eng = Engine(model, head, tree=tree, draft_sampling=draft_sampling, costs=synthetic_costs(0.0, 0.0))
    grafted = assert_law_of(eng, ids, sp, law, V, 3000, lambda st: st.lookup_tokens)
    assert sum(grafted) > 100


# -- batches: each row decoded with its own accepted lengths equals its own greedy decoding ------
@pytest.mark.parametrize("tree", ["paper", "chain:3"])
def test_batch_greedy_equals_hf_per_row(tiny_pair, tree):
    model, head = tiny_pair
    eng = Engine(model, head, tree=tree)
    prompts = PROMPTS + [[40, 41]]
    refs = [hf_greedy(model, ids, 30) for ids in prompts]
    for method in ("eagle", "vanilla"):
        outs = eng.generate_batch(prompts, 30, method=method)
        assert [o.token_ids for o in outs] == refs
        assert all(o.finish_reason == "length" and o.stats.new_tokens == 30 for o in outs)
    lengths = [o.stats.accept_lengths for o in eng.generate_batch(prompts, 30)]
    assert len({tuple(x) for x in lengths}) > 1  # rows really advanced by different amounts


def test_batch_rows_finish_at_different_times(tiny_pair):
    """A row that hits EOS leaves the batch; the others go on unchanged."""
    model, head = tiny_pair
    eng = Engine(model, head)
    prompts = PROMPTS
    full = [hf_greedy(model, ids, 40) for ids in prompts]
    eos = full[0][7]  # the 8th token of row 0 becomes EOS
    refs = [hf_greedy(model, ids, 40, eos=eos) for ids in prompts]
    outs = eng.generate_batch(prompts, 40, method="eagle", eos_token_ids=[eos])
    for o, ref in zip(outs, refs):
        assert o.token_ids == ref
        assert o.finish_reason == ("eos" if ref[-1] == eos else "length")
    assert outs[0].finish_reason == "eos" and len(outs[0].token_ids) <= 8


@pytest.mark.parametrize("method", ["eagle", "vanilla"])
def test_batch_returns_the_features_of_every_fed_token(tiny_pair, method):
    """return_features: prompt + tokens[:-1], equal to one plain forward over them, also when a row
    stops at an EOS in the middle of an accepted path."""
    model, head = tiny_pair
    eng = Engine(model, head, tree="paper")
    eos = hf_greedy(model, PROMPTS[0], 40)[6]
    outs = eng.generate_batch(PROMPTS, 40, method=method, eos_token_ids=[eos], return_features=True)
    assert outs[0].finish_reason == "eos"
    for ids, o in zip(PROMPTS, outs):
        seq = ids + o.token_ids[:-1]
        assert o.features.shape == (len(seq), model.config.hidden_size)
        with torch.no_grad():
            want = model.get_decoder()(input_ids=torch.tensor([seq], device=model.device)).last_hidden_state[0]
        torch.testing.assert_close(o.features, want, atol=1e-4, rtol=1e-4)
    assert all(o.features is None for o in eng.generate_batch(PROMPTS, 5, method=method))


def test_batch_rejects_dynamic_trees(tiny_pair):
    model, head = tiny_pair
    with pytest.raises(EaglespecError, match="dynamic"):
        Engine(model, head, tree="dynamic").generate_batch([[3], [4]], 5)
    assert len(Engine(model, head, tree="dynamic").generate_batch([[3]], 5)[0].token_ids) == 5


def test_batch_sampling_law_of_first_three_tokens():
    """Row 0's law in a ragged batch of two (the other row longer, advancing differently)."""
    V, model, head, sp = law_setup()
    ids = [2, 5, 3]
    law = exact_three_token_law(model, ids, sp).flatten()
    eng = Engine(model, head, tree=[[0], [1], [0, 0], [0, 1], [1, 0]])
    assert_law(lambda s: eng.generate_batch([ids, [4, 4, 6, 1, 7, 2]], 3, sampling=sp, seed=s)[0].token_ids,
               law, V, 3000)


# -- input modes (paper Fig. 8): what the head reads while drafting --------------------------------
MODES = ["feature+shifted_token", "feature+unshifted_token", "feature", "token"]


def mode_head(model, mode: str) -> EagleDraftHead:
    head = EagleDraftHead(model.config, input_mode=mode).bind(model)
    head.load_state_dict(good_head(model).state_dict(), strict=False)
    return head.eval()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tree", ["paper", "dynamic:3,2,6"])
def test_each_input_mode_drafts_from_what_it_says_and_stays_lossless(mode, tree):
    """The committed pairs after the prefill, and every tree level: f_j with t_{j+1} (EAGLE: a node's
    own token beside its parent's feature), t_j (the parent's token), or one input zeroed; checked on
    the tokens and tensors the head reads. Greedy output is vanilla's in every mode."""
    model = tiny_target("llama")
    head = mode_head(model, mode)
    H, emb = model.config.hidden_size, model.get_input_embeddings()
    calls: list[torch.Tensor] = []  # the token ids of each head call
    forward = head.forward
    head.forward = lambda f, tokens, *a, **k: calls.append(tokens.clone()) or forward(f, tokens, *a, **k)
    fc_in: list[torch.Tensor] = []
    head.fc.register_forward_pre_hook(lambda mod, args: fc_in.append(args[0].detach().clone()))
    ids = PROMPTS[2]
    eng = Engine(model, head, tree=tree)
    out = eng.generate(ids, 30)
    assert out.token_ids == hf_greedy(model, ids, 30)
    root = out.token_ids[0]
    with torch.no_grad():
        f = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    unshifted = mode == "feature+unshifted_token"
    want = ids if unshifted else ids[1:] + [root]
    assert calls[0][0].tolist() == want  # the prompt's pairs
    torch.testing.assert_close(fc_in[0][0, :, :H], torch.zeros_like(f) if mode == "token" else f,
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fc_in[0][0, :, H:], torch.zeros_like(f) if mode == "feature" else emb(torch.tensor(want)),
                               atol=1e-6, rtol=1e-6)
    # the first round's second level: each depth-1 node reads its own token, or (unshifted) the root
    level1 = calls[1][0].tolist()
    assert (set(level1) == {root}) == unshifted
    assert max(out.stats.accept_lengths) > 1 or mode == "feature"


@pytest.mark.parametrize("mode", MODES)
def test_every_input_mode_drafts_in_c_too(monkeypatch, mode):
    """The C draft step reads whichever token the loop passes (t_j for the unshifted ablation), and
    a packed ablation head has its unused fc columns zeroed: every mode runs there (so speeds
    compare), its output vanilla's."""
    from eaglespec.cpu import kernels
    from eaglespec.cpu.quant import pack_target

    if not kernels.draft_available():
        pytest.skip("eaglespec's AVX-512 kernels are not built here")
    model = tiny_target("llama")
    ids = PROMPTS[0]
    head = mode_head(model, mode)
    head.set_draft_vocab(torch.arange(model.config.vocab_size))  # the C step drafts over a draft vocabulary
    with torch.no_grad():  # both halves of fc matter
        head.fc.weight[:, : model.config.hidden_size].normal_(0, 0.01)
    pack_target(model)
    eng = Engine(model, head, tree="paper")
    fed: list[list[int]] = []
    step = eng.head.accel.draft_step
    monkeypatch.setattr(eng.head.accel, "draft_step",
                        lambda f, tokens, *a, **kw: fed.append(list(tokens)) or step(f, tokens, *a, **kw))
    out = eng.generate(ids, 30)
    assert out.token_ids == eng.generate(ids, 30, method="vanilla").token_ids
    assert eng.head.accel.step_spec() is not None  # the levels ran in C
    H = model.config.hidden_size
    x = torch.randn(3, 2 * H)
    with torch.no_grad():  # the packed fc ignores the input the mode zeroes, as the C step needs
        if mode == "feature":
            torch.testing.assert_close(head.fc(x), head.fc(torch.cat([x[:, :H], torch.zeros(3, H)], -1)))
        if mode == "token":
            torch.testing.assert_close(head.fc(x), head.fc(torch.cat([torch.zeros(3, H), x[:, H:]], -1)))
    unshifted = mode == "feature+unshifted_token"
    assert fed[0] == (ids if unshifted else ids[1:] + [out.token_ids[0]])  # the prompt's pairs
    assert (set(fed[1]) == {out.token_ids[0]}) == unshifted  # level 1: the root, or the nodes' own tokens
    assert max(out.stats.accept_lengths) > 1 or mode == "feature"


# -- continuous batching: sequences join and leave a running batch at round boundaries ---------
def run_continuous(cb: ContinuousBatch, arrivals: dict[int, list[tuple[int, list[int], int]]],
                   cancel: dict[int, int] | None = None) -> tuple[dict[int, list[int]], dict[int, str], list[int]]:
    """Step `cb` until empty; `arrivals[step]` join before that step, `cancel[key]` leaves before
    that step. Returns tokens and finish reasons per key, and the batch size of every step."""
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    sizes, step = [], 0
    while len(cb) or any(s >= step for s in arrivals):
        for key, ids, n in arrivals.get(step, []):
            cb.add(key, ids, n)
            tokens[key] = []
        for key, at in (cancel or {}).items():
            if at == step:
                cb.cancel(key)
        sizes.append(len(cb))
        for key, new, reason in cb.step():
            assert key not in reasons, "an event after the finish"
            tokens[key] += new
            if reason is not None:
                reasons[key] = reason
        step += 1
    return tokens, reasons, sizes


@pytest.mark.parametrize("tree,batch_tree", [("paper", "paper"), ("dynamic:3,2,6+lookup", "chain:2"),
                                             ("chain:3", None)])
def test_continuous_batch_rows_equal_their_own_greedy_decoding(tiny_pair, tree, batch_tree):
    """Rows join a running batch at different rounds with different budgets and leave at their own
    end; each row's tokens are its own greedy decoding, whatever ran beside it (one row alone drafts
    with the engine's tree, several with the batch's tree or plain batched steps)."""
    model, head = tiny_pair
    eng = Engine(model, head, tree=tree)
    batch = None if batch_tree is None else Engine(model, head, tree=batch_tree)
    prompts = PROMPTS + [[40, 41], [8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 9]]
    budgets = [30, 12, 25, 40, 20]
    full = [hf_greedy(model, ids, n) for ids, n in zip(prompts, budgets)]
    eos = full[3][9]
    refs = [hf_greedy(model, ids, n, eos=eos) for ids, n in zip(prompts, budgets)]
    cb = ContinuousBatch(eng, eos_token_ids=[eos], batch=batch)
    arrivals = {0: [(0, prompts[0], budgets[0])], 2: [(1, prompts[1], budgets[1]), (2, prompts[2], budgets[2])],
                5: [(3, prompts[3], budgets[3])], 30: [(4, prompts[4], budgets[4])]}
    tokens, reasons, sizes = run_continuous(cb, arrivals)
    assert [tokens[k] for k in range(5)] == refs
    assert reasons[3] == "eos" and all(reasons[k] == "length" for k in (0, 1, 2, 4) if refs[k][-1] != eos)
    assert max(sizes) >= 3 and 1 in sizes[1:]  # they really shared rounds, and one ran alone too
    assert cb.run is None and not len(cb)
    vanilla = ContinuousBatch(eng, method="vanilla", eos_token_ids=[eos])
    assert [run_continuous(vanilla, arrivals)[0][k] for k in range(5)] == refs


def test_continuous_batch_cancel_and_refusals(tiny_pair):
    model, head = tiny_pair
    eng = Engine(model, head, tree="paper")
    cb = ContinuousBatch(eng, batch=Engine(model, head, tree="chain:2"))
    tokens, reasons, _ = run_continuous(cb, {0: [(0, PROMPTS[0], 40), (1, PROMPTS[1], 40)]}, cancel={0: 3})
    assert 0 not in reasons and 0 < len(tokens[0]) < 40  # no event after the cancel
    assert tokens[1] == hf_greedy(model, PROMPTS[1], 40)
    with pytest.raises(EaglespecError, match="empty prompt"):
        cb.add(5, [], 3)
    cb.add(5, [3], 3)
    with pytest.raises(EaglespecError, match="already"):
        cb.add(5, [4], 3)
    with pytest.raises(EaglespecError, match="static tree"):
        ContinuousBatch(eng, batch=Engine(model, head, tree="dynamic"))


def test_continuous_batch_sampling_law_of_a_row_that_joins_late():
    """Row 0's law when it joins a batch whose other row has run for two rounds already (the batch
    tree drafts sampled nodes for both)."""
    V, model, head, sp = law_setup()
    ids = [2, 5, 3]
    law = exact_three_token_law(model, ids, sp).flatten()
    eng = Engine(model, head, tree=[[0], [1], [0, 0]], sampled_tree=None)
    batch = Engine(model, head, tree=[[0], [1], [0, 0], [0, 1], [1, 0]], sampled_tree=None)

    def sample(seed: int) -> list[int]:
        cb = ContinuousBatch(eng, sp, batch=batch, seed=seed)
        return run_continuous(cb, {0: [(1, [4, 4, 6, 1, 7, 2], 12)], 2: [(0, ids, 3)]})[0][0]

    assert_law(sample, law, V, 2000)


@pytest.mark.parametrize("tree", ["paper", "dynamic:3,2,6"])
def test_fused_head_reads_the_targets_aux_layers(tiny_pair, tree):
    """EAGLE-3 fusion: a head given aux layers starts exactly as it was (fuse = 0); once `fuse`
    is non-zero the aux hidden states change its predictions, the engine feeds it those layers
    (its drafts differ from the plain head's), and greedy output is still vanilla's; no hook stays
    on the target's layers between forwards (vanilla decoding on the same model must not pay for them)."""
    model, head = tiny_pair
    ids = torch.tensor([PROMPTS[2]], device=model.device)
    hs = model.model(input_ids=ids, output_hidden_states=True).hidden_states
    f, wide = hs[-1], torch.cat([hs[-1], hs[1]], -1)
    pos, tok = torch.arange(ids.shape[1], device=model.device)[None], torch.roll(ids, -1, 1)
    with torch.no_grad():
        plain = head(f, tok, pos)
        head.add_aux_layers([1])
        torch.testing.assert_close(head(wide, tok, pos), plain, atol=0, rtol=0)
        head.fuse.weight.normal_(0, 0.02)
        assert not torch.allclose(head(wide, tok, pos), plain, atol=1e-3)
        torch.testing.assert_close(head(f, tok, pos), plain)  # a drafted node (width H) has no aux
    eng = Engine(model, head, tree=tree)
    draft = eng.generate(PROMPTS[2], 40).stats
    for p in PROMPTS:
        assert eng.generate(p, 40, method="eagle").token_ids == hf_greedy(model, p, 40)
    assert not any(layer._forward_pre_hooks for layer in model.model.layers)
    if tree == "paper":  # ragged batch rows carry their aux features too
        outs = eng.generate_batch(PROMPTS, 30)
        assert [o.token_ids for o in outs] == [hf_greedy(model, p, 30) for p in PROMPTS]
    with torch.no_grad():
        head.fuse.weight.zero_()
    assert eng.generate(PROMPTS[2], 40).stats.accept_lengths != draft.accept_lengths


def test_fused_head_round_trip_and_fit(tiny_pair, tmp_path):
    model, head = tiny_pair
    head.add_aux_layers([0, 2])
    with torch.no_grad():
        head.fuse.weight.normal_()
    head.save_pretrained(tmp_path / "h")
    back = EagleDraftHead.from_pretrained(tmp_path / "h", model)
    assert back.aux_layers == [0, 2] and back.feature_width == 3 * model.config.hidden_size
    torch.testing.assert_close(back.fuse.weight, head.fuse.weight)
    with pytest.raises(EaglespecError, match="already fuses"):
        back.add_aux_layers([1])
    deep = tiny_target("llama", layers=1)
    with pytest.raises(EaglespecError, match="aux layer 2"):
        EagleDraftHead.from_pretrained(tmp_path / "h", deep)


# -- the pure architectures: official EAGLE-1's head and EAGLE-3's --------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_each_architecture_decodes_losslessly_with_every_tree_and_kernel(family, arch):
    """An eagle1 and an eagle3 head (trained for a moment, so they accept): greedy output equals
    the target's with static, dynamic (+lookup) and chain trees, batched and continuously batched,
    on the torch path and on eaglespec's packed CPU kernels."""
    from eaglespec.cpu import kernels
    from eaglespec.cpu.quant import pack_target

    from conftest import trained_head

    model = tiny_target(family)
    head = trained_head(model, arch, PROMPTS)
    refs = [hf_greedy(model, p, 40) for p in PROMPTS]
    for packed in (False, True):
        if packed:
            if not kernels.available():
                continue
            pack_target(model)
        for tree in ("paper", "chain:3", "dynamic:3,2,6+lookup"):
            eng = Engine(model, head, tree=tree)
            outs = [eng.generate(p, 40) for p in PROMPTS]
            assert [o.token_ids for o in outs] == refs, (packed, tree)
            assert max(a for o in outs for a in o.stats.accept_lengths) > 2  # drafts really accepted
        assert [o.token_ids for o in Engine(model, head, tree="paper").generate_batch(PROMPTS, 30)] == \
            [r[:30] for r in refs]
        cb = ContinuousBatch(Engine(model, head, tree="paper"), batch=Engine(model, head, tree="chain:2"))
        tokens, _, _ = run_continuous(cb, {0: [(0, PROMPTS[0], 30)], 2: [(1, PROMPTS[2], 20)]})
        assert tokens == {0: refs[0][:30], 1: refs[2][:20]}
    assert head.accel is not None or not kernels.available()


def test_sampling_law_with_an_eagle3_head():
    """An eagle3 head drafts over its own LM head's vocabulary (here half the target's): the law of
    the first three tokens is still the target's, enumerated exactly."""
    from conftest import trained_head

    V, model, _, sp = law_setup()
    head = EagleDraftHead(model.config, arch="eagle3", aux_layers=[0, 1, 2], draft_vocab=torch.arange(0, V, 2))
    head.bind(model).warm_start(model)
    trained = trained_head(model, "eagle3", [[2, 5, 3]], steps=60)
    with torch.no_grad():  # the trained layer, the draft vocabulary's rows of its LM head
        for name, p in head.named_parameters():
            src = dict(trained.named_parameters())[name]
            p.copy_(src[::2] if name == "draft_lm_head.weight" else src)
    ids = [2, 5, 3]
    law = exact_three_token_law(model, ids, sp).flatten()
    eng = Engine(model, head.eval(), tree="dynamic:3,3,7", draft_sampling="sample", costs=synthetic_costs(0.0, 0.0))
    assert_law(lambda s: eng.generate(ids, 3, sampling=sp, seed=s).token_ids, law, V, 3000)


def test_architecture_arguments_are_checked():
    model = tiny_target("llama")
    with pytest.raises(ValueError, match="arch must be one of"):
        EagleDraftHead(model.config, arch="eagle2")
    with pytest.raises(ValueError, match="no aux layers"):
        EagleDraftHead(model.config, arch="eagle1", aux_layers=[1])
    with pytest.raises(ValueError, match="one layer"):
        EagleDraftHead(model.config, arch="eagle3", aux_layers=[0, 1, 2], num_layers=2)
    with pytest.raises(ValueError, match="too shallow"):
        EagleDraftHead(model.config, arch="eagle3")  # a 2-layer target has no EAGLE-3 default layers
    head = EagleDraftHead(model.config, arch="eagle3", aux_layers=[0, 1, 2]).bind(model)
    with pytest.raises(EaglespecError, match="cannot change"):
        head.set_draft_vocab(torch.arange(10))
    with pytest.raises(EaglespecError, match="only a hybrid head"):
        head.grow(2)
    assert not head.predicts_features and head.feature_width == 4 * model.config.hidden_size
