"""The one draft-budget estimator (``DraftGate`` with ``BatchCosts``) against synthetic servers:
no model, no engine, pure Python loops; plus the engine's report of the rows it verified.

A ``Sim`` plays the engine: the step time of a batch whose widest request drafts ``w`` nodes
comes from a cost model ``cost(batch, w)`` (with a little seeded noise), and each request of a
step accepts the tokens of a chain drafter that gets each token right with probability ``p``
(after the previous one). Every request is greedy (timed) unless said otherwise.
"""
from __future__ import annotations

import random

import pytest
import torch

from verispec.core.sampling import SamplingParams
from verispec.core.tree import DraftTree
from verispec.drafting.batch_cost import BatchCosts, bucket
from verispec.drafting.draft_shape import PRIOR_HIT, generic_options
from verispec.drafting.draft_gate import DraftGate, Mode
from verispec.serve.policy import StaticPolicy, TablePolicy, parse_policy

FLAT8 = tuple((t, 10.0 * max(1.0, t / 8)) for t in (1, 2, 4, 8, 16, 32, 64))    # flat to 8 rows, then linear


def cpu(batch: int, width: int) -> float:
    """CPU-like, as ``FLAT8``: a forward is flat up to 8 rows and linear beyond."""
    return 0.010 * max(1.0, batch * (1 + width) / 8)


def cpu_wide(batch: int, width: int) -> float:
    """What ``FLAT8`` mis-models: linear from 2 rows (a machine slower than its measurement)."""
    return 0.010 * max(1.0, batch * (1 + width) / 2)


def gate(max_nodes: int = 4, verify=FLAT8) -> DraftGate:
    options = generic_options(max_nodes, verify)
    return DraftGate(options, costs=BatchCosts(verify, {o.nodes: 0.0 for o in options}))


class Sim:
    def __init__(self, cost, p: float, seed: int = 0, noise: float = 0.05):
        self.cost, self.p, self.noise = cost, p, noise
        self.rng = random.Random(seed)

    def run(self, g: DraftGate, ids: list[int], steps: int, timed: bool = True) -> list[list[int]]:
        """``steps`` engine steps of the requests ``ids``; the budgets the gate gave."""
        chosen = []
        for _ in range(steps):
            budgets = g.plan([(i, timed) for i in ids])
            width = max(budgets)
            dt = self.cost(len(ids), width) * (1 + self.noise * (2 * self.rng.random() - 1))
            for i, k in zip(ids, budgets):
                n = 0
                while n < k and self.rng.random() < self.p:
                    n += 1
                g.observe(i, k, n)
            g.observe_step([i if timed else None for i in ids], budgets, dt)
            chosen.append(budgets)
        return chosen


def drafted_share(chosen: list[list[int]]) -> float:
    flat = [b for step in chosen for b in step]
    return sum(b > 0 for b in flat) / len(flat)


# ---------------------------------------------------------------------------- BatchCosts
def test_modelled_ratio_is_the_verify_forward_of_the_batchs_rows():
    c = BatchCosts(FLAT8, {1: 2.0, 4: 5.0})
    assert c.modelled(1, 0) == 1.0 and c.modelled(1, 4) == pytest.approx((5.0 + 10.0) / 10.0)
    assert c.modelled(16, 1) == pytest.approx((2.0 * 2 + 40.0) / 20.0)      # 32 rows over 16, draft x v(16)/v(1)
    assert c.modelled(2, 3) == pytest.approx(1.0)                          # 8 rows: still flat
    assert [bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 64)] == [0, 1, 2, 2, 3, 3, 4, 6]
    with pytest.raises(ValueError):
        BatchCosts((), {})
    with pytest.raises(ValueError):
        BatchCosts(FLAT8, {}, min_timed=0)


def test_measured_ratio_replaces_the_model_per_bucket():
    c = BatchCosts(FLAT8, {}, min_timed=2)
    for _ in range(2):
        c.observe(8, 0, 0.010)
    c.observe(7, 2, 0.030)
    assert c.measured(8, 2) is None and c.ratio(8, 2) == pytest.approx(c.modelled(8, 2))
    c.observe(5, 2, 0.030)                               # 5..8 share a bucket
    assert c.measured(8, 2) == pytest.approx(3.0) and c.ratio(6, 2) == pytest.approx(3.0)
    assert c.ratio(6, 2, timed=False) == pytest.approx(c.modelled(6, 2))
    assert c.measured(16, 2) is None and c.measured(8, 1) is None
    assert set(c.describe()) == {"batch<=8"}
    c.observe(8, 2, 0.0)                                 # no time: ignored
    assert c.describe()["batch<=8"]["2"]["steps"] == 2


def test_probes_time_plain_steps_then_rarely():
    c = BatchCosts(FLAT8, {}, min_timed=2, probe_every=4)
    due = []
    for _ in range(40):
        if c.probe_due(4):
            due.append(True)
            c.observe(4, 0, 0.01)
        else:
            due.append(False)
            c.observe(4, 2, 0.01)
    first = [i for i, d in enumerate(due) if d]
    assert first[:2] == [4, 9] and first[2] - first[1] == 17     # every 4 until 2 timed, then every 16


