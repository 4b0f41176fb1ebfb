"""``AutoPolicy`` against synthetic servers: no model, no engine, pure Python loops.

A ``Sim`` plays the server: the step time comes from a cost model ``cost(batch, budget)`` (with a
little seeded noise) and every sequence of a step emits 1 + the number of its draft tokens
accepted by a chain drafter that gets each token right with probability ``p`` (after the previous
one), so ``tau(k) = 1 + p + ... + p^k``.
"""
from __future__ import annotations

import json
import random

import pytest
import torch

from verispec.core.sampling import SamplingParams
from verispec.serve.policy import AutoPolicy, StaticPolicy, TablePolicy, parse_policy
from verispec.core.tree import DraftTree


def cheap(batch: int, k: int) -> float:
    """Accelerator-like: the forward is flat up to 256 rows; drafting costs 1% per node."""
    return 0.010 * max(1.0, batch * (1 + k) / 256) * (1 + 0.01 * k)


def cpu(batch: int, k: int) -> float:
    """CPU-like: step cost linear in rows above 8 rows; drafting 1 ms per node and sequence."""
    return 0.040 * max(1.0, batch * (1 + k) / 8) + 0.001 * batch * k


def cpu_narrow(batch: int, k: int) -> float:
    """CPU-like, linear above 4 rows: at batch 4 every draft token costs a full row."""
    return 0.040 * max(1.0, batch * (1 + k) / 4) + 0.001 * batch * k


def cpu_slow_drafter(batch: int, k: int) -> float:
    """CPU-like with a drafter costing 10% of a batch-1 step per node."""
    return 0.040 * max(1.0, batch * (1 + k) / 8) + 0.004 * batch * k


def tau(p: float, k: int) -> float:
    return sum(p ** i for i in range(k + 1))


class Sim:
    def __init__(self, cost, p: float, seed: int = 0, noise: float = 0.05):
        self.cost, self.p, self.noise = cost, p, noise
        self.rng = random.Random(seed)
        self.tokens = 0
        self.time = 0.0

    def emitted(self, batch: int, k: int) -> int:
        total = 0
        for _ in range(batch):
            n = 1
            while n <= k and self.rng.random() < self.p:
                n += 1
            total += n
        return total

    def run(self, policy: AutoPolicy, batch: int, steps: int) -> list[int]:
        """``steps`` steps at ``batch``; the budgets the policy chose. Resets the throughput."""
        self.tokens, self.time, chosen = 0, 0.0, []
        for _ in range(steps):
            k = policy.budget(batch)
            dt = self.cost(batch, k) * (1 + self.noise * (2 * self.rng.random() - 1))
            e = self.emitted(batch, k)
            policy.observe(batch, k, dt, e)
            self.tokens += e
            self.time += dt
            chosen.append(k)
        return chosen

    def speedup(self, batch: int) -> float:
        """Throughput of the last ``run`` over plain decoding's."""
        return (self.tokens / self.time) / (batch / self.cost(batch, 0))


SEEDS = 12


def auto(max_nodes: int = 4, **kw) -> AutoPolicy:
    p = AutoPolicy(**kw)
    p.bind(max_nodes)
    return p


# ---------------------------------------------------------------------------- basics
def test_arms_bind_and_parse():
    assert AutoPolicy.arms_for(4) == [0, 1, 2, 4] and AutoPolicy.arms_for(6) == [0, 1, 2, 4, 6]
    assert AutoPolicy.arms_for(1) == [0, 1] and AutoPolicy.arms_for(0) == [0]
    p = auto(4)
    Sim(cpu, 0.5).run(p, 1, 20)
    assert p.cost
    p.bind(4)
    assert p.cost                                  # same size: kept
    p.bind(8)
    assert p.arms == [0, 1, 2, 4, 8] and not p.cost and all(a.seqs == 0 for a in p.acc.values())
    assert isinstance(parse_policy("auto"), AutoPolicy) and isinstance(parse_policy(None), AutoPolicy)
    with pytest.raises(ValueError):
        AutoPolicy(explore_every=1)
    with pytest.raises(ValueError):
        AutoPolicy(margin=1.5)


def test_budget_zero_is_measured_first_in_every_bucket():
    p = auto(4)
    sim = Sim(cheap, 0.8)
    assert sim.run(p, 1, 1) == [0]
    assert sim.run(p, 1, 30).count(0) < 5          # speculation pays at batch 1
    for batch in (2, 3, 8, 32):
        assert sim.run(p, batch, 1) == [0]         # a new bucket starts plain
    assert (p.bucket(4), 0) in p.cost              # 3 and 4 share a bucket: measured by 3


