"""The one decode loop: prefill -> (draft tree -> verify in one pass -> accept -> compact) ...

``method="vanilla"`` runs the same loop with an empty tree: one token per target forward, the
same cache, the same sampling code. That is the baseline every speedup is measured against.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from transformers import PreTrainedModel

from .cache import KVCache
from .errors import EaglespecError
from .head import EagleDraftHead
from .tree import TreeBuffers, build_tree, float_mask, prefix_tree_mask
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
                 tree: str | list[list[int]] = "paper", draft_sampling: str = "sample"):
        if draft_sampling not in DRAFT_SAMPLING:
            raise ValueError(f"draft_sampling must be one of {DRAFT_SAMPLING}")
        if getattr(model.config, "final_logit_softcapping", None):
            raise EaglespecError("models with final logit soft-capping are not supported")
        self.model = model.eval()
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.head = head.eval() if head is not None else None
        self.tree: TreeBuffers = build_tree(tree)
        self.plain: TreeBuffers = build_tree("chain:0")  # root only: one token per forward
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
        eagle = method == "eagle" and self.tree.n > 1
        tree = self.tree if eagle else self.plain
        cache = KVCache(min(len(input_ids) + max_new_tokens, self.max_context) + tree.n)
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
            use_tree = eagle and n_ctx + tree.max_depth < self.max_context
            ta = self._clock()
            if use_tree:
                node_tokens, node_q = self._draft(pending, head_cache, sp, gen, stats)
            else:
                node_tokens, node_q = [root], [None]
            tb = self._clock()
            cur = tree if use_tree else self.plain
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
               gen: torch.Generator | None, stats: GenerationStats) -> tuple[list[int], list[torch.Tensor | None]]:
        """Feed the newly committed (feature, next token) pairs to the head, then grow the tree level
        by level: one head forward per depth over all nodes of that depth (tree attention)."""
        head, tree = self.head, self.tree
        feats, toks = pending
        committed = head_cache.get_seq_length()
        pos = torch.arange(committed, committed + len(toks), device=self.device)
        out = head(feats[None].to(self.dtype), torch.tensor([toks], device=self.device), pos[None], cache=head_cache)
        committed += len(toks)
        node_feat: dict[int, torch.Tensor] = {0: out[0, -1:]}
        node_tokens: list[int] = [pending[1][-1]] + [0] * (tree.n - 1)
        node_q: list[torch.Tensor | None] = [None] * tree.n
        for d in range(tree.max_depth):
            nodes = tree.expand_nodes[d]
            if d == 0:
                f = node_feat[0]
            else:
                parents_f = torch.cat([node_feat[tree.parent[i]] for i in nodes])
                toks_d = torch.tensor([[node_tokens[i] for i in nodes]], device=self.device)
                pos = torch.full((1, len(nodes)), committed + d - 1, device=self.device)
                allowed = prefix_tree_mask(tree.draft_masks[d].to(self.device), committed)
                f = head(parents_f[None], toks_d, pos, float_mask(allowed, self.dtype), head_cache)[0]
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
        head_cache.crop(committed)
        return node_tokens, node_q

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