# ---------------------------------------------------------------------------- the gate by batch size
def test_generic_options_are_a_chain_prior_at_the_measured_verify_costs():
    opts = generic_options(6, FLAT8)
    assert [o.nodes for o in opts] == [1, 2, 4, 6]
    assert opts[1].expected_accepted == pytest.approx(PRIOR_HIT + PRIOR_HIT ** 2)
    assert opts[-1].hit_by_depth == (PRIOR_HIT,) * 6 and all(o.cost_ratio == 1.0 for o in opts)
    with pytest.raises(ValueError):
        generic_options(0, FLAT8)


def test_batch1_drafts_the_whole_tree_and_a_cpu_batch32_does_not_draft():
    g = gate()
    at1 = Sim(cpu, 0.8).run(g, [0], 60)
    assert sum(b == [4] for b in at1[-40:]) >= 35                # flat verify: the whole chain pays
    at32 = Sim(cpu, 0.8, seed=1).run(g, list(range(1, 33)), 60)
    assert drafted_share(at32) == 0.0                            # 5x the rows for 1.8 tokens: never
    assert g.mode(1) is Mode.DRAFT                               # not stopped: the batch's cost, not its acceptance
    again = Sim(cpu, 0.8, seed=2).run(g, [1], 10)
    assert again[0] == [4] and sum(b[0] > 0 for b in again) >= 8   # alone again: drafts at once (and probes)


def test_a_batch_size_where_drafting_pays_by_a_little_still_drafts():
    g = gate()
    chosen = Sim(cpu, 0.9).run(g, [0, 1], 80)                    # 2 x 5 rows: 1.25x the cost
    assert drafted_share(chosen[20:]) > 0.8


def test_measured_batch_costs_overrule_a_model_that_is_too_cheap():
    g = gate(verify=tuple((t, 10.0 * max(1.0, t / 64)) for t in (1, 8, 64, 128)))   # claims flat to 64 rows
    chosen = Sim(cpu_wide, 0.6, seed=3).run(g, list(range(8)), 300)
    assert drafted_share(chosen[:20]) > 0.5                      # the model says drafting is free
    assert drafted_share(chosen[-100:]) < 0.1                    # measured: 8 x 5 rows cost 5x
    assert g.costs.measured(8, 4) is not None and g.stats.probes >= 2


def test_sampled_requests_follow_the_model_and_take_no_batch_probes():
    g1, g2 = gate(), gate()
    a = Sim(cpu, 0.7, seed=4).run(g1, [0, 1, 2, 3], 80, timed=False)
    b = Sim(cpu, 0.7, seed=4).run(g2, [0, 1, 2, 3], 80, timed=False)
    assert a == b and g1.stats.probes == 0 and g1.costs.describe() == {}


SLOPED = tuple((t, 10.0 + 2.0 * (t - 1)) for t in (1, 2, 4, 8, 16, 32, 64))    # each row costs 20%


def sloped(batch: int, width: int) -> float:
    return 0.001 * (10.0 + 2.0 * (batch * (1 + width) - 1))


MILD = tuple((t, 10.0 + 1.0 * (t - 1)) for t in (1, 2, 4, 8, 16, 32, 64))      # each row costs 10%


def mild(batch: int, width: int) -> float:
    return 0.001 * (10.0 + 1.0 * (batch * (1 + width) - 1))


def test_acceptance_learned_at_one_batch_size_is_used_at_another():
    g = gate(verify=MILD)
    Sim(mild, 0.0, seed=5).run(g, [7], 40)                       # the drafts of request 7 are wrong
    assert g.mode(7) is not Mode.DRAFT                           # stopped at batch 1
    pair = Sim(mild, 0.0, seed=6).run(g, [7, 8], 8)
    assert sum(b[0] > 0 for b in pair) <= g.config.trial // 2     # and stays stopped at batch 2 (one
    assert g.mode(7) is not Mode.DRAFT                           # hopeless trial, cut at its half)
    assert sum(b[1] > 0 for b in pair) >= 1                      # while the new request tries