def test_observe_signature_and_ignored_steps():
    p = auto(4)
    p.observe(1, 0, 0.01, 1)                       # the scheduler's positional call
    p.observe(1, 4, 0.011, 3, rows=3)              # optional: rows of the padded verify forward
    assert p.cost[(0, 4)].rows == 3.0 and p.cost[(0, 0)].rows == 1.0
    before = json.dumps(p.describe(), sort_keys=True)
    p.observe(1, 3, 0.01, 2)                       # not an arm
    p.observe(1, 0, 0.0, 1)                        # no time
    p.observe(0, 0, 0.01, 0)                       # no sequences
    assert json.dumps(p.describe(), sort_keys=True) == before
    for other in (StaticPolicy(), TablePolicy({1: 2})):
        other.observe(1, 0, 0.01, 1)
        other.observe(1, 0, 0.01, 1, rows=1)


def test_describe_is_json_serializable():
    p = auto(4)
    sim = Sim(cpu, 0.6)
    for batch in (1, 4, 32):
        sim.run(p, batch, 40)
    d = json.loads(json.dumps(p.describe()))
    assert d["policy"] == "auto" and d["arms"] == [0, 1, 2, 4]
    assert set(d["buckets"]) == {"batch<=1", "batch<=4", "batch<=32"}
    assert d["buckets"]["batch<=32"]["best"] == 0
    assert json.loads(json.dumps(auto(0).describe()))["buckets"] == {}


def test_deterministic_given_the_observations():
    runs = []
    for _ in range(2):
        p, sim = auto(4), Sim(cpu, 0.5, seed=3)
        runs.append([sim.run(p, b, 50) for b in (1, 4, 16, 1)] + [json.dumps(p.describe())])
    assert runs[0] == runs[1]


def test_unmeasured_cost_is_flat_then_linear_from_what_was_seen():
    p = auto(4)
    p.observe(1, 0, 0.0100, 1)                     # the reference: plain at batch 1
    p.observe(2, 0, 0.0105, 2)                     # 2 rows: flat
    p.observe(1, 2, 0.0110, 2, rows=3)             # 3 rows: flat (within 25%), 10% overhead
    p.observe(1, 4, 0.0200, 2, rows=5)             # 5 rows: 2x, not flat
    assert p.flat_rows == 3 and p.knee_opt == 6
    assert p.overhead[2] == pytest.approx(1.1)
    assert p.overhead[4] == pytest.approx(2.0 / (5 / 3))   # measured / modelled ratio at batch 1
    b, c0 = p.bucket(2), p.cost[(p.bucket(2), 0)].per_seq
    for k, rows_ratio, optimistic_ratio in ((1, 4 / 3, 1.0), (2, 6 / 3, 1.0), (4, 10 / 3, 10 / 6)):
        cost = c0 * rows_ratio * p.overhead[k]     # max(R, B(1+k)) / max(R, B) with R = 3
        assert p.predict(b, 2, k) == pytest.approx(p.tau[k][0] / cost)
        cost = c0 * optimistic_ratio * p.overhead[k]            # the same with R = 6
        assert p.predict(b, 2, k, optimistic=True) == pytest.approx(p.tau[k][1] / cost)


# ---------------------------------------------------------------------------- behaviour
def test_batch1_cheap_verification_good_acceptance_converges_to_full_budget():
    for cost in (cheap, cpu):
        p, sim = auto(4), Sim(cost, 0.8)
        chosen = sim.run(p, 1, 200)
        assert 4 in chosen[:60]                    # the exploration ladder 1, 2, 4 is quick
        chosen = sim.run(p, 1, 320)
        assert chosen.count(4) >= 0.9 * 320        # and re-checks of the others are rare
        assert sim.speedup(1) > 0.9 * tau(0.8, 4) * cost(1, 0) / cost(1, 4)
        assert p.tau[4][0] > 2.6


def test_cpu_like_batch32_cold_start_speculates_in_at_most_a_few_percent_of_steps():
    """Nothing known: one cheap look at budget 1 (acceptance tau(4) ~ 1.4 is modest), then plain."""
    p, sim = auto(4), Sim(cpu, 0.3)
    chosen = sim.run(p, 32, 300)
    assert sum(k > 0 for k in chosen) <= 3 and not any(chosen[50:])
    assert sim.speedup(32) > 0.97
    assert (p.bucket(32), 4) not in p.cost         # the expensive budget was never run


