"""EAGLE-2 dynamic tree builder vs a brute-force reference on random confidence tables, its
invariants, and what the ablation switches change. Pure Python/torch, no model."""
from __future__ import annotations

import random
import zlib

import pytest
import torch

from verispec.drafting.dynamic_tree import DynamicTreeConfig, RankBy, StaticTreeConfig, rank
from verispec.core.tree import tree_from_choices


def random_table(vocab: int, seed: int):
    """logits_of(path) -> [vocab] logits, a fixed random function of the path."""
    def logits_of(path: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(zlib.crc32(repr((seed, path)).encode()))
        return torch.randn(vocab, generator=g) * 2.5
    return logits_of


def run_builder(cfg, logits_of, budget: int):
    """Drive a builder the way the drafter does; return the chosen nodes as token paths."""
    builder = cfg.builder(rank(logits_of(()), cfg.width), budget)
    nodes = builder.nodes
    path = {-1: ()}
    while builder.frontier():
        front = builder.frontier()
        for n in front:
            path[n] = path[nodes.parents[n]] + (nodes.tokens[n],)
        builder.grow(rank(torch.stack([logits_of(path[n]) for n in front]), cfg.width))
    chosen = builder.select()
    for n in chosen:                                        # topological order: parents first
        path[n] = path[nodes.parents[n]] + (nodes.tokens[n],)
    return builder, chosen, [path[n] for n in chosen]


def reference(logits_of, k: int, depth: int, m: int, rank_by: RankBy, rerank: bool) -> set:
    """EAGLE-2 written declaratively on token paths, with no early stopping."""
    cand = {}                                               # path -> (own logp, path score, order)
    frontier = [()]
    for d in range(1, depth + 1):
        new = []
        for parent in frontier:
            lp = torch.log_softmax(logits_of(parent).double(), -1).tolist()
            for tok in sorted(range(len(lp)), key=lambda t: -lp[t])[:k]:
                score = lp[tok] + (cand[parent][1] if parent else 0.0)
                cand[parent + (tok,)] = (lp[tok], score, len(cand))
                new.append(parent + (tok,))
        key = (lambda p: cand[p][1]) if rank_by is RankBy.PATH else (lambda p: cand[p][0])
        frontier = sorted(new, key=lambda p: (-key(p), cand[p][2]))[:k]
    if not rerank:
        return set(sorted(cand, key=lambda p: cand[p][2])[:m])
    if rank_by is RankBy.PATH:                              # plain top-m: closed under ancestors
        return set(sorted(cand, key=lambda p: (-cand[p][1], cand[p][2]))[:m])
    chosen: set = set()                                     # best-first among connected candidates
    while len(chosen) < m:
        ready = [p for p in cand if p not in chosen and (len(p) == 1 or p[:-1] in chosen)]
        if not ready:
            break
        chosen.add(max(ready, key=lambda p: (cand[p][0], -cand[p][2])))
    return chosen


@pytest.mark.parametrize("rank_by", list(RankBy))
@pytest.mark.parametrize("rerank", [True, False])
def test_matches_brute_force(rank_by, rerank):
    rnd = random.Random(zlib.crc32(f"{rank_by.value}-{rerank}".encode()))
    for case in range(60):
        vocab, k, depth = rnd.randint(3, 9), rnd.randint(1, 4), rnd.randint(1, 5)
        m = rnd.randint(1, 24)
        table = random_table(vocab, case)
        cfg = DynamicTreeConfig(topk=k, depth=depth, num_draft_tokens=m, rank_by=rank_by, rerank=rerank)
        builder, chosen, paths = run_builder(cfg, table, m)
        want = reference(table, k, depth, m, rank_by, rerank)
        assert set(paths) == want, (case, vocab, k, depth, m)
        # invariants: connected, bound respected, distinct siblings, topological order
        assert len(paths) == len(want) <= m
        assert all(len(p) == 1 or p[:-1] in set(paths) for p in paths)
        assert len(set(paths)) == len(paths)
        par = builder.nodes.parents
        assert all(par[n] < n for n in chosen)
        if rank_by is RankBy.PATH:
            sc = builder.nodes.score
            assert all(par[n] < 0 or sc[n] <= sc[par[n]] + 1e-6 for n in chosen)


def test_budget_and_request_cap():
    table = random_table(8, 3)
    cfg = DynamicTreeConfig(topk=4, depth=5, num_draft_tokens=10)
    _, chosen, _ = run_builder(cfg, table, budget=10)
    assert len(chosen) == 10
    _, capped, paths = run_builder(cfg, table, budget=3)     # a request's max_nodes below the budget
    assert len(capped) == 3 and max(len(p) for p in paths) <= 3


def _table_from(spec: dict[tuple, dict[int, float]], vocab: int = 6):
    """Exact probabilities per path (rest spread evenly on the remaining tokens)."""
    def logits_of(path):
        probs = spec.get(path, {})
        rest = (1.0 - sum(probs.values())) / max(1, vocab - len(probs))
        p = torch.full((vocab,), max(rest, 1e-9))
        for t, v in probs.items():
            p[t] = v
        return torch.log(p / p.sum())
    return logits_of


def test_confidence_ranking_prefers_confident_deep_node():
    # root: A=0 (0.9), B=1 (0.05); under A: 0 (0.51), 1 (0.49); under (A, 0): token 2 with 0.95
    table = _table_from({(): {0: 0.9, 1: 0.05}, (0,): {0: 0.51, 1: 0.49}, (0, 0): {2: 0.95}})
    path_cfg = DynamicTreeConfig(topk=2, depth=3, num_draft_tokens=3, rank_by=RankBy.PATH)
    conf_cfg = DynamicTreeConfig(topk=2, depth=3, num_draft_tokens=3, rank_by=RankBy.CONFIDENCE)
    assert set(run_builder(path_cfg, table, 3)[2]) == {(0,), (0, 0), (0, 1)}        # path 0.46, 0.44 > 0.44 (deep)
    assert set(run_builder(conf_cfg, table, 3)[2]) == {(0,), (0, 0), (0, 0, 2)}     # own prob 0.95


def test_no_rerank_keeps_expansion_order():
    # root: 0 (0.9), 1 and 2 (0.04 each); under 0: 0 (0.6), 1 (0.3)
    table = _table_from({(): {0: 0.9, 1: 0.04, 2: 0.04}, (0,): {0: 0.6, 1: 0.3}})
    rerank = DynamicTreeConfig(topk=3, depth=2, num_draft_tokens=3, rerank=True)
    plain = DynamicTreeConfig(topk=3, depth=2, num_draft_tokens=3, rerank=False)
    assert set(run_builder(rerank, table, 3)[2]) == {(0,), (0, 0), (0, 1)}
    assert set(run_builder(plain, table, 3)[2]) == {(0,), (1,), (2,)}       # first three created


def test_static_builder_matches_tree_from_choices():
    choices = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]]
    cfg = StaticTreeConfig.from_choices(choices)
    table = random_table(10, 7)
    builder, chosen, paths = run_builder(cfg, table, budget=100)
    ranked_of = {}

    def ranked(path_ranks):
        toks, cur = (), ()
        for r in path_ranks:                # follow ranks to token path
            cur = cur + (ranked_of.setdefault(toks, torch.topk(table(toks), 10).indices.tolist())[r],)
            toks = cur
        return torch.topk(table(toks), 10).indices.tolist()
    want = tree_from_choices(choices, ranked)
    assert builder.nodes.tokens == want.tokens.tolist()
    assert builder.nodes.parents == want.parents.tolist()
    assert len(run_builder(cfg, table, budget=4)[1]) == 4      # request cap keeps a topological prefix


def test_config_validation():
    with pytest.raises(ValueError, match="topk"):
        DynamicTreeConfig(topk=0)
    assert StaticTreeConfig.chain(3).choices == ((0,), (0, 0), (0, 0, 0))
    assert DynamicTreeConfig(topk=8, depth=6).max_expanded == 40


def test_default_budget_is_the_benchmarked_one():
    """The default node budget is the one benchmarks/tree_cost.py chose and recorded."""
    import json
    from pathlib import Path
    from verispec.drafting.dynamic_tree import DEFAULT_NUM_DRAFT_TOKENS
    res = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "tree_cost.json"
    if not res.exists():
        pytest.skip("benchmarks/results/tree_cost.json not generated")
    assert json.loads(res.read_text())["chosen_num_draft_tokens"] == DEFAULT_NUM_DRAFT_TOKENS
    assert DynamicTreeConfig().num_draft_tokens == DEFAULT_NUM_DRAFT_TOKENS
