"""The compiled decode/verify forward (``models.compiled``): the logits of the eager forward within
float tolerance on decode and tree-verify shapes, greedy decoding (vanilla and speculative) equal
to the eager engine's, eager fallback for other rows, compile time reported. A tiny model keeps
the compilation to seconds; the real-model check is marked slow."""
from __future__ import annotations

import pytest
import torch

from helpers import tiny_llama
from verispec import SamplingParams
from verispec.core.kv_budget import PagedKV
from verispec.drafting.draft_model import DraftModelDrafter
from verispec.core.engine import Engine, Sequence
from verispec.models.compiled import CompiledForward
from verispec.models.kv_cache import KVCache
from verispec.core.tree import DraftTree


@pytest.fixture(scope="module")
def tiny():
    model = tiny_llama(48, 32, 2, seed=3).fuse_()
    return model, CompiledForward(model)


def test_compiled_logits_match_eager_on_decode_and_tree_shapes(tiny):
    model, compiled = tiny
    torch.manual_seed(0)
    with torch.inference_mode():
        caches = [KVCache.for_model(model.cfg, 2, 192) for _ in range(2)]
        ids = torch.randint(0, 48, (2, 70))
        for c in caches:
            model(ids, torch.arange(70).expand(2, 70), c)
            c.advance([0, 1], 70)
        tree = DraftTree(torch.tensor([5, 9, 7]), torch.tensor([-1, -1, 0]))
        mask = tree.ancestor_mask()                                   # [4, 4]: root and nodes
        for toks, pos, m in ((torch.tensor([[3], [4]]), torch.tensor([[70], [70]]), None),
                             (torch.tensor([[3, 5, 9, 7]] * 2), torch.tensor([[70, 71, 71, 72]] * 2), mask.expand(2, 4, 4))):
            t = toks.shape[1]
            want = model(toks, pos, caches[0], attn_mask=m, kv_len=caches[0].kv_len([0, 1], t)).logits
            got = compiled(toks, pos, caches[1], attn_mask=m, rows=[0, 1], kv_len=caches[1].kv_len([0, 1], t)).logits
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert compiled.graphs >= 2 and compiled.compile_s > 0 and compiled.eager_calls == 0
    assert "graph(s)" in compiled.describe()


def test_other_rows_run_eager(tiny):
    model, compiled = tiny
    with torch.inference_mode():
        cache = KVCache.for_model(model.cfg, 3, 64)
        cache.advance([2], 0)
        before = compiled.eager_calls
        out = compiled(torch.tensor([[1]]), torch.tensor([[0]]), cache, rows=[2], kv_len=64)
        want = model(torch.tensor([[1]]), torch.tensor([[0]]), cache, rows=[2], kv_len=64)
    assert compiled.eager_calls == before + 1 and torch.equal(out.logits, want.logits)


def test_compiled_engine_greedy_equals_eager(tiny):
    model, compiled = tiny
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8]]

    def run(forward, drafter=None, max_len=96):
        engine = Engine(model, drafter, max_batch=2, max_len=max_len, forward=forward)
        seqs = [Sequence(prompt_ids=p, params=params) for p in prompts]
        engine.run(seqs)
        return [s.output_ids for s in seqs]
    eager = run(None)
    assert run(compiled) == eager
    draft = DraftModelDrafter(tiny_llama(48, 32, 1, seed=3), max_batch=2, max_len=96, num_speculative_tokens=3)
    assert run(compiled, draft) == eager
    graphs = compiled.graphs
    assert run(compiled, max_len=80) == eager                 # another cache size: the same graphs
    assert compiled.graphs == graphs
    # a longer prompt in a bigger cache (kv_len past the first cache's size): still no recompile
    long_prompts = [[(7 * i + j) % 48 for i in range(110)] for j in range(2)]

    def run_long(forward):
        engine = Engine(model, None, max_batch=2, max_len=200, forward=forward)   # kv_len < max_len
        seqs = [Sequence(prompt_ids=p, params=params) for p in long_prompts]
        engine.run(seqs)
        return [s.output_ids for s in seqs]
    assert run_long(compiled) == run_long(None)
    assert compiled.graphs == graphs


