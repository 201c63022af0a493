import pytest
import torch

from eaglespec.spec.tree import PAPER_TREE, build_tree, chain, float_mask, parse_tree, prefix_tree_mask


def test_paper_tree_shape():
    t = build_tree("paper")
    assert t.n == 26 and t.max_depth == 5
    assert len(PAPER_TREE) == 25
    assert [len(t.children[0])] == [4]
    # every level is contiguous and parents come first
    assert t.depth == sorted(t.depth)
    assert all(t.parent[i] < i for i in range(1, t.n))


def test_ancestor_mask_matches_paths():
    t = build_tree("paper")
    for i, pi in enumerate(t.paths):
        for j, pj in enumerate(t.paths):
            assert bool(t.ancestor_mask[i, j]) == (pi[: len(pj)] == pj), (pi, pj)


def test_retrieve_lists_every_root_to_leaf_path():
    t = build_tree("paper")
    leaves = {p for p in t.paths if not any(q[:-1] == p for q in t.paths if q)}
    got = set()
    for row in t.retrieve.tolist():
        nodes = [i for i in row if i >= 0]
        assert nodes[0] == 0
        for a, b in zip(nodes, nodes[1:]):
            assert t.parent[b] == a
        got.add(t.paths[nodes[-1]])
    assert got == leaves


def test_position_offsets_are_depths():
    t = build_tree("paper")
    assert t.position_offsets.tolist() == [len(p) for p in t.paths]


def test_chain_and_parse():
    assert chain(3) == [[0], [0, 0], [0, 0, 0]]
    t = build_tree("chain:3")
    assert t.n == 4 and t.expand_topk == [1, 1, 1]
    assert torch.equal(t.ancestor_mask, torch.ones(4, 4, dtype=torch.bool).tril())
    assert build_tree("chain:0").n == 1
    assert parse_tree([[0], [1]]) == [[0], [1]]


@pytest.mark.parametrize("bad", ["chain:x", "chain:-1", "bushy", [[0, 0]], [[0], [0]], [[-1]]])
def test_bad_trees(bad):
    with pytest.raises(ValueError):
        build_tree(bad)


def test_draft_masks_see_ancestors_among_expanded_nodes():
    t = build_tree("paper")
    slots = []
    for d in range(1, t.max_depth):
        slots += t.expand_nodes[d]
        m = t.draft_masks[d]
        assert m.shape == (len(t.expand_nodes[d]), len(slots))
        for r, i in enumerate(t.expand_nodes[d]):
            for c, j in enumerate(slots):
                assert bool(m[r, c]) == bool(t.ancestor_mask[i, j])
    # expand top-k covers the highest child rank
    assert t.expand_topk == [4, 3, 3, 3, 2]


def test_masks():
    allowed = torch.tensor([[True, False], [True, True]])
    full = prefix_tree_mask(allowed, 3)
    assert full.shape == (2, 5) and full[:, :3].all()
    fm = float_mask(full, torch.float32)
    assert fm.shape == (1, 1, 2, 5)
    assert fm[0, 0, 0, 4] == torch.finfo(torch.float32).min and fm[0, 0, 1, 4] == 0


# -- dynamic trees (EAGLE-2) ----------------------------------------------------------------------
from eaglespec.spec.tree import DynamicTree, parse_spec, paths_of, plan_children, select_nodes  # noqa: E402


def test_parse_spec_dynamic_and_auto():
    assert parse_spec("dynamic") == DynamicTree()
    assert parse_spec("dynamic:3,2,8") == DynamicTree(3, 2, 8)
    assert parse_spec("auto").auto and not parse_spec("dynamic").auto
    assert parse_spec("paper") == parse_tree("paper")
    for bad in ("dynamic:3,2", "dynamic:0,2,8", "dynamic:3,2,1", "dynamic:a,b,c"):
        with pytest.raises(ValueError):
            parse_spec(bad)


