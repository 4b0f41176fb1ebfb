"""The shared tree pieces of ``verispec.core.tree``: ``ChoicesFiller`` (every static choices tree:
``tree_from_choices``, the EAGLE static builder, the draft model's tree) and ``pack_trees`` (every
ragged tree forward: the engine's verify, the draft model's levels, the EAGLE head's levels).
Pure Python/torch, no model."""
from __future__ import annotations

import random

import pytest
import torch

from verispec.core.tree import ChoicesFiller, DraftTree, pack_trees, tree_from_choices, validate_choices

CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
RANKED = {(): [5, 6], (0,): [7, 8, 9], (1,): [4], (0, 0): [3]}      # only 2 candidates at the root


def fill(choices, ranked: dict, budget=None, payload=False) -> ChoicesFiller:
    """Drive a filler level by level the way the drafters do."""
    f = ChoicesFiller(choices, budget)
    for depth in range(f.max_depth):
        for path in f.expandable(depth):
            toks = ranked[path]
            f.add_children(path, toks, [torch.full((4,), float(t)) for t in toks] if payload else None)
    return f


def reference(choices, ranked: dict, budget=None) -> tuple[list[int], list[int]]:
    """Declarative: a choice is a node iff every rank on its path has a candidate; nodes in
    (depth, path) order, the first ``budget`` of them."""
    kept = [c for c in validate_choices(choices)
            if all(c[i] < len(ranked.get(c[:i], [])) for i in range(len(c)))][:budget]
    index = {c: i for i, c in enumerate(kept)}
    return [ranked[c[:-1]][c[-1]] for c in kept], [index.get(c[:-1], -1) for c in kept]


def test_filler_by_hand():
    f = fill(CHOICES, RANKED)
    # (2,) has no third root candidate; (0, 0, 0) hangs below node 2 = (0, 0)
    assert f.tokens == [5, 6, 7, 8, 4, 3] and f.parents == [-1, -1, 0, 0, 1, 2]
    assert f.index == {(): -1, (0,): 0, (1,): 1, (0, 0): 2, (0, 1): 3, (1, 0): 4, (0, 0, 0): 5}
    cut = fill(CHOICES, RANKED, budget=3)
    assert cut.tokens == [5, 6, 7] and cut.parents == [-1, -1, 0] and cut.full
    cut.add_children((0, 0), [3])                        # the budget is spent: nothing added
    assert len(cut) == 3 and (0, 0, 0) not in cut.index
    tree = tree_from_choices(CHOICES, RANKED.__getitem__)
    assert tree.tokens.tolist() == f.tokens and tree.parents.tolist() == f.parents and tree.q is None


def test_children_of_a_skipped_node_are_skipped_and_never_ranked():
    calls = []

    def ranked(path):
        calls.append(path)
        return {(): [5], (0,): []}[path]                 # no second root candidate: (1,) is skipped
    tree = tree_from_choices([[0], [1], [1, 0], [1, 1], [0, 0]], ranked)
    assert tree.tokens.tolist() == [5] and tree.parents.tolist() == [-1]
    assert calls == [(), (0,)]                           # once per created node with children
    f = ChoicesFiller([[0], [1], [1, 0], [0, 0]])
    f.add_children((), [5])
    assert f.expandable(1) == [(0,)] and len(f) == 1


def test_filler_matches_reference_on_random_choice_sets():
    rnd = random.Random(17)
    for case in range(200):
        choices: set = set()
        for _ in range(rnd.randint(1, 14)):
            c = (rnd.randint(0, 3),)
            while rnd.random() < 0.5 and len(c) < 4:
                c += (rnd.randint(0, 2),)
            choices |= {c[:i] for i in range(1, len(c) + 1)}
        ranked = {p: [rnd.randint(0, 99) for _ in range(rnd.randint(0, 4))]
                  for p in {c[:-1] for c in choices}}
        budget = rnd.choice([None, 1, 2, 3, 5, 8, 30])
        f = fill(sorted(choices), ranked, budget)
        assert (f.tokens, f.parents) == reference(choices, ranked, budget), case
        whole = tree_from_choices(sorted(choices), ranked.__getitem__).prefix(budget)
        assert (whole.tokens.tolist(), whole.parents.tolist()) == (f.tokens, f.parents), case


def test_filler_payload_becomes_q():
    f = fill(CHOICES, RANKED, payload=True)
    tree = f.tree(q=True)
    assert tree.q.shape == (6, 4) and tree.q[:, 0].tolist() == [5.0, 6.0, 7.0, 8.0, 4.0, 3.0]
    assert f.tree().q is None and ChoicesFiller(CHOICES).tree(q=True).q is None


# -- pack_trees ------------------------------------------------------------------------------------
T_A = DraftTree(torch.tensor([10, 11, 12]), torch.tensor([-1, 0, -1]))      # depths 1, 2, 1
T_B = DraftTree(torch.tensor([20]), torch.tensor([-1]))


def test_pack_trees_with_roots():
    tokens, positions, mask = pack_trees([T_A, T_B, DraftTree.empty()], torch.tensor([5, 7, 9]), roots=[1, 2, 3])
    assert tokens.tolist() == [[1, 10, 11, 12], [2, 20, 0, 0], [3, 0, 0, 0]]
    assert positions.tolist() == [[5, 6, 7, 6], [7, 8, 7, 7], [9, 9, 9, 9]]
    assert tokens.dtype == positions.dtype == torch.long and mask.dtype == torch.bool
    want = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]],
                         [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]],
                         [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]], dtype=torch.bool)
    assert torch.equal(mask, want)


def test_pack_trees_without_roots():
    tokens, positions, mask = pack_trees([T_A, T_B, DraftTree.empty()], [5, 7, 9])
    assert tokens.tolist() == [[10, 11, 12], [20, 0, 0], [0, 0, 0]]
    assert positions.tolist() == [[5, 6, 5], [7, 7, 7], [9, 9, 9]]
    want = torch.tensor([[[1, 0, 0], [1, 1, 0], [0, 0, 1]]] + [torch.eye(3, dtype=torch.int).tolist()] * 2,
                        dtype=torch.bool)
    assert torch.equal(mask, want)
    tokens, positions, mask = pack_trees([DraftTree.empty()] * 2, [3, 4])    # at least one column
    assert tokens.tolist() == [[0], [0]] and positions.tolist() == [[3], [4]] and mask.all()


@pytest.mark.parametrize("roots", [None, [7, 8]])
def test_pack_trees_rows_agree_with_each_tree_alone(roots):
    trees = [tree_from_choices(CHOICES, RANKED.__getitem__), T_B]
    tokens, positions, mask = pack_trees(trees, [4, 6], roots)
    for b, tree in enumerate(trees):
        t, p, m = pack_trees([tree], [[4, 6][b]], None if roots is None else roots[b:b + 1])
        n = t.shape[1]
        assert torch.equal(tokens[b, :n], t[0]) and torch.equal(positions[b, :n], p[0])
        assert torch.equal(mask[b, :n, :n], m[0]) and not mask[b, n:, :n].any()
