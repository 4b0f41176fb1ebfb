"""``GraphedForward``: one graph per (B, T, kv_len, rows) key, preallocated inputs, outputs equal to
the plain forward's across steps whose commits change the lengths. On the CPU with
``eager_capture`` (same contract as a CUDA graph); benchmarks/gpu_verify_capture.py runs the
CUDA capture and compares it with eager on a GPU."""
from __future__ import annotations

import pytest
import torch

from helpers import tiny_llama
from verispec.models.graphs import GraphedForward, eager_capture
from verispec.models.kv_cache import KVCache
from verispec.core.tree import DraftTree, pack_trees

VOCAB = 64
ACCEPTED = {0: [0, 1, 2], 1: [0, 1], 2: [0, 3]}


def test_replays_equal_the_plain_forward_and_reuse_graphs(single_thread):
    model = tiny_llama(VOCAB, 32, 2, seed=2)
    ref, cache = (KVCache.for_model(model.cfg, 3, 64) for _ in range(2))
    graphs = GraphedForward(model, cache, capture=eager_capture)
    g = torch.Generator().manual_seed(0)
    for c in (ref, cache):
        c.advance([0, 1, 2], [5, 9, 2])
    trees = [DraftTree(torch.tensor([3, 4, 5]), torch.tensor([-1, 0, -1])), DraftTree.chain([7, 8, 9]),
             DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, -1, -1]))]
    outputs = []
    for rows in ([0, 1, 2], [0, 1, 2], [2, 0], [2, 0], [0, 1, 2]):
        sub = [trees[r] for r in rows]
        roots = torch.randint(0, VOCAB, (len(rows),), generator=g).tolist()
        tokens, positions, mask = pack_trees(sub, cache.lengths_of(rows), roots=roots)
        kv = cache.kv_len(rows, tokens.shape[1], 32)
        with torch.no_grad():
            want = model(tokens, positions, ref, attn_mask=mask, rows=torch.tensor(rows), hidden_layers=(0,))
            got = graphs(tokens, positions, kv, attn_mask=mask, rows=rows, hidden_layers=(0,))
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.hidden[0], want.hidden[0], rtol=1e-5, atol=1e-5)
        outputs.append(got)
        paths = [ACCEPTED[r] for r in rows]                  # root, accepted nodes (entries)
        keep = torch.tensor([p + [0] * (3 - len(p)) for p in paths])
        for c in (ref, cache):
            c.compact_batch(rows, keep, [len(p) for p in paths])
    assert len(graphs) == 2                        # one graph for rows 0..2, one for rows (2, 0)
    assert outputs[0] is outputs[1] is outputs[4] and outputs[2] is outputs[3]
    with pytest.raises(ValueError, match="below"):
        graphs(tokens, positions, 16, attn_mask=mask, rows=[0, 1, 2])
