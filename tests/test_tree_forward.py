"""Tree attention and cache compaction on the real model."""
from __future__ import annotations

import torch

from verispec.models.kv_cache import KVCache
from verispec.core.tree import DraftTree, tree_from_choices, validate_choices


def _prefill(target, ids, extra=16):
    cache = KVCache.for_model(target.config, 1, len(ids) + extra + 8)
    with torch.no_grad():
        target.model(torch.tensor([ids]), torch.arange(len(ids))[None], cache)
    cache.advance(torch.tensor([0]), len(ids))
    return cache


def _tree():
    # root -> a(0) -> c(2) -> e(4); root -> b(1) -> d(3); a -> f(5)
    return DraftTree(torch.tensor([330, 1050, 2200, 17, 903, 48]), torch.tensor([-1, -1, 0, 1, 2, 0]))


def test_tree_logits_equal_causal_forward_of_each_path(target, chat_prompts):
    ids = chat_prompts[0][:-1]
    root = chat_prompts[0][-1]
    tree = _tree()
    cache = _prefill(target, ids)
    n = len(ids)
    tokens = torch.cat([torch.tensor([root]), tree.tokens])[None]
    with torch.no_grad():
        out = target.model(tokens, tree.positions(n)[None], cache, attn_mask=tree.ancestor_mask()[None]).logits[0]
        par = tree.parents.tolist()
        for node in range(len(tree)):
            path, i = [], node
            while i >= 0:
                path.append(int(tree.tokens[i]))
                i = par[i]
            seq = ids + [root] + path[::-1]
            ref = target.model(torch.tensor([seq]), torch.arange(len(seq))[None]).logits[0, -1]
            assert (out[node + 1] - ref).abs().max().item() < 1e-3, f"node {node}"


def test_compaction_equals_sequential_decoding(target, chat_prompts):
    ids = chat_prompts[1][:-1]
    root = chat_prompts[1][-1]
    tree = _tree()
    n = len(ids)
    cache = _prefill(target, ids)
    tokens = torch.cat([torch.tensor([root]), tree.tokens])[None]
    with torch.no_grad():
        target.model(tokens, tree.positions(n)[None], cache, attn_mask=tree.ancestor_mask()[None])
    accepted = [0, 2, 4]                                   # path a -> c -> e
    cache.compact(0, torch.tensor([0] + [a + 1 for a in accepted]))
    ref = _prefill(target, ids + [root] + [int(tree.tokens[a]) for a in accepted])
    length = int(ref.lengths[0])
    assert int(cache.lengths[0]) == length
    for layer in range(target.config.num_layers):
        assert torch.allclose(cache.k[layer][0, :, :length], ref.k[layer][0, :, :length], atol=1e-4)
        assert torch.allclose(cache.v[layer][0, :, :length], ref.v[layer][0, :, :length], atol=1e-4)


def test_tree_helpers():
    tree = _tree()
    assert tree.depth.tolist() == [1, 1, 2, 2, 3, 2]
    assert sorted(tree.paths()) == [[0, 2, 4], [0, 5], [1, 3]]
    m = tree.ancestor_mask()
    assert m[5].tolist() == [True, True, False, True, False, True, False]
    assert tree.positions(10).tolist() == [10, 11, 11, 12, 12, 13, 12]
    chain = DraftTree.chain([5, 6, 7])
    assert chain.parents.tolist() == [-1, 0, 1] and chain.paths() == [[0, 1, 2]]
    assert validate_choices([[0, 1], [0], (1,)]) == [(0,), (1,), (0, 1)]
    t = tree_from_choices([[0], [1], [0, 0], [0, 1]], lambda path: {(): [9, 8], (0,): [7, 6]}[path])
    assert t.tokens.tolist() == [9, 8, 7, 6] and t.parents.tolist() == [-1, -1, 0, 0]


def test_bad_trees_are_refused():
    import pytest
    with pytest.raises(ValueError, match="topological"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([1, -1]))
    with pytest.raises(ValueError, match="same length"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1]))
    with pytest.raises(ValueError, match="q must be"):
        DraftTree(torch.tensor([1]), torch.tensor([-1]), torch.ones(2, 4))
    with pytest.raises(ValueError, match="parent"):
        validate_choices([[0, 0]])
