"""Sampling is lossless: speculative output follows the target distribution exactly.

Three levels, all with fixed seeds and a chi-square test against the *exact* target joint
distribution (p-value bound 1e-3; each test also shows it can fail by rejecting a broken verifier):
1. verifier-level, synthetic conditional tables (V=4, first 3 tokens = 64 outcomes): chains and
   trees, sampled drafts (with and without replacement) and deterministic drafts, T=0.7/1.0, top-p;
2. engine-level, tiny random target and draft Transformers through the whole loop (KV cache,
   tree masks, compaction, batching);
3. the real model: joint of the first two tokens of a speculative step.
"""
from __future__ import annotations

import functools
import hashlib
import itertools

import pytest
import torch
from scipy.stats import chisquare

from helpers import accept_first_children
from verispec.core.sampling import SamplingParams, target_probs
from verispec.core.tree import DraftTree
from verispec.core.verify import accept

V, L, N = 4, 3, 6000
P_BOUND = 1e-3


@functools.lru_cache(maxsize=None)
def _logits(prefix: tuple, salt: str) -> torch.Tensor:
    seed = int(hashlib.sha256(f"{salt}{prefix}".encode()).hexdigest()[:12], 16)
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 1.5


def _probs(prefix: tuple, salt: str, params: SamplingParams) -> torch.Tensor:
    return _probs_cached(prefix, salt, params.temperature, params.top_p)


@functools.lru_cache(maxsize=None)
def _probs_cached(prefix: tuple, salt: str, temperature: float, top_p: float) -> torch.Tensor:
    return target_probs(_logits(prefix, salt), SamplingParams(temperature=temperature, top_p=top_p))


def _exact_joint(params: SamplingParams) -> dict[tuple, float]:
    out = {}
    for seq in itertools.product(range(V), repeat=L):
        pr = 1.0
        for i in range(L):
            pr *= float(_probs(seq[:i], "t", params)[seq[i]])
        out[seq] = pr
    return out


def _draft(prefix: tuple, params, shape: str, g) -> DraftTree:
    """Synthetic drafter. shape: chain | tree (2 children, no replacement) | det (top-2 tree, q=None)."""
    toks, pars, qs = [], [], []

    def children(parent, ctx, width):
        q = _probs(ctx, "d", params)
        if shape == "det":
            for x in torch.topk(q, width).indices.tolist():
                toks.append(x), pars.append(parent)
            return
        for _ in range(width):
            q = q / q.sum()
            x = int(torch.multinomial(q, 1, generator=g))
            toks.append(x), pars.append(parent), qs.append(q)
            if shape == "tree":
                q = q.clone()
                q[x] = 0.0
    width = 1 if shape == "chain" else 2
    children(-1, prefix, width)
    for node in range(len(toks)):
        if pars[node] == -1:
            children(node, prefix + (toks[node],), width)
    return DraftTree(torch.tensor(toks), torch.tensor(pars), torch.stack(qs) if qs else None)


def _sample_once(params, shape, g, accept_fn) -> tuple:
    out: tuple = ()
    while len(out) < L:
        tree = _draft(out, params, shape, g)
        logits = [_logits(out, "t")]
        for node in range(len(tree)):
            path, i = [], node
            while i >= 0:
                path.append(int(tree.tokens[i]))
                i = int(tree.parents[i])
            logits.append(_logits(out + tuple(path[::-1]), "t"))
        out = out + tuple(accept_fn(tree, torch.stack(logits), params, g).tokens)
    return out[:L]


def _pvalue(samples: list[tuple], exact: dict[tuple, float]) -> float:
    keys = sorted(exact)
    counts = torch.zeros(len(keys))
    index = {k: i for i, k in enumerate(keys)}
    for s in samples:
        counts[index[s]] += 1
    expected = torch.tensor([exact[k] for k in keys]) * len(samples)
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


CASES = [("chain", 1.0, 1.0), ("chain", 0.7, 1.0), ("tree", 1.0, 1.0), ("tree", 0.7, 0.9),
         ("det", 1.0, 1.0), ("det", 0.7, 0.9)]


@pytest.mark.parametrize("shape,temperature,top_p", CASES)
def test_verifier_is_lossless_on_synthetic_tables(shape, temperature, top_p, single_thread):
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=L)
    g = torch.Generator().manual_seed(1234)
    samples = [_sample_once(params, shape, g, accept) for _ in range(N)]
    assert _pvalue(samples, _exact_joint(params)) > P_BOUND


def test_statistical_test_rejects_a_broken_verifier(single_thread):
    params = SamplingParams(temperature=1.0, max_tokens=L)
    g = torch.Generator().manual_seed(99)
    samples = [_sample_once(params, "chain", g, accept_first_children) for _ in range(N)]
    assert _pvalue(samples, _exact_joint(params)) < 1e-6
