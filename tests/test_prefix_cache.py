"""Prefix caching: the block cache's contract (chain hashes, lookup, LRU eviction of leaves under a
byte budget, exact byte accounting, errors), the engine with it (copied K/V and joined target
features equal a full prefill's; mixed hit / miss admission; prompt_logprobs bypass) and, on
SmolLM2-135M, output with the cache equal to output without it on real chat prompts (a shared
system prompt, a second turn reusing the first turn's prompt and output) for vanilla, ngram,
EAGLE-3 and the self-draft draft model, greedy and seeded sampling; the server flag and its
Prometheus counters."""
from __future__ import annotations

import pytest
import torch

from helpers import assert_same_or_tie, dense_module_fixtures, tiny_llama
from verispec import LLM, SamplingParams
from verispec.drafting import StatelessDrafter
from verispec.core.engine import Engine, Sequence
from verispec.models.kv_cache import KVCache
from verispec.core.prefix_cache import CacheLayout, PrefixCache, block_keys, num_positions
from verispec.core.tree import DraftTree

target, llm = dense_module_fixtures()   # greedy answers equal with and without cache hits


BS = 4                                   # block size of the unit tests
LAYOUT = CacheLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
BLOCK_BYTES = 2 * 2 * 2 * BS * 8 * 4     # K and V, 2 layers, 2 heads, BS slots, dim 8, fp32


def _filled(tokens: list[int], rows: int = 1) -> KVCache:
    """A KV cache whose row 0 holds ``len(tokens)`` committed slots; slot i's values are
    ``token_i + layer / 10`` (K) and their negatives (V)."""
    cache = KVCache(2, rows, 2, 64, 8)
    for layer in range(2):
        vals = torch.tensor(tokens, dtype=torch.float32)[None, :, None] + layer / 10
        cache.k[layer][0, :, :len(tokens)] = vals
        cache.v[layer][0, :, :len(tokens)] = -vals
    cache.lengths[0] = len(tokens)
    return cache


def _cache(blocks: int = 100, **kw) -> PrefixCache:
    pc = PrefixCache(blocks * BLOCK_BYTES, BS, **kw)
    pc.bind(LAYOUT)
    return pc


def _reachable(pc: PrefixCache) -> bool:
    return all(b.parent is None or b.parent in pc._blocks for b in pc._blocks.values())


# ---------------------------------------------------------------------------- the block cache
def test_chain_hash_names_the_whole_prefix():
    a, b = block_keys(list(range(12)), BS), block_keys(list(range(12)) + [5, 6], BS)
    assert len(a) == 3 and b == a                        # partial blocks get no key
    c = block_keys([99] + list(range(1, 12)), BS)
    assert all(x != y for x, y in zip(a, c))             # one token changed: every later key changes
    d = block_keys(list(range(4)) + [0, 0, 0, 0] + list(range(8, 12)), BS)
    assert d[0] == a[0] and d[1] != a[1] and d[2] != a[2]   # same third block, other parent


def test_lookup_returns_whole_blocks_at_most_len_minus_one_and_counts_tokens():
    toks = list(range(1, 13))                            # 3 whole blocks
    pc = _cache()
    assert pc.insert(toks, _filled(toks), 0) == 3 and len(pc) == 3
    assert pc.insert(toks, _filled(toks), 0) == 0        # already cached
    hit = pc.lookup(toks)                                # len 12: at most 11 tokens -> 2 blocks
    assert hit.num_tokens == 8 and hit.k.shape == (2, 2, 8, 8)
    assert torch.equal(hit.k[1, 0, :, 0], torch.tensor(toks[:8], dtype=torch.float32) + 0.1)
    assert torch.equal(hit.v, -hit.k)
    assert pc.lookup(toks + [13]).num_tokens == 12
    assert pc.lookup(toks[:6] + [0] * 7).num_tokens == 4     # diverges inside block 2
    assert pc.lookup([7] + toks[1:]).num_tokens == 0
    assert pc.lookup([]).num_tokens == 0
    st = pc.stats()
    assert (st.queries, st.hits) == (12 + 13 + 13 + 12, 8 + 12 + 4)
    assert st.hit_rate == pytest.approx(24 / 50)


