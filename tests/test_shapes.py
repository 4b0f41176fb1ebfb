"""Bucketed shapes (issue #18 item 3): a forward given a host-known ``kv_len`` gives today's
logits (prefill, decode, tree verify; ragged batches, row subsets; Gemma-3 sliding layers); the
cache's host mirror of the lengths; ``compact_batch`` equals ``compact`` row by row; and the verify
forward compiles with ``fullgraph=True`` and reuses one graph for every step inside a bucket."""
from __future__ import annotations

import pytest
import torch

from helpers import randomise, tiny_llama
from verispec.models.config import ModelConfig
from verispec.models.kv_cache import CacheFullError, KVCache, bucket_len
from verispec.models.transformer import Transformer
from verispec.core.tree import DraftTree, pack_trees

VOCAB, GRANULE = 64, 16


def tiny_gemma3() -> Transformer:
    """3 layers, 0 and 2 sliding (window 5), Gemma-3 norms, GeGLU, soft-capped logits."""
    cfg = ModelConfig(arch="gemma3", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=8, hidden_act="gelu_tanh", embed_scale=32 ** 0.5,
                      qk_norm=True, sandwich_norm=True, query_scale=0.3, sliding_window=5,
                      sliding_layers=(0, 2), rope_local_theta=1000.0, final_logit_softcapping=20.0,
                      tie_word_embeddings=True)
    return randomise(Transformer(cfg), 3).requires_grad_(False)


MODELS = {"llama": lambda: tiny_llama(VOCAB, 32, 2, seed=1), "gemma3": tiny_gemma3}


def random_tree(n: int, g: torch.Generator) -> DraftTree:
    parents = [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, n)]
    return DraftTree(torch.randint(0, VOCAB, (n,), generator=g), torch.tensor(parents[:n]))


def accepted_keep(tree: DraftTree, g: torch.Generator) -> list[int]:
    """Entries of (root, nodes...) on a random path from the root (the root alone sometimes)."""
    if not len(tree) or torch.rand(1, generator=g) < 0.2:
        return [0]
    return tree.root_paths()[1 + int(torch.randint(0, len(tree), (1,), generator=g))]


