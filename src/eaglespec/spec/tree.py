"""Draft trees as lists of paths, and the pure tensors that drafting and verification need.

A tree is a list of paths from the root. The root is the last token already emitted (not yet
in the target's KV cache); a path ``[0, 2]`` is "the third-best child of the best child of the
root". Node 0 is always the root; the other nodes are ordered by depth, then by path, so every
parent comes before its children and every depth level is one contiguous slice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

# Appendix A.1 / Fig. 9 of the EAGLE paper: 25 nodes, depth 5.
PAPER_TREE: list[list[int]] = [
    [0], [1], [2], [3],
    [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
    [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2],
    [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
]


def chain(k: int) -> list[list[int]]:
    """A chain of k draft tokens (classic speculative sampling; k=0 is plain decoding)."""
    return [[0] * d for d in range(1, k + 1)]


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's context-dependent tree, regrown every round from the head's confidence.

    Grow ``depth`` levels; at each level expand the ``top_k`` candidates with the highest
    cumulative draft log-probability, each into its ``top_k`` best children. Then verify the root
    plus the ``total_tokens - 1`` best candidates. ``total_tokens=0`` (``auto``) lets the cost model
    of this machine pick the size per round, and stop drafting early when a level cannot pay.
    """

    depth: int = 5
    top_k: int = 4
    total_tokens: int = 16

    @property
    def auto(self) -> bool:
        return self.total_tokens == 0

    @property
    def max_nodes(self) -> int:
        return 1 + self.top_k + (self.depth - 1) * self.top_k * self.top_k


AUTO_TREE = DynamicTree(depth=6, top_k=4, total_tokens=0)


def parse_spec(spec: "str | list[list[int]] | DynamicTree") -> "list[list[int]] | DynamicTree":
    """``paper`` | ``chain:K`` | ``dynamic[:D,K,N]`` | ``auto`` | an explicit list of paths."""
    if isinstance(spec, DynamicTree):
        return spec
    if isinstance(spec, str) and spec == "auto":
        return AUTO_TREE
    if isinstance(spec, str) and (spec == "dynamic" or spec.startswith("dynamic:")):
        if spec == "dynamic":
            return DynamicTree()
        try:
            d, k, n = (int(x) for x in spec.split(":", 1)[1].split(","))
        except ValueError:
            raise ValueError(f"bad tree spec {spec!r}: use dynamic:DEPTH,TOP_K,TOTAL_TOKENS") from None
        if not (1 <= d <= 16 and 1 <= k <= 16 and (n == 0 or 2 <= n <= 128)):
            raise ValueError(f"bad tree spec {spec!r}: need 1<=DEPTH<=16, 1<=TOP_K<=16, TOTAL 0 (auto) or 2..128")
        return DynamicTree(d, k, n)
    return parse_tree(spec)


LOOKUP_TOKENS = 8  # default graft length of TREE+lookup


def split_lookup(spec: "str | list[list[int]] | DynamicTree") -> "tuple[str | list[list[int]] | DynamicTree, int]":
    """``TREE+lookup[:L]`` -> (TREE, L): graft up to L prompt-lookup tokens onto every tree (0 = off)."""
    if not isinstance(spec, str) or "+lookup" not in spec:
        return spec, 0
    base, _, arg = spec.partition("+lookup")
    try:
        n = int(arg[1:]) if arg.startswith(":") else (LOOKUP_TOKENS if not arg else -1)
    except ValueError:
        n = -1
    if not 1 <= n <= 32:
        raise ValueError(f"bad tree spec {spec!r}: use TREE+lookup or TREE+lookup:L with 1<=L<=32")
    return base, n


def prompt_lookup(history: list[int], max_tokens: int, max_ngram: int = 3, min_ngram: int = 2) -> list[int]:
    """Prompt lookup's guess: the tokens that followed the latest earlier occurrence of the
    history's last n-gram (longest n first). Answers that quote their prompt (numbers, code
    identifiers) are where a draft head is weakest and this is free."""
    end = len(history)
    for n in range(max_ngram, min_ngram - 1, -1):
        if end <= n:
            continue
        tail = history[end - n:]
        for s in range(end - n - 1, -1, -1):
            if history[s + n - 1] == tail[-1] and history[s:s + n] == tail:
                return list(history[s + n:s + n + max_tokens])
    return []


def graft_chain(paths: list[tuple[int, ...]], tokens: list[int], chain_tokens: list[int]
                ) -> tuple[list[tuple[int, ...]], list[int], list[tuple[int, ...]]]:
    """Add a chain of guessed tokens under the root of a tree given as node paths and tokens
    (node 0 = the root, path ()); nodes that already hold a prefix of the chain are reused, new
    nodes are appended as the last-ranked children. Returns the new paths and tokens, and the
    path of each chain token's node."""
    paths, tokens = list(paths), list(tokens)
    kids: dict[tuple[int, ...], dict[int, tuple[int, ...]]] = {}
    next_rank: dict[tuple[int, ...], int] = {}
    for p, t in zip(paths[1:], tokens[1:]):
        kids.setdefault(p[:-1], {}).setdefault(t, p)
        next_rank[p[:-1]] = max(next_rank.get(p[:-1], 0), p[-1] + 1)
    cur: tuple[int, ...] = ()
    chain_paths = []
    for t in chain_tokens:
        nxt = kids.get(cur, {}).get(t)
        if nxt is None:
            nxt = cur + (next_rank.get(cur, 0),)
            next_rank[cur] = nxt[-1] + 1
            kids.setdefault(cur, {})[t] = nxt
            paths.append(nxt)
            tokens.append(t)
        cur = nxt
        chain_paths.append(nxt)
    return paths, tokens, chain_paths


