"""Lossless sampling through the whole engine, and on the real model.

1. Tiny random target and draft Transformers (vocab 8) through ``Engine``: KV cache, tree masks,
   compaction, batching, draft-model sampling with q. The joint distribution of the first three
   generated tokens is compared with the exact target joint (chi-square, p > 1e-3, fixed seeds).
2. SmolLM2-135M: the joint distribution of the two tokens a speculative step emits first, for a
   deterministic n-gram tree and for sampled self-draft proposals, against the exact target joint
   computed with plain forwards (many acceptance draws on real verify logits).
"""
from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from helpers import BrokenAcceptance
from verispec.drafting.draft_model import DraftModelDrafter, with_vocab_head
from verispec.drafting.ngram import NgramDrafter
from verispec.core.engine import Engine, Sequence
from verispec.models.config import ModelConfig
from verispec.models.kv_cache import KVCache
from verispec.models.transformer import Transformer
from verispec.core.sampling import SamplingParams, target_probs
from verispec.core.tree import DraftTree
from verispec.core.verify import accept, accept_from_probs

P_BOUND = 1e-3


def _pvalue(counts: dict, exact: dict) -> float:
    n = sum(counts.values())
    keys = sorted(exact, key=lambda k: -exact[k])
    obs, exp, rest_o, rest_e = [], [], 0.0, 0.0
    for k in keys:
        if exact[k] * n >= 5:
            obs.append(counts.get(k, 0))
            exp.append(exact[k] * n)
        else:
            rest_o += counts.get(k, 0)
            rest_e += exact[k] * n
    if any(k not in exact for k in counts):
        return 0.0                      # an outcome the target cannot produce
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    assert len(obs) >= 5, "degenerate test: the target distribution has too few likely outcomes"
    scale = sum(obs) / sum(exp)
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


def _tiny(seed: int, vocab: int = 8, noise: float = 0.0) -> Transformer:
    """A tiny random LM; ``noise`` > 0 perturbs the seed's weights (a draft close to the target)."""
    torch.manual_seed(seed)
    cfg = ModelConfig(arch="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    m = Transformer(cfg).eval().requires_grad_(False)
    m.lm_head.weight.mul_(3.0)             # peakier distributions, like a real LM
    if noise:
        g = torch.Generator().manual_seed(seed + 1000)
        for p in m.parameters():
            p.add_(noise * torch.randn(p.shape, generator=g))
    return m


def _exact_tiny(model, prompt, params, length=3) -> dict:
    out = {}
    with torch.no_grad():
        for seq in itertools.product(range(model.cfg.vocab_size), repeat=length):
            pr = 1.0
            for i in range(length):
                ids = prompt + list(seq[:i])
                logits = model(torch.tensor([ids]), torch.arange(len(ids))[None]).logits[0, -1]
                pr *= float(target_probs(logits, params)[seq[i]])
                if pr == 0:
                    break
            out[seq] = pr
    return out


@pytest.mark.parametrize("tree,temperature,top_p,draft_ids,stop", [
    (None, 1.0, 1.0, None, None),
    ([[0], [1], [0, 0], [1, 0], [0, 0, 0]], 0.7, 0.9, None, None),
    ([[0], [1], [0, 0], [1, 0]], 1.0, 1.0, [0, 2, 3, 5, 6], None),  # reduced draft vocabulary: q = 0 elsewhere
    (None, 1.0, 1.0, None, 0.3),        # chains cut after a draft token below probability 0.3: ragged lengths
])
def test_engine_is_lossless_with_tiny_models(tree, temperature, top_p, draft_ids, stop, single_thread):
    from verispec.drafting.draft_vocab import DraftVocab
    target, draft = _tiny(0), _tiny(0, noise=0.3)
    prompt = [1, 2, 3, 1, 2]
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=5, ignore_eos=True)
    n, batch = 3000, 500
    vocab = DraftVocab.from_ids(torch.tensor(draft_ids), 8) if draft_ids else None
    if vocab is not None:
        draft = with_vocab_head(draft, vocab)
    drafter = DraftModelDrafter(draft, max_batch=batch, max_len=16, num_speculative_tokens=2 if stop is None else 3,
                                tree=tree, vocab=vocab, confidence_threshold=stop)
    engine = Engine(target, drafter, max_batch=batch, max_len=16 + drafter.max_tree_nodes + 2)
    seqs = [Sequence(prompt_ids=prompt, params=SamplingParams(**{**vars(params), "seed": i})) for i in range(n)]
    with torch.no_grad():
        engine.run(seqs)
    assert engine.stats.num_accepted_tokens > 0.1 * engine.stats.num_drafts   # speculation is exercised
    if stop is not None:                                   # some chains were cut, others not
        assert 1.0 < engine.stats.num_draft_tokens / engine.stats.num_drafts < 3.0
    counts: dict = {}
    for s in seqs:
        counts[tuple(s.output_ids[:3])] = counts.get(tuple(s.output_ids[:3]), 0) + 1
    assert _pvalue(counts, _exact_tiny(target, prompt, params)) > P_BOUND