def test_blocks_are_copies():
    toks = list(range(1, 9))
    kv = _filled(toks)
    pc = _cache()
    pc.insert(toks, kv, 0)
    kv.k[0].zero_()
    assert torch.equal(pc.lookup(toks + [0]).k[0, 0, :, 0], torch.tensor(toks, dtype=torch.float32))


def test_bytes_are_counted_exactly_with_features():
    toks = list(range(1, 10))
    layout = CacheLayout(2, 2, 8, torch.float32, hidden_layers=(0, 1), last_hidden=True)
    pc = PrefixCache(10 ** 6, BS)
    pc.bind(layout)
    from verispec.core.features import TargetFeatures
    feats = TargetFeatures({0: torch.randn(9, 6), 1: torch.randn(9, 6)}, torch.randn(9, 6).to(torch.bfloat16))
    assert pc.insert(toks, _filled(toks), 0, feats) == 2
    want = 2 * (BLOCK_BYTES + 2 * BS * 6 * 4 + BS * 6 * 2)
    assert pc.bytes_used == want == pc.stats().bytes_used
    assert sum(b.nbytes for b in pc._blocks.values()) == want
    hit = pc.lookup(toks)
    assert num_positions(hit.features) == 8 and torch.equal(hit.features.hidden[1], feats.hidden[1][:8])
    assert hit.features.last_hidden.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="target features"):
        pc.insert(toks, _filled(toks), 0, None)
    with pytest.raises(ValueError, match="positions"):
        pc.insert(toks + [1, 2, 3], _filled(toks + [1, 2, 3]), 0, feats)


def test_lru_eviction_keeps_the_budget_and_evicts_leaves_first():
    pc = _cache(blocks=4)
    a = [1] * 12                                         # a chain of 3 blocks (oldest)
    b = [2] * 8                                          # 2 blocks
    pc.insert(a, _filled(a), 0)
    pc.insert(b, _filled(b), 0)                          # 5 blocks > 4: a's leaf goes, not a's root
    assert len(pc) == 4 and pc.bytes_used == 4 * BLOCK_BYTES and _reachable(pc)
    assert pc.lookup(a + [0]).num_tokens == 8 and pc.lookup(b + [0]).num_tokens == 8
    pc.lookup(a + [0])                                   # a used last: b's blocks are older now
    c = [3] * 4
    pc.insert(c, _filled(c), 0)
    assert pc.lookup(b + [0]).num_tokens == 4 and pc.lookup(a + [0]).num_tokens == 8 and _reachable(pc)
    st = pc.stats()
    assert st.evicted_blocks == 2 and st.num_blocks == 4 and st.bytes_used <= pc.budget_bytes


def test_a_chain_longer_than_the_budget_keeps_its_start():
    pc = _cache(blocks=3)
    toks = list(range(1, 25))                            # 6 blocks; each needs its parent
    assert pc.insert(toks, _filled(toks), 0) == 3
    assert pc.lookup(toks).num_tokens == 12 and _reachable(pc)
    tiny = PrefixCache(BLOCK_BYTES - 1, BS)
    tiny.bind(LAYOUT)
    assert tiny.insert(toks, _filled(toks), 0) == 0 and tiny.bytes_used == 0


@pytest.mark.parametrize("budget", [0, -5, 1.5, True, None, "1"])
def test_bad_budget_is_refused(budget):
    with pytest.raises(ValueError, match="budget"):
        PrefixCache(budget)


@pytest.mark.parametrize("size", [0, -1, 2.0, "16", False])
def test_bad_block_size_is_refused(size):
    with pytest.raises(ValueError, match="block size"):
        PrefixCache(1000, size)