def select_nodes(scores: list[float], parents: list[int], budget: int) -> list[int]:
    """Indices of the `budget` best candidates by cumulative log-probability, ancestor-closed.

    Candidates are listed parent-first (`parents[i] < i`, -1 = the root). A child never scores
    above its parent, and ties go to the earlier index, so the best set is already closed under
    ancestors; the walk up only guards against rounding. Returned in ascending index order.
    """
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:max(0, budget)]
    chosen = set(order)
    for i in order:
        j = parents[i]
        while j >= 0 and j not in chosen:
            chosen.add(j)
            j = parents[j]
    return sorted(chosen)


def plan_children(drawn: list[float], slots: list[list[float]], keep: int, cap: int) -> list[int]:
    """How many children each frontier node of a sampled tree draws this level.

    drawn: values of the nodes already drawn (they stay, whatever comes). slots[r][j]: value of
    frontier node r's j-th draw (non-increasing in j). Takes the slots that rank among the best
    `keep` of drawn + slots (ties included), at most `cap` of them, best first. Per node the taken
    slots are a prefix, so the counts can be decided before anything is drawn.
    """
    ranked = sorted(drawn + [v for row in slots for v in row], reverse=True)
    worst = -math.inf if keep >= len(ranked) else (ranked[keep - 1] if keep > 0 else math.inf)
    counts = [0] * len(slots)
    for _, r, j in sorted((-v, r, j) for r, row in enumerate(slots) for j, v in enumerate(row))[: max(0, cap)]:
        if slots[r][j] >= worst and counts[r] == j:
            counts[r] += 1
    return counts


def lineage(i: int, parents: list[int]) -> list[int]:
    """Node i's ancestors, root-most first, then i itself (`parents[j]` < 0 ends the walk)."""
    line = []
    while i >= 0:
        line.append(i)
        i = parents[i]
    return line[::-1]


def visible(seen: list[list[int]], keys: Sequence[int]) -> torch.Tensor:
    """(len(seen), len(keys)) bool: row r may attend to key c where keys[c] is in seen[r]."""
    sets = [set(row) for row in seen]
    return torch.tensor([[k in row for k in keys] for row in sets], dtype=torch.bool).reshape(len(seen), len(keys))


def paths_of(selected: list[int], parents: list[int], ranks: list[int]) -> list[list[int]]:
    """Rank paths (the input of `build_tree`) of the selected candidates."""
    return [[ranks[j] for j in lineage(i, parents)] for i in selected]


def parse_tree(spec: str | list[list[int]]) -> list[list[int]]:
    """``paper`` | ``chain:K`` | an explicit list of paths."""
    if not isinstance(spec, str):
        return [list(p) for p in spec]
    if spec == "paper":
        return [list(p) for p in PAPER_TREE]
    if spec.startswith("chain:"):
        try:
            k = int(spec.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"bad tree spec {spec!r}: chain:K needs an integer K") from None
        if not 0 <= k <= 64:
            raise ValueError(f"bad tree spec {spec!r}: K must be in [0, 64]")
        return chain(k)
    raise ValueError(f"unknown tree {spec!r}: use paper, chain:K, dynamic[:D,K,N] or auto (each optionally +lookup[:L])")