def test_engine_test_detects_a_biased_engine(single_thread):
    """Power check: the same test rejects an engine with a broken verifier (in its acceptance slot)."""
    target, draft = _tiny(0), _tiny(0, noise=0.3)
    prompt = [1, 2, 3, 1, 2]
    params = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    drafter = DraftModelDrafter(draft, max_batch=500, max_len=16, num_speculative_tokens=2)
    engine = Engine(target, drafter, max_batch=500, max_len=20, acceptance=BrokenAcceptance())
    seqs = [Sequence(prompt_ids=prompt, params=SamplingParams(**{**vars(params), "seed": i})) for i in range(1500)]
    with torch.no_grad():
        engine.run(seqs)
    counts: dict = {}
    for s in seqs:
        counts[tuple(s.output_ids[:3])] = counts.get(tuple(s.output_ids[:3]), 0) + 1
    assert _pvalue(counts, _exact_tiny(target, prompt, params)) < 1e-6


# ----------------------------------------------------------------------------- real model
class _RealModelStep:
    """Exact target probabilities and verify logits of one speculative step on SmolLM2."""

    def __init__(self, target, context: list[int], params: SamplingParams):
        self.m, self.ctx, self.params = target.model, context, params
        self._p2: dict[int, torch.Tensor] = {}

    def verify_logits(self, tree: DraftTree) -> torch.Tensor:
        prefix, root = self.ctx[:-1], self.ctx[-1]
        cache = KVCache.for_model(self.m.cfg, 1, len(self.ctx) + len(tree) + 2)
        with torch.no_grad():
            self.m(torch.tensor([prefix]), torch.arange(len(prefix))[None], cache)
            cache.advance(torch.tensor([0]), len(prefix))
            toks = torch.cat([torch.tensor([root]), tree.tokens])[None]
            return self.m(toks, tree.positions(len(prefix))[None], cache,
                          attn_mask=tree.ancestor_mask()[None]).logits[0]

    def p_next(self, extra: tuple) -> torch.Tensor:
        if extra not in self._p2:
            ids = self.ctx + list(extra)
            with torch.no_grad():
                logits = self.m(torch.tensor([ids]), torch.arange(len(ids))[None]).logits[0, -1]
            self._p2[extra] = target_probs(logits, self.params)
        return self._p2[extra]

    def exact_joint(self, support_first: set[int]) -> dict:
        p1 = self.p_next(())
        out = {}
        for a in support_first:
            p2 = self.p_next((a,))
            for b in torch.nonzero(p2 > 0).flatten().tolist():
                out[(a, b)] = float(p1[a] * p2[b])
        return out

    def complete(self, tokens: list[int], g) -> tuple:
        if len(tokens) == 1:
            tokens = tokens + [int(torch.multinomial(self.p_next((tokens[0],)), 1, generator=g))]
        return tuple(tokens[:2])


@pytest.fixture(scope="module")
def real_context(target):
    tok = target.tokenizer
    text = ("The train leaves at nine. The train leaves at nine. The bus leaves at ten. "
            "Repeat the first sentence: The train")
    return tok(text).input_ids


def test_real_model_ngram_tree_is_lossless(target, real_context):
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=4)
    step = _RealModelStep(target, real_context, params)
    tree = NgramDrafter(4, 1, 3, num_matches=2).propose(
        [type("R", (), {"context": real_context, "max_nodes": None})()])[0]
    assert len(tree) >= 2
    probs = target_probs(step.verify_logits(tree), params)
    g = torch.Generator().manual_seed(0)
    counts: dict = {}
    for _ in range(6000):
        key = step.complete(accept_from_probs(tree, probs, g).tokens, g)
        counts[key] = counts.get(key, 0) + 1
    first = {k[0] for k in counts} | set(torch.nonzero(step.p_next(()) > 1e-4).flatten().tolist())
    assert _pvalue(counts, step.exact_joint(first)) > P_BOUND


def test_real_model_sampled_self_draft_is_lossless(target, real_context):
    from verispec.drafting import self_draft
    params = SamplingParams(temperature=0.7, top_k=20, max_tokens=4)
    step = _RealModelStep(target, real_context, params)
    draft = self_draft(target.model, 10)
    with torch.no_grad():
        q = target_probs(draft(torch.tensor([real_context]), torch.arange(len(real_context))[None]).logits[0, -1], params)
    g = torch.Generator().manual_seed(1)
    probs_by_x: dict[int, torch.Tensor] = {}
    counts: dict = {}
    for _ in range(4000):
        x = int(torch.multinomial(q, 1, generator=g))
        tree = DraftTree.chain([x], q[None])
        if x not in probs_by_x:
            probs_by_x[x] = target_probs(step.verify_logits(tree), params)
        key = step.complete(accept_from_probs(tree, probs_by_x[x], g).tokens, g)
        counts[key] = counts.get(key, 0) + 1
    first = set(torch.nonzero(step.p_next(()) > 0).flatten().tolist())
    assert _pvalue(counts, step.exact_joint(first)) > P_BOUND


