"""Suffix decoding (``method: "suffix"``, ``verispec.drafting.suffix``).

1. The config: vLLM's keys and defaults, each bad value a ``SpecConfigError`` naming its key.
2. The trees (arctic-inference's native suffix tree behind ``SuffixCache``): hand-computed counts
   and probabilities, the depth bound, the caps (``num_speculative_tokens``, ``max_spec_factor`` x
   match length, the request's ``max_nodes``), ``min_token_prob``, tree shape and node order,
   FIFO eviction of cached outputs, and random sequences against a brute-force reference of the
   semantics the module docstring states (counts of windows of at most D tokens).
3. The drafter in the engine: greedy output equals vanilla greedy on real prompts (SmolLM2-135M,
   batch 1 and 4), a second similar request drafts from the first one's output (higher tau),
   seeded sampling is reproducible, sampled output of a tiny target keeps the target's joint
   distribution (chi-square), the server takes ``{"method": "suffix"}``, and a step with a
   2000-token context costs well under a millisecond.
Tests of 2 and 3 need arctic-inference and are skipped without it (``make setup`` installs it).
"""
from __future__ import annotations

import random
import sys

import pytest
import torch

from helpers import assert_same_or_tie
from verispec import LLM, SamplingParams
from verispec.drafting.base import DraftRequest
from verispec.drafting.spec_config import SpecConfigError, SpeculativeConfig, SuffixConfig

try:
    import arctic_inference.suffix_decoding  # noqa: F401
    HAVE_ARCTIC = True
except ImportError:
    HAVE_ARCTIC = False
needs_arctic = pytest.mark.skipif(not HAVE_ARCTIC, reason="arctic-inference is not installed (make setup installs it)")

GREEDY = SamplingParams(temperature=0, max_tokens=64)


# ----------------------------------------------------------------------------- 1. config
def test_config_defaults_are_vllms():
    cfg = SpeculativeConfig.from_dict({"method": "suffix"})
    assert type(cfg) is SuffixConfig
    assert (cfg.suffix_decoding_max_tree_depth, cfg.suffix_decoding_max_cached_requests,
            cfg.suffix_decoding_max_spec_factor, cfg.suffix_decoding_min_token_prob) == (24, 10000, 1.0, 0.1)
    assert cfg.max_nodes == 24                     # num_speculative_tokens defaults to the depth
    assert SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 6}).max_nodes == 6
    assert SuffixConfig.keys() == ["method", "num_speculative_tokens", "suffix_decoding_max_tree_depth",
                                   "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor",
                                   "suffix_decoding_min_token_prob", "suffix_decoding_corpus", "adaptive_drafting"]
    off = SpeculativeConfig.from_dict('{"method": "suffix", "suffix_decoding_max_cached_requests": 0}')
    assert off.suffix_decoding_max_cached_requests == 0 and off.as_dict()["method"] == "suffix"


@pytest.mark.parametrize("key,value", [
    ("suffix_decoding_max_tree_depth", 0), ("suffix_decoding_max_tree_depth", 2.5),
    ("suffix_decoding_max_cached_requests", -1), ("suffix_decoding_max_cached_requests", True),
    ("suffix_decoding_max_cached_requests", 1.0), ("suffix_decoding_max_spec_factor", -0.5),
    ("suffix_decoding_max_spec_factor", "1"), ("suffix_decoding_max_spec_factor", float("inf")),
    ("suffix_decoding_min_token_prob", 1.5), ("suffix_decoding_min_token_prob", -0.1),
    ("suffix_decoding_min_token_prob", None), ("num_speculative_tokens", 0)])
def test_config_rejects_bad_values(key, value):
    with pytest.raises(SpecConfigError, match=f"'{key}'"):
        SpeculativeConfig.from_dict({"method": "suffix", key: value})


def test_config_rejects_other_methods_keys():
    with pytest.raises(SpecConfigError, match="'prompt_lookup_max' applies to method 'ngram'") as e:
        SpeculativeConfig.from_dict({"method": "suffix", "prompt_lookup_max": 4})
    assert "'suffix_decoding_min_token_prob'" in str(e.value)
    with pytest.raises(SpecConfigError, match="applies to method 'hybrid' / 'suffix'"):
        SpeculativeConfig.from_dict({"method": "ngram", "suffix_decoding_max_tree_depth": 8})


