"""Batched acceptance (``verify.accept_batch`` and the rules' ``accept_batch``) against the
sequential reference verifiers, path for path, and its host-sync budget.

- With the same per-node uniforms, the batched rejection sampler gives exactly the tokens of the
  sequential one (sibling by sibling, residual after residual) on random trees of mixed sizes,
  with sampled q (with and without replacement), deterministic trees, and both in one batch.
- Greedy and Medusa's typical acceptance likewise, including duplicate sibling tokens.
- A batch's acceptance makes no host reads; its result comes to the host in one copy.
The statistical tests (``test_lossless``, ``test_lossless_engine``) run on the same code.
"""
from __future__ import annotations

import random

import pytest
import torch

from helpers import tiny_llama
from reference_accept import reference_greedy, reference_sampled, reference_typical
from sync_counter import HostSyncCounter
from verispec.core.acceptance import LOSSLESS, LossyTypicalAcceptance
from verispec.drafting import StatelessDrafter
from verispec.core.engine import Engine, Sequence
from verispec.core.params import SamplingParams
from verispec.core.tree import DraftTree
from verispec.core.tree_batch import TreeBatch, _pack
from verispec.core import tree_batch, verify
from verispec.core.verify import accept_from_probs_batch, accept_greedy_batch

V = 6


def _random_tree(rng: random.Random, g: torch.Generator, n: int, kind: str) -> DraftTree:
    """``kind``: det (q None), q (each node drawn from its own q), noreplace (siblings drawn
    without replacement from one q), dup (det with duplicate sibling tokens allowed)."""
    parents = [rng.randrange(-1, i) if i else -1 for i in range(n)]
    toks, qs = [], []
    used: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        sib = used.setdefault(p, [])
        if kind in ("q", "noreplace"):
            q = torch.rand(V, generator=g) ** 2
            q[torch.randint(V, (1,), generator=g)] = 0.0
            if kind == "noreplace" and sib:
                q[sib] = 0.0
            q = q / q.sum() if q.sum() > 0 else torch.full((V,), 1.0 / V)
            x = int(torch.multinomial(q, 1, generator=g))
            qs.append(q)
        else:
            choices = [t for t in range(V) if kind == "dup" or t not in sib] or list(range(V))
            x = rng.choice(choices)
        sib.append(x)
        toks.append(x)
    q = torch.stack(qs) if qs else None
    return DraftTree(torch.tensor(toks, dtype=torch.long), torch.tensor(parents, dtype=torch.long), q)


def _random_probs(g: torch.Generator, t: int) -> torch.Tensor:
    p = torch.rand(t, V, generator=g) ** 3
    p[torch.rand(t, V, generator=g) < 0.25] = 0.0        # some zero-probability tokens
    p[:, 0] += 1e-3
    return p / p.sum(-1, keepdim=True)


def _batch_case(seed: int, kinds: list[str]):
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    trees = [_random_tree(rng, g, rng.randrange(0, 9), k) for k in kinds]
    batch = TreeBatch.pack(trees, [3] * len(trees), [1] * len(trees), vocab=V)
    probs = torch.stack([_random_probs(g, batch.num_nodes + 1) for _ in trees])
    u = torch.rand(len(trees), batch.num_nodes + 1, generator=g)
    return trees, batch, probs, u


@pytest.mark.parametrize("kinds", [["det"] * 4, ["q"] * 4, ["noreplace"] * 4, ["det", "q", "noreplace", "dup"]])
def test_batched_sampling_equals_sequential_reference(kinds):
    for seed in range(150):
        trees, batch, probs, u = _batch_case(seed, kinds)
        got = accept_from_probs_batch(batch, probs, u).to_host()
        for b, tree in enumerate(trees):
            n = len(tree)
            want = reference_sampled(tree, probs[b, :n + 1], torch.cat([u[b, :n], u[b, -1:]]))
            assert got[b] == want, (seed, b, tree, got[b], want)


@pytest.mark.parametrize("rows", [1, 3])
def test_a_batch_of_empty_trees_packs_as_the_general_path_does(rows):
    """A plain step (empty trees, the chain shortcut of ``TreeBatch.pack``) builds every field the
    general path would, twice over (the second from the cached structure)."""
    trees, starts, roots = [DraftTree.empty()] * rows, torch.tensor([7, 30, 2][:rows]), [11, 12, 13][:rows]
    for _ in range(2):
        _same_batch(TreeBatch.pack(trees, starts, roots), _pack(trees, starts, roots, torch.device("cpu"), None))


