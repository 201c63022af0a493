"""The `auto` tree: each round drafted and verified as far as it raises tokens per second on this
machine, by the machine's measured cost curve (`costmodel`), refitted as the engine runs.

EAGLE-2 observed that the head's cumulative confidence in a node approximates the chance it is
accepted, so a tree's expected tokens are ``1 + sum(node confidences)``; on a CPU a verified row
is not free, so the best tree is the one that maximises expected tokens over the round's cost.
`AutoPolicy` also shuts drafting off while drafted rounds lose to plain steps (`DraftGate`), sizes
prompt-lookup grafts by their measured acceptance, and on a CPU drafts sampled requests (T > 0)
with one token a round.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

from ..spec.policy import DraftPolicy, Prediction, ratio
from ..spec.tree import TreeBuffers, plan_children
from .costmodel import CostProfile, DraftGate, LiveCosts, load_or_measure

if TYPE_CHECKING:
    from ..spec.engine import Draft, Engine

# `auto`'s deepest level for sampled drafts: every drawn node is verified (none can be pruned after
# drawing) and a level accepts about half as often as at T = 0, so deep levels rarely pay.
SAMPLED_AUTO_DEPTH = 3
# What `auto` drafts sampled requests with on a CPU: one sampled token a round. Its sampled trees and
# lookup grafts cost more planning than they won there.
CPU_SAMPLED_TREE = "chain:1"


def expected_gains(scores: list[float], calibration: float) -> list[float]:
    """Each candidate's expected extra accepted tokens, best first: its cumulative draft probability
    scaled by the head's calibration."""
    return sorted((math.exp(x) * calibration for x in scores), reverse=True)


