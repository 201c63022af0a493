"""The paper's decode loop: prefill, then rounds of draft -> verify -> accept -> update.

``_decode`` is the loop. Each round the head drafts a tree (`_draft`), the target scores every
node in one forward and the accepted path is chosen greedily or by multi-round speculative
sampling (`_verify`), and the accepted rows stay in the KV cache while their features are queued
for the head (`_update`). The loop asks a `Backend` for its device's fast paths and a
`DraftPolicy` how much to draft; both have plain defaults here, so the algorithm runs on torch
alone.

``method="vanilla"`` runs the same loop with an empty tree: one token per target forward, the
same cache, the same sampling code. That is the baseline every speedup is measured against.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import PreTrainedModel

from ..errors import EaglespecError
from .backend import TORCH, Backend, DraftLevel
from .cache import KVCache
from .head import EagleDraftHead
from .policy import DraftPolicy, Prediction
from .tap import HiddenStateTap
from .tree import (DynamicTree, TreeBuffers, build_tree, float_mask, graft_chain, lineage, parse_spec, paths_of,
                   prefix_tree_mask, prompt_lookup, select_nodes, split_lookup, visible)
from .verify import SEEDS, SamplingParams, greedy_accept, renormalise, sample_accept, sample_token, target_probs

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
    lookup_tokens: int = 0  # accepted tokens that only the prompt-lookup chain proposed
    plain_steps: int = 0  # EAGLE's one-token steps without a draft (`DraftGate`, or the context's end): not rounds

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
            "lookup_tokens": self.lookup_tokens, "plain_steps": self.plain_steps,
        }


@dataclass
class GenerationOutput:
    token_ids: list[int]
    finish_reason: str  # "eos" | "length" | "context"
    stats: GenerationStats
    # with return_features: the target's final-norm hidden states of prompt + token_ids[:-1] (the last
    # token is never fed), fp32 on the CPU -- training data for a head without a second forward pass
    features: torch.Tensor | None = None
    # with return_features and the engine's `sink_layers`: those layers' hidden states, (n, k, H)
    aux: torch.Tensor | None = None


class Draft(NamedTuple):
    """One round's proposal, per row: the node tokens (the root first) and the law each was drawn
    from (None = chosen deterministically); the tree shape all rows share; what the head expects of
    a dynamic tree. With prompt-lookup grafts, `drafted` is the head's own tree inside `tree` and
    `chain` the grafted guesses' node paths."""

    tokens: list[list[int]]
    laws: list[list[torch.Tensor | None]]
    tree: TreeBuffers
    predicted: Prediction | None = None
    drafted: TreeBuffers | None = None
    chain: Sequence[tuple[int, ...]] = ()


@dataclass
class _Row:
    """One sequence of a (possibly batched) decode."""

    index: int  # the caller's key: position in its list of prompts, or a `ContinuousBatch` key
    n_ctx: int  # this row's entries in the target cache (the root is not in it yet)
    root: int  # the last emitted token: the root of the next tree
    stats: GenerationStats
    max_new: int  # this row's token budget
    t0: float  # when its prefill began
    # head inputs not yet in the head's cache: feature chunks (joined only when the head drafts: plain
    # steps would copy the whole backlog each) and their next tokens
    pending: tuple[list[torch.Tensor], list[int]] | None = None
    head_len: int = 0  # this row's committed entries in the head's cache
    emitted: int = 0
    reason: str | None = None
    history: list[int] = field(default_factory=list)  # prompt + emitted tokens (for prompt lookup)


class _Run:
    """What one decode shares across its rounds: the caches (one row per sequence; rows leave when
    done and, in a `ContinuousBatch`, join at round boundaries), the end tokens, the clock."""

    def __init__(self, engines: "Sequence[Engine]", eos_token_ids: list[int] | None, eagle: bool,
                 feature_sink: list[list[torch.Tensor]] | None = None):
        engine = engines[0]
        self.eagle, self.feature_sink = eagle, feature_sink
        self.eos = set(eos_token_ids or [])
        self.max_context = engine.max_context
        # prompt-lookup grafts need one sequence: they run while a single row decodes
        self.lookup = engine.lookup if eagle else 0
        reach = [e.tree_reach() for e in engines]
        self.depth = max([d for d, _ in reach] + [self.lookup])
        self.max_nodes = max(n for _, n in reach) + self.lookup
        self.cache: KVCache | None = None  # made by the first prefill, grown by later ones
        self.head_cache: KVCache | None = None
        self.aux = eagle or (feature_sink is not None and bool(engine.sink_layers))
        self.clock, self.device = engine.clock, engine.device

    def capacity(self, rows: "Sequence[_Row]") -> int:
        """Cache entries the rows can need: + depth + 1, because a row may overshoot its budget by
        one accepted path before it leaves, and the shared write offset (the longest row) keeps
        that length for the rows still running; + a tree's nodes."""
        longest = max(min(r.n_ctx + r.max_new, self.max_context) for r in rows)
        return longest + self.depth + 1 + self.max_nodes

    def emit(self, r: "_Row", new: list[int]) -> tuple[int, list[int], str | None]:
        """The row's new tokens, cut at its budget or its first end-of-sequence token."""
        if r.emitted + len(new) >= r.max_new:  # an EOS past the budget does not count
            new, r.reason = new[: r.max_new - r.emitted], "length"
        for i, t in enumerate(new):
            if t in self.eos:
                new, r.reason = new[: i + 1], "eos"
                break
        r.emitted += len(new)
        r.stats.new_tokens = r.emitted
        r.stats.time_s = self.clock() - r.t0
        return r.index, new, r.reason

    def retire(self, rows: list["_Row"]) -> tuple[list["_Row"], list[tuple[int, list[int], str | None]]]:
        """The rows still running (finished ones leave the batch and its caches), and the events of
        rows that ran out of context."""
        events = []
        for r in rows:
            if r.reason is None and r.n_ctx >= self.max_context:  # no position left for the root
                r.reason = "context"
                events.append((r.index, [], "context"))
        live = [i for i, r in enumerate(rows) if r.reason is None]
        if len(live) < len(rows):
            if live and len(rows) > 1:
                idx = torch.tensor(live, device=self.device)
                self.cache.select_rows(idx)
                if self.head_cache is not None:
                    self.head_cache.select_rows(idx)
            rows = [rows[i] for i in live]
        return rows, events