def test_missing_arctic_inference_is_a_clear_error(monkeypatch):
    from verispec.drafting import build_drafter_factory
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)     # import fails
    with pytest.raises(SpecConfigError, match="needs arctic-inference.*pip install arctic-inference==0.3.0"):
        build_drafter_factory(SpeculativeConfig.from_dict({"method": "suffix"}), None)


# ----------------------------------------------------------------------------- 2. the trees
def _cache(depth=24, cached=10000):
    from verispec.drafting.suffix import SuffixCache
    return SuffixCache(depth, cached)


def _paths(d) -> dict[tuple[int, ...], float]:
    """{root path of tokens: probability} of a ``SuffixDraft``."""
    out, path = {}, []
    for tok, par, p in zip(d.tokens, d.parents, d.probs):
        path.append((path[par] if par >= 0 else ()) + (tok,))
        out[path[-1]] = p
    return out


def _check_order(d) -> None:
    """Topological, and best-first: probabilities never increase in node order (so siblings come
    most likely first, and a parent is at least as likely as its children)."""
    assert all(-1 <= p < i for i, p in enumerate(d.parents))
    assert all(a >= b - 1e-7 for a, b in zip(d.probs, d.probs[1:])), d.probs
    assert abs(d.score - sum(d.probs)) < 1e-5


A, B, C, D, E, X = 10, 11, 12, 13, 14, 99


@needs_arctic
def test_counts_probabilities_and_tree_shape():
    """``A B`` occurs 5 times (the last one is the current context, no continuation yet): C 3 x,
    D 1 x, so P(C) = 3/5, P(D) = 1/5; after ``A B C``: A 2 x, E 1 x. The tree branches at the root
    (C before D) and below C (A before E), and every probability is count / count of the match."""
    cache = _cache()
    seq = [A, B, C, A, B, C, E, A, B, C, A, B, D, X, A, B]
    rid = cache.start(seq)
    d = cache.speculate(rid, seq, max_nodes=50, max_spec_factor=30, min_token_prob=0.0)   # uncapped: 32 nodes
    _check_order(d)
    got = _paths(d)
    assert d.match_len == 2 and len(got) == 32                # "X A B" occurs only at the end
    assert got[(C,)] == pytest.approx(3 / 5) and got[(D,)] == pytest.approx(1 / 5)
    assert got[(C, A)] == pytest.approx(2 / 5) and got[(C, E)] == pytest.approx(1 / 5)
    assert got[(C, A, B)] == pytest.approx(2 / 5) and got[(D, X)] == pytest.approx(1 / 5)
    assert d.tokens[:3] == [C, A, B]                          # best-first: C (0.6), then its 0.4 chain
    kids = [t for t, p in zip(d.tokens, d.parents) if p == -1]
    assert kids == [C, D]                                     # siblings: most likely first
    assert d.score == pytest.approx(sum(got.values()))


@needs_arctic
def test_min_token_prob_and_caps():
    cache = _cache()
    seq = [A, B, C, A, B, C, E, A, B, C, A, B, D, X, A, B]
    rid = cache.start(seq)
    strict = cache.speculate(rid, seq, max_nodes=50, max_spec_factor=10, min_token_prob=0.35)
    assert all(p >= 0.35 for p in strict.probs) and (C,) in _paths(strict) and (D,) not in _paths(strict)
    assert _paths(strict).keys() >= {(C,), (C, A), (C, A, B)}
    # nodes <= floor(max_spec_factor x match length): the 2-token match allows 2 nodes at factor 1
    d = cache.speculate(rid, seq, max_nodes=50, max_spec_factor=1.0, min_token_prob=0.0)
    assert len(d.tokens) == 2 and d.match_len == 2
    assert len(cache.speculate(rid, seq, max_nodes=50, max_spec_factor=1.6, min_token_prob=0.0).tokens) == 3
    # the node budget keeps the most likely nodes: a prefix of the best-first order
    full = cache.speculate(rid, seq, max_nodes=50, max_spec_factor=10, min_token_prob=0.0)
    for k in (1, 3, 5):
        cut = cache.speculate(rid, seq, max_nodes=k, max_spec_factor=10, min_token_prob=0.0)
        assert len(cut.tokens) == k and _check_order(cut) is None
        assert min(cut.probs) >= sorted(full.probs, reverse=True)[k - 1] - 1e-6