def test_other_errors():
    for mib in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="MiB"):
            PrefixCache.from_mib(mib)
    assert PrefixCache.from_mib(1.5).budget_bytes == 3 << 19
    pc = PrefixCache(10 * BLOCK_BYTES, BS)
    with pytest.raises(RuntimeError, match="bind"):
        pc.insert([1] * 4, _filled([1] * 4), 0)
    pc.bind(LAYOUT)
    with pytest.raises(ValueError, match="cannot share"):
        pc.bind(CacheLayout(2, 2, 8, torch.bfloat16))
    with pytest.raises(ValueError, match="not committed"):
        pc.insert([1] * 8, _filled([1] * 4), 0)
    kv = KVCache(2, 1, 2, 8, 8)
    kv.lengths[0] = 1
    with pytest.raises(ValueError, match="not empty"):
        kv.write_prefix(0, torch.zeros(2, 2, 4, 8), torch.zeros(2, 2, 4, 8))


def test_llm_checks_its_arguments_before_loading():
    for bad in (-1, float("inf"), "8", True):
        with pytest.raises(ValueError, match="prefix_cache_mb"):
            LLM(model="no-such-model", prefix_cache_mb=bad)
    with pytest.raises(ValueError, match="prefix_cache_block_size"):
        LLM(model="no-such-model", prefix_cache_mb=4, prefix_cache_block_size=0)


# ---------------------------------------------------------------------------- the engine (tiny model)
class _Recorder(StatelessDrafter):
    """No drafts; records the target features the engine hands over (EAGLE-3 and EAGLE-1 sets)."""
    hidden_layers = (0, 2)
    needs_last_hidden = True

    def __init__(self):
        self.starts: dict[int, object] = {}

    def start(self, row, prompt_ids, features):
        self.starts[len(prompt_ids)] = features

    def propose(self, requests):
        return [DraftTree.empty() for _ in requests]


def _run(model, drafter, pc, prompts, max_tokens=6, max_batch=2):
    eng = Engine(model, drafter, max_batch=max_batch, max_len=96, prefix_cache=pc)
    seqs = [Sequence(list(p), SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            for p in prompts]
    eng.run(seqs)
    return [s.output_ids for s in seqs], eng


def test_engine_hit_equals_full_prefill_kv_features_and_output(single_thread):
    model = tiny_llama(50, 32, 3)
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 50, (21,), generator=g).tolist()
    a2 = a + torch.randint(0, 50, (13,), generator=g).tolist()   # a's continuation: another turn
    pc = PrefixCache(1 << 20, BS)
    ref_rec, rec = _Recorder(), _Recorder()
    (ref_a,), _ = _run(model, ref_rec, None, [a])
    (out_a,), _ = _run(model, rec, pc, [a])
    assert out_a == ref_a and pc.stats().hits == 0
    turn2 = a + out_a + a2[len(a):]
    (ref2,), _ = _run(model, ref_rec, None, [turn2])
    (out2,), eng = _run(model, rec, pc, [turn2])
    assert out2 == ref2
    # a's 21 prompt + 6 output tokens: 26 committed slots at retirement -> 6 blocks reused
    assert pc.stats().hits == 24 and pc.stats().queries == len(a) + len(turn2)
    want, got = ref_rec.starts[len(turn2)], rec.starts[len(turn2)]
    assert num_positions(got) == len(turn2)
    for k in (0, 2):
        torch.testing.assert_close(got.hidden[k], want.hidden[k], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.last_hidden, want.last_hidden, atol=1e-5, rtol=1e-5)
    assert eng.free_rows and not eng.running and int(eng.cache.lengths.sum()) == 0