def random_stream(sp: SamplingParams, seed: int | None, device: torch.device) -> torch.Generator | None:
    """The generator a sampled decode draws from (seeded, or from torch's entropy); None when greedy."""
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed not in SEEDS):
        raise EaglespecError(f"seed must be an integer in {SEEDS.start}..{SEEDS.stop - 1}, got {seed!r}")
    if sp.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else torch.seed())
    return gen


def sample_without_replacement(q: torch.Tensor, k: int, gen: torch.Generator | None,
                               backend: Backend = TORCH) -> torch.Tensor:
    """k draws per row of q (R, V) without replacement, in draw order: on the CPU each by inverse
    CDF from the row without the earlier draws where the backend draws (k uniforms a row), else by
    Gumbel top-k (a uniform per token). When a row has fewer than k non-zero entries, the extra
    picks are zero-probability tokens chosen deterministically; `sibling_q` then gives them a
    one-hot q, which is their true law."""
    if q.device.type == "cpu":
        drawn = backend.draw(q, torch.rand(q.shape[0], k, generator=gen, dtype=torch.float64))
        if drawn is not None:
            return drawn
    u = torch.rand(q.shape, generator=gen, device=q.device).clamp_(1e-20, 1.0)
    keys = q.log() - (-u.log()).log()
    return torch.topk(keys, k, dim=-1).indices


def sibling_q(q: torch.Tensor, earlier: list[int], token: int) -> torch.Tensor | None:
    """The distribution a sibling was drawn from: q without the earlier siblings, renormalised
    (None = one-hot: the pick was deterministic)."""
    qc = q
    if earlier:
        qc = q.clone()
        qc[earlier] = 0.0
    if float(qc[token]) <= 0.0:
        return None
    return renormalise(qc)


LAZY_LM_HEAD_ROWS = 8  # rows off a tree's top path from which verification skips their LM head until read


def first_child_chain(node: int, children: list[list[int]]) -> list[int]:
    """The node and its first child, that child's first child, ...: the drafted top path below it."""
    chain = [node]
    while children[chain[-1]]:
        chain.append(children[chain[-1]][0])
    return chain


class NodeRows:
    """What acceptance reads at each tree node of one sequence (the target's argmax there, or its
    processed law), computed on first use by ``compute(nodes)`` for the node and its first-child
    chain in one call. A walk reads only the root and the nodes it accepts, so most of a wide
    tree's rows never reach the target's LM head (a quarter of a verified row's work on the models
    here). ``ready`` holds values computed beforehand. The LM head kernels sum each row alone, so a
    row's logits are the same bits in any call."""

    def __init__(self, compute: Callable[[list[int]], Sequence], children: list[list[int]], ready: dict | None = None):
        self.compute, self.children, self.values = compute, children, dict(ready or {})

    def __getitem__(self, node: int):
        if node not in self.values:
            chain = [n for n in first_child_chain(node, self.children) if n not in self.values]
            self.values.update(zip(chain, self.compute(chain)))
        return self.values[node]