def _same_batch(fast: TreeBatch, general: TreeBatch) -> None:
    for name in TreeBatch.__dataclass_fields__:
        a, b = getattr(fast, name), getattr(general, name)
        if name == "rank_groups":
            assert len(a) == len(b), name
            for ga, gb in zip(a, b):
                assert all(torch.equal(x, y) for x, y in zip(ga, gb)), name
        elif isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), name
        else:
            assert a == b, name


@pytest.mark.parametrize("sizes", [[1], [3], [2, 0, 5], [0, 4], [1, 1, 1]])
def test_a_batch_of_chains_packs_as_the_general_path_does(sizes, monkeypatch):
    """The chain shortcut of ``TreeBatch.pack`` (chains without q, empty rows among them) builds
    every field the general path would; a batch with a branching tree takes the general path."""
    g = torch.Generator().manual_seed(len(sizes) * 7 + sum(sizes))
    trees = [DraftTree.chain(torch.randint(0, 50, (n,), generator=g)) for n in sizes]
    starts, roots = torch.tensor([9, 31, 4][:len(sizes)]), [11, 12, 13][:len(sizes)]
    with monkeypatch.context() as m:
        m.setattr(tree_batch, "_pack", None)                # the shortcut must not need it
        fast = TreeBatch.pack(trees, starts, roots)
    _same_batch(fast, _pack(trees, starts, roots, torch.device("cpu"), None))
    branching = trees + [DraftTree(torch.tensor([5, 6]), torch.tensor([-1, -1]))]
    _same_batch(TreeBatch.pack(branching, torch.tensor([1] * len(branching)), [3] * len(branching)),
                _pack(branching, torch.tensor([1] * len(branching)), [3] * len(branching), torch.device("cpu"), None))


@pytest.mark.parametrize("host_walk", [True, False], ids=["host-walk", "batched"])
def test_batched_greedy_equals_reference_with_duplicate_siblings(host_walk, monkeypatch):
    """Both greedy paths (the CPU's host walk and the device's batched ops) give the reference's
    decision, path for path, and the same tensors (tied argmaxes included: few distinct values)."""
    monkeypatch.setattr(verify, "HOST_WALK_ON_CPU", host_walk)
    for seed in range(200):
        trees, batch, probs, _ = _batch_case(seed, ["dup", "det", "dup"])
        logits = torch.log(probs + 1e-9)
        if seed % 3 == 0:
            logits = (logits * 2).round() / 2                        # ties between entries' maxima
        decided = accept_greedy_batch(batch, logits)
        got = decided.to_host()
        assert got == [reference_greedy(t, logits[b, :len(t) + 1]) for b, t in enumerate(trees)], seed
        if host_walk:
            monkeypatch.setattr(verify, "HOST_WALK_ON_CPU", False)
            other = accept_greedy_batch(batch, logits)
            monkeypatch.setattr(verify, "HOST_WALK_ON_CPU", True)
            for name in ("num_accepted", "nodes", "keep", "tokens", "bonus"):
                assert torch.equal(getattr(decided, name), getattr(other, name)), (seed, name)


def test_batched_typical_equals_reference():
    rule = LossyTypicalAcceptance(posterior_threshold=0.3, posterior_alpha=0.5)   # lenient: long paths
    params = [SamplingParams(temperature=1.0)] * 3
    for seed in range(150):
        trees, batch, probs, _ = _batch_case(seed, ["det", "dup", "q"])
        logits = torch.log(probs.clamp_min(1e-30))
        gens = [torch.Generator().manual_seed(seed + k) for k in range(3)]
        got = rule.accept_batch(batch, logits, params, gens).to_host()
        for b, tree in enumerate(trees):
            u_final = float(torch.rand(len(tree) + 1, generator=torch.Generator().manual_seed(seed + b))[-1])
            p = torch.softmax(logits[b, :len(tree) + 1], -1)
            assert got[b] == reference_typical(tree, p, u_final, 0.3, 0.5), (seed, b)