def test_mixed_hit_and_miss_batch_admission(single_thread):
    """One ``add_many`` of a hitting and a missing prompt (one right-padded prefill with per-row
    offsets) decodes as each prompt alone without the cache."""
    model = tiny_llama(50, 32, 2, seed=1)
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 50, (17,), generator=g).tolist()
    p1 = shared + [3, 4, 5]
    p2 = shared + [9, 9, 9, 9, 9, 1]
    miss = torch.randint(0, 50, (11,), generator=g).tolist()
    refs = [_run(model, None, None, [p])[0][0] for p in (p1, p2, miss)]
    pc = PrefixCache(1 << 20, BS)
    assert _run(model, None, pc, [p1])[0][0] == refs[0]
    outs, eng = _run(model, None, pc, [p2, miss])
    assert outs == refs[1:]
    assert pc.stats().hits == 16
    long_hit = shared + list(range(20, 40))
    outs, _ = _run(model, None, pc, [long_hit, miss], max_tokens=3)   # 16 + 20 rest: still fits
    assert outs == [_run(model, None, None, [p], max_tokens=3)[0][0] for p in (long_hit, miss)]


def test_prompt_logprobs_bypass_the_lookup_but_insert(single_thread):
    model = tiny_llama(50, 32, 2, seed=2)
    p = list(range(1, 14))
    pc = PrefixCache(1 << 20, BS)
    eng = Engine(model, None, max_batch=1, max_len=64, prefix_cache=pc)
    sp = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    s = eng.run([Sequence(p, sp)])[0]
    assert len(s.prompt_logprobs) == len(p) - 1 and pc.stats().queries == 0 and len(pc) == 3
    s2 = eng.run([Sequence(p, sp)])[0]
    assert pc.stats().queries == 0 and [e.logprob for e in s2.prompt_logprobs] == \
        [e.logprob for e in s.prompt_logprobs]
    eng.run([Sequence(p, SamplingParams(temperature=0.0, max_tokens=2))])
    assert pc.stats().hits == 12


