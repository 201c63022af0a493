"""Exactness of the acceptance rules, by enumeration where possible and by chi-square elsewhere."""

import pytest
import torch
from scipy.stats import chisquare

from eaglespec.spec.verify import (SamplingParams, check_sampling, greedy_accept, sample_accept, sample_token, speculative_step,
                              target_probs)


def test_greedy_accept_longest_matching_path():
    # root -> children 1 (tok 5), 2 (tok 6); 1 -> 3 (tok 7); 3 -> none
    children = [[1, 2], [3], [], []]
    tokens = [0, 5, 6, 7]
    assert greedy_accept([6, 0, 0, 0], tokens, children) == ([2], 0)
    assert greedy_accept([5, 7, 0, 9], tokens, children) == ([1, 3], 9)
    assert greedy_accept([4, 7, 0, 9], tokens, children) == ([], 4)


def test_target_probs_matches_transformers_warpers():
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    for t, k, p in [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.5, 10, 0.9)]:
        ref = TemperatureLogitsWarper(t)(None, logits.clone())
        if k:
            ref = TopKLogitsWarper(k)(None, ref)
        if p < 1:
            ref = TopPLogitsWarper(p)(None, ref)
        torch.testing.assert_close(target_probs(logits, SamplingParams(t, p, k)), ref.softmax(-1))


@pytest.mark.parametrize("bad", [(-0.1, 1.0, 0), (float("nan"), 1.0, 0), (1.0, 0.0, 0), (1.0, 1.5, 0),
                                 (1.0, 1.0, -1), (1e-40, 1.0, 0), (5e-4, 1.0, 0), (True, 1.0, 0)])
def test_bad_sampling_params(bad):
    with pytest.raises(ValueError):
        check_sampling(*bad)


def step_distribution_by_enumeration(p, q_list, without_replacement):
    """Exact output law when k candidates are drawn from q (with or without replacement) then verified."""
    V = p.numel()
    k = len(q_list)
    out = torch.zeros(V, dtype=torch.float64)

    def rec(i, p_cur, prob, used):
        if i == k:
            out.add_(prob * p_cur)
            return
        q = q_list[i].double().clone()
        if without_replacement and used:
            q[list(used)] = 0
            if q.sum() == 0:
                out.add_(prob * p_cur)
                return
            q = q / q.sum()
        for tok in range(V):
            if q[tok] == 0:
                continue
            acc = min(1.0, float(p_cur[tok] / q[tok]))
            out[tok] += prob * q[tok] * acc
            residual = (p_cur - q).clamp_min(0)
            if residual.sum() > 0 and acc < 1:
                rec(i + 1, residual / residual.sum(), prob * q[tok] * (1 - acc), used | {tok})

    rec(0, p.double(), 1.0, frozenset())
    return out


@pytest.mark.parametrize("without_replacement", [False, True])
def test_multi_round_is_exact_analytically(without_replacement):
    torch.manual_seed(1)
    V = 5
    p = torch.tensor([0.5, 0.2, 0.2, 0.1, 0.0], dtype=torch.float64)
    qs = [torch.tensor([0.1, 0.0, 0.3, 0.3, 0.3], dtype=torch.float64),  # q zero where p is not
          torch.tensor([0.25, 0.25, 0.25, 0.25, 0.0], dtype=torch.float64),
          torch.tensor([0.0, 0.0, 0.0, 0.5, 0.5], dtype=torch.float64)]
    law = step_distribution_by_enumeration(p, qs, without_replacement)
    torch.testing.assert_close(law, p)


def _draw(p, q_list, without_replacement, gen):
    toks, used_q = [], []
    for q in q_list:
        q = q.clone()
        if without_replacement and toks:
            q[toks] = 0
            q = q / q.sum()
        toks.append(int(torch.multinomial(q, 1, generator=gen)))
        used_q.append(q)
    return speculative_step(p, toks, used_q, gen)[1]