class Pair:
    """Two caches driven in lockstep: one by today's forward, one by the bucketed forward."""

    def __init__(self, model, batch: int, max_len: int):
        self.model = model
        self.ref = KVCache.for_model(model.cfg, batch, max_len)
        self.new = KVCache.for_model(model.cfg, batch, max_len)

    def forward(self, tokens, positions, rows, mask=None):
        with torch.no_grad():
            want = self.model(tokens, positions, self.ref, attn_mask=mask, rows=torch.tensor(rows)).logits
            kv = self.new.kv_len(rows, tokens.shape[1], GRANULE)
            got = self.model(tokens, positions, self.new, attn_mask=mask, rows=rows, kv_len=kv).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert kv % GRANULE == 0 or kv == self.new.max_len
        return want

    def assert_same_cache(self):
        """Same lengths; committed K/V equal up to float rounding (extra masked slots change the
        softmax's summation order, so a later layer's K/V may differ in the last bits)."""
        assert self.ref.lengths.tolist() == self.new.lengths.tolist() == self.new.lengths_of(range(self.new.max_batch))
        for layer, (a, b) in enumerate(zip(self.ref.k + self.ref.v, self.new.k + self.new.v)):
            for row, n in enumerate(self.ref.lengths.tolist()):
                torch.testing.assert_close(a[row, :, :n], b[row, :, :n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_bucketed_logits_equal_todays(arch, single_thread):
    """Ragged prefill, decode steps, then tree-verify steps with batched compaction, on all rows and
    on row subsets (consecutive and not): every step's logits equal today's forward."""
    g = torch.Generator().manual_seed(0)
    pair = Pair(MODELS[arch](), batch=4, max_len=72)
    for row, n in enumerate((9, 3, 14, 6)):                       # prefill, one row at a time
        toks = torch.randint(0, VOCAB, (1, n), generator=g)
        pair.forward(toks, torch.arange(n)[None], [row])
        for c in (pair.ref, pair.new):
            c.advance([row], n)
    for step in range(4):                                        # decode: all rows, then a subset
        rows = [0, 1, 2, 3] if step % 2 == 0 else [3, 1]
        starts = pair.new.lengths_of(rows)
        pair.forward(torch.randint(0, VOCAB, (len(rows), 1), generator=g), torch.tensor(starts)[:, None], rows)
        for c in (pair.ref, pair.new):
            c.advance(rows, 1)
    for step, rows in enumerate(([0, 1, 2, 3], [1, 2], [2, 0, 3], [0, 1, 2, 3])):   # tree verify
        trees = [random_tree(int(torch.randint(0, 7, (1,), generator=g)), g) for _ in rows]
        roots = torch.randint(0, VOCAB, (len(rows),), generator=g).tolist()
        tokens, positions, mask = pack_trees(trees, pair.new.lengths_of(rows), roots=roots)
        pair.forward(tokens, positions, rows, mask)
        keeps = [accepted_keep(t, g) for t in trees]
        for row, keep in zip(rows, keeps):
            pair.ref.compact(row, torch.tensor(keep))
        padded = torch.tensor([k + [-7] * (tokens.shape[1] - len(k)) for k in keeps])
        pair.new.compact_batch(rows, padded, [len(k) for k in keeps])
        pair.assert_same_cache()


def test_kv_len_is_checked_and_bucketed():
    model = MODELS["llama"]()
    cache = KVCache.for_model(model.cfg, 2, 40)
    cache.advance([0, 1], [30, 5])
    assert cache.kv_len([1], 1, 16) == 16 and cache.kv_len([0, 1], 3, 16) == 40 and cache.kv_len([0], 2) == 40
    assert [bucket_len(n, 100, 64) for n in (1, 64, 65, 100)] == [64, 64, 100, 100]
    with pytest.raises(CacheFullError):
        cache.kv_len([0], 11)
    toks = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="below"):
        model(toks, torch.zeros(2, 3, dtype=torch.long), cache, kv_len=32)
    with pytest.raises(CacheFullError):
        model(toks, torch.zeros(2, 3, dtype=torch.long), cache, kv_len=41)


def test_host_mirror_follows_every_commit():
    """advance, rollback, compact, compact_batch, write_prefix, reset, and an outside in-place write
    (noticed through the tensor's version counter) all keep ``lengths_of`` equal to ``lengths``."""
    cache = KVCache(1, 3, 1, 20, 2)
    same = lambda: cache.lengths_of(range(3)) == cache.lengths.tolist()   # noqa: E731
    cache.advance(torch.tensor([0, 2]), torch.tensor([4, 6]))
    assert same() and cache.lengths_of([2, 0]) == [6, 4]
    cache.advance(1, 3)
    cache.rollback([2], 5)
    assert same() and cache.lengths.tolist() == [4, 3, 5]
    cache.compact(0, torch.tensor([0, 2]))
    cache.compact_batch([1, 2], torch.tensor([[1, 0], [0, 3]]), [1, 2])
    assert same() and cache.lengths.tolist() == [6, 4, 7]
    cache.reset(torch.tensor([1]))
    cache.write_prefix(1, torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
    assert same() and cache.lengths.tolist() == [6, 2, 7]
    with torch.inference_mode():
        cache.lengths[0] = 9                                     # not through a commit method
    assert same() and cache.lengths_of([0]) == [9]
    cache.reset()
    assert same() and cache.lengths.tolist() == [0, 0, 0]


@pytest.mark.parametrize("seed", range(4))
def test_compact_batch_equals_compact_row_by_row(seed):
    """Random K/V, ragged lengths (one row nearly full, so padded entries would run past the
    end), random increasing keeps (identity keeps and empty keeps included): ``compact_batch``
    leaves every tensor bit-identical to ``compact`` called row by row, and so does its copy
    step alone over every row (what a cache on an accelerator runs: no identity rows skipped)."""
    g = torch.Generator().manual_seed(seed)
    layers, rows, max_len, width = 2, 5, 24, 6
    a = KVCache(layers, rows, 2, max_len, 3)
    for t in a.k + a.v:
        t.copy_(torch.randn(t.shape, generator=g))
    a.advance(range(rows), [3, 0, max_len - width, 11, 7])
    b, c = KVCache(layers, rows, 2, max_len, 3), KVCache(layers, rows, 2, max_len, 3)
    for s, d, e in zip(a.k + a.v, b.k + b.v, c.k + c.v):
        d.copy_(s)
        e.copy_(s)
    b.advance(range(rows), a.lengths_of(range(rows)))
    c.advance(range(rows), a.lengths_of(range(rows)))
    chosen = [1, 4, 2, 0] if seed % 2 else [3, 2, 0, 1, 4]
    keeps = []
    for i, row in enumerate(chosen):
        kind = (seed + i) % 3
        n = int(torch.randint(0, width + 1, (1,), generator=g))
        keep = list(range(n)) if kind == 0 else sorted(torch.randperm(width, generator=g)[:n].tolist())
        keeps.append(keep)
        a.compact(row, torch.tensor(keep, dtype=torch.long))
    padded = torch.tensor([k + [width + 99] * (width - len(k)) for k in keeps])
    counts = [len(k) for k in keeps]
    b.compact_batch(chosen, padded, counts)
    at = torch.tensor(chosen)                  # a device cache's path: identity rows moved too
    c._move(at, c.lengths[at], padded, torch.tensor(counts))
    c.advance(chosen, counts)
    assert a.lengths.tolist() == b.lengths.tolist() == b.lengths_of(range(rows)) == c.lengths.tolist()
    for x, y, z in zip(a.k + a.v, b.k + b.v, c.k + c.v):
        assert torch.equal(x, y) and torch.equal(x, z)


def test_verify_forward_compiles_whole_and_reuses_its_graph(single_thread):
    """``torch.compile(fullgraph=True)`` of the bucketed verify forward: no graph break, the
    compiled logits equal eager ones, and a second step with other row lengths inside the same
    bucket runs the same graph (recompiling is an error)."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters
    model = MODELS["llama"]()
    cache = KVCache.for_model(model.cfg, 2, 64).mark_static_addresses()
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (2, 5), generator=g)
    trees = [random_tree(4, g), random_tree(3, g)]

    def verify(tokens, positions, mask, kv_len: int):
        return model(tokens, positions, cache, attn_mask=mask, kv_len=kv_len).logits

    dynamo.reset()
    counters.clear()
    compiled = torch.compile(verify, fullgraph=True, backend="eager", dynamic=False)
    cache.advance([0, 1], [7, 12])
    with torch.no_grad():
        for step in range(2):
            _, positions, mask = pack_trees(trees, cache.lengths_of([0, 1]), roots=[1, 2])
            kv = cache.kv_len([0, 1], 5, 32)
            assert kv == 32
            want = verify(tokens, positions, mask, kv)
            with dynamo.config.patch(error_on_recompile=step > 0):
                got = compiled(tokens, positions, mask, kv)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            cache.advance([0, 1], [3, 1])                    # next step: other lengths, same bucket
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


def test_gpu_capture_benchmark_runs_its_cpu_fallback(tmp_path, monkeypatch, single_thread):
    """benchmarks/gpu_verify_capture.py on a tiny model without CUDA, with its CPU stand-ins for the
    captured variants: it says so, and every variant's logits (a second step in the same bucket
    included) equal today's forward."""
    import importlib.util
    import json
    import sys
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_verify_capture.py"
    spec = importlib.util.spec_from_file_location("gpu_verify_capture", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "capture"
    monkeypatch.setattr(sys, "argv", ["x", "--tiny", "--device", "cpu", "--cpu-standins", "--reps", "2",
                                      "--context", "40", "--batches", "1,3", "--tree-tokens", "4", "--out", str(out)])
    mod.main()
    res = json.loads(out.with_suffix(".json").read_text())
    assert res["note"] == mod.STANDIN_MSG and len(res["rows"]) == 2
    for r in res["rows"]:
        assert not [k for k in r if k.endswith("_error")], r
        diffs = [r[k] for k in ("eager_max_abs_diff", "cuda_graph_max_abs_diff", "compiled_max_abs_diff",
                                "cuda_graph_reused", "compiled_reused")]
        assert max(diffs) < 1e-5, r
        assert r["cuda_graph_graphs"] == r["compiled_graphs"] == 1, r
    assert "not a measurement" in out.with_suffix(".md").read_text()
