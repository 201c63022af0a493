"""How much the loop drafts each round: the interface the decode loop asks, and its plain answer.

`DraftPolicy` drafts every tree as it was specified: a static tree whole, a dynamic tree
(`dynamic:D,K,N`) to its N nodes, every prompt-lookup guess, every round. It also learns how the
head's confidence relates to what the target accepts (`observe_accepted`), which shapes sampled
dynamic trees. `eaglespec.policy.AutoPolicy` sizes each round by the machine's measured costs
instead (the `auto` tree). A policy changes how fast the output comes, never what it is: every
drafted node is verified, and an undrafted round is a plain decoding step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import EaglespecError
from .tree import TreeBuffers, plan_children

if TYPE_CHECKING:
    from .engine import Draft, Engine


@dataclass
class Prediction:
    """What the head expects a drafted tree to yield: the sum of its nodes' acceptance chances as
    drafted (cumulative draft probabilities, or a sampled tree's planned values), and for a sampled
    tree the same per sibling rank. `DraftPolicy.observe_accepted` compares it with what the target
    accepted."""

    total: float
    per_rank: list[float] | None = None
    levels: int = 1  # head levels run (logits computed), deeper than the tree where a level's nodes lost


def ratio(sums: list[float], floor: float) -> float:
    """accepted / predicted from decayed sums, kept within [floor, 2]."""
    accepted, predicted = sums
    return min(2.0, max(floor, accepted / predicted))


class DraftPolicy:
    """The tree as specified (see the module's docstring); subclasses override what they size."""

    decay = 0.98  # of the calibration sums, per round

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.calibration = [1.0, 1.0]  # decayed sums of (accepted - 1, predicted): head-confidence calibration
        self.calibration_rank: list[list[float]] = []  # the same per sibling rank, for sampled trees

    def bind(self, engine: "Engine") -> None:
        """The engine this policy drafts for (one policy per engine)."""
        if engine.dynamic is not None and engine.dynamic.auto:
            raise EaglespecError("the 'auto' tree needs a cost-aware policy (eaglespec.policy.AutoPolicy; "
                                 "eaglespec.Engine picks it)")
        self.engine = engine

    def fresh(self) -> "DraftPolicy":
        """A new policy of this kind, for another engine on the same model."""
        return type(self)()

    def sampled_tree(self) -> Any:
        """The tree requests at temperature > 0 draft with, where the engine was not told (None:
        its own tree)."""
        return None

    def start(self) -> None:
        """A new text begins."""

    def draft_round(self, batch: int, room: bool) -> bool:
        """Whether this round drafts at all (`room`: every row has positions left for the tree)."""
        return room

    def another_level(self, scores: list[float], parents: list[int], frontier: list[int], t_round: float) -> bool:
        """Whether a dynamic tree grows one more level (candidates' cumulative log-probabilities
        `scores`, their `parents`, the `frontier` to expand; the round began at `t_round`)."""
        return True

    def tree_budget(self, scores: list[float], t_round: float) -> int:
        """How many of a dynamic tree's candidates (beyond the root) to verify."""
        return self.engine.dynamic.total_tokens - 1

    def plan_level(self, drawn: list[float], slot_values: list[list[float]], t_round: float) -> list[int]:
        """A sampled dynamic tree's next level: how many children each frontier node draws, from the
        drawn nodes' values and each frontier node's children's planned values."""
        budget = self.engine.dynamic.total_tokens - 1
        return plan_children(drawn, slot_values, budget, budget - len(drawn))

    def sampled_depth(self) -> int:
        """The deepest level a sampled dynamic tree draws."""
        return self.engine.dynamic.depth

    def lookup_guesses(self, guess: list[int], nodes: int, predicted: Prediction, t_round: float) -> list[int]:
        """Which prompt-lookup guesses to graft beside the head's `nodes`-node tree."""
        return guess

    def observe_verify(self, batch: int, nodes: int, seconds: float, drafted: bool) -> None:
        """A target forward verified `nodes` tokens per row in `seconds`."""

    def observe_round(self, tokens: int, draft: "Draft", seconds: float, drafted: bool) -> None:
        """A whole round (or plain step) emitted `tokens` in `seconds`, bookkeeping included."""

    def observe_lookup(self, tree: TreeBuffers, path: list[int], chain: Sequence[tuple[int, ...]]) -> None:
        """The accepted `path` of a tree with grafted lookup guesses (`chain`, as node paths)."""

    # -- how the head's confidence relates to acceptance ------------------------------------------
    def calib_ratio(self) -> float:
        return ratio(self.calibration, 0.2)

    def rank_ratio(self, rank: int) -> float:
        return ratio(self.calibration_rank[rank], 0.05) if rank < len(self.calibration_rank) else 1.0

    def observe_accepted(self, tree: TreeBuffers, path: list[int], predicted: Prediction) -> None:
        """Track how the head's cumulative confidence relates to what the target really accepts
        (overall, and per sibling rank after a sampled round)."""
        decay = self.decay
        self.calibration = [decay * self.calibration[0] + len(path), decay * self.calibration[1] + predicted.total]
        if predicted.per_rank is not None:
            while len(self.calibration_rank) < len(predicted.per_rank):
                self.calibration_rank.append([1.0, 1.0])
            for r, pred in enumerate(predicted.per_rank):
                hits = sum(tree.rank[n] == r for n in path)
                a, p = self.calibration_rank[r]
                self.calibration_rank[r] = [decay * a + hits, decay * p + pred]