def test_select_nodes_best_and_ancestor_closed():
    # root -> 0 (-0.1), 1 (-1.0); 0 -> 2 (-0.3), 3 (-2.5); 1 -> 4 (-1.1); 2 -> 5 (-0.35)
    parents = [-1, -1, 0, 0, 1, 2]
    scores = [-0.1, -1.0, -0.3, -2.5, -1.1, -0.35]
    ranks = [0, 1, 0, 1, 0, 0]
    assert select_nodes(scores, parents, 3) == [0, 2, 5]
    assert select_nodes(scores, parents, 4) == [0, 1, 2, 5]
    assert select_nodes(scores, parents, 0) == []
    assert select_nodes(scores, parents, 99) == list(range(6))
    # ties go to the earlier (shallower) candidate, so a child never displaces its parent
    assert select_nodes([-0.5, -0.5, -0.5], [-1, 0, 1], 2) == [0, 1]
    # rounding that puts a child above its parent still yields a closed set
    assert select_nodes([-0.5, -0.4999], [-1, 0], 1) == [0, 1]
    paths = paths_of([0, 1, 2, 5], parents, ranks)
    assert paths == [[0], [1], [0, 0], [0, 0, 0]]
    t = build_tree(paths)
    assert t.n == 5 and t.max_depth == 3


def test_plan_children_takes_the_best_slots_as_prefixes():
    slots = [[0.5, 0.2, 0.1], [0.4, 0.3, 0.05]]
    assert plan_children([], slots, keep=3, cap=99) == [1, 2]  # 0.5, 0.4, 0.3
    assert plan_children([0.9, 0.45], slots, keep=3, cap=99) == [1, 0]  # drawn nodes hold two places
    assert plan_children([], slots, keep=99, cap=4) == [2, 2]  # the cap takes the best four
    assert plan_children([], slots, keep=0, cap=99) == [0, 0]
    assert plan_children([], [[0.3, 0.3, 0.3]], keep=2, cap=99) == [3]  # ties are all in
    assert plan_children([], [[0.5, 0.5], [0.5]], keep=2, cap=2) == [2, 0]  # ties: lower node first


def test_prompt_lookup_finds_the_latest_longest_match():
    from eaglespec.spec.tree import prompt_lookup

    h = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # last trigram (5, 2, 3) never occurred before; bigram (2, 3) did, latest at index 6 -> 7, 8, ...
    assert prompt_lookup(h, 3) == [7, 8, 5]
    assert prompt_lookup(h + [7], 2) == [8, 5]  # trigram (2, 3, 7) wins over the older bigram
    assert prompt_lookup([4, 5, 6], 4) == [] and prompt_lookup([3], 4) == []
    assert prompt_lookup([1, 2, 1, 2], 5) == [1, 2]  # the continuation may run into the tail


def test_graft_chain_reuses_prefix_nodes_and_appends_the_rest():
    from eaglespec.spec.tree import graft_chain

    t = build_tree([[0], [1], [0, 0]])  # root, a(0), b(1), a->c(0,0)
    tokens = [50, 10, 11, 12]  # by t.paths: (), (0,), (1,), (0, 0)
    paths, toks, chain = graft_chain(t.paths, tokens, [10, 12, 13])  # follows a -> c, then adds 13 under c
    assert paths[4:] == [(0, 0, 0)] and toks[4:] == [13] and chain == [(0,), (0, 0), (0, 0, 0)]
    paths, toks, chain = graft_chain(t.paths, tokens, [10, 14, 15])  # branches off a as its second child
    assert paths[4:] == [(0, 1), (0, 1, 0)] and toks[4:] == [14, 15] and chain[1:] == paths[4:]
    paths, toks, _ = graft_chain(t.paths, tokens, [16])  # a new third child of the root
    assert paths[4:] == [(2,)] and toks[4:] == [16]
    built = build_tree([list(p) for p in paths[1:]])  # always a valid tree
    assert built.n == 5


def test_split_lookup():
    from eaglespec.spec.tree import LOOKUP_TOKENS, split_lookup

    assert split_lookup("auto") == ("auto", 0)
    assert split_lookup("auto+lookup") == ("auto", LOOKUP_TOKENS)
    assert split_lookup("chain:1+lookup:5") == ("chain:1", 5)
    for bad in ("auto+lookup:0", "auto+lookup:x", "auto+lookupy", "auto+lookup:99"):
        with pytest.raises(ValueError, match="lookup"):
            split_lookup(bad)


def test_build_tree_remembers_shapes_and_still_checks_them():
    """A dynamic tree is built every round: one shape is built once (whatever the paths' order), and
    a remembered shape does not let a bad one through."""
    a = build_tree([[0], [1], [0, 0]])
    assert build_tree([[0, 0], [1], [0]]) is a and a.n == 4 and a.children[0] == [1, 2]
    assert build_tree([[0], [1]]) is not a
    for bad in ([[0], [0]], [[0], [1, 0, 0]], [[-1]]):
        with pytest.raises(ValueError):
            build_tree(bad)