def _exact_tiny_penalized(model, prompt, params, length=3) -> dict:
    """Exact joint of the first ``length`` tokens under sequential sampling with penalties, the
    penalties written out here token by token (independent of ``verispec.penalties``)."""
    out = {}
    rp, f, r = params.repetition_penalty, params.frequency_penalty, params.presence_penalty
    with torch.no_grad():
        for seq in itertools.product(range(model.cfg.vocab_size), repeat=length):
            pr = 1.0
            for i in range(length):
                ids, gen = prompt + list(seq[:i]), list(seq[:i])
                logits = model(torch.tensor([ids]), torch.arange(len(ids))[None]).logits[0, -1].clone()
                for t in set(ids):
                    logits[t] = logits[t] / rp if logits[t] > 0 else logits[t] * rp
                for t in set(gen):
                    logits[t] -= f * gen.count(t) + r
                pr *= float(target_probs(logits, params)[seq[i]])
                if pr == 0:
                    break
            out[seq] = pr
    return out


def _tiny_run(params: SamplingParams, tree, eos: tuple[int, ...] = (), n: int = 3000, batch: int = 500):
    """``n`` seeded sequences of ``params`` through the engine with the tiny target and its noisy
    draft (chains of 2 or ``tree``); returns (target, prompt, seqs, counts of the first 3 tokens)."""
    target, draft = _tiny(0), _tiny(0, noise=0.3)
    prompt = [1, 2, 3, 1, 2]
    drafter = DraftModelDrafter(draft, max_batch=batch, max_len=16, num_speculative_tokens=2, tree=tree)
    engine = Engine(target, drafter, max_batch=batch, max_len=16 + drafter.max_tree_nodes + 2, eos_token_ids=eos)
    seqs = [Sequence(prompt_ids=prompt, params=SamplingParams(**{**vars(params), "seed": i})) for i in range(n)]
    with torch.no_grad():
        engine.run(seqs)
    assert engine.stats.num_accepted_tokens > 0.1 * engine.stats.num_drafts
    counts: dict = {}
    for s in seqs:
        counts[tuple(s.output_ids[:3])] = counts.get(tuple(s.output_ids[:3]), 0) + 1
    return target, prompt, seqs, counts


@pytest.mark.parametrize("tree", [None, [[0], [1], [0, 0], [1, 0], [0, 0, 0]]], ids=["chain", "tree"])
def test_engine_is_lossless_with_penalties_and_min_p(tree, single_thread):
    """Repetition, frequency and presence penalties (per tree node: the node's own root path
    counts as generated) and min-p: the engine's output joint equals sequential penalised sampling."""
    params = SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.3, frequency_penalty=1.2,
                            presence_penalty=1.0, max_tokens=5, ignore_eos=True)
    target, prompt, _, counts = _tiny_run(params, tree)
    exact = _exact_tiny_penalized(target, prompt, params)
    assert _pvalue(counts, exact) > P_BOUND
    plain = _exact_tiny(target, prompt, SamplingParams(temperature=1.0, max_tokens=5))
    assert sum(abs(exact[k] - plain[k]) for k in exact) > 0.2      # the penalties matter here


@pytest.mark.parametrize("tree", [None, [[0], [1], [0, 0], [1, 0], [0, 0, 0]]], ids=["chain", "tree"])
def test_engine_is_lossless_with_min_tokens(tree, single_thread):
    """``min_tokens`` 2 with EOS = token 4: the first two output tokens are drawn with EOS removed,
    the third may end the sequence; the engine's joint equals that sequential process."""
    target, prompt, seqs, counts = _tiny_run(SamplingParams(temperature=1.0, max_tokens=5, min_tokens=2), tree, (4,))
    assert all(4 not in s.output_ids[:2] and len(s.output_ids) >= 2 for s in seqs)
    exact: dict = {}
    with torch.no_grad():
        for seq in itertools.product(range(8), repeat=3):
            pr = 1.0
            for i in range(3):
                ids = prompt + list(seq[:i])
                logits = target(torch.tensor([ids]), torch.arange(len(ids))[None]).logits[0, -1].clone()
                if i < 2:
                    logits[4] = float("-inf")
                pr *= float(torch.softmax(logits, -1)[seq[i]])
            key = seq[:2] if seq[2] == 4 else seq              # EOS ends the output (not appended)
            exact[key] = exact.get(key, 0.0) + pr
    assert _pvalue(counts, exact) > P_BOUND
    assert sum(c for k, c in counts.items() if len(k) == 2) > 20      # some did end at the third token