class Engine:
    """EAGLE (and vanilla) generation for one target model and an optional draft head. `tree` drafts
    every request; `sampled_tree`, if not None, those at temperature > 0 (through an engine of its own
    on the same model and head; "default": what the policy chooses, see `DraftPolicy.sampled_tree`).
    `backend` computes (default: plain torch), `policy` sizes each round (default: the tree as given);
    `eaglespec.Engine` picks both for the machine."""

    def __init__(self, model: PreTrainedModel, head: EagleDraftHead | None = None,
                 tree: str | list[list[int]] | DynamicTree = "paper", draft_sampling: str = "sample",
                 sink_layers: list[int] | None = None, sampled_tree: str | list[list[int]] | None = "default",
                 backend: Backend | None = None, policy: DraftPolicy | None = None):
        if draft_sampling not in DRAFT_SAMPLING:
            raise ValueError(f"draft_sampling must be one of {DRAFT_SAMPLING}")
        if getattr(model.config, "final_logit_softcapping", None):
            raise EaglespecError("models with final logit soft-capping are not supported")
        self.model = model.eval()
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.head = head.eval() if head is not None else None
        self.hidden_size = int(model.config.hidden_size)
        self.backend = backend if backend is not None else TORCH
        self.backend.prepare(model, self.head)
        tree, self.lookup = split_lookup(tree)  # "+lookup[:L]": graft prompt-lookup guesses (batch 1)
        self.tree_name = tree if isinstance(tree, str) else None
        spec = parse_spec(tree)
        # a static tree is built once; a dynamic one is regrown by the head every round
        self.dynamic: DynamicTree | None = spec if isinstance(spec, DynamicTree) else None
        self.tree: TreeBuffers | None = None if self.dynamic else build_tree(spec)
        self.plain: TreeBuffers = build_tree("chain:0")  # root only: one token per forward
        # headless data runs (`regenerate --aux-layers`): the layers whose hidden states return_features adds
        self.sink_layers = list(sink_layers or [])
        if self.head is not None and self.sink_layers and self.sink_layers != self.head.aux_layers:
            raise EaglespecError(f"sink_layers {self.sink_layers} differ from the head's aux layers {self.head.aux_layers}")
        self._tap = HiddenStateTap.of(self.decoder, self.aux_layers)
        self.draft_sampling = draft_sampling
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.max_context = int(getattr(model.config, "max_position_embeddings", 2048))
        self._cuda = self.device.type == "cuda"
        self.policy = policy if policy is not None else DraftPolicy()
        self.policy.bind(self)
        if sampled_tree == "default":
            sampled_tree = self.policy.sampled_tree()
        self.sampled_tree = sampled_tree
        # made here, so that a bad sampled_tree fails now and not at the first sampled request
        self._sampled = None if sampled_tree is None else self.with_tree(sampled_tree)

    def with_tree(self, tree: str | list[list[int]] | DynamicTree) -> "Engine":
        """An engine on the same model, head and backend that drafts `tree` at every temperature,
        with a policy of its own."""
        return type(self)(self.model, self.head, tree=tree, draft_sampling=self.draft_sampling,
                          sink_layers=self.sink_layers, sampled_tree=None, backend=self.backend,
                          policy=self.policy.fresh())

    # -- helpers ----------------------------------------------------------------------------------
    def clock(self) -> float:
        """Seconds, after the device's queued work is done."""
        if self._cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @property
    def aux_layers(self) -> list[int]:
        """EAGLE-3 fusion: the target layers whose hidden states the head also reads, after f_j."""
        return self.head.aux_layers if self.head is not None else self.sink_layers

    def _forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                 mask: torch.Tensor | None = None, aux: bool = False,
                 seen: list[list[int]] | None = None) -> torch.Tensor:
        """Target forward on new tokens x (B, q) -> final-norm hidden states (features), (B, q, H),
        followed with `aux` by the layers the head fuses (if any), (B, q, H * (1 + k)). `seen`: for
        one sequence, which new rows each row sees after the cache (what `mask` says, as lists)."""
        aux = aux and bool(self.aux_layers)  # vanilla decoding never pays for them
        b, q = x.shape
        plan = self.backend.forward_kwargs(mask, b, q, cache.get_seq_length(), seen)
        layers = self.aux_layers if aux else []
        with self._tap.capture(layers):
            out = self.decoder(input_ids=x, position_ids=positions, attention_mask=mask, past_key_values=cache,
                               use_cache=True, **plan, **self._tap.forward_kwargs(layers))
        if not aux:
            return out.last_hidden_state
        return torch.cat([out.last_hidden_state] + self._tap.read(out, self.aux_layers), -1)

    def target_forward(self, ids: list[int], start: int, cache: KVCache, mask: torch.Tensor | None = None,
                       positions: torch.Tensor | None = None) -> torch.Tensor:
        """One sequence: features (q, H) of `ids`, placed at `start` (or at explicit positions)."""
        if positions is None:
            positions = torch.arange(start, start + len(ids), device=self.device)
        return self._forward(torch.tensor([ids], device=self.device), positions[None], cache, mask)[0]

    def _choose(self, logits: torch.Tensor, sp: SamplingParams, gen: torch.Generator | None) -> int:
        if sp.greedy:
            return self.backend.argmax(logits)
        return sample_token(target_probs(logits, sp), gen, self.backend)

    def _fed(self, seq: list[int]) -> list[int]:
        """The tokens the head reads beside the features of seq[:-1]: each position's next token
        (EAGLE's shift), or its own for the unshifted ablation (`EagleDraftHead.token_offset`)."""
        return seq[1:] if self.head.token_offset else seq[:-1]

    def _node_token(self, own: int, parent: int) -> int:
        """What the head reads beside a tree node's parent feature: the node's own token (t_{j+1}),
        or its parent's (t_j) for the unshifted ablation."""
        return own if self.head.token_offset else parent

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
        vocab = self.model.get_input_embeddings().num_embeddings
        if min(input_ids) < 0 or max(input_ids) >= vocab:
            raise EaglespecError(f"token ids must be in 0..{vocab - 1}, got {min(input_ids)}..{max(input_ids)}")
        if method not in ("eagle", "vanilla"):
            raise EaglespecError(f"method must be 'eagle' or 'vanilla', got {method!r}")
        if method == "eagle" and self.head is None:
            raise EaglespecError("method 'eagle' needs a draft head")

    @torch.inference_mode()
    def stream(self, input_ids: list[int], max_new_tokens: int = 128, sampling: SamplingParams | None = None,
               method: str = "eagle", seed: int | None = None, eos_token_ids: list[int] | None = None,
               stats: GenerationStats | None = None) -> Iterator[tuple[list[int], str]]:
        """Yields (new token ids, finish reason so far) once per target forward."""
        stats = stats if stats is not None else GenerationStats()
        for events in self._decode([input_ids], max_new_tokens, sampling, method, seed, eos_token_ids, [stats]):
            for _, new, reason in events:
                yield new, reason or "length"

    @torch.inference_mode()
    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int = 128,
                       sampling: SamplingParams | None = None, method: str = "eagle", seed: int | None = None,
                       eos_token_ids: list[int] | None = None, return_features: bool = False
                       ) -> list[GenerationOutput]:
        """Decode several prompts together: one target forward per round verifies every sequence's
        tree, and each sequence keeps its own accepted length (ragged rows in one KV cache)."""
        if not prompts:
            raise EaglespecError("no prompts given")
        stats = [GenerationStats() for _ in prompts]
        tokens: list[list[int]] = [[] for _ in prompts]
        reasons = ["length"] * len(prompts)
        sink: list[list[torch.Tensor]] | None = [[] for _ in prompts] if return_features else None
        for events in self._decode(prompts, max_new_tokens, sampling, method, seed, eos_token_ids, stats, sink):
            for i, new, reason in events:
                tokens[i] += new
                reasons[i] = reason or "length"
        outs = [GenerationOutput(t, r, st) for t, r, st in zip(tokens, reasons, stats)]
        if sink is not None:
            H = self.hidden_size
            for o, ids, parts in zip(outs, prompts, sink):
                # fed positions can run past the last emitted token (accepted nodes after an EOS)
                fed = torch.cat(parts)[: len(ids) + len(o.token_ids) - 1].float().cpu()
                o.features = fed[:, :H]
                if fed.shape[-1] > H:
                    o.aux = fed[:, H:].reshape(len(fed), -1, H)
        return outs

    def _decode(self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams | None, method: str,
                seed: int | None, eos_token_ids: list[int] | None, stats: list[GenerationStats],
                feature_sink: list[list[torch.Tensor]] | None = None
                ) -> Iterator[list[tuple[int, list[int], str | None]]]:
        """The loop. Yields, once per target forward, (row, new tokens, finish reason or None) events.
        `feature_sink[i]` collects row i's features of every token fed to the target, in order."""
        sp = sampling or SamplingParams()
        if method == "eagle" and not sp.greedy and self._sampled is not None:
            yield from self._sampled._decode(prompts, max_new_tokens, sp, method, seed, eos_token_ids, stats,
                                             feature_sink)
            return
        for ids in prompts:
            self.check_request(ids, max_new_tokens, method)
        eagle = method == "eagle" and (self.dynamic is not None or self.tree.n > 1)
        if eagle and self.dynamic is not None and len(prompts) > 1:
            raise EaglespecError("dynamic trees decode one sequence at a time; use a static tree "
                                 "(paper, chain:K) for batches")
        gen = random_stream(sp, seed, self.device)
        if eagle:
            self.policy.start()
        run = _Run([self], eos_token_ids, eagle, feature_sink)
        rows = self._prefill(run, prompts, list(range(len(prompts))), [max_new_tokens] * len(prompts), sp, gen, stats)
        yield [run.emit(r, [r.root]) for r in rows]
        while True:
            rows, events = run.retire(rows)
            if events:
                yield events
            if not rows:
                break
            yield self._round(run, rows, sp, gen)

    def _round(self, run: "_Run", rows: list["_Row"], sp: SamplingParams, gen: torch.Generator | None,
               may_draft: bool = True) -> list[tuple[int, list[int], str | None]]:
        """One round for every row: draft (unless the policy or `may_draft` says a plain step),
        verify in one target forward, update. Returns each row's event."""
        t_draft = self.clock()
        plan = run.eagle and may_draft  # the policy sees only the rounds it plans
        # near the context limit the deepest tree node would overflow the positions: go plain
        drafting = plan and self.policy.draft_round(
            len(rows), room=all(r.n_ctx + run.depth < self.max_context for r in rows))
        if drafting:
            draft = self._draft(rows, run.head_cache, sp, gen, t_draft)
            if run.lookup and len(rows) == 1:
                draft = self._graft(draft, rows[0].history, run.lookup, t_draft)
        else:
            draft = Draft([[r.root] for r in rows], [[None] for _ in rows], self.plain)
        t_verify = self.clock()
        paths, bonuses, feats = self._verify(rows, draft, run.cache, sp, gen, run.aux)
        t_done = self.clock()
        if plan:
            self.policy.observe_verify(len(rows), draft.tree.n, t_done - t_verify, drafting)
        events = [self._update(run, r, draft, b, paths[b], bonuses[b], feats[b], drafting, t_verify - t_draft,
                               t_done - t_verify) for b, r in enumerate(rows)]
        if plan:  # the whole round, its bookkeeping included: a drafted round's is dearer
            self.policy.observe_round(len(paths[0]) + 1, draft, self.clock() - t_draft, drafting)
        return events

    def tree_reach(self) -> tuple[int, int]:
        """The deepest node and the most nodes (beyond the root) a round of this engine drafts."""
        dyn = self.dynamic
        if dyn is None:
            return self.tree.max_depth, self.tree.n
        return dyn.depth, dyn.total_tokens or dyn.max_nodes

    def _prefill(self, run: "_Run", prompts: list[list[int]], keys: list[int], budgets: list[int],
                 sp: SamplingParams, gen: torch.Generator | None, stats: list[GenerationStats]) -> list["_Row"]:
        """Every prompt (right-padded) through the target: its cache rows, features f_1..f_N, and
        each row's first new token (the root of its first tree). The first prefill makes the run's
        caches; a later one (rows joining a running batch) appends its rows to them."""
        t0 = self.clock()
        lens = [len(ids) for ids in prompts]
        B, L = len(prompts), max(lens)
        rows = [_Row(key, n, 0, st, budget, t0) for key, n, budget, st in zip(keys, lens, budgets, stats)]
        joining = run.cache is not None
        cache = KVCache(run.capacity(rows))
        x = torch.tensor([ids + [0] * (L - len(ids)) for ids in prompts], device=self.device)
        pos = torch.arange(L, device=self.device).expand(B, L)
        mask = None
        if min(lens) < L:
            causal = torch.ones(L, L, dtype=torch.bool, device=self.device).tril()
            mask = float_mask(causal[None] & (pos[:, None, :] < torch.tensor(lens, device=self.device)[:, None, None]),
                              self.dtype)
        feats = self._forward(x, pos, cache, mask, aux=run.aux)
        last = self.lm_head(torch.stack([feats[b, n - 1, : self.hidden_size] for b, n in enumerate(lens)]))
        for b, r in enumerate(rows):
            r.root = self._choose(last[b], sp, gen)
            if run.eagle:  # head inputs (f_j, t_{j+1}) not yet in the head's cache
                r.pending = ([feats[b, :r.n_ctx]], self._fed(prompts[b] + [r.root]))
            if run.lookup:
                r.history = prompts[b] + [r.root]
            r.stats.prefill_time_s = self.clock() - t0
            if run.feature_sink is not None:
                run.feature_sink[r.index].append(feats[b, :r.n_ctx])
        if joining:
            run.cache.add_rows(cache)
            if run.head_cache is not None:
                run.head_cache.add_rows(B, run.cache.max_len)
        else:
            run.cache = cache
            if run.eagle:
                run.head_cache = KVCache(cache.max_len)
                self.head.reset_context()
        return rows

    def _update(self, run: "_Run", r: "_Row", draft: "Draft", b: int, path: list[int], bonus: int,
                feats: torch.Tensor, drafted: bool, draft_s: float, verify_s: float
                ) -> tuple[int, list[int], str | None]:
        """After verification: the row's accepted tokens and their features (the head's next
        inputs), its statistics, and what the policy learns from the round."""
        keep = [0] + path  # tree rows kept in the cache: the root and the accepted nodes
        r.n_ctx += len(keep)
        accepted = [draft.tokens[b][i] for i in path] + [bonus]
        f = feats[keep]
        if run.feature_sink is not None:
            run.feature_sink[r.index].append(f)
        if run.eagle:
            fed = self._fed([r.root] + accepted)
            r.pending = ([f], fed) if drafted else (r.pending[0] + [f], r.pending[1] + fed)
        r.root = bonus
        if run.eagle and not drafted:
            r.stats.plain_steps += 1
        else:
            r.stats.rounds += 1
            r.stats.accept_lengths.append(len(accepted))
        r.stats.draft_time_s += draft_s
        r.stats.verify_time_s += verify_s
        tree_h, path_h = draft.tree, path
        if draft.drafted is not None:  # the head's statistics see only the head's nodes
            tree_h, path_h = draft.drafted, self._head_path(draft.drafted, draft.tree, path)
            r.stats.lookup_tokens += len(path) - len(path_h)
            self.policy.observe_lookup(draft.tree, path, draft.chain)
        if run.lookup:  # plain steps' tokens too: lookup matches the text as it is
            r.history += accepted
        if tree_h.n > 1:
            self._count_alpha(tree_h, path_h, r.stats)
        if draft.predicted is not None:
            self.policy.observe_accepted(tree_h, path_h, draft.predicted)
        return run.emit(r, accepted)

    # -- drafting ---------------------------------------------------------------------------------
    def _draft(self, rows: list["_Row"], head_cache: KVCache, sp: SamplingParams, gen: torch.Generator | None,
               t_round: float) -> Draft:
        """Feed each row's newly committed (feature, next token) pairs to the head, then grow this
        round's tree. Returns per row the node tokens and the law each was drawn from (None = chosen
        deterministically), the tree shape (shared by all rows), and what the head expects of a
        dynamic tree (None for a static one)."""
        counts = [len(r.pending[1]) for r in rows]
        B, c = len(rows), max(counts)
        start = head_cache.get_seq_length()
        # each row's pending pairs, zero-padded to the longest (one sequence: no padding to fill)
        feats = pad_sequence([torch.cat(r.pending[0]) for r in rows], batch_first=True)
        toks = pad_sequence([torch.tensor(r.pending[1], device=self.device) for r in rows], batch_first=True)
        for b, n in enumerate(counts):
            self.head.add_context(toks[b, :n])
        hl = torch.tensor([r.head_len for r in rows], device=self.device)
        pos = hl[:, None] + torch.arange(c, device=self.device)
        mask = None
        ragged = any(r.head_len != start for r in rows)  # rows of a batch (or what is left of one)
        if ragged:  # each row sees its own committed entries, then its new ones causally
            causal = torch.ones(c, c, dtype=torch.bool, device=self.device).tril()
            mask = float_mask(prefix_tree_mask(causal, start, hl), self.dtype)
        k, temp, law = self._level_top(sp)  # one sequence: the head, and the root's best tokens, in one C call
        step = None if B > 1 or ragged else self.backend.draft_step(self.head, feats, rows[0].pending[1],
                                                                    pos[0].tolist(), head_cache, None, k, temp, c - 1, law)
        out = self.head(feats, toks, pos, mask, head_cache) if step is None else step.features
        root_level = step if step is not None and k else None
        root_f = torch.stack([out[b, n - 1 : n] for b, n in enumerate(counts)])  # (B, 1, H)
        if ragged or B > 1:
            self.backend.compact_rows(head_cache, hl.tolist(), start, [list(range(n)) for n in counts])
        for r, n in zip(rows, counts):
            r.head_len += n
        lens = [r.head_len for r in rows]
        if self.dynamic is not None:
            result = self._grow_dynamic(root_f, rows[0].root, lens, head_cache, sp, gen, t_round, root_level)
        else:
            result = self._grow_static(root_f, [r.root for r in rows], lens, head_cache, sp, gen, root_level)
        head_cache.crop(max(lens))
        return result

    def _level_top(self, sp: SamplingParams) -> tuple[int, float, bool]:
        """What the root's level reads of the head: its k best draft tokens (a static tree: as many
        as the root has children), at which temperature, and whether its whole law (sampled drafts
        draw from it)."""
        sampled = not sp.greedy and self.draft_sampling == "sample"
        k = self.dynamic.top_k if self.dynamic is not None else self.tree.expand_topk[0]
        return k, (1.0 if sp.greedy else sp.temperature), sampled

    def _head_level(self, parent_f: torch.Tensor, tokens: list[list[int]], lens: list[int], depth: int,
                    allowed: torch.Tensor, head_cache: KVCache, seen: list[list[int]] | None = None, k: int = 0,
                    temp: float = 1.0, law: bool = False) -> tuple[torch.Tensor, DraftLevel | None]:
        """One head forward over all nodes of one depth, (B, q, H): each row sees its own committed
        entries and, by tree attention, its nodes' ancestors from earlier levels (`allowed`; for
        one sequence also as lists, `seen`, which spares the kernels' plan a read of the mask). For
        one sequence on the CPU, with k > 0, also what `_level_top` asks of each node, where the
        head runs the level as one C call (`draft_step`); else None."""
        plan = self.backend.rows_plan(lens[0], seen) if seen is not None and len(lens) == 1 else None
        if plan is not None:
            step = self.backend.draft_step(self.head, parent_f, tokens[0], [lens[0] + depth - 1] * len(tokens[0]),
                                           head_cache, plan, k, temp, 0, law)
            if step is not None:
                return step.features, step if k else None
        toks = torch.tensor(tokens, device=self.device)
        hl = torch.tensor(lens, device=self.device)
        pos = (hl[:, None] + depth - 1).expand(toks.shape)
        ragged = hl if len(set(lens)) > 1 else None
        mask = float_mask(prefix_tree_mask(allowed.to(self.device), max(lens), ragged), self.dtype)
        return self.head(parent_f, toks, pos, mask, head_cache, plan=plan), None

    def _grow_static(self, root_f: torch.Tensor, roots: list[int], lens: list[int], head_cache: KVCache,
                     sp: SamplingParams, gen: torch.Generator | None, root_level: DraftLevel | None = None) -> Draft:
        """The fixed tree's nodes, level by level: each expanded node's best (or, sampling, drawn)
        draft tokens. One sequence on the CPU runs each level in one C call (`_head_level`) and
        reads its tokens and law from it, as dynamic trees do; `root_level`: the root's, if the
        head's forward gave it."""
        head, tree = self.head, self.tree
        B = len(roots)
        _, temp, sampled = self._level_top(sp)
        one = B == 1  # one sequence: its levels may run in one backend call, which reads tree.draft_seen
        node_feat: dict[int, torch.Tensor] = {0: root_f}  # (B, 1, H) per expanded node
        node_tokens = [[root] + [0] * (tree.n - 1) for root in roots]
        node_q: list[list[torch.Tensor | None]] = [[None] * tree.n for _ in roots]
        for d in range(tree.max_depth):
            nodes = tree.expand_nodes[d]
            k = tree.expand_topk[d]
            if d == 0:
                f, top = root_f, root_level
            else:
                parents_f = torch.cat([node_feat[tree.parent[i]] for i in nodes], dim=1)
                fed = [[self._node_token(row[i], row[tree.parent[i]]) for i in nodes] for row in node_tokens]
                f, top = self._head_level(parents_f, fed, lens, d,
                                          tree.draft_masks[d], head_cache, tree.draft_seen[d] if one else None,
                                          k if one else 0, temp, sampled)
                for j, i in enumerate(nodes):
                    node_feat[i] = f[:, j : j + 1]
            # from C (`top`): the law to draw from, or the best target ids; else from the head's logits
            logits = None if top is not None else head.logits(f).float().flatten(0, 1)  # (B * nodes, draft vocab)
            if sampled:
                q_draft = top.probs if top is not None else torch.softmax(logits / sp.temperature, -1)
                picks = head.to_target_ids(sample_without_replacement(q_draft, k, gen, self.backend)).tolist()
                qs = head.to_target_probs(q_draft)
            else:
                picks = ([row[:k] for row in top.ids] if top is not None
                         else head.to_target_ids(torch.topk(logits, k, dim=-1).indices).tolist())
                qs = None
            for b in range(B):
                for j, i in enumerate(nodes):
                    row = b * len(nodes) + j
                    for c in tree.children[i]:
                        r = tree.rank[c]
                        node_tokens[b][c] = picks[row][r]
                        if qs is not None:
                            node_q[b][c] = sibling_q(qs[row], picks[row][:r], picks[row][r])
        return Draft(node_tokens, node_q, tree)

    def _expand(self, frontier: list[int], toks: list[int], root: int, parents: list[int], slots: list[int],
                feat: dict[int, torch.Tensor], lens: list[int], depth: int, head_cache: KVCache, k: int = 0,
                temp: float = 1.0, law: bool = False) -> tuple[torch.Tensor, DraftLevel | None]:
        """One head forward over the frontier candidates of a dynamic tree (`toks`, under `root`);
        each sees its ancestors' head-cache entries (`slots` lists the candidates with an entry, in
        cache order). With k > 0, maybe what `_level_top` asks of them too (`_head_level`)."""
        slots += frontier
        col = {c: j for j, c in enumerate(slots)}
        seen = [sorted(col[j] for j in lineage(i, parents)) for i in frontier]  # head-cache entries, ascending
        allowed = visible(seen, range(len(slots)))
        f, top = self._head_level(torch.cat([feat[parents[i]] for i in frontier], dim=1),
                                  [[self._node_token(toks[i], toks[parents[i]] if parents[i] >= 0 else root)
                                    for i in frontier]], lens, depth, allowed, head_cache, seen, k, temp, law)
        for r, i in enumerate(frontier):
            feat[i] = f[:, r : r + 1]
        return f, top

    def _grow_dynamic(self, root_f: torch.Tensor, root: int, lens: list[int], head_cache: KVCache,
                      sp: SamplingParams, gen: torch.Generator | None, t_round: float,
                      root_level: DraftLevel | None = None) -> Draft:
        """EAGLE-2: candidates are each expanded node's top-k children, scored by cumulative draft
        log-probability; the best `top_k` of a depth are expanded next, the best overall verified.
        Candidates are deterministic given the head, so they carry a one-hot law (q = None).
        When sampling with sampled drafts, `_grow_sampled` grows the tree instead. `root_level`: what
        the head's forward gave of the root (`_level_top`), if it did."""
        if not sp.greedy and self.draft_sampling == "sample":
            return self._grow_sampled(root_f, root, lens, head_cache, sp, gen, t_round, root_level)
        head, dyn = self.head, self.dynamic
        k, temp, _ = self._level_top(sp)
        toks: list[int] = []
        parents: list[int] = []  # -1 = the root
        ranks: list[int] = []
        scores: list[float] = []
        feat: dict[int, torch.Tensor] = {-1: root_f}
        slots: list[int] = []  # candidates with a head-cache entry, in cache order
        frontier, f, level_start, levels, top = [-1], root_f, 0, 0, root_level
        for d in range(dyn.depth):
            if d > 0:
                level = range(level_start, len(toks))
                frontier = sorted(level, key=lambda i: (-scores[i], i))[:k]
                if not self.policy.another_level(scores, parents, frontier, t_round):
                    break
                f, top = self._expand(frontier, toks, root, parents, slots, feat, lens, d, head_cache, k, temp)
            if top is not None:
                vals, ids = top.logprobs, top.ids
            else:
                logits = head.logits(f[0]).float()
                best = torch.topk(torch.log_softmax(logits if temp == 1.0 else logits / temp, -1), k, dim=-1)
                vals, ids = best.values.tolist(), head.to_target_ids(best.indices).tolist()
            levels, top = levels + 1, None
            level_start = len(toks)
            for r, pi in enumerate(frontier):
                base = 0.0 if pi < 0 else scores[pi]
                for c in range(k):
                    toks.append(ids[r][c])
                    parents.append(pi)
                    ranks.append(c)
                    scores.append(base + vals[r][c])
        chosen = select_nodes(scores, parents, self.policy.tree_budget(scores, t_round))
        tree, order = self._tree_of(chosen, parents, ranks)
        predicted = Prediction(sum(math.exp(scores[i]) for i in chosen), levels=levels)
        return Draft([[root] + [toks[i] for i in order]], [[None] * tree.n], tree, predicted)

    def _grow_sampled(self, root_f: torch.Tensor, root: int, lens: list[int], head_cache: KVCache,
                      sp: SamplingParams, gen: torch.Generator | None, t_round: float,
                      root_level: DraftLevel | None = None) -> Draft:
        """A dynamic tree of sampled drafts (T > 0). Lossless only if every drawn node is verified
        with the law it was drawn from, so nothing is pruned after drawing: each level first decides,
        from what is already drawn and the expanded nodes' distributions (never from the draws it is
        about to make), how many children each frontier node draws (`DraftPolicy.plan_level`); those
        are then drawn without replacement, in order, and all of them are verified. The j-th child's
        value is its parent's times the head's j-th largest probability at the parent: the shape
        follows the head's distributions, and the calibration compares acceptance with the same
        planned values."""
        head = self.head
        k, temp, _ = self._level_top(sp)
        toks: list[int] = []
        parents: list[int] = []
        ranks: list[int] = []
        scores: list[float] = []  # log planned value of each drawn node
        laws: list[torch.Tensor | None] = []
        feat: dict[int, torch.Tensor] = {-1: root_f}
        slots: list[int] = []
        frontier, f, level_start, levels, level = [-1], root_f, 0, 0, root_level
        c = [self.policy.rank_ratio(j) for j in range(k)]  # sampled siblings accept less the later they come
        for d in range(self.policy.sampled_depth()):
            if d > 0:
                frontier = sorted(range(level_start, len(toks)), key=lambda i: (-scores[i], i))[:k]
                if not frontier or not self.policy.another_level(scores, parents, frontier, t_round):
                    break
                f, level = self._expand(frontier, toks, root, parents, slots, feat, lens, d, head_cache, k, temp, True)
            if level is not None:  # the law from C, and its k largest values
                q, planned = level.probs, [[math.exp(v) for v in row] for row in level.logprobs]
            else:
                q = torch.softmax(head.logits(f[0]).float() / temp, -1)  # (len(frontier), draft vocab)
                planned = torch.topk(q, k, dim=-1).values.tolist()
            levels, level = levels + 1, None
            slot_values = [[math.exp(0.0 if pi < 0 else scores[pi]) * p * c[j] for j, p in enumerate(planned[r])]
                           for r, pi in enumerate(frontier)]
            drawn = [math.exp(x) * c[j] for x, j in zip(scores, ranks)]
            counts = self.policy.plan_level(drawn, slot_values, t_round)
            if not any(counts):
                break
            picks = sample_without_replacement(q, max(counts), gen, self.backend)
            target_ids = head.to_target_ids(picks).tolist()
            q_full = head.to_target_probs(q)
            level_start = len(toks)
            for r, pi in enumerate(frontier):
                base = 0.0 if pi < 0 else scores[pi]
                for j in range(counts[r]):
                    tok = target_ids[r][j]
                    toks.append(tok)
                    parents.append(pi)
                    ranks.append(j)
                    scores.append(base + math.log(max(planned[r][j], 1e-30)))
                    laws.append(sibling_q(q_full[r], target_ids[r][:j], tok))
        tree, order = self._tree_of(list(range(len(toks))), parents, ranks)
        predicted = Prediction(sum(math.exp(x) for x in scores),
                               [sum(math.exp(x) for x, j in zip(scores, ranks) if j == r) for r in range(k)], levels)
        return Draft([[root] + [toks[i] for i in order]], [[None] + [laws[i] for i in order]], tree, predicted)

    def _tree_of(self, chosen: list[int], parents: list[int], ranks: list[int]) -> tuple[TreeBuffers, list[int]]:
        """The tree of the chosen candidates, and the candidate behind each of its non-root nodes
        (build_tree orders nodes by (depth, path), not by candidate)."""
        if not chosen:
            return self.plain, []
        paths = paths_of(chosen, parents, ranks)
        tree = build_tree(paths)
        by_path = {tuple(p): i for p, i in zip(paths, chosen)}
        return tree, [by_path[p] for p in tree.paths[1:]]

    def _graft(self, draft: Draft, history: list[int], n: int, t_round: float) -> Draft:
        """The drafted tree plus a chain of up to n prompt-lookup guesses under its root (as many as
        the policy keeps). A guess is a deterministic proposal (law None, one-hot): greedy acceptance
        is argmax as ever, and speculative sampling accepts it with the residual's probability of
        that token, after the head's siblings, so the output law is the target's whatever was guessed."""
        tree, tokens, qs = draft.tree, draft.tokens[0], draft.laws[0]
        guess = prompt_lookup(history, n)
        if guess and draft.predicted is not None:
            guess = self.policy.lookup_guesses(guess, tree.n, draft.predicted, t_round)
        paths, toks, chain = graft_chain(tree.paths, tokens, guess)
        if len(paths) > tree.n:
            new = build_tree([list(p) for p in paths[1:]])
            tok_of, q_of = dict(zip(paths, toks)), dict(zip(tree.paths, qs))
            tree, tokens, qs = new, [tok_of[p] for p in new.paths], [q_of.get(p) for p in new.paths]
        return Draft([tokens], [qs], tree, draft.predicted, draft.tree, chain)

    @staticmethod
    def _head_path(drafted: TreeBuffers, grafted: TreeBuffers, path: list[int]) -> list[int]:
        """The accepted path's prefix of drafted nodes, as indices of the drafted tree."""
        index = {p: i for i, p in enumerate(drafted.paths)}
        out = []
        for node in path:
            if grafted.paths[node] not in index:
                break
            out.append(index[grafted.paths[node]])
        return out

    # -- verification -----------------------------------------------------------------------------
    def _verify(self, rows: list["_Row"], draft: Draft, cache: KVCache, sp: SamplingParams,
                gen: torch.Generator | None, aux: bool = False) -> tuple[list[list[int]], list[int], torch.Tensor]:
        """One target forward over every row's root + tree nodes; per row the accepted nodes (greedy,
        or multi-round speculative sampling) and the bonus token, the features (B, n, H); the cache
        keeps the root's and the accepted nodes' rows after each row's prefix."""
        tree, node_tokens = draft.tree, draft.tokens
        prefix = cache.get_seq_length()
        n_ctx = torch.tensor([r.n_ctx for r in rows], device=self.device)
        positions = tree.position_offsets.to(self.device)[None] + n_ctx[:, None]
        ragged = any(r.n_ctx != prefix for r in rows)  # ragged rows: each sees only its own prefix
        mask = None  # a plain aligned step is causal
        if ragged or tree.n > 1:
            mask = float_mask(prefix_tree_mask(tree.ancestor_mask.to(self.device), prefix, n_ctx if ragged else None),
                              self.dtype)
        feats = self._forward(torch.tensor(node_tokens, device=self.device), positions, cache, mask, aux,
                              None if ragged else tree.ancestors)
        hidden = feats[..., : self.hidden_size]
        # wide trees: the LM head first runs over every root's top path (one call), then over the nodes
        # a walk reaches off it; others over all rows at once, as a call off the path streams the whole
        # LM head again (about what 4 of its rows compute, on the CPUs here)
        top = first_child_chain(0, tree.children)
        first = top if tree.n - len(top) >= LAZY_LM_HEAD_ROWS else list(range(tree.n))
        compute = self.backend.argmax if sp.greedy else (lambda x: target_probs(x, sp))
        values = compute(self.lm_head(hidden[:, first].reshape(-1, self.hidden_size)))
        paths, bonuses = [], []
        for b in range(len(rows)):
            at_node = NodeRows(lambda nodes, b=b: compute(self.lm_head(hidden[b, nodes])), tree.children,
                               dict(zip(first, values[b * len(first):(b + 1) * len(first)])))
            if sp.greedy:
                path, bonus = greedy_accept(at_node, node_tokens[b], tree.children)
            else:
                path, bonus = sample_accept(at_node, node_tokens[b], tree.children, draft.laws[b], gen, self.backend)
            paths.append(path)
            bonuses.append(bonus)
        if tree.n > 1 or ragged:  # a plain aligned step is already in place
            self.backend.compact_rows(cache, [r.n_ctx for r in rows], prefix, [[0] + path for path in paths])
        return paths, bonuses, feats

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