@needs_arctic
def test_depth_bounds_match_plus_speculation():
    """A match of L tokens leaves at most D - L levels, and L < D: with D = 5 on a text of period
    20 every node has probability 2/3, so the 1-token match (4 levels, score 8/3) beats longer ones."""
    seq = list(range(20, 40)) * 3
    for depth in (5, 12, 24):
        cache = _cache(depth=depth)
        rid = cache.start(seq)
        d = cache.speculate(rid, seq, max_nodes=50, max_spec_factor=10, min_token_prob=0.0)
        levels = max(len(p) for p in _paths(d))
        assert 1 <= d.match_len < depth and d.match_len + levels <= depth
        assert d.parents == list(range(-1, len(d.tokens) - 1))     # one continuation: a chain
        if depth == 5:
            assert (d.match_len, levels) == (1, 4) and d.probs == pytest.approx([2 / 3] * 4)


@needs_arctic
def test_global_tree_learns_outputs_and_evicts_the_oldest():
    """An output is found by later requests with unrelated prompts; with room for 2 cached
    outputs, starting a third request evicts the oldest (FIFO); 0 turns the global tree off."""
    cache = _cache(cached=2)
    outs = [[100 + 10 * i + j for j in range(8)] for i in range(3)]
    for i, out in enumerate(outs[:2]):
        rid = cache.start([1, 2, 3])
        cache.extend(rid, out)
        cache.stop(rid)
    assert cache.cached_requests == 2 and cache.active_requests == 0
    rid = cache.start([7, 7])                                  # the third request: evicts outs[0]
    assert cache.cached_requests == 2
    ctx = [7, 7] + outs[1][:3]
    cache.extend(rid, outs[1][:3])
    assert cache.speculate(rid, ctx, 8, 10.0, 0.0).tokens[:5] == outs[1][3:8]
    assert cache.speculate(rid, [7, 7] + outs[0][:3], 8, 10.0, 0.0).tokens == []    # evicted
    off = _cache(cached=0)
    rid = off.start([1])
    off.extend(rid, outs[0])
    off.stop(rid)
    rid = off.start([2])
    assert off.cached_requests == 0 and off.speculate(rid, [2] + outs[0][:3], 8, 10.0, 0.0).tokens == []


def _count(seqs, pattern, depth) -> int:
    m = len(pattern)
    if m > depth:
        return 0
    return sum(1 for s in seqs for i in range(len(s) - m + 1) if s[i:i + m] == pattern)


def _reference(seqs, ctx, depth, min_prob) -> dict[int, tuple[float, dict]]:
    """Match length L -> (score, {path: probability}) of the documented semantics, uncapped:
    P(path) = count(match + path) / count(match) over windows of at most ``depth`` tokens."""
    vocab = sorted({t for s in seqs for t in s})
    out = {}
    ctx = ctx[-depth:]
    for L in range(1, len(ctx)):
        match = ctx[-L:]
        base = _count(seqs, match, depth)
        if not base:
            break
        nodes, frontier = {}, [()]
        while frontier:
            nxt = []
            for p in frontier:
                for t in vocab:
                    n = _count(seqs, match + list(p + (t,)), depth)
                    if n and n / base >= min_prob:
                        nodes[p + (t,)] = n / base
                        nxt.append(p + (t,))
            frontier = nxt
        out[L] = (sum(nodes.values()), nodes)
    return out