def test_mixed_greedy_and_sampled_rows():
    """Greedy rows in a sampled batch follow the argmax and draw nothing from their generator."""
    trees, batch, probs, _ = _batch_case(7, ["q", "det", "q"])
    logits = torch.log(probs.clamp_min(1e-30))
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)]
    gens = [torch.Generator().manual_seed(k) for k in range(3)]
    got = LOSSLESS.accept_batch(batch, logits, params, gens).to_host()
    assert got[1] == reference_greedy(trees[1], logits[1, :len(trees[1]) + 1])
    assert gens[1].get_state().equal(torch.Generator().manual_seed(1).get_state())
    for b in (0, 2):     # each sampled row used exactly len(tree) + 1 draws of its own generator
        again = torch.Generator().manual_seed(b)
        u = torch.rand(len(trees[b]) + 1, generator=again)
        assert gens[b].get_state().equal(again.get_state())
        assert got[b] == reference_sampled(trees[b], probs[b, :len(trees[b]) + 1], u)


def test_a_rows_draws_do_not_depend_on_its_batch():
    trees, batch, probs, _ = _batch_case(11, ["q", "noreplace", "det"])
    logits = torch.log(probs.clamp_min(1e-30))
    params = [SamplingParams(temperature=0.8)] * 3
    together = LOSSLESS.accept_batch(batch, logits, params,
                                     [torch.Generator().manual_seed(k) for k in range(3)]).to_host()
    for b, tree in enumerate(trees):
        alone = LOSSLESS(tree, logits[b, :len(tree) + 1], params[b], torch.Generator().manual_seed(b))
        assert alone == together[b]


@pytest.mark.parametrize("rule", [LOSSLESS, LossyTypicalAcceptance()], ids=["lossless", "typical"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_acceptance_makes_no_host_reads(rule, temperature, monkeypatch):
    """The whole batch is decided on the device; ``to_host`` is the step's one copy. The count is
    the same for 3 small trees and for 8 rows of 40-node trees (nothing per node or per row).
    (The device path: CPU greedy rows take the host walk, where reads cost nothing.)"""
    monkeypatch.setattr(verify, "HOST_WALK_ON_CPU", False)
    counts = []
    for n_rows, n_nodes in ((3, 4), (8, 40)):
        rng, g = random.Random(n_nodes), torch.Generator().manual_seed(n_nodes)
        trees = [_random_tree(rng, g, n_nodes, "q") for _ in range(n_rows)]
        batch = TreeBatch.pack(trees, [5] * n_rows, [0] * n_rows, vocab=V)
        logits = torch.randn(n_rows, batch.num_nodes + 1, V, generator=g)
        params = [SamplingParams(temperature=temperature)] * n_rows
        gens = [torch.Generator().manual_seed(k) for k in range(n_rows)]
        with HostSyncCounter() as inside:
            result = rule.accept_batch(batch, logits, params, gens)
        with HostSyncCounter() as copy:
            host = result.to_host()
        assert inside.count == 0, inside.calls
        assert copy.count == 1, copy.calls
        assert len(host) == n_rows
        counts.append(inside.count + copy.count)
    assert counts[0] == counts[1]


def test_counter_sees_a_per_node_loop():
    """The counter is not blind: the sequential reference reads values once per node tried."""
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    tree = _random_tree(rng, g, 12, "q")
    probs = _random_probs(g, 13)
    with HostSyncCounter() as c:
        reference_sampled(tree, probs, torch.rand(13, generator=g))
    assert c.count >= 3


class _Tree(StatelessDrafter):
    """A fixed tree of ``n`` nodes per row: a chain with a second child under every node."""

    def __init__(self, n: int):
        self.max_tree_nodes = n
        self.parents = torch.tensor([-1 if i < 2 else i // 2 * 2 - 2 for i in range(n)], dtype=torch.long)

    def propose(self, requests):
        return [DraftTree(torch.arange(len(self.parents)) % 7 + 1, self.parents).prefix(r.max_nodes)
                for r in requests]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engine_step_host_reads_do_not_grow_with_the_tree(single_thread, temperature, monkeypatch):
    """A whole ``Engine.step`` (3 rows) makes as many host reads with 2-node trees as with
    14-node trees: none per node (the acceptance itself makes none, the test above; the device
    path, as there)."""
    monkeypatch.setattr(verify, "HOST_WALK_ON_CPU", False)
    counts = []
    for n in (2, 14):
        eng = Engine(tiny_llama(10, 16, 2), _Tree(n), max_batch=3, max_len=96)
        seqs = [Sequence([1, 2, 3 + k], SamplingParams(temperature=temperature, max_tokens=40, ignore_eos=True,
                                                       seed=k)) for k in range(3)]
        eng.add_many(seqs)
        eng.step()
        with HostSyncCounter() as c:
            report = eng.step()
        assert report.rows == 3 * (n + 1)
        counts.append(c.count)
    assert counts[0] == counts[1], counts