class AutoPolicy(DraftPolicy):
    """Cost-aware drafting (see the module's docstring). `costs`: the machine's cost curve, taken as
    it is; None: loaded from the cache (measured once) and refitted to the forwards this engine times."""

    def __init__(self, costs: CostProfile | None = None) -> None:
        super().__init__()
        self.costs = costs
        self.refit = costs is None
        self.live: LiveCosts | CostProfile | None = costs
        self.gate: DraftGate | None = None  # no draft while drafted rounds lose to plain steps
        self._gated: DraftGate | None = None  # the gate this round asked, if any
        self._drafted_last = False  # whether the head drafted last round (else it has a backlog to feed)
        self.lookup_hits: list[list[float]] = []  # per graft position: decayed (accepted, proposed)

    def bind(self, engine: "Engine") -> None:
        self.engine = engine

    def fresh(self) -> "AutoPolicy":
        return AutoPolicy()

    @property
    def auto(self) -> bool:
        return self.engine.dynamic is not None and self.engine.dynamic.auto

    def sampled_tree(self) -> Any:
        eng = self.engine
        on_cpu = eng.head is not None and eng.device.type == "cpu"
        return CPU_SAMPLED_TREE if eng.tree_name == "auto" and on_cpu else None

    def start(self) -> None:
        if self.auto and self.costs is None:
            self.costs = load_or_measure(self.engine)
        if self.costs is not None and getattr(self.live, "profile", self.live) is not self.costs:
            self.live = LiveCosts(self.costs) if self.refit else self.costs
        if self.gate is not None:
            self.gate.new_text()
        # how often prompt-lookup guesses land is the text's, not the head's (code that restates its
        # prompt against prose): a new text starts from the prior, not from the last text's misses
        self.lookup_hits = []
        self._drafted_last = False

    # -- whether to draft, and how much ------------------------------------------------------------
    def draft_round(self, batch: int, room: bool) -> bool:
        self._gated = self.gate_for(batch) if room else None
        if self._gated is not None:
            return self._gated.draft()
        return room

    def gate_for(self, batch: int) -> DraftGate | None:
        """The `auto` tree's gate (one sequence), made anew with each cost curve."""
        if batch != 1 or not self.auto or self.costs is None:
            return None
        if self.gate is None or self.gate.profile is not self.live:
            self.gate = DraftGate(self.live)
        return self.gate

    def _spent(self, t_round: float) -> float:
        return self.engine.clock() - t_round

    def another_level(self, scores: list[float], parents: list[int], frontier: list[int], t_round: float) -> bool:
        """Would one more draft level raise this round's expected tokens per second? Each frontier
        node is assumed to get a best child as likely as the node was given its own parent."""
        if not self.auto:
            return True
        c = self.calib_ratio()
        gains = expected_gains(scores, c)
        spent = self._spent(t_round)
        _, now = self.live.best_size(gains, spent)
        guess = [math.exp(2 * scores[i] - (scores[parents[i]] if parents[i] >= 0 else 0.0)) * c for i in frontier]
        _, then = self.live.best_size(sorted(gains + guess, reverse=True), spent + self.live.draft_level_s)
        return then > now

    def tree_budget(self, scores: list[float], t_round: float) -> int:
        if not self.auto:
            return super().tree_budget(scores, t_round)
        return self.live.best_size(expected_gains(scores, self.calib_ratio()), self._spent(t_round))[0]

    def plan_level(self, drawn: list[float], slot_values: list[list[float]], t_round: float) -> list[int]:
        if not self.auto:
            return super().plan_level(drawn, slot_values, t_round)
        gains = sorted(drawn + [v for row in slot_values for v in row], reverse=True)
        keep, _ = self.live.best_size(gains, self._spent(t_round))
        return plan_children(drawn, slot_values, keep, len(gains))

    def sampled_depth(self) -> int:
        depth = self.engine.dynamic.depth
        return min(depth, SAMPLED_AUTO_DEPTH) if self.auto else depth

    # -- prompt-lookup grafts ----------------------------------------------------------------------
    def lookup_guesses(self, guess: list[int], nodes: int, predicted: Prediction, t_round: float) -> list[int]:
        """With `auto`, the chain is cut where one more guess no longer raises tokens per second (at
        least one guess: the first position's rate keeps being measured)."""
        if not self.auto:
            return guess
        return guess[: max(1, self.lookup_budget(len(guess), nodes, predicted.total, t_round))]

    @staticmethod
    def _lookup_prior(k: int) -> float:
        return 0.6 ** (k + 1)

    def lookup_rates(self, n: int) -> list[float]:
        """How often each of a graft's first n guesses was accepted lately; a guess's rate never
        exceeds the one before it, which must be accepted first."""
        rates, low, h = [], 1.0, self.lookup_hits
        for k in range(n):
            low = min(low, self._lookup_prior(k) if k >= len(h) else ratio(h[k], 0.01))
            rates.append(low)
        return rates

    def lookup_budget(self, n: int, nodes: int, predicted: float, t_round: float) -> int:
        """How many of n guesses to verify next to the head's `nodes`-node tree, of which it expects
        `predicted` accepted: each guess adds its acceptance rate to the expected tokens and one
        token to the verification."""
        spent = self._spent(t_round)
        expected = 1.0 + predicted * self.calib_ratio()
        best_l, best = 0, expected / (spent + self.live.verify(nodes))
        for l, r in enumerate(self.lookup_rates(n), start=1):
            expected += r
            rate = expected / (spent + self.live.verify(nodes + l))
            if rate > best:
                best_l, best = l, rate
        return best_l

    def observe_lookup(self, tree: TreeBuffers, path: list[int], chain: Sequence[tuple[int, ...]]) -> None:
        """Proposed positions learn from this round; the others drift back to their prior, so a
        position the budget stopped proposing (after a run of misses) is tried again later."""
        decay, on_path = self.decay, {tree.paths[i] for i in path}
        while len(self.lookup_hits) < max(len(chain), self.engine.lookup):
            self.lookup_hits.append([self._lookup_prior(len(self.lookup_hits)), 1.0])
        for k, (a, q) in enumerate(self.lookup_hits):
            if k < len(chain):
                self.lookup_hits[k] = [decay * a + (chain[k] in on_path), decay * q + 1.0]
            else:
                self.lookup_hits[k] = [decay * a + (1 - decay) * self._lookup_prior(k), decay * q + (1 - decay)]

    # -- what the rounds cost ----------------------------------------------------------------------
    def observe_verify(self, batch: int, nodes: int, seconds: float, drafted: bool) -> None:
        # the gate's plain steps too: they pin verify(1)
        if isinstance(self.live, LiveCosts) and batch == 1 and (drafted or self._gated is not None):
            self.live.observe(nodes, seconds)

    def observe_round(self, tokens: int, draft: "Draft", seconds: float, drafted: bool) -> None:
        gate = self._gated
        if gate is not None:
            if drafted:
                # the head levels run, which can outnumber the tree's depth (`auto` trees always predict)
                gate.observe(tokens, draft.predicted.levels, draft.tree.n, seconds, backlog=not self._drafted_last)
            else:
                gate.observe_plain(seconds)
        self._drafted_last = drafted