@needs_arctic
@pytest.mark.parametrize("seed", range(12))
def test_random_sequences_match_a_brute_force_reference(seed):
    """Prompt + output trees and the global tree of earlier outputs, small vocabularies (many
    repeats and branches): the proposal is the reference's best (score, ties to the longer match,
    then to the request's own tree) for one tree, node for node with its probabilities."""
    rnd = random.Random(seed)
    depth, vocab = rnd.choice([4, 6, 8]), rnd.choice([2, 3, 4])
    min_prob = rnd.choice([0.0, 0.13, 0.27])
    cache = _cache(depth=depth)
    outputs = []
    for _ in range(3):                                         # earlier requests
        rid = cache.start([rnd.randrange(vocab) for _ in range(rnd.randrange(3, 12))])
        outputs.append([rnd.randrange(vocab) for _ in range(rnd.randrange(5, 25))])
        cache.extend(rid, outputs[-1])
        cache.stop(rid)
    prompt = [rnd.randrange(vocab) for _ in range(rnd.randrange(2, 20))]
    rid = cache.start(prompt)
    out = [rnd.randrange(vocab) for _ in range(rnd.randrange(1, 15))]
    cache.extend(rid, out)
    ctx = prompt + out
    d = cache.speculate(rid, ctx, max_nodes=10 ** 6, max_spec_factor=1000.0, min_token_prob=min_prob)
    _check_order(d)
    refs = {"own": _reference([ctx], ctx, depth, min_prob), "global": _reference(outputs + [out], ctx, depth, min_prob)}
    best = max((s for r in refs.values() for s, _ in r.values()), default=0.0)
    assert d.score == pytest.approx(best, abs=1e-4)
    if not d.tokens:
        assert best == 0.0
        return
    got = _paths(d)
    candidates = [nodes for r in refs.values() for L, (s, nodes) in r.items() if L == d.match_len]
    assert any(got.keys() == nodes.keys() and all(abs(got[k] - nodes[k]) < 1e-5 for k in nodes)
               for nodes in candidates), (got, candidates)
    # capped (vLLM's factor 1 and a node budget): the best-first prefix keeps the cap's most likely
    # nodes, so the probabilities are the top ones of a candidate (which nodes, among ties, is free)
    budget = rnd.randrange(1, 8)
    capped = cache.speculate(rid, ctx, max_nodes=budget, max_spec_factor=1.0, min_token_prob=min_prob)
    _check_order(capped)
    top = lambda nodes, L: sorted(nodes.values(), reverse=True)[:min(budget, L)]  # noqa: E731
    best = max((sum(top(n, L)) for r in refs.values() for L, (_, n) in r.items()), default=0.0)
    assert capped.score == pytest.approx(best, abs=1e-4)
    assert any(capped.probs == pytest.approx(top(n, L), abs=1e-5) for r in refs.values()
               for L, (_, n) in r.items() if L == capped.match_len)


@needs_arctic
def test_drafter_learns_every_committed_token_and_caps_nodes():
    """The drafter's trees follow the row's context (the root from ``propose``, accepted tokens
    from ``accept``); ``max_nodes`` and ``num_speculative_tokens`` cap its trees."""
    from verispec.drafting.suffix import SuffixDrafter
    cache = _cache()
    drafter = SuffixDrafter(cache, num_speculative_tokens=6, max_spec_factor=10.0, min_token_prob=0.0)
    text = [50, 51, 52, 53, 54, 55, 56, 57]
    prompt = [1, 2] + text + [3]
    drafter.start(0, prompt)
    ctx = prompt + [50]                                        # the first root
    req = lambda n=None: DraftRequest(0, list(ctx), SamplingParams(temperature=0), None, max_nodes=n)  # noqa: E731
    assert drafter.propose([req()])[0].tokens.tolist() == text[1:7]
    assert len(drafter.propose([req(2)])[0]) == 2 and len(drafter.propose([req(0)])[0]) == 0
    drafter.accept(0, [50, 51, 52], None)                      # root + 2 accepted; the new root 53 comes next
    ctx += [51, 52, 53]
    assert drafter.propose([req()])[0].tokens.tolist() == [54, 55, 56, 57, 3, 50]
    drafter.accept(0, [53], None)
    drafter.accept(0, [54, 55], None)                          # a step without propose (budget 0)
    drafter.release(0)                                         # 54, 55 came only through accept
    drafter.start(1, [9, 9, 53])                               # another request: row 0's output is global
    ctx = [9, 9, 53, 54]
    got = drafter.propose([DraftRequest(1, ctx, SamplingParams(temperature=0), None)])[0]
    assert got.tokens.tolist() == [55] and got.q is None
    with pytest.raises(RuntimeError, match="not started"):
        drafter.propose([DraftRequest(5, ctx, SamplingParams(temperature=0), None)])


# ----------------------------------------------------------------------------- 3. in the engine
@pytest.fixture(scope="module")
def prompts(chat_prompts):
    """Writing, coding, extraction, summarization-style and translation prompts."""
    return [chat_prompts[i] for i in (0, 8, 10, 14, 16, 20)]


@pytest.fixture(scope="module")
def vanilla(target, prompts):
    outs = LLM(loaded=target, max_num_seqs=4).generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.token_ids for o in outs]


@needs_arctic
@pytest.mark.parametrize("batch", [4, 1])
def test_greedy_equals_vanilla(target, prompts, vanilla, batch):
    llm = LLM(loaded=target, max_num_seqs=batch, speculative_config={"method": "suffix"})
    chosen = range(len(prompts)) if batch > 1 else (1, 2)
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in chosen], GREEDY)
    for i, o in zip(chosen, outs):
        assert_same_or_tie(target.model, prompts[i], o.token_ids, vanilla[i], f"prompt {i}, batch {batch}")
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0