def test_one_request_cannot_pay_for_a_batchs_wider_step():
    """The verify forward is padded to the widest request: with each row costing 20%, a width-1
    step of 8 requests costs 1.67 plain ones. One request accepting 95% of its drafts gains 1.95
    tokens for that (worth it alone), the batch 8.95 tokens for 8 x 1.67: never drafted, while
    eight such requests draft."""
    g = gate(verify=SLOPED)
    for i in range(1, 8):                                        # seven requests whose drafts fail
        Sim(sloped, 0.0, seed=i).run(g, [i], 40)
    assert all(g.mode(i) is not Mode.DRAFT for i in range(1, 8))
    mixed = Sim(sloped, 0.95, seed=8).run(g, list(range(8)), 12)
    assert all(b == [0] * 8 for b in mixed)
    assert g.mode(0) is Mode.DRAFT                               # request 0 keeps drafting where it pays
    assert Sim(sloped, 0.95, seed=9).run(g, [0], 4)[-1][0] > 0
    h = gate(verify=tuple((t, 10.0 * max(1.0, t / 16)) for t in (1, 2, 4, 8, 16, 32, 64)))   # flat to 16 rows
    good = Sim(lambda b, w: 0.010 * max(1.0, b * (1 + w) / 16), 0.95, seed=10).run(h, list(range(8)), 30)
    assert all(len(set(b)) == 1 for b in good)                   # one width for the whole step
    assert drafted_share(good[10:]) > 0.8


def test_deterministic_given_the_observations():
    runs = [Sim(cpu, 0.7, seed=9).run(gate(), [0, 1, 2], 120) for _ in range(2)]
    assert runs[0] == runs[1]


# ---------------------------------------------------------------------------- user caps
def test_policy_caps_and_parsing():
    t = parse_policy({"1": 4, "4": 2, "16": 0})
    assert isinstance(t, TablePolicy)
    t.bind(5)
    assert [t.budget(b) for b in (1, 3, 4, 15, 16, 64)] == [4, 4, 2, 2, 0, 0]
    assert parse_policy("auto") is None and parse_policy(None) is None    # the estimator alone
    assert isinstance(parse_policy("static"), StaticPolicy)
    for bad in ("{", "[]", {}, {"x": 1}, {"0": 1}, {"1": -1}, {"1": 1.5}, "fast"):
        with pytest.raises(ValueError):
            parse_policy(bad)


def test_engine_reports_the_rows_of_the_padded_verify_forward(single_thread):
    """The rows a step reports are those the verify forward ran: batch x (1 + longest tree)."""
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


def test_a_gate_without_step_times_decides_from_the_model_alone():
    """``GateConfig(use_step_times=False)`` (pinned costs): no probes and no measured ratios, so a
    machine far slower than modelled (``cpu_wide``) gets the same budgets as a fast one."""
    from verispec.drafting.draft_gate import GateConfig

    def untimed() -> DraftGate:
        options = generic_options(4, FLAT8)
        return DraftGate(options, GateConfig(use_step_times=False),
                         costs=BatchCosts(FLAT8, {o.nodes: 0.0 for o in options}))
    slow = Sim(cpu_wide, p=0.8, seed=3).run(untimed(), [0, 1], 120)
    fast = Sim(cpu, p=0.8, seed=3).run(untimed(), [0, 1], 120)
    assert slow == fast and drafted_share(slow) > 0.9          # no probe steps, same choices
    timed = Sim(cpu_wide, p=0.8, seed=3).run(gate(), [0, 1], 120)
    assert timed != slow                                       # with step times the slow machine differs


def test_pinned_step_costs_replace_measurement(tmp_path, monkeypatch):
    """``$VERISPEC_STEP_COSTS`` names the costs every shape is chosen from; nothing is measured,
    and a file that is not step costs is a clear error."""
    import json

    from verispec.drafting.draft_shape import PINNED_ENV, cached_costs, pinned_costs
    path = tmp_path / "pinned.json"
    path.write_text(json.dumps({"verify": [[1, 10.0], [4, 11.0]], "draft_fixed": 1.5, "chain": [0.4, 0.2]}))
    monkeypatch.setenv(PINNED_ENV, str(path))
    costs = cached_costs("any key", lambda: pytest.fail("pinned costs are never measured"))
    assert costs.verify == ((1, 10.0), (4, 11.0)) and costs.draft_fixed == 1.5 and costs.chain == (0.4, 0.2)
    path.write_text(json.dumps({"verify": [[1, 0.0]], "draft_fixed": 1.0}))
    with pytest.raises(ValueError, match="positive"):
        pinned_costs()
    path.write_text("{broken")
    with pytest.raises(ValueError, match="not step costs"):
        pinned_costs()
    monkeypatch.setenv(PINNED_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="missing.json"):
        pinned_costs()


def test_a_batch_where_no_budget_could_pay_is_all_plain_and_keeps_each_request_state():
    """At batch 32 on ``FLAT8`` no budget pays even at full acceptance: ``plan`` makes the whole
    step plain without a per-request estimate, and each request's mode is untouched, so the
    requests draft again as soon as the batch shrinks."""
    g = gate()
    ids = list(range(32))
    assert not g._may_pay(32) and g._may_pay(2)
    assert g.plan([(i, True) for i in ids]) == [0] * 32
    modes = {i: g.mode(i) for i in ids}
    assert modes[0] is Mode.DRAFT
    assert all(b == 0 for _ in range(20) for b in g.plan([(i, True) for i in ids]))
    assert {i: g.mode(i) for i in ids} == modes                 # no request was sent to wait
    assert all(b > 0 for b in g.plan([(0, True), (1, True)]))
