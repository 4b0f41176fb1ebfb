"""The paged KV cache (``models.paged_kv``): the same numbers as static rows, blocks handed out as
tokens arrive and given back at the end, all-or-nothing reservation, copy-on-write of shared
blocks, engine admission against the pool (``core.kv_budget``) and the prefix cache sharing
blocks by reference."""
from __future__ import annotations

import pytest
import torch

from helpers import tiny_llama
from verispec import SamplingParams
from verispec.core.engine import Engine, Sequence
from verispec.core.kv_budget import KVBudget, PagedKV, pool_blocks
from verispec.core.prefix_cache import CacheLayout, PrefixCache
from verispec.core.tree import DraftTree
from verispec.drafting.draft_model import DraftModelDrafter
from verispec.models.kv_cache import CacheFullError, KVCache
from verispec.models.paged_kv import KVPoolFullError, PagedKVCache

pytestmark = pytest.mark.usefixtures("module_single_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_llama(48, 64, 2, seed=3)


def _pair(model, rows=3, max_len=160, blocks=40):
    return KVCache.for_model(model.cfg, rows, max_len), PagedKVCache.for_model(model.cfg, rows, max_len,
                                                                                num_blocks=blocks)


def test_forwards_and_commits_equal_static_rows(model):
    """Prefill, a tree verify, a batched compaction and a decode on rows [0, 2] of a paged cache
    give bit-identical logits and K/V to static rows (the C++ op reads the pool in place)."""
    torch.manual_seed(0)
    with torch.inference_mode():
        static, paged = _pair(model)
        ids = torch.randint(0, 48, (2, 37))
        outs = []
        for c in (static, paged):
            outs.append(model(ids, torch.arange(37).expand(2, 37), c, rows=[0, 2]).logits)
            c.advance([0, 2], 37)
        assert torch.equal(*outs)
        mask = DraftTree(torch.tensor([5, 9, 7]), torch.tensor([-1, -1, 0])).ancestor_mask().expand(2, 4, 4)
        toks, pos = torch.tensor([[3, 5, 9, 7]] * 2), torch.tensor([[37, 38, 38, 39]] * 2)
        a, b = (model(toks, pos, c, attn_mask=mask, rows=[0, 2], kv_len=c.kv_len([0, 2], 4)).logits
                for c in (static, paged))
        assert torch.equal(a, b)
        keep = torch.tensor([[0, 2, 0], [0, 1, 3]])
        for c in (static, paged):
            c.compact_batch([0, 2], keep, [2, 3])
        for r in (0, 2):
            n = static.lengths_of([r])[0]
            assert paged.lengths_of([r])[0] == n
            for x, y in zip(static.read_slots(r, 0, n), paged.read_slots(r, 0, n)):
                assert torch.equal(x, y)
        step = (torch.tensor([[4], [6]]), torch.tensor([[39], [40]]))
        a, b = (model(*step, c, rows=[0, 2], kv_len=c.kv_len([0, 2], 1)).logits for c in (static, paged))
        assert torch.equal(a, b)


def test_gathered_attention_equals_the_op(model, monkeypatch):
    """Where the op does not run (here: turned off), the gather + SDPA path gives the same logits
    within float tolerance."""
    import verispec.models.attention as attention
    torch.manual_seed(1)
    with torch.inference_mode():
        paged = PagedKVCache.for_model(model.cfg, 2, 96, num_blocks=20)
        ids = torch.randint(0, 48, (2, 21))
        model(ids, torch.arange(21).expand(2, 21), paged)
        paged.advance([0, 1], 21)
        step = (torch.tensor([[4], [6]]), torch.tensor([[21], [21]]))
        want = model(*step, paged, kv_len=paged.kv_len([0, 1], 1)).logits
        monkeypatch.setattr(attention, "uses_op", lambda q, mask: False)
        got = model(*step, paged, kv_len=paged.kv_len([0, 1], 1)).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_blocks_follow_the_tokens_and_reservation_is_all_or_nothing(model):
    paged = PagedKVCache.for_model(model.cfg, 3, 64, num_blocks=5, block_size=16)
    cfg = model.cfg
    assert paged.num_free_blocks == 5
    assert paged.bytes_per_block == 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    paged.reserve([0], 17)                                     # 17 slots: 2 blocks
    assert paged.num_used_blocks == 2 and paged.blocks_of(0) == [1, 2]
    paged.advance([0], 17)
    paged.reserve([0], 15)                                     # up to slot 31: no new block
    assert paged.num_used_blocks == 2
    with pytest.raises(KVPoolFullError, match="KV pool is full"):
        paged.reserve([1, 2], [32, 32])                        # 4 blocks, 3 free: nothing taken
    assert paged.num_used_blocks == 2 and paged.blocks_of(1) == [] and paged.blocks_of(2) == []
    with pytest.raises(CacheFullError):
        paged.reserve([1], 65)                                 # past max_len
    paged.reset([0])
    assert paged.num_free_blocks == 5 and paged.table[0].tolist() == [0] * paged.blocks_per_row
    with pytest.raises(ValueError, match="power of two"):
        PagedKVCache.for_model(model.cfg, 1, 64, num_blocks=4, block_size=12)


def test_shared_blocks_are_copied_before_a_write(model):
    """A row started on another owner's blocks (``share``) copies a shared block before writing
    it; the owner's K/V stay as they were."""
    torch.manual_seed(2)
    with torch.inference_mode():
        paged = PagedKVCache.for_model(model.cfg, 2, 96, num_blocks=10, block_size=16)
        ids = torch.randint(0, 48, (1, 32))
        model(ids, torch.arange(32)[None], paged, rows=[0])
        paged.advance([0], 32)
        owned = paged.blocks_of(0)
        paged.retain(owned)                                    # an owner besides the row
        before = [t.clone() for t in paged.read_slots(0, 0, 32)]
        paged.reset([0])
        assert paged.num_used_blocks == 2                      # still held
        paged.share(1, owned, 32)
        assert paged.blocks_of(1) == owned and paged.ref_count(owned[0]) == 2
        paged.rollback([1], 20)                                # the next write lands in block 2 of 2
        model(torch.tensor([[5]]), torch.tensor([[20]]), paged, rows=[1])
        assert paged.blocks_of(1)[0] == owned[0] and paged.blocks_of(1)[1] != owned[1]
        paged.reset([1])
        paged.share(0, owned, 32)
        for x, y in zip(before, paged.read_slots(0, 0, 32)):
            assert torch.equal(x, y)


def _run(model, prompts, budgets, drafter=None, **engine):
    eng = Engine(model, drafter, max_batch=3, max_len=128, **engine)
    seqs = [Sequence(prompt_ids=p, params=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, budgets)]
    waiting, peak = list(seqs), 0
    while waiting or eng.num_running:
        while waiting and eng.can_admit(waiting[0]):
            eng.add(waiting.pop(0))
        if eng.cache.paged:
            peak = max(peak, eng.cache.num_used_blocks)
        eng.step()
    return [s.output_ids for s in seqs], eng, peak


@pytest.mark.parametrize("speculative", [False, True])
def test_engine_on_a_small_pool_equals_static_rows(model, speculative):
    """Five requests through three rows on a pool that holds two of them at once: admission waits
    for blocks, every output equals the static engine's, and all blocks come back."""
    prompts = [[(5 * i + j) % 48 for i in range(9 + 7 * j)] for j in range(5)]
    budgets = [30, 12, 25, 8, 20]

    def drafter(kv=None):
        return DraftModelDrafter(tiny_llama(48, 32, 1, seed=3), max_batch=3, max_len=128,
                                 num_speculative_tokens=3, kv=kv) if speculative else None
    want, _, _ = _run(model, prompts, budgets, drafter())
    got, eng, peak = _run(model, prompts, budgets, drafter(PagedKV(6, 16)), kv=PagedKV(6, 16))
    assert got == want
    assert 0 < peak <= 6 and eng.cache.num_used_blocks == 0 and eng.kv.committed_blocks == 0
    if speculative:                   # the draft model's own cache is paged too, and given back
        assert eng.drafter.cache.paged and eng.drafter.cache.block_size == 16
        assert eng.drafter.cache.num_used_blocks == 0 and eng.stats.num_draft_tokens > 0
    with pytest.raises(ValueError, match="does not fit the KV pool"):
        eng.add(Sequence(prompt_ids=[1] * 40, params=SamplingParams(temperature=0.0, max_tokens=80)))
    assert eng.cache.num_used_blocks == 0 and len(eng.free_rows) == 3


def test_a_draft_models_cache_grows_with_its_tokens(model):
    """The draft model's paged cache holds every row at full length (its rows share no prefix
    blocks, so it never runs short) but hands out blocks only as its rows' tokens arrive, and a
    finished row's blocks come back; the drafts equal a static cache's."""
    draft = tiny_llama(48, 32, 1, seed=3)
    static = DraftModelDrafter(draft, max_batch=3, max_len=128, num_speculative_tokens=3)
    paged = DraftModelDrafter(draft, max_batch=3, max_len=128, num_speculative_tokens=3, kv=PagedKV(4, 16))
    assert not static.cache.paged and paged.cache.num_blocks == 3 * 9     # 3 rows of 132 slots
    from verispec.drafting.base import DraftRequest
    reqs = [DraftRequest(r, [(7 * r + i) % 48 for i in range(20 + 30 * r)], SamplingParams(temperature=0.0),
                         torch.Generator().manual_seed(0)) for r in range(2)]
    for d in (static, paged):
        for r in reqs:
            d.start(r.row, r.context[:-1], None)
    got, want = paged.propose(reqs), static.propose(reqs)
    assert [t.tokens.tolist() for t in got] == [t.tokens.tolist() for t in want]
    assert paged.cache.blocks_of(0) and len(paged.cache.blocks_of(1)) == 4 and not paged.cache.blocks_of(2)
    paged.release(1)
    assert len(paged.cache.blocks_of(1)) == 0 and paged.cache.num_used_blocks == len(paged.cache.blocks_of(0))


def test_an_llms_paged_engine_pages_its_draft_models_cache(packed_target):
    """``LLM.make_engine(kv=...)`` hands the paged pool to a drafter with a cache of its own."""
    from verispec import LLM
    llm = LLM(loaded=packed_target, speculative_config={"method": "draft_model", "model": "self",
                                                        "self_draft_layers": 1})
    assert llm.make_engine(2, 64, kv=PagedKV(8, 16)).drafter.cache.paged
    assert not llm.make_engine(2, 64).drafter.cache.paged


def test_prefix_cache_shares_pool_blocks_by_reference(model):
    """An engine on a paged pool keeps its prefix cache's blocks in the pool: a second prompt with
    the same start gets the blocks themselves (one reference more, no copy), answers as without a
    cache, and a short pool takes back blocks only the cache holds."""
    prompt = [(3 * i) % 48 for i in range(40)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = Engine(model, None, max_batch=2, max_len=96).run([Sequence(prompt_ids=prompt + [7], params=params)])
    cache = PrefixCache(1 << 20, block_size=16)
    eng = Engine(model, None, max_batch=2, max_len=96, prefix_cache=cache, kv=PagedKV(8, 16))
    eng.run([Sequence(prompt_ids=prompt, params=params)])
    assert cache.attached and len(cache) == 3                  # 50 committed slots: 3 whole blocks
    held = eng.cache.num_used_blocks
    assert held == 3 and cache.bytes_used == 3 * eng.cache.bytes_per_block   # K/V in the pool, counted
    seq = Sequence(prompt_ids=prompt + [7], params=params)
    eng.add(seq)
    shared = eng.cache.blocks_of(seq.row)[:2]
    assert all(eng.cache.ref_count(b) == 2 for b in shared)    # the cache's and the row's
    while eng.num_running:
        eng.step()
    assert seq.output_ids == want[0].output_ids
    assert cache.stats().hits == 32
    big = Sequence(prompt_ids=[(7 * i) % 48 for i in range(60)], params=SamplingParams(temperature=0.0,
                   max_tokens=30, ignore_eos=True))
    assert eng.can_admit(big)                                  # cached blocks do not block admission
    eng.run([big])                                             # 6 blocks: the cache gives some back
    assert len(big.output_ids) == 30 and cache.stats().evicted_blocks > 0


@pytest.mark.parametrize("kv_blocks", [None, 24])
def test_exact_reuse_answers_bit_for_bit_as_a_cold_prefill(model, kv_blocks):
    """Exact reuse: hits cut to whole chunks of the prefill grid, answers' blocks never stored;
    a prompt sharing 70 tokens with an earlier one reuses 64 (two chunks of 32) and its logits,
    K/V and answer equal a cold engine's bit for bit."""
    first = [(3 * i + 1) % 48 for i in range(80)]
    second = first[:70] + [5, 9, 11, 2]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    def admit(engine):
        seq = Sequence(prompt_ids=second, params=params)
        engine.add(seq)
        kv = engine.cache.read_slots(seq.row, 0, len(second))
        while engine.num_running:
            engine.step()
        return seq, kv
    want, want_kv = admit(Engine(model, None, max_batch=1, max_len=128, prefill_chunk=32))
    cache = PrefixCache(1 << 20, block_size=16, exact=True)
    eng = Engine(model, None, max_batch=1, max_len=128, prefill_chunk=32, prefix_cache=cache,
                 kv=None if kv_blocks is None else PagedKV(kv_blocks, 16))
    eng.run([Sequence(prompt_ids=first, params=params)])
    assert len(cache) == 5                                     # the prompt's 5 blocks, not the answer's
    got, got_kv = admit(eng)
    assert cache.stats().hits == 64 and got.output_ids == want.output_ids
    assert all(torch.equal(a, b) for a, b in zip(got_kv, want_kv))
    with pytest.raises(ValueError, match="prefill grid"):
        Engine(model, None, max_batch=1, max_len=128, prefill_chunk=40, prefix_cache=cache)


def test_attach_forgets_another_pools_blocks(model):
    cache = PrefixCache(1 << 20, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    Engine(model, None, max_batch=1, max_len=64, prefix_cache=cache, kv=PagedKV(8, 16)).run(
        [Sequence(prompt_ids=list(range(40)), params=params)])
    assert len(cache) > 0
    Engine(model, None, max_batch=1, max_len=64, prefix_cache=cache, kv=PagedKV(8, 16))
    assert len(cache) == 0
    with pytest.raises(ValueError, match="cannot share a KV pool"):
        PrefixCache(1 << 20, block_size=8).attach(PagedKVCache.for_model(model.cfg, 1, 64, num_blocks=4,
                                                                          block_size=16))
    layout = CacheLayout(model.cfg.num_layers, model.cfg.num_kv_heads, model.cfg.head_dim, torch.float32)
    assert cache.layout == layout


def test_pool_sizing(model):
    cfg = model.cfg
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    assert pool_blocks(cfg, torch.float32, None, 4, 100, 16) == 4 * 7
    assert pool_blocks(cfg, torch.float32, 10 * per_block / (1 << 20), 4, 100, 16) == 10
    with pytest.raises(ValueError, match="less than one sequence"):
        pool_blocks(cfg, torch.float32, 3 * per_block / (1 << 20), 4, 100, 16)
    budget = KVBudget(KVCache.for_model(cfg, 1, 32), slack=4)
    assert budget.fits(10 ** 6) and budget.holds(10 ** 6)      # static rows: their slots exist


def test_server_flags_size_the_pool(model):
    """``verispec serve``: the default pool holds max-num-seqs x max-model-len and commits memory
    as used; ``--kv-cache-mb`` sizes it and commits it at start; too small for one sequence, or
    set with ``--no-paged-kv``, is refused."""
    import argparse
    from types import SimpleNamespace
    from verispec.cli import serve as cli
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    llm = SimpleNamespace(target=SimpleNamespace(model=model), max_model_len=200)
    kv = cli._paged_kv(p.parse_args(["--max-num-seqs", "4"]), llm)
    assert kv == PagedKV(4 * 5, 64, preallocate=False)                 # 264 slots a row: 5 blocks
    per_mib = PagedKVCache.blocks_in_budget(model.cfg, 1 << 20, torch.float32)
    kv = cli._paged_kv(p.parse_args(["--kv-cache-mb", str(10 / per_mib)]), llm)
    assert kv == PagedKV(10, 64, preallocate=True)
    with pytest.raises(ValueError, match="less than one sequence"):
        cli._paged_kv(p.parse_args(["--kv-cache-mb", str(2 / per_mib)]), llm)
    with pytest.raises(ValueError, match="--no-paged-kv"):
        cli._paged_kv(p.parse_args(["--no-paged-kv", "--kv-cache-mb", "64"]), llm)
    assert cli._paged_kv(p.parse_args(["--no-paged-kv"]), llm) is None
    pool = PagedKVCache.for_model(model.cfg, 1, 64, num_blocks=3, preallocate=True)
    assert all(bool((t == 0).all()) for t in (*pool.k, *pool.v))


def test_compiled_engine_runs_every_row_set_in_the_graph():
    """On a paged cache the compiled forward takes any rows (a finished request's hole, rows out
    of order) in the graph: no eager step, whose sums round differently, and every output equals
    the compiled static engine's (ghost rows) and the eager engine's."""
    from verispec.models.compiled import CompiledForward
    model = tiny_llama(48, 32, 2, seed=3).fuse_()
    compiled = CompiledForward(model)
    prompts, budgets = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]], [20, 5, 20]

    def run(forward, kv=None):
        eng = Engine(model, None, max_batch=3, max_len=96, forward=forward, kv=kv)
        seqs = [Sequence(prompt_ids=p, params=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
                for p, n in zip(prompts, budgets)]
        eng.run(seqs)
        return [s.output_ids for s in seqs]
    with torch.inference_mode():
        want = run(None)
        assert run(compiled) == want
        eager_before = compiled.eager_calls
        assert run(compiled, PagedKV(6, 16)) == want
        assert compiled.eager_calls == eager_before
        graphs = compiled.graphs
        assert run(compiled, PagedKV(9, 16)) == want and compiled.graphs == graphs     # another pool: no compile