@needs_arctic
def test_second_request_drafts_from_the_first(target, prompts, vanilla):
    """One LLM, two generate calls: the global tree (made once, in the drafter factory) keeps the
    first call's output, so the same prompt, and a reworded one, accept more per step."""
    llm = LLM(loaded=target, max_num_seqs=1, speculative_config={"method": "suffix"})
    first = llm.generate([{"prompt_token_ids": prompts[1]}], GREEDY)[0]
    again = llm.generate([{"prompt_token_ids": prompts[1]}], GREEDY)[0]
    assert first.token_ids == again.token_ids == vanilla[1]
    assert again.metrics.mean_acceptance_length > first.metrics.mean_acceptance_length + 1.0, \
        (first.metrics.mean_acceptance_length, again.metrics.mean_acceptance_length)
    tok = target.tokenizer
    asks = ["Write a Python function `add_numbers(a, b)` that returns the sum of two numbers, with a docstring.",
            "Write a Python function `add_numbers(x, y)` that returns the sum of two numbers, with a docstring."]
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": a}], tokenize=False, add_generation_prompt=True),
               add_special_tokens=False).input_ids for a in asks]
    fresh = LLM(loaded=target, max_num_seqs=1, speculative_config={"method": "suffix"})
    one, two = (fresh.generate([{"prompt_token_ids": p}], GREEDY)[0] for p in ids)
    plain = LLM(loaded=target, max_num_seqs=1).generate([{"prompt_token_ids": ids[1]}], GREEDY)[0]
    assert_same_or_tie(target.model, ids[1], two.token_ids, plain.token_ids, "reworded")
    assert two.metrics.mean_acceptance_length > one.metrics.mean_acceptance_length, \
        (one.metrics.mean_acceptance_length, two.metrics.mean_acceptance_length)


@needs_arctic
def test_seeded_sampling_is_reproducible(target, prompts):
    sp = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=48, seed=7)
    runs = []
    for _ in range(2):
        llm = LLM(loaded=target, max_num_seqs=2, speculative_config={"method": "suffix"})
        outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in (1, 2)], sp)
        runs.append(([o.token_ids for o in outs], sum(o.metrics.num_drafts for o in outs)))
    assert runs[0] == runs[1] and runs[0][1] > 0


@needs_arctic
def test_sampled_output_keeps_the_target_distribution(single_thread):
    """A tiny random target (vocab 8), 3000 seeded sequences in batches of 500 sharing one
    global tree: suffix trees with siblings are verified losslessly (chi-square of the first 3
    tokens against the exact target joint)."""
    from test_lossless_engine import P_BOUND, _exact_tiny, _pvalue, _tiny
    from verispec.drafting.suffix import SuffixDrafter
    from verispec.core.engine import Engine, Sequence

    class Recording(SuffixDrafter):
        branched = 0

        def propose(self, requests):
            trees = super().propose(requests)
            self.branched += sum(1 for t in trees if len(t) and len(t.paths()) > 1)
            return trees

    target = _tiny(0)
    prompt = [1, 2, 3, 1, 2]
    params = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    drafter = Recording(_cache(depth=8), num_speculative_tokens=4, max_spec_factor=2.0, min_token_prob=0.05)
    engine = Engine(target, drafter, max_batch=500, max_len=16 + drafter.max_tree_nodes + 2)
    seqs = [Sequence(prompt_ids=prompt, params=SamplingParams(**{**vars(params), "seed": i})) for i in range(3000)]
    with torch.no_grad():
        engine.run(seqs)
    assert engine.stats.num_accepted_tokens > 0.1 * engine.stats.num_drafts and drafter.branched > 100
    counts: dict = {}
    for s in seqs:
        counts[tuple(s.output_ids[:3])] = counts.get(tuple(s.output_ids[:3]), 0) + 1
    assert _pvalue(counts, _exact_tiny(target, prompt, params)) > P_BOUND


@needs_arctic
def test_server_takes_method_suffix(target):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient
    from verispec.serve.app import ServeConfig, create_app
    llm = LLM(loaded=target, max_num_seqs=2, speculative_config='{"method": "suffix", "num_speculative_tokens": 8}')
    body = {"model": "smollm2-135m", "prompt": "List the days of the week: Monday, Tuesday,", "max_tokens": 24,
            "temperature": 0}
    want = LLM(loaded=target).generate(body["prompt"], SamplingParams(temperature=0, max_tokens=24))[0].text
    with TestClient(create_app(llm, ServeConfig(model_name="smollm2-135m", max_model_len=256))) as client:
        for _ in range(2):
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