class ContinuousBatch:
    """Sequences that decode together and join or leave at round boundaries (continuous batching):
    each `step` is one target forward for every running sequence (and one prefill for those joining),
    so several requests share each pass over the weights.

    One `SamplingParams` and one random stream serve every row; each row keeps its own budget and
    stops at its own end token. A single running row drafts as `engine` does (its dynamic tree,
    prompt-lookup grafts, policy); several draft with `batch`, an engine on the same model and head
    with a static tree, or take plain batched steps where `batch` is None. Every row's output is
    its own decoding's: greedy rows equal their vanilla decoding; sampled rows follow the target's
    law (their draws depend on the batch they shared, so a seed reproduces a row decoded alone)."""

    def __init__(self, engine: Engine, sampling: SamplingParams | None = None, method: str = "eagle",
                 eos_token_ids: list[int] | None = None, batch: Engine | None = None, seed: int | None = None):
        self.sp = sampling or SamplingParams()
        if method == "eagle" and not self.sp.greedy and engine._sampled is not None:
            engine = engine._sampled
        if batch is not None:
            self.check_batch_engine(engine, batch)
        self.engine, self.batch, self.method, self.eos = engine, batch, method, eos_token_ids
        self.gen = random_stream(self.sp, seed, engine.device)
        self.eagle = method == "eagle" and engine.head is not None
        self.run: _Run | None = None
        self.rows: list[_Row] = []
        self.joining: list[tuple[int, list[int], int, GenerationStats]] = []

    @staticmethod
    def check_batch_engine(engine: Engine, batch: Engine) -> None:
        """What several rows draft with: a static tree (dynamic ones draft for one sequence) on the
        engine's model and head."""
        if batch.dynamic is not None:
            raise EaglespecError(f"a batch engine needs a static tree (paper, chain:K, a list of paths), got "
                                 f"{batch.tree_name or 'a dynamic tree'!r}")
        if batch.model is not engine.model or batch.head is not engine.head:
            raise EaglespecError("a batch engine needs the engine's model and head")

    def __len__(self) -> int:
        return len(self.rows) + len(self.joining)

    def add(self, key: int, input_ids: list[int], max_new_tokens: int,
            stats: GenerationStats | None = None) -> GenerationStats:
        """Queue a sequence to join at the next step (its events carry `key`); its statistics."""
        self.engine.check_request(input_ids, max_new_tokens, self.method)
        if any(key == k for k, *_ in self.joining) or any(key == r.index for r in self.rows):
            raise EaglespecError(f"key {key} is already in the batch")
        stats = stats if stats is not None else GenerationStats()
        self.joining.append((key, list(input_ids), max_new_tokens, stats))
        return stats

    def cancel(self, key: int) -> None:
        """Stop decoding a sequence (it leaves at the next step, with no further event)."""
        self.joining = [j for j in self.joining if j[0] != key]
        for r in self.rows:
            if r.index == key and r.reason is None:
                r.reason = "cancelled"

    @torch.inference_mode()
    def step(self) -> list[tuple[int, list[int], str | None]]:
        """Admit the joining sequences, then one round for all: (key, new tokens, finish reason or
        None) events, at most one per sequence and round."""
        events: list[tuple[int, list[int], str | None]] = []
        if self.joining:
            if self.run is None:
                engines = [self.engine] + ([self.batch] if self.batch is not None else [])
                self.run = _Run(engines, self.eos, self.eagle)
                if self.eagle:
                    for e in engines:
                        e.policy.start()
            keys, prompts, budgets, stats = zip(*self.joining)
            self.joining = []
            new = self.engine._prefill(self.run, list(prompts), list(keys), list(budgets), self.sp, self.gen,
                                       list(stats))
            events += [self.run.emit(r, [r.root]) for r in new]
            self.rows += new
        if self.run is None:
            return events
        self.rows, ended = self.run.retire(self.rows)
        events += ended
        if self.rows:
            one = len(self.rows) == 1
            eng = self.engine if one or self.batch is None else self.batch
            events += eng._round(self.run, self.rows, self.sp, self.gen, may_draft=one or self.batch is not None)
            self.rows, ended = self.run.retire(self.rows)
            events += ended
        if not self.rows:
            self.run = None  # the next sequence starts fresh caches
        return events