@dataclass
class TreeBuffers:
    """Everything about one tree shape, computed once.

    Index 0 is the root; ``n = len(paths) + 1`` nodes in all. What only a static tree's drafting
    reads is computed on first use: a dynamic tree is built anew every round (twice with a lookup
    graft) and never reads it.
    """

    paths: list[tuple[int, ...]]  # path of every node, () for the root
    parent: list[int]  # parent node index (-1 for the root)
    depth: list[int]  # 0 for the root
    rank: list[int]  # which top-k child of its parent (0 = best)
    children: list[list[int]]  # child node indices, by rank
    max_depth: int
    ancestor_mask: torch.Tensor  # (n, n) bool: row i sees column j (j is i or an ancestor of i)
    ancestors: list[list[int]]  # the same as lists: row i's True columns, ascending
    position_offsets: torch.Tensor  # (n,) long: depth of each node, added to the root's position

    @property
    def n(self) -> int:
        return len(self.paths)

    @cached_property
    def retrieve(self) -> torch.Tensor:
        """(leaves, max_depth + 1) long: root-to-leaf node indices, padded with -1."""
        leaves = [i for i in range(self.n) if not self.children[i]]
        return torch.tensor([self.ancestors[leaf] + [-1] * (self.max_depth + 1 - len(self.ancestors[leaf]))
                             for leaf in leaves], dtype=torch.long)

    @cached_property
    def expand_nodes(self) -> list[list[int]]:
        """Drafting, per level d: the nodes of depth d that get a draft-head step (those with children)."""
        return [[i for i in range(self.n) if self.depth[i] == d and self.children[i]] for d in range(self.max_depth)]

    @cached_property
    def expand_topk(self) -> list[int]:
        """Per level: how many top candidates each expanded node needs (its largest child rank + 1)."""
        return [max(self.rank[c] for i in nodes for c in self.children[i]) + 1 for nodes in self.expand_nodes]

    @cached_property
    def draft_masks(self) -> list[torch.Tensor]:
        """Head-side tree attention: the expanded nodes of depth >= 1 get draft-head cache entries in
        level order; draft_masks[d] (d >= 1) says which of the entries so far each level-d node sees."""
        slots: list[int] = []
        masks = [torch.zeros(0, 0, dtype=torch.bool)]
        for d in range(1, self.max_depth):
            slots += self.expand_nodes[d]
            masks.append(visible([self.ancestors[i] for i in self.expand_nodes[d]], slots))
        return masks

    @cached_property
    def draft_seen(self) -> list[list[list[int]]]:
        """`draft_masks` as lists (one sequence's draft step reads them): per level d >= 1, per
        expanded node, the head-cache entries of this round it sees, ascending."""
        return [[row.nonzero().flatten().tolist() for row in mask] for mask in self.draft_masks]


_BUILT: dict[tuple[tuple[int, ...], ...], TreeBuffers] = {}  # shapes built so far (read-only once built)


def build_tree(spec: str | list[list[int]]) -> TreeBuffers:
    """The buffers of a tree shape. A dynamic tree is built every round, mostly as one of a few small
    shapes, so shapes are remembered (~40 us a round)."""
    raw = parse_tree(spec)
    paths = sorted({tuple(p) for p in raw}, key=lambda p: (len(p), p))
    if len(paths) != len(raw):
        raise ValueError("tree has duplicate paths")
    known = _BUILT.get(tuple(paths))
    if known is not None:
        return known
    index = {(): 0}
    for i, p in enumerate(paths, start=1):
        index[p] = i
    all_paths: list[tuple[int, ...]] = [()] + paths
    for p in paths:
        if any(r < 0 for r in p):
            raise ValueError(f"tree path {list(p)} has a negative rank")
        if p[:-1] not in index:
            raise ValueError(f"tree path {list(p)} has no parent {list(p[:-1])} in the tree")
    n = len(all_paths)
    parent = [-1] + [index[p[:-1]] for p in paths]
    depth = [len(p) for p in all_paths]
    rank = [0] + [p[-1] for p in paths]
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        children[parent[i]].append(i)
    for c in children:
        c.sort(key=lambda i: rank[i])
    max_depth = max(depth)

    # Python lists first, one tensor each: a dynamic tree is built anew every round
    ancestors = [lineage(i, parent) for i in range(n)]  # the nodes each sees: its ancestors and itself, ascending
    mask = visible(ancestors, range(n))

    tree = TreeBuffers(
        paths=all_paths,
        parent=parent,
        depth=depth,
        rank=rank,
        children=children,
        max_depth=max_depth,
        ancestor_mask=mask,
        ancestors=ancestors,
        position_offsets=torch.tensor(depth, dtype=torch.long),
    )
    if len(_BUILT) >= 4096:  # bounded: big dynamic trees rarely repeat
        _BUILT.clear()
    _BUILT[tuple(paths)] = tree
    return tree


def float_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool "may attend" (q, k) or (B, q, k) -> additive float mask (0 or the dtype's minimum),
    shape (1 or B, 1, q, k). A float mask works for both the eager and the SDPA attention of transformers."""
    out = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    out.masked_fill_(~allowed, torch.finfo(dtype).min)
    return out[None, None] if out.dim() == 2 else out[:, None]


def prefix_tree_mask(tree_allowed: torch.Tensor, prefix_len: int, lens: torch.Tensor | None = None) -> torch.Tensor:
    """(q, s) tree mask -> (q, prefix_len + s) mask where every query also sees the whole prefix.

    With `lens` (B,), a batch of ragged rows: row b's prefix is only its first lens[b] cache
    entries (the rest of the shared prefix region is padding or stale), giving (B, q, prefix_len + s).
    """
    q = tree_allowed.shape[0]
    dev = tree_allowed.device
    if lens is None:
        prefix = torch.ones(q, prefix_len, dtype=torch.bool, device=dev)
        return torch.cat([prefix, tree_allowed], dim=1)
    b = lens.shape[0]
    prefix = (torch.arange(prefix_len, device=dev)[None, :] < lens.to(dev)[:, None])[:, None, :].expand(b, q, prefix_len)
    return torch.cat([prefix, tree_allowed[None].expand(b, *tree_allowed.shape)], dim=2)