def test_rows_with_holes_run_compiled_with_ghost_rows(tiny, monkeypatch):
    """Three requests, the middle one finishing first: the batch of rows [0, 2] runs the compiled
    graph of rows 0..2 with row 1 as a ghost row (``core.row_padding``), and every output equals
    the eager engine's, vanilla and speculative."""
    import verispec.core.engine as engine_mod
    model, compiled = tiny
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
    budgets = [20, 5, 20]
    padded = []
    take = engine_mod.take_rows
    monkeypatch.setattr(engine_mod, "take_rows", lambda out, index: padded.append(index.tolist()) or take(out, index))

    def run(forward, drafter=None):
        engine = Engine(model, drafter, max_batch=3, max_len=96, forward=forward)
        seqs = [Sequence(prompt_ids=p, params=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
                for p, n in zip(prompts, budgets)]
        engine.run(seqs)
        return [s.output_ids for s in seqs]
    eager = run(None)
    assert not padded and [len(o) for o in eager] == budgets
    assert run(compiled) == eager and [0, 2] in padded
    padded.clear()
    draft = DraftModelDrafter(tiny_llama(48, 32, 1, seed=3), max_batch=3, max_len=96, num_speculative_tokens=3)
    assert run(compiled, draft) == eager and [0, 2] in padded


def test_ghost_rows_only_where_they_pay():
    """No padding for rows already 0..B-1, for more ghost rows than real ones, or for a ghost row
    whose committed length would widen the attended slots."""
    from verispec.core.row_padding import ghost_rows
    assert ghost_rows([0, 1, 2], [5, 5, 5], 1, 64) == []
    assert ghost_rows([0, 2], [5, 0, 5], 1, 64) == [1]
    assert ghost_rows([1, 3], [0, 5, 0, 5], 2, 64) == [0, 2]
    assert ghost_rows([0, 5], [5] * 6, 1, 64) == []                 # four ghosts for two rows
    assert ghost_rows([0, 2], [5, 70, 5], 1, 64) == []              # a long prefilling row: eager


@pytest.mark.slow
def test_compiled_smollm2_greedy_equals_eager(packed_target, head_prompts):
    from verispec import LLM
    greedy = SamplingParams(temperature=0, max_tokens=32)
    batch = [{"prompt_token_ids": p} for p in head_prompts[:1]]
    want = LLM(loaded=packed_target, max_num_seqs=1).generate(batch, greedy)
    llm = LLM(loaded=packed_target, max_num_seqs=1, compile=True, speculative_config={"method": "eagle3"})
    got = llm.generate(batch, greedy)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.compiled.graphs > 0


def test_shared_compiled_forward_is_one_per_model():
    """Every LLM over one model uses one compiled forward (graphs compiled once per process)."""
    a, b = tiny_llama(48, 32, 1, seed=1), tiny_llama(48, 32, 1, seed=2)
    assert CompiledForward.shared(a) is CompiledForward.shared(a)
    assert CompiledForward.shared(a) is not CompiledForward.shared(b)
    assert CompiledForward.shared(a).model is a


def test_a_model_changed_after_compiling_gets_a_new_compiled_forward():
    """The graphs do not guard the model's modules; ``shared`` notices a structural change (here
    fp16 packing after the first compile) by its signature and compiles anew: same logits as the
    packed model's eager forward."""
    model = tiny_llama(48, 32, 1, seed=4).fuse_()
    first = CompiledForward.shared(model)
    toks, pos = torch.tensor([[3]]), torch.tensor([[5]])
    with torch.inference_mode():
        cache = KVCache.for_model(model.cfg, 1, 64)
        cache.advance([0], 5)
        first(toks, pos, cache, kv_len=cache.kv_len([0], 1))
        model.pack_fp16_()
        again = CompiledForward.shared(model)
        assert again is not first and CompiledForward.shared(model) is again
        got = again(toks, pos, cache, kv_len=cache.kv_len([0], 1)).logits
        want = model(toks, pos, cache, kv_len=cache.kv_len([0], 1)).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_multi_token_forwards_share_one_graph(tiny):
    """Prefill and verify forwards of any length reuse one graph (no recompile per new length)."""
    model, compiled = tiny
    with torch.inference_mode():
        cache = KVCache.for_model(model.cfg, 1, 192)
        n = 0
        for t in (5, 3, 7, 2, 9):
            toks = torch.randint(0, 48, (1, t))
            pos = torch.arange(n, n + t)[None]
            want = model(toks, pos, cache, kv_len=cache.kv_len([0], t)).logits
            got = compiled(toks, pos, cache, kv_len=cache.kv_len([0], t)).logits
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            if t == 5:
                graphs = compiled.graphs
            cache.advance([0], t)
            n += t
    assert compiled.graphs == graphs


def test_batches_and_caches_of_any_size_share_one_graph_per_shape_kind():
    """Under a server the batch size changes every few steps and each engine sizes its cache:
    after one graph each for (B = 1 | B > 1) x (T = 1 | T > 1), no batch of 2..16 rows and no
    cache of 2..16 rows recompiles (a slice of the cache's rows once specialised every B)."""
    torch._dynamo.reset()
    model = tiny_llama(40, 32, 1, seed=4).fuse_()
    compiled = CompiledForward(model)

    def run(max_batch: int, b: int, t: int) -> None:
        cache = KVCache.for_model(model.cfg, max_batch, 100 + max_batch)
        rows = list(range(b))
        toks = torch.randint(0, 40, (b, t))
        pos = torch.arange(t)[None].expand(b, t).contiguous()
        mask = torch.ones(t, t, dtype=torch.bool).tril().expand(b, t, t)
        kw = dict(attn_mask=mask, rows=rows, kv_len=cache.kv_len(rows, t))
        torch.testing.assert_close(compiled(toks, pos, cache, **kw).logits, model(toks, pos, cache, **kw).logits,
                                   rtol=1e-4, atol=1e-4)
    with torch.inference_mode():
        for b in (1, 2):
            for t in (1, 3):
                run(2, b, t)
        graphs = compiled.graphs
        for max_batch, b in ((16, 5), (16, 16), (4, 3), (8, 1), (3, 2)):
            for t in (1, 4):
                run(max_batch, b, t)
    assert compiled.graphs == graphs and compiled.eager_calls == 0


def _speculating(layers: int, seed: int):
    """A fresh tiny model (no graph left by earlier tests), its speculating compiled forward and a
    cache holding a 6-token prompt."""
    torch._dynamo.reset()
    model = tiny_llama(40, 32, layers, seed=seed).fuse_()
    compiled = CompiledForward(model)
    compiled.speculative = True
    with torch.inference_mode():
        cache = KVCache.for_model(model.cfg, 1, 128)
        model(torch.randint(0, 40, (1, 6)), torch.arange(6)[None], cache)
        cache.advance([0], 6)
    return model, compiled, cache


def test_speculative_compiles_the_verify_graph_with_the_first():
    """With ``speculative`` set, the first one-token call also compiles the multi-token graph:
    a later verify forward compiles nothing."""
    model, compiled, cache = _speculating(layers=1, seed=5)
    with torch.inference_mode():
        one = torch.ones(1, 1, 1, dtype=torch.bool)
        compiled(torch.tensor([[3]]), torch.tensor([[6]]), cache, attn_mask=one, kv_len=cache.kv_len([0], 1))
        graphs = compiled.graphs
        mask = torch.ones(3, 3, dtype=torch.bool).tril()[None]
        got = compiled(torch.tensor([[3, 4, 5]]), torch.tensor([[6, 7, 8]]), cache, attn_mask=mask,
                       kv_len=cache.kv_len([0], 3)).logits
        want = model(torch.tensor([[3, 4, 5]]), torch.tensor([[6, 7, 8]]), cache, attn_mask=mask,
                     kv_len=cache.kv_len([0], 3)).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert compiled.graphs == graphs and graphs >= 2


def test_first_compile_on_a_full_cache_serves_other_caches():
    """The first graphs compiled while the forward attends every slot of its cache (prompt and
    answer fill it) still serve caches of other sizes: ``KVCache`` keeps a spare slot, so the K/V
    read is never the whole slot dimension (without it dynamo specialised the slot dimension, and
    the next cache failed: a ConstraintViolationError or a recompile in a timed run)."""
    torch._dynamo.reset()                                 # this must be the first compile
    model = tiny_llama(48, 32, 2, seed=4).fuse_()
    compiled = CompiledForward(model)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def run(forward, prompt_len, max_len):
        engine = Engine(model, None, max_batch=2, max_len=max_len, forward=forward)
        seqs = [Sequence(prompt_ids=[(3 * i + j) % 48 for i in range(prompt_len)], params=params)
                for j in range(2)]
        engine.run(seqs)
        return [s.output_ids for s in seqs]
    assert run(compiled, 40, 64) == run(None, 40, 64)      # 40 + 24 tokens: kv_len reaches 64
    graphs = compiled.graphs
    for prompt_len, max_len in ((50, 90), (100, 140), (30, 54)):
        assert run(compiled, prompt_len, max_len) == run(None, prompt_len, max_len)
    assert compiled.graphs == graphs


def test_speculative_compiles_the_one_token_graph_with_the_first_verify():
    """The other way round: a drafter whose every step verifies a tree (EAGLE-3) compiles its first
    multi-token graph; a later step with an empty tree (one token, with a mask and the same hidden
    layers) must not compile inside a timed run."""
    model, compiled, cache = _speculating(layers=2, seed=6)
    with torch.inference_mode():
        mask = torch.ones(3, 3, dtype=torch.bool).tril()[None]
        compiled(torch.tensor([[3, 4, 5]]), torch.tensor([[6, 7, 8]]), cache, attn_mask=mask,
                 hidden_layers=(0, 1), kv_len=cache.kv_len([0], 3))
        graphs = compiled.graphs
        one = torch.ones(1, 1, 1, dtype=torch.bool)
        got = compiled(torch.tensor([[3]]), torch.tensor([[6]]), cache, attn_mask=one, hidden_layers=(0, 1),
                       kv_len=cache.kv_len([0], 1))
        want = model(torch.tensor([[3]]), torch.tensor([[6]]), cache, attn_mask=one, hidden_layers=(0, 1),
                     kv_len=cache.kv_len([0], 1))
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
    assert compiled.graphs == graphs and graphs >= 2


def test_a_compiled_draft_model_proposes_what_the_eager_one_does(tiny):
    """``DraftModelDrafter(forward=CompiledForward(draft))``: on rows 0..B-1 every draft forward
    (catch-up feeds with ``logits_index``, chain steps) runs compiled, and the engine's output is
    the eager engine's."""
    model, compiled = tiny
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    draft_model = tiny_llama(48, 32, 1, seed=3).fuse_()
    draft_fwd = CompiledForward(draft_model)

    def run(drafter, batch):
        engine = Engine(model, drafter, max_batch=batch, max_len=96, forward=compiled)
        seqs = [Sequence(prompt_ids=[1, 2, 3, 4 + i], params=params) for i in range(batch)]
        engine.run(seqs)
        return [s.output_ids for s in seqs], engine.stats
    for batch in (1, 2):
        eager, _ = run(DraftModelDrafter(draft_model, max_batch=batch, max_len=96, num_speculative_tokens=3), batch)
        got, stats = run(DraftModelDrafter(draft_model, max_batch=batch, max_len=96, num_speculative_tokens=3,
                                           forward=draft_fwd), batch)
        assert got == eager and stats.num_draft_tokens > 0
    assert draft_fwd.graphs >= 2 and draft_fwd.eager_calls == 0


@pytest.mark.slow
def test_a_compiled_draft_model_on_a_paged_engine_pages_its_cache(tiny):
    """On a paged engine the draft model's cache is paged too: its compiled forwards reserve their
    rows' blocks, the outputs are the static engine's and every block comes back (slow: the
    paged cache compiles graphs of its own)."""
    model, compiled = tiny
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    draft_model = tiny_llama(48, 32, 1, seed=3).fuse_()
    draft_fwd = CompiledForward(draft_model)

    def run(kv=None):
        engine = Engine(model, DraftModelDrafter(draft_model, max_batch=2, max_len=96, num_speculative_tokens=3,
                                                 forward=draft_fwd, kv=kv),
                        max_batch=2, max_len=96, forward=compiled, kv=kv)
        seqs = [Sequence(prompt_ids=[1, 2, 3, 4 + i], params=params) for i in range(2)]
        engine.run(seqs)
        return [s.output_ids for s in seqs], engine
    want, _ = run()
    got, engine = run(PagedKV(16, 16))
    assert got == want and draft_fwd.eager_calls == 0 and engine.stats.num_draft_tokens > 0
    assert engine.drafter.cache.paged and engine.drafter.cache.num_used_blocks == 0


def test_llm_compiles_its_draft_model_unless_told_not_to(packed_target):
    from verispec import LLM
    from verispec.drafting.spec_config import SpecConfigError, SpeculativeConfig
    cfg = {"method": "draft_model", "model": "self", "self_draft_layers": 1}
    assert LLM(loaded=packed_target, compile=True, speculative_config=cfg).spec.draft_compile is True
    assert LLM(loaded=packed_target, speculative_config=cfg).spec.draft_compile is None      # eager target
    off = LLM(loaded=packed_target, compile=True, speculative_config={**cfg, "draft_compile": False})
    assert off.spec.draft_compile is False
    assert SpeculativeConfig.from_dict(cfg).draft_compile is None
    assert SpeculativeConfig.from_dict({**cfg, "draft_compile": False}).draft_compile is False
    with pytest.raises(SpecConfigError, match="draft_compile"):
        SpeculativeConfig.from_dict({**cfg, "draft_compile": "yes"})