def test_cpu_like_batch32_after_learning_never_speculates():
    p, sim = auto(4), Sim(cpu, 0.3)
    assert sim.run(p, 1, 300)[-50:].count(0) < 10  # at batch 1 speculation still pays
    assert sim.speedup(1) > 1.1
    sim.run(p, 4, 200)
    chosen = sim.run(p, 32, 300)
    assert not any(chosen)                         # predicted to lose: not even explored
    assert sim.speedup(32) > 0.99
    # the rule for unmeasured costs is the compute-bound one at batch 32: (1 + k) x plain
    b = p.bucket(32)
    for k in (1, 2, 4):
        ratio = p.predict(b, 32, 0) / p.predict(b, 32, k) * p.tau[k][0]
        assert ratio == pytest.approx((1 + k) * p.overhead[k])


def test_acceptance_learned_at_batch1_is_used_at_batch4():
    # cheap verification: known acceptance lets batch 4 go to the full budget at once
    p, sim = auto(4), Sim(cheap, 0.8)
    sim.run(p, 1, 200)
    samples = {k: a.seqs for k, a in p.acc.items()}
    chosen = sim.run(p, 4, 100)
    assert chosen[:1] == [0] and chosen.index(4) <= 6 and chosen[7:].count(4) >= 85
    assert samples[4] >= p.min_samples             # trusted before batch 4 ran
    # modest acceptance known from batch 1: at batch 4 (linear above 4 rows) the budget that
    # cannot win is never tried, the cheaper ones are looked at once at most
    p, sim = auto(4), Sim(cpu_narrow, 0.3)
    assert sim.run(p, 1, 300)[-100:].count(0) < 10
    chosen = sim.run(p, 4, 200)
    assert sum(k > 0 for k in chosen) <= 2
    assert (p.bucket(4), 4) not in p.cost
    assert sim.speedup(4) > 0.97


def test_acceptance_shift_moves_the_choice_to_plain():
    for seed in range(SEEDS):
        p, sim = auto(4), Sim(cpu_slow_drafter, 0.8, seed=seed)
        assert sim.run(p, 1, 300)[-100:].count(0) <= 5
        assert sim.speedup(1) > 1.8                # speculation pays (full budget: 2.4x) ...
        sim.p = 0.0                                # ... until the drafter stops being accepted
        chosen = sim.run(p, 1, 400)
        settled = chosen[80:]                      # within 80 steps: plain, but for re-checks
        assert sum(k > 0 for k in settled) <= 0.06 * len(settled)
        assert sim.speedup(1) > 0.92


def test_prefers_the_faster_budget_and_rechecks_rarely():
    """Deterministic costs where budget 2 is the fastest at batch 1 and plain at batch 32."""
    p = auto(4, explore_every=16)
    emitted = {0: 1, 1: 2, 2: 3, 4: 3}            # budget 4 adds nothing over 2
    step = {0: 0.10, 1: 0.10, 2: 0.10, 4: 0.12}

    def run(batch: int, steps: int, cost, per_seq) -> list[int]:
        chosen = []
        for _ in range(steps):
            k = p.budget(batch)
            p.observe(batch, k, cost(k), round(batch * per_seq[k]))
            chosen.append(k)
        return chosen
    run(1, 100, step.get, emitted)
    chosen = run(1, 256, step.get, emitted)
    assert chosen.count(2) >= 256 * 0.9 and 0 in chosen      # plain decoding is re-measured
    half = {k: 1 + (v - 1) / 2 for k, v in emitted.items()}  # compute bound, acceptance halved
    assert run(32, 256, lambda k: 0.5 * (1 + k), half).count(0) >= 256 - 1


def test_engine_reports_the_rows_of_the_padded_verify_forward(single_thread):
    """The rows a policy is told are those the verify forward ran: batch x (1 + longest tree)."""
    from helpers import tiny_llama
    from verispec.drafting import StatelessDrafter
    from verispec.core.engine import Engine, Sequence

    class Sizes(StatelessDrafter):
        max_tree_nodes = 4

        def propose(self, requests):
            return [DraftTree(torch.arange(n), torch.arange(n) - 1, None) for n, _ in zip([4, 1, 0], requests)]

    eng = Engine(tiny_llama(10, 16, 2), Sizes(), max_batch=3, max_len=64)
    eng.add_many([Sequence([1, 2], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)) for _ in range(3)])
    assert eng.step(4).rows == 3 * (1 + 4)
    assert eng.step(2).rows == 3 * (1 + 2)
    assert eng.step(0).rows == 3
