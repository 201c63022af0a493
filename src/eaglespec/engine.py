"""The one decode loop: prefill -> (draft tree -> verify in one pass -> accept -> compact) ...

``method="vanilla"`` runs the same loop with an empty tree: one token per target forward, the
same cache, the same sampling code. That is the baseline every speedup is measured against.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from transformers import PreTrainedModel

from .cache import KVCache
from .errors import EaglespecError
from .head import EagleDraftHead
from .costmodel import CostProfile, load_or_measure
from .tree import DynamicTree, TreeBuffers, build_tree, float_mask, parse_spec, paths_of, prefix_tree_mask, select_nodes
from .verify import SamplingParams, greedy_accept, sample_accept, target_probs

DRAFT_SAMPLING = ("topk", "sample")


@dataclass
class GenerationStats:
    rounds: int = 0
    new_tokens: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per verify round
    prefill_time_s: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    time_s: float = 0.0
    # n-alpha: at a tree position reached with n draft-predicted features upstream, was a child accepted?
    alpha_accepted: list[int] = field(default_factory=list)
    alpha_total: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.time_s if self.time_s > 0 else 0.0

    @property
    def n_alpha(self) -> list[float | None]:
        return [a / t if t else None for a, t in zip(self.alpha_accepted, self.alpha_total)]

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds, "new_tokens": self.new_tokens, "tau": self.tau,
            "accept_lengths": self.accept_lengths, "time_s": self.time_s, "tokens_per_s": self.tokens_per_s,
            "prefill_time_s": self.prefill_time_s, "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s, "n_alpha": self.n_alpha,
            "alpha_accepted": self.alpha_accepted, "alpha_total": self.alpha_total,
        }


@dataclass
class GenerationOutput:
    token_ids: list[int]
    finish_reason: str  # "eos" | "length" | "context"
    stats: GenerationStats


def sample_without_replacement(q: torch.Tensor, k: int, gen: torch.Generator | None) -> torch.Tensor:
    """k draws per row of q (R, V) without replacement, in draw order (Gumbel top-k). When a row has
    fewer than k non-zero entries, the extra picks are zero-probability tokens chosen
    deterministically; `sibling_q` then gives them a one-hot q, which is their true law."""
    u = torch.rand(q.shape, generator=gen, device=q.device).clamp_(1e-20, 1.0)
    keys = q.log() - (-u.log()).log()
    return torch.topk(keys, k, dim=-1).indices


def sibling_q(q: torch.Tensor, earlier: list[int], token: int) -> torch.Tensor | None:
    """The distribution a sibling was drawn from: q without the earlier siblings, renormalised
    (None = one-hot: the pick was deterministic)."""
    qc = q.clone()
    if earlier:
        qc[earlier] = 0.0
    total = float(qc.sum())
    if total <= 0.0 or float(qc[token]) <= 0.0:
        return None
    return qc / total


class Engine:
    """EAGLE (and vanilla) generation for one target model and an optional draft head. Batch size 1."""

    def __init__(self, model: PreTrainedModel, head: EagleDraftHead | None = None,
                 tree: str | list[list[int]] | DynamicTree = "paper", draft_sampling: str = "sample",
                 costs: CostProfile | None = None):
        if draft_sampling not in DRAFT_SAMPLING:
            raise ValueError(f"draft_sampling must be one of {DRAFT_SAMPLING}")
        if getattr(model.config, "final_logit_softcapping", None):
            raise EaglespecError("models with final logit soft-capping are not supported")
        self.model = model.eval()
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.head = head.eval() if head is not None else None
        spec = parse_spec(tree)
        # a static tree is built once; a dynamic one is regrown by the head every round
        self.dynamic: DynamicTree | None = spec if isinstance(spec, DynamicTree) else None
        self.tree: TreeBuffers | None = None if self.dynamic else build_tree(spec)
        self.plain: TreeBuffers = build_tree("chain:0")  # root only: one token per forward
        self.costs = costs  # the machine's cost curve, for `auto` (measured on first use if None)
        self._calib = [1.0, 1.0]  # decayed sums of (accepted - 1, predicted): head-confidence calibration
        self.draft_sampling = draft_sampling
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.max_context = int(getattr(model.config, "max_position_embeddings", 2048))
        self._cuda = self.device.type == "cuda"

    # -- helpers ----------------------------------------------------------------------------------
    def _clock(self) -> float:
        if self._cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _target(self, ids: list[int], start: int, cache: KVCache, mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Run the target on new tokens; returns the final-norm hidden states (features), (q, H)."""
        x = torch.tensor([ids], device=self.device)
        if positions is None:
            positions = torch.arange(start, start + len(ids), device=self.device)
        out = self.decoder(input_ids=x, position_ids=positions[None], attention_mask=mask,
                           past_key_values=cache, use_cache=True)
        return out.last_hidden_state[0]

    def _choose(self, logits: torch.Tensor, sp: SamplingParams, gen: torch.Generator | None) -> int:
        if sp.greedy:
            return int(logits.argmax(-1))
        return int(torch.multinomial(target_probs(logits, sp), 1, generator=gen))

    # -- public API -------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, input_ids: list[int], max_new_tokens: int = 128, sampling: SamplingParams | None = None,
                 method: str = "eagle", seed: int | None = None, eos_token_ids: list[int] | None = None,
                 on_tokens: Callable[[list[int]], None] | None = None) -> GenerationOutput:
        stats = GenerationStats()
        tokens: list[int] = []
        reason = "length"
        for new, reason in self.stream(input_ids, max_new_tokens, sampling, method, seed, eos_token_ids, stats):
            tokens += new
            if on_tokens is not None:
                on_tokens(new)
        return GenerationOutput(tokens, reason, stats)

    def check_request(self, input_ids: list[int], max_new_tokens: int, method: str) -> None:
        if not input_ids:
            raise EaglespecError("empty prompt: give at least one token")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise EaglespecError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens}")
        if len(input_ids) >= self.max_context:
            raise EaglespecError(f"prompt is {len(input_ids)} tokens; the model's context is {self.max_context}")
        if method not in ("eagle", "vanilla"):
            raise EaglespecError(f"method must be 'eagle' or 'vanilla', got {method!r}")
        if method == "eagle" and self.head is None:
            raise EaglespecError("method 'eagle' needs a draft head")

    @torch.inference_mode()
    def stream(self, input_ids: list[int], max_new_tokens: int = 128, sampling: SamplingParams | None = None,
               method: str = "eagle", seed: int | None = None, eos_token_ids: list[int] | None = None,
               stats: GenerationStats | None = None) -> Iterator[tuple[list[int], str]]:
        """Yields (new token ids, finish reason so far) once per target forward."""
        sp = sampling or SamplingParams()
        self.check_request(input_ids, max_new_tokens, method)
        stats = stats if stats is not None else GenerationStats()
        eos = set(eos_token_ids or [])
        gen = None
        if not sp.greedy:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed if seed is not None else torch.seed())
        eagle = method == "eagle" and (self.dynamic is not None or self.tree.n > 1)
        if eagle and self.dynamic is not None and self.dynamic.auto and self.costs is None:
            self.costs = load_or_measure(self)
        depth = self.dynamic.depth if self.dynamic else self.tree.max_depth
        max_nodes = (self.dynamic.total_tokens or self.dynamic.max_nodes) if self.dynamic else self.tree.n
        cache = KVCache(min(len(input_ids) + max_new_tokens, self.max_context) + max_nodes)
        t0 = self._clock()

        # Prefill: the whole prompt, features f_1..f_N, then the first new token (the first root).
        feats = self._target(input_ids, 0, cache)
        root = self._choose(self.lm_head(feats[-1]), sp, gen)
        n_ctx = len(input_ids)  # tokens in the target cache; the root is not in it yet
        if eagle:
            head_cache = KVCache(cache.max_len)
            pending = (feats, input_ids[1:] + [root])  # head inputs (f_j, t_{j+1}) not yet in head_cache
        stats.prefill_time_s = self._clock() - t0
        emitted = 0

        def emit(new: list[int]) -> tuple[list[int], str | None]:
            nonlocal emitted
            reason = None
            for i, t in enumerate(new):
                if t in eos:
                    new, reason = new[: i + 1], "eos"
                    break
            if emitted + len(new) >= max_new_tokens:
                new, reason = new[: max_new_tokens - emitted], reason or "length"
            emitted += len(new)
            stats.new_tokens = emitted
            return new, reason

        new, reason = emit([root])
        stats.time_s = self._clock() - t0
        yield new, reason or "length"
        while reason is None:
            if n_ctx >= self.max_context:  # no position left for the root
                reason = "context"
                break
            # near the context limit the deepest tree node would overflow the positions: go plain
            use_tree = eagle and n_ctx + depth < self.max_context
            ta = self._clock()
            if use_tree:
                node_tokens, node_q, cur = self._draft(pending, head_cache, sp, gen, ta)
            else:
                node_tokens, node_q, cur = [root], [None], self.plain
            tb = self._clock()
            path, bonus, feats = self._verify(node_tokens, node_q, cur, n_ctx, cache, sp, gen, stats)
            keep = [0] + path
            cache.compact(n_ctx, torch.tensor(keep, device=self.device))
            n_ctx += len(keep)
            accepted = [node_tokens[i] for i in path] + [bonus]
            if eagle:
                pending = (feats[keep], accepted) if use_tree else (
                    torch.cat([pending[0], feats[keep]]), pending[1] + accepted)
            root = bonus
            stats.rounds += 1
            stats.accept_lengths.append(len(accepted))
            if use_tree and self.dynamic is not None:
                self._calibrate(len(path))
            stats.draft_time_s += tb - ta
            stats.verify_time_s += self._clock() - tb
            new, reason = emit(accepted)
            stats.time_s = self._clock() - t0
            yield new, reason or "length"
        stats.time_s = self._clock() - t0
        if reason == "context":
            yield [], "context"

    # -- drafting ---------------------------------------------------------------------------------
    def _draft(self, pending: tuple[torch.Tensor, list[int]], head_cache: KVCache, sp: SamplingParams,
               gen: torch.Generator | None, t_round: float) -> tuple[list[int], list[torch.Tensor | None], TreeBuffers]:
        """Feed the newly committed (feature, next token) pairs to the head, then grow this round's tree.
        Returns the node tokens, the law each was drawn from (None = chosen deterministically), the tree."""
        feats, toks = pending
        committed = head_cache.get_seq_length()
        pos = torch.arange(committed, committed + len(toks), device=self.device)
        out = self.head(feats[None].to(self.dtype), torch.tensor([toks], device=self.device), pos[None],
                        cache=head_cache)
        committed += len(toks)
        if self.dynamic is not None:
            result = self._grow_dynamic(out[0, -1:], toks[-1], committed, head_cache, sp, t_round)
        else:
            result = self._grow_static(out[0, -1:], toks[-1], committed, head_cache, sp, gen)
        head_cache.crop(committed)
        return result

    def _head_level(self, parent_f: torch.Tensor, tokens: list[int], committed: int, depth: int,
                    allowed: torch.Tensor, head_cache: KVCache) -> torch.Tensor:
        """One head forward over all nodes of one depth (tree attention over earlier levels' entries)."""
        toks = torch.tensor([tokens], device=self.device)
        pos = torch.full((1, len(tokens)), committed + depth - 1, device=self.device)
        mask = float_mask(prefix_tree_mask(allowed.to(self.device), committed), self.dtype)
        return self.head(parent_f[None], toks, pos, mask, head_cache)[0]

    def _grow_static(self, root_f: torch.Tensor, root: int, committed: int, head_cache: KVCache, sp: SamplingParams,
                     gen: torch.Generator | None) -> tuple[list[int], list[torch.Tensor | None], TreeBuffers]:
        head, tree = self.head, self.tree
        node_feat: dict[int, torch.Tensor] = {0: root_f}
        node_tokens: list[int] = [root] + [0] * (tree.n - 1)
        node_q: list[torch.Tensor | None] = [None] * tree.n
        for d in range(tree.max_depth):
            nodes = tree.expand_nodes[d]
            if d == 0:
                f = root_f
            else:
                parents_f = torch.cat([node_feat[tree.parent[i]] for i in nodes])
                f = self._head_level(parents_f, [node_tokens[i] for i in nodes], committed, d, tree.draft_masks[d],
                                     head_cache)
                for j, i in enumerate(nodes):
                    node_feat[i] = f[j : j + 1]
            logits = head.logits(f).float()  # (len(nodes), draft vocab)
            k = tree.expand_topk[d]
            if sp.greedy or self.draft_sampling == "topk":
                picks = head.to_target_ids(torch.topk(logits, k, dim=-1).indices).tolist()
                qs = None
            else:
                q_draft = torch.softmax(logits / sp.temperature, -1)
                picks = head.to_target_ids(sample_without_replacement(q_draft, k, gen)).tolist()
                qs = q_draft if head.d2t is None else torch.zeros(
                    len(nodes), head.vocab_size, device=q_draft.device).index_copy_(1, head.d2t, q_draft)
            for j, i in enumerate(nodes):
                for c in tree.children[i]:
                    r = tree.rank[c]
                    node_tokens[c] = picks[j][r]
                    if qs is not None:
                        node_q[c] = sibling_q(qs[j], picks[j][:r], picks[j][r])
        return node_tokens, node_q, tree

    def _grow_dynamic(self, root_f: torch.Tensor, root: int, committed: int, head_cache: KVCache,
                      sp: SamplingParams, t_round: float) -> tuple[list[int], list[torch.Tensor | None], TreeBuffers]:
        """EAGLE-2: candidates are each expanded node's top-k children, scored by cumulative draft
        log-probability; the best `top_k` of a depth are expanded next, the best overall verified.
        Candidates are deterministic given the head, so they carry a one-hot law (q = None)."""
        head, dyn = self.head, self.dynamic
        k, temp = dyn.top_k, (1.0 if sp.greedy else sp.temperature)
        toks: list[int] = []
        parents: list[int] = []  # -1 = the root
        ranks: list[int] = []
        scores: list[float] = []
        feat: dict[int, torch.Tensor] = {-1: root_f}
        slots: list[int] = []  # candidates with a head-cache entry, in cache order
        frontier, f, level_start = [-1], root_f, 0
        for d in range(dyn.depth):
            if d > 0:
                level = range(level_start, len(toks))
                frontier = sorted(level, key=lambda i: (-scores[i], i))[:k]
                if dyn.auto and not self._worth_a_level(scores, parents, frontier, t_round):
                    break
                slots += frontier
                allowed = torch.zeros(len(frontier), len(slots), dtype=torch.bool)
                col = {c: j for j, c in enumerate(slots)}
                for r, i in enumerate(frontier):
                    j = i
                    while j >= 0:
                        allowed[r, col[j]] = True
                        j = parents[j]
                f = self._head_level(torch.cat([feat[parents[i]] for i in frontier]), [toks[i] for i in frontier],
                                     committed, d, allowed, head_cache)
                for r, i in enumerate(frontier):
                    feat[i] = f[r : r + 1]
            top = torch.topk(torch.log_softmax(head.logits(f).float() / temp, -1), k, dim=-1)
            vals, ids = top.values.tolist(), head.to_target_ids(top.indices).tolist()
            level_start = len(toks)
            for r, pi in enumerate(frontier):
                base = 0.0 if pi < 0 else scores[pi]
                for c in range(k):
                    toks.append(ids[r][c])
                    parents.append(pi)
                    ranks.append(c)
                    scores.append(base + vals[r][c])
        if dyn.auto:
            gains = sorted((math.exp(x) * self._calib_ratio() for x in scores), reverse=True)
            budget, _ = self.costs.best_size(gains, self._clock() - t_round)
        else:
            budget = dyn.total_tokens - 1
        chosen = select_nodes(scores, parents, budget)
        tree = build_tree(paths_of(chosen, parents, ranks)) if chosen else self.plain
        # build_tree orders nodes by (depth, path); map each back to its candidate
        by_path = {tuple(p): i for p, i in zip(paths_of(chosen, parents, ranks), chosen)}
        node_tokens = [root] + [toks[by_path[p]] for p in tree.paths[1:]]
        self._predicted = sum(math.exp(scores[i]) for i in chosen)
        return node_tokens, [None] * tree.n, tree

    def _calib_ratio(self) -> float:
        accepted, predicted = self._calib
        return min(2.0, max(0.2, accepted / predicted))

    def _calibrate(self, accepted: int) -> None:
        """Track how the head's cumulative confidence relates to what the target really accepts."""
        decay = 0.98
        self._calib = [decay * self._calib[0] + accepted, decay * self._calib[1] + self._predicted]

    def _worth_a_level(self, scores: list[float], parents: list[int], frontier: list[int], t_round: float) -> bool:
        """Would one more draft level raise this round's expected tokens per second? Each frontier
        node is assumed to get a best child as likely as the node was given its own parent."""
        c = self._calib_ratio()
        gains = sorted((math.exp(x) * c for x in scores), reverse=True)
        spent = self._clock() - t_round
        _, now = self.costs.best_size(gains, spent)
        guess = [math.exp(2 * scores[i] - (scores[parents[i]] if parents[i] >= 0 else 0.0)) * c for i in frontier]
        _, then = self.costs.best_size(sorted(gains + guess, reverse=True), spent + self.costs.draft_level_s)
        return then > now

    # -- verification -----------------------------------------------------------------------------
    def _verify(self, node_tokens: list[int], node_q: list[torch.Tensor | None], tree: TreeBuffers, n_ctx: int,
                cache: KVCache, sp: SamplingParams, gen: torch.Generator | None,
                stats: GenerationStats) -> tuple[list[int], int, torch.Tensor | None]:
        """One target forward over root + all tree nodes; returns (accepted nodes, bonus, features)."""
        if tree.n == 1:
            feats = self._target(node_tokens, n_ctx, cache)
        else:
            allowed = prefix_tree_mask(tree.ancestor_mask.to(self.device), n_ctx)
            positions = tree.position_offsets.to(self.device) + n_ctx
            feats = self._target(node_tokens, n_ctx, cache, float_mask(allowed, self.dtype), positions)
        logits = self.lm_head(feats)
        if sp.greedy:
            path, bonus = greedy_accept(logits.argmax(-1).tolist(), node_tokens, tree.children)
        else:
            path, bonus = sample_accept(target_probs(logits, sp), node_tokens, tree.children, node_q, gen)
        if tree.n > 1:
            self._count_alpha(tree, path, stats)
        return path, bonus, feats

    @staticmethod
    def _count_alpha(tree: TreeBuffers, path: list[int], stats: GenerationStats) -> None:
        # The walk tried children at the root (0 predicted features), then at each accepted node.
        tried = [0] + [n for n in path if tree.children[n]]
        for depth, node in enumerate(tried):
            while len(stats.alpha_total) <= depth:
                stats.alpha_total.append(0)
                stats.alpha_accepted.append(0)
            stats.alpha_total[depth] += 1
            stats.alpha_accepted[depth] += int(depth < len(path))