def test_retirement_stores_only_the_sequence_tokens(single_thread):
    """Only slots ``[0, min(cache length, len(prompt + output)))`` are stored: at a length finish
    the last token is not in the cache yet; after a stop string cut inside a step the cache holds
    accepted tokens past the output. Stored K/V equal a plain prefill of the stored tokens."""
    model = tiny_llama(50, 32, 2, seed=3)
    p = list(range(1, 8))
    (greedy,), _ = _run(model, None, None, [p], max_tokens=30, max_batch=1)

    class Oracle(StatelessDrafter):            # drafts the target's own greedy continuation
        max_tree_nodes = 6

        def propose(self, requests):
            return [DraftTree.chain(greedy[len(r.context) - len(p):][:6]) for r in requests]
    pc = PrefixCache(1 << 20, BS)
    _run(model, None, pc, [p], max_tokens=5, max_batch=1)            # 7 + 5 tokens, 11 in the cache
    assert len(pc) == 2
    pc = PrefixCache(1 << 20, BS)
    cut = []

    def stop_after_5(new):                      # the output layer's stop hook: a stop at token 5
        k = 5 - len(cut) if len(cut) + len(new) >= 5 else None
        cut.extend(new[:k])
        return k
    eng = Engine(model, Oracle(), max_batch=1, max_len=64, prefix_cache=pc)
    seq = Sequence(p, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), stop_hook=stop_after_5)
    eng.run([seq])
    assert seq.output_ids == greedy[:5] and seq.finish_reason == "stop" and seq.stats.num_accepted_tokens == 6
    toks = p + seq.output_ids                   # 12 tokens; the cache held 14 when the step ended
    assert [b.tokens for b in pc._blocks.values()] == [tuple(toks[i:i + BS]) for i in range(0, 12, BS)]
    ref = KVCache.for_model(model.cfg, 1, 16)
    model(torch.tensor([toks]), torch.arange(12)[None], ref)
    ref.advance(torch.tensor([0]), 12)
    torch.testing.assert_close(torch.cat([b.k for b in pc._blocks.values()], dim=2), ref.read_slots(0, 0, 12)[0],
                               atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- the real model
SYSTEM = ("You are Verity, the support assistant of Northwind Outfitters, a shop for hiking and camping gear. "
          "Answer in a friendly, concise way. Our return policy: unused items can be returned within 30 days "
          "with the receipt; used items only when they are faulty. Shipping is free for orders over 50 euros, "
          "otherwise it costs 4.90 euros; delivery takes two to four working days. We do not ship outside the "
          "European Union. If you do not know an answer, say so and offer to connect the customer with a human "
          "colleague by email at help@northwind.example.")
Q1 = "Can I return a tent I have already used once?"
Q2 = "How long does delivery to Vienna take?"
Q3 = "Thanks. And what would shipping cost for a 30 euro order?"
TOKENS = 20
METHODS = {"vanilla": None, "ngram": {"method": "ngram", "num_speculative_tokens": 4},
           "eagle3": {"method": "eagle3"}, "medusa": {"method": "medusa"},
           "draft_model": {"method": "draft_model", "model": "self", "self_draft_layers": 8,
                           "num_speculative_tokens": 3}}
DRAFT_STATE = ("eagle3", "medusa", "draft_model")    # drafters fed target features / the prefix


def _ids(llm: LLM, messages: list[dict]) -> list[int]:
    return llm.tokenizer(llm.apply_chat_template(messages), add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def chat(llm):
    """Three chat prompts (two users sharing the system prompt, user 1's second turn with the
    first turn's answer) and their greedy outputs without a cache."""
    greedy = SamplingParams(temperature=0.0, max_tokens=TOKENS)
    a1 = _ids(llm, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": Q1}])
    b1 = _ids(llm, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": Q2}])
    out_a1 = llm.generate({"prompt_token_ids": a1}, greedy)[0]
    a2 = _ids(llm, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": Q1},
                    {"role": "assistant", "content": out_a1.text}, {"role": "user", "content": Q3}])
    assert a2[:len(a1) + len(out_a1.token_ids)] == a1 + out_a1.token_ids, "the template re-tokenizes the answer"
    prompts = [a1, b1, a2]
    refs = [out_a1.token_ids] + [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts[1:]],
                                                                     greedy)]
    return prompts, refs


def _blocks(n: int, bs: int = 16) -> int:
    return n // bs * bs


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_chat_output_equals_no_cache(llm, chat, method):
    prompts, refs = chat
    spec = METHODS[method]
    if method in ("eagle3", "medusa"):                    # budgets fixed: the gate times greedy steps, so its
        spec = dict(spec, adaptive_drafting=False)        # budgets (and draft counts) may differ run to run
    plain = LLM(loaded=llm.target, speculative_config=spec) if method in DRAFT_STATE else None
    cached = LLM(loaded=llm.target, speculative_config=spec, prefix_cache_mb=32)
    greedy = SamplingParams(temperature=0.0, max_tokens=TOKENS)
    outs, base = [], []
    for p in prompts:                                     # one generate each: every turn sees the last
        outs.append(cached.generate({"prompt_token_ids": p}, greedy)[0])
        base.append(plain.generate({"prompt_token_ids": p}, greedy)[0] if method in DRAFT_STATE else None)
    for p, o, r in zip(prompts, outs, refs):
        assert_same_or_tie(llm.target.model, p, o.token_ids, r, method)
    a1, b1, a2 = prompts
    st = cached.prefix_cache.stats()
    sys_hit = _blocks(min(_common(a1, b1), len(b1) - 1))
    committed_lo = len(a1) + len(outs[0].token_ids) - 1     # slots of a1's row at retirement, at least
    lo = _blocks(min(_common(a2, a1 + outs[0].token_ids), committed_lo, len(a2) - 1))
    assert st.queries == sum(map(len, prompts))
    assert sys_hit <= st.hits - lo <= sys_hit + 16 and lo > _blocks(len(a1)), (st, sys_hit, lo)
    if method in DRAFT_STATE:                             # drafters rebuilt from the joined features:
        for o, b in zip(outs, base):                      # the same drafts as without the cache
            assert (o.metrics.num_draft_tokens, o.metrics.num_accepted_tokens) == \
                (b.metrics.num_draft_tokens, b.metrics.num_accepted_tokens), method


@pytest.mark.parametrize("method", ["vanilla", "eagle3"])
def test_seeded_sampling_is_identical_with_the_cache(llm, chat, method):
    prompts, _ = chat
    spec = METHODS[method]
    sp = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=TOKENS, seed=11)
    plain = LLM(loaded=llm.target, speculative_config=spec)
    cached = LLM(loaded=llm.target, speculative_config=spec, prefix_cache_mb=32)
    want = [plain.generate({"prompt_token_ids": p}, sp)[0].token_ids for p in (prompts[0], prompts[1])]
    got = [cached.generate({"prompt_token_ids": p}, sp)[0].token_ids for p in (prompts[0], prompts[1])]
    assert got == want and cached.prefix_cache.stats().hits > 0