@pytest.mark.parametrize("without_replacement", [False, True])
def test_multi_round_chi_square(without_replacement):
    gen = torch.Generator().manual_seed(123)
    p = target_probs(torch.tensor([2.0, 1.0, 0.5, 0.1, -1.0, -3.0]), SamplingParams(1.0, 0.95, 5))
    qs = [torch.tensor([0.05, 0.6, 0.05, 0.1, 0.1, 0.1]), torch.tensor([0.3, 0.3, 0.1, 0.1, 0.1, 0.1]),
          torch.tensor([0.1, 0.0, 0.4, 0.4, 0.1, 0.0])]
    n = 100_000 if not without_replacement else 60_000
    counts = torch.zeros(6)
    for _ in range(n):
        counts[_draw(p, qs, without_replacement, gen)] += 1
    keep = p > 0
    assert counts[~keep].sum() == 0  # top-k / top-p removed tokens never come out
    stat = chisquare(counts[keep].numpy(), (p[keep] * n).numpy())
    assert stat.pvalue > 1e-3, (counts / n, p)


def test_one_hot_candidates_repeated_tokens_exact():
    """Deterministic (top-k) siblings, including a repeated token: exact law by enumeration of r."""
    p = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    for tokens in ([0, 1], [2, 2, 0], [3, 1, 0, 2]):
        out = torch.zeros(4, dtype=torch.float64)
        cur, stay = p.clone(), 1.0
        for t in tokens:
            out[t] += stay * cur[t]
            stay *= 1 - cur[t]
            if stay == 0:
                break
            cur = cur.clone()
            cur[t] = 0
            cur = cur / cur.sum()
        if stay > 0:
            out += stay * cur
        torch.testing.assert_close(out, p)
        # and the implementation follows that law
        gen = torch.Generator().manual_seed(7)
        n = 40_000
        counts = torch.zeros(4)
        for _ in range(n):
            counts[speculative_step(p.float(), tokens, [None] * len(tokens), gen)[1]] += 1
        assert chisquare(counts.numpy(), (p * n).numpy()).pvalue > 1e-3


def test_sample_accept_walks_tree_and_returns_bonus():
    # a tree whose draft tokens are certain under p: everything is accepted, bonus from the leaf
    V = 4
    probs = torch.zeros(3, V)
    probs[0, 2] = 1
    probs[1, 3] = 1
    probs[2, 1] = 1
    path, bonus = sample_accept(probs, [0, 2, 3], [[1], [2], []], [None, None, None], torch.Generator().manual_seed(0))
    assert path == [1, 2] and bonus == 1


def test_sample_token_draws_the_law_and_never_a_zero():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0]) * 7  # unnormalised on purpose
    n = 40_000
    counts = torch.bincount(torch.tensor([sample_token(p, gen) for _ in range(n)]), minlength=6).double()
    want = p.double() / p.sum()
    assert counts[want == 0].sum() == 0
    sigma = (want * (1 - want) / n).sqrt()
    assert ((counts / n - want).abs() <= 4 * sigma + 1e-12).all(), counts / n


@pytest.mark.parametrize("p", [[float("nan"), 0.5, 0.5], [0.0, 0.0, 0.0], [float("inf"), 1.0, 0.0]])
def test_sample_token_refuses_a_law_without_mass_rather_than_answer_past_the_vocabulary(p):
    """NaN, all-zero or infinite entries (logits / a tiny temperature overflowing) cannot be drawn
    from: a clear error, never the id one past the vocabulary that a search over them returns."""
    from eaglespec.errors import EaglespecError

    with pytest.raises(EaglespecError, match="no finite positive mass"):
        sample_token(torch.tensor(p))
    assert SamplingParams(temperature=1e-3).temperature == 1e-3  # the documented minimum is accepted


@pytest.mark.parametrize("u, token", [(0.0, 1), (1.0, 2)])
def test_sample_token_at_the_ends_of_the_unit_interval(monkeypatch, u, token):
    """u = 0 must skip leading zeros, and u = 1 (a closed-interval generator's, e.g. cuRAND's) must
    not run past the last non-zero entry into trailing zeros."""
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.full((1,), u, dtype=torch.float64))
    assert sample_token(torch.tensor([0.0, 0.3, 0.7, 0.0, 0.0])) == token