def test_batch_of_hits_and_misses_on_the_real_model(llm, chat):
    prompts, refs = chat
    a1, b1, a2 = prompts
    other = _ids(llm, [{"role": "user", "content": Q2}])          # no system prompt: a miss
    greedy = SamplingParams(temperature=0.0, max_tokens=TOKENS)
    want_other = llm.generate({"prompt_token_ids": other}, greedy)[0].token_ids
    cached = LLM(loaded=llm.target, max_num_seqs=3, prefix_cache_mb=32)
    cached.generate({"prompt_token_ids": a1}, greedy)
    before = cached.prefix_cache.stats().hits
    outs = cached.generate([{"prompt_token_ids": p} for p in (a2, other, b1)], greedy)
    for p, o, r in zip((a2, other, b1), outs, (refs[2], want_other, refs[1])):
        assert_same_or_tie(llm.target.model, p, o.token_ids, r, "batch")
    hits = cached.prefix_cache.stats().hits - before
    assert hits >= _blocks(len(a1)) + _blocks(min(_common(a1, b1), len(b1) - 1))


# ---------------------------------------------------------------------------- the server
def test_server_flag_and_metrics(llm, chat):
    from test_serve import ServerProcess
    import verispec.cli.serve as cli_serve
    with pytest.raises(SystemExit) as e:
        cli_serve.main(["--prefix-cache-mb", "-1"])
    assert e.value.code == 2
    prompts, refs = chat
    assert cli_serve.main(["--prefix-cache-block-size", "16"]) == 2      # the paged cache's blocks are 64
    srv = ServerProcess("--max-num-seqs", "2", "--max-model-len", "512", "--prefix-cache-mb", "16", "--no-paged-kv",
                        "--prefix-cache-block-size", "16", "--prefix-cache-reuse", "any")
    try:
        srv.wait_ready()
        m0 = srv.metrics()
        assert m0["verispec:prefix_cache_queries_total"] == m0["verispec:prefix_cache_hits_total"] == 0
        texts = []
        for p in prompts[:2]:
            r = srv.post("/v1/completions", {"model": "smollm2-135m", "prompt": p, "max_tokens": TOKENS,
                                             "temperature": 0})
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        assert texts == [llm._decode(t) for t in refs[:2]]
        m = srv.metrics()
        a1, b1 = prompts[:2]
        assert m["verispec:prefix_cache_queries_total"] == len(a1) + len(b1)
        assert m["verispec:prefix_cache_hits_total"] == _blocks(min(_common(a1, b1), len(b1) - 1)) > 0
        assert m["verispec:prefix_cache_bytes"] > 0
    finally:
        srv.stop()
