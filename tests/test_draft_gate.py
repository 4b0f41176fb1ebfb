"""Adaptive drafting (``verispec.drafting.draft_gate``): the per-sequence decisions, the measured
break-even, the configs that turn it on and off, and the engine staying lossless while rows
switch between drafted and plain steps."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helpers import assert_same_or_tie

from verispec import LLM, SamplingParams
from verispec.drafting.draft_gate import DraftGate, GateConfig, GateOption, Mode
from verispec.drafting.draft_shape import (AcceptanceProfile, ShapedFactory, StepCosts, gate_options,
                                          modelled_shape, tree_cost)
from verispec.drafting.spec_config import SpecConfigError, SpeculativeConfig

ROOT = Path(__file__).resolve().parents[1] / "checkpoints"


OPTIONS = (GateOption(1, 0.5, 1.2), GateOption(2, 0.6, 1.3), GateOption(3, 0.86, 1.45))


def simulate(gate: DraftGate, seq: int, true_scale: float, steps: int) -> list[int]:
    """``steps`` steps of a request whose drafted steps get ``true_scale`` x the modelled accepted
    tokens of their budget (deterministic: fractions carried over); returns each step's budget."""
    budgets, credit = [], 0.0
    for _ in range(steps):
        b = gate.budget(seq)
        budgets.append(b)
        if b:
            credit += true_scale * next(o.expected_accepted for o in gate.options if o.nodes == b)
            a = int(credit)
            credit -= a
            gate.observe(seq, b, a)
        else:
            gate.observe(seq, 0, 0)                   # a plain step changes nothing
    return budgets


def test_the_best_budget_follows_the_scaled_profile():
    gate = DraftGate(OPTIONS)
    assert gate.best(1.0) == 3          # (1 + 0.86) / 1.45 beats 1.5 / 1.2 and 1.6 / 1.3
    assert gate.best(0.6) == 1          # 1.3 / 1.2 beats the deeper prefixes
    assert gate.best(0.3) == 0          # nothing beats a plain step
    assert gate.scale(99) == 1.0        # no steps yet: the profile as it is
    gate.budget(4)
    for acc in (0, 1, 0):
        gate.observe(4, 3, acc)                        # three whole-tree steps: 1 of 3 x 0.86 modelled
    assert gate.scale(4) == pytest.approx((1 + 4 * 0.86) / (3 * 0.86 + 4 * 0.86))      # prior: 4 such steps


def test_each_budget_comes_with_the_model_behind_it():
    """``modelled`` gives the expected tokens and cost ratio of the step just decided (a plain
    step: 1 and 1; a trial: its first option's), the numbers the engine sums per request."""
    c = GateConfig()
    gate = DraftGate(OPTIONS, c)
    assert gate.modelled(5) == (1.0, 1.0)              # an unknown request
    assert gate.budget(5) == 3 and gate.modelled(5) == pytest.approx((1.86, 1.45))
    simulate(gate, 5, 0.0, 12)                         # rejected: it stops drafting
    assert gate.mode(5) is Mode.WAIT and gate.budget(5) == 0 and gate.modelled(5) == (1.0, 1.0)
    for _ in range(c.min_wait):
        gate.budget(5)
    assert gate.mode(5) is Mode.TRIAL and gate.budget(5) == 1
    tokens, ratio = gate.modelled(5)
    assert ratio == 1.2 and 1.0 < tokens < 1.5          # the first option, with the request's calibration


def test_a_request_that_gains_keeps_its_tree_and_a_weaker_one_drafts_less():
    gate = DraftGate(OPTIONS)
    budgets = simulate(gate, 1, 1.0, 60)             # its first step gets 0 (fractions carry over)
    assert budgets[0] == 3 and set(budgets[5:]) == {3} and gate.mode(1) is Mode.DRAFT
    budgets = simulate(gate, 2, 0.6, 60)
    assert budgets[0] == 3 and set(budgets[5:]) == {1} and gate.mode(2) is Mode.DRAFT
    assert gate.stats.drafted == 120 and gate.stats.plain == 0


def test_a_request_that_loses_stops_then_backs_off():
    c = GateConfig()
    gate = DraftGate(OPTIONS, c)
    drafted = [b > 0 for b in simulate(gate, 7, 0.0, 8 + 7 * c.min_wait + 3 * c.trial)]
    first = drafted.index(False)
    assert 4 <= first <= 8 and all(drafted[:first])     # a few steps: the profile weighs 4 steps
    half = c.trial // 2                               # a trial that accepts nothing ends halfway
    expect = [False] * c.min_wait + [True] * half + [False] * (2 * c.min_wait) + [True] * half + \
        [False] * (4 * c.min_wait) + [True] * half
    assert len(drafted) - first >= len(expect) and drafted[first:first + len(expect)] == expect
    assert gate.stats.trials >= 2 and gate.mode(7) in (Mode.WAIT, Mode.TRIAL)


def test_a_trial_that_pays_resumes_drafting():
    c = GateConfig()
    gate = DraftGate(OPTIONS, c)
    simulate(gate, 3, 0.0, 8)
    assert gate.mode(3) is Mode.WAIT
    budgets = simulate(gate, 3, 1.0, c.min_wait + 20)
    assert 0 in budgets and all(budgets[-10:]) and gate.mode(3) is Mode.DRAFT
    gate.release(3)
    assert gate.mode(3) is None


def test_cost_ratios_come_from_the_requests_timed_batch_one_steps():
    gate = DraftGate(OPTIONS, GateConfig(min_timed=3))
    gate.budget(5)
    gate.budget(6)
    for _ in range(3):
        gate.observe_step([5], [3], 0.0150)
        gate.observe_step([5], [0], 0.0100)
        gate.observe_step([6], [0], 0.0200)             # another request (a longer context): its own
        gate.observe_step([5, 6], [3, 1], 0.100)        # batch > 1: not timed
    gate.observe_step([5], [0], 9.0)                    # one outlier (a compile) does not move a median
    assert gate.measured_ratio(3, 5) == pytest.approx(1.5) and gate.cost_ratio(3, 5) == pytest.approx(1.5)
    assert gate.measured_ratio(1, 5) is None and gate.cost_ratio(1, 5) == 1.2   # not timed: modelled
    assert gate.best(1.0, 5) == 1                       # the measured cost made the whole tree dearer
    assert gate.measured_ratio(3, 6) is None and gate.best(1.0, 6) == 3
    gate.observe_step([99], [0], 0.01)                  # an unknown request: ignored


def test_finished_requests_teach_the_ratios_of_those_not_yet_timed():
    """A timed request not yet timed itself takes the median ratio its predecessors measured; a
    sampled (untimed) one keeps the model, so its budgets follow from its seed alone."""
    gate = DraftGate(OPTIONS, GateConfig(min_timed=2))
    for seq, ratio in ((1, 1.5), (2, 1.7), (3, 1.6)):
        gate.budget(seq)
        for _ in range(2):
            gate.observe_step([seq], [3], 0.010 * ratio)
            gate.observe_step([seq], [0], 0.010)
        assert gate.measured_ratio(3, seq) == pytest.approx(ratio)
        gate.release(seq)
        assert gate.cost_ratio(3, 9) == (1.45 if seq < 3 else pytest.approx(1.6))    # 3 needed
    gate.budget(9)
    assert gate.cost_ratio(3, 9) == pytest.approx(1.6) and gate.cost_ratio(1, 9) == 1.2   # never timed: model
    assert gate.cost_ratio(3, 9, timed=False) == 1.45
    assert DraftGate(OPTIONS, GateConfig(learned=0)).cost_ratio(3, 9) == 1.45


def test_the_gates_of_one_factory_learn_ratios_together(measured_costs):
    """``LLM.generate`` makes an engine, and so a gate, per call: the gates a drafter factory
    makes share the ratios finished requests measured, so a request of a later call starts from
    them instead of the load-time model (timed steps: costs not pinned)."""
    factory = ShapedFactory(lambda max_batch, max_len: None, None, OPTIONS,
                            StepCosts(((1, 10.0), (2, 11.0), (4, 12.0)), 1.0))
    config = GateConfig()
    for seq, ratio in ((1, 1.5), (2, 1.7), (3, 1.6)):
        gate = factory.make_gate(3)                       # one engine per request
        gate.budget(seq)
        for _ in range(config.min_timed):
            gate.observe_step([seq], [3], 0.010 * ratio)
            gate.observe_step([seq], [0], 0.010)
        gate.release(seq)
    later = factory.make_gate(3)
    assert later.learned is gate.learned and later.cost_ratio(3, 9) == pytest.approx(1.6)
    assert DraftGate(OPTIONS).cost_ratio(3, 9) == 1.45   # a gate of its own starts from the model


def test_drafting_must_beat_plain_decoding_by_the_margin():
    option = (GateOption(1, 0.22, 1.2),)              # 1.22 / 1.2: 1.7% more tokens per time
    assert DraftGate(option).best(1.0) == 0
    assert DraftGate(option, GateConfig(margin=0.0)).best(1.0) == 1
    with pytest.raises(ValueError, match="margin"):
        GateConfig(margin=-0.1)


def test_probe_steps_time_plain_decoding_and_turn_off_what_does_not_pay():
    """A timed request that keeps drafting takes plain probe steps, so its measured ratios exist:
    drafted steps timed at twice a plain one (the model said 1.2-1.45) stop drafting, though the
    acceptance is as modelled; drafted steps as dear as modelled keep drafting, a probe every
    ``probe_every`` steps; the dear request untimed (sampled, or batch > 1) never probes and keeps
    drafting on the modelled costs."""
    ratio = {o.nodes: o.cost_ratio for o in OPTIONS}

    def run(gate, seq, timed, step_s, steps):
        credit, budgets = 0.0, []
        for _ in range(steps):
            b = gate.budget(seq)
            budgets.append(b)
            if b:
                credit += next(o.expected_accepted for o in gate.options if o.nodes == b)
                gate.observe(seq, b, int(credit))
                credit -= int(credit)
            gate.observe_step([seq if timed else None], [b], step_s(b))
        return budgets
    dear = lambda b: 0.020 if b else 0.010             # noqa: E731
    c = GateConfig()
    gate = DraftGate(OPTIONS, c)
    budgets = run(gate, 1, True, dear, 120)
    assert budgets.index(0) == c.probe_every // 4 and gate.stats.probes >= 1
    assert gate.measured_ratio(3, 1) == pytest.approx(2.0)
    assert gate.mode(1) in (Mode.WAIT, Mode.TRIAL) and budgets[-40:].count(0) > 30
    untimed = DraftGate(OPTIONS, c)
    assert 0 not in run(untimed, 2, False, dear, 120) and untimed.stats.probes == 0
    fair = DraftGate(OPTIONS, c)
    budgets = run(fair, 3, True, lambda b: 0.010 * ratio.get(b, 1.0), 200)
    assert fair.mode(3) is Mode.DRAFT and fair.stats.probes == budgets.count(0)
    assert 200 // (c.probe_every + 1) <= fair.stats.probes <= c.min_timed + 200 // c.probe_every


def test_gate_arguments_are_checked():
    with pytest.raises(ValueError, match="min_wait"):
        GateConfig(min_wait=9, max_wait=4)
    with pytest.raises(ValueError, match="window"):
        GateConfig(window=0)
    with pytest.raises(ValueError, match="min_timed"):
        GateConfig(min_timed=0)
    with pytest.raises(ValueError, match="at least one"):
        DraftGate([])
    with pytest.raises(ValueError, match="increasing"):
        DraftGate([GateOption(2, 0.5, 1.1), GateOption(1, 0.4, 1.0)])
    with pytest.raises(ValueError, match="cost_ratio"):
        DraftGate([GateOption(1, 0.5, 0.0)])


def test_gate_options_are_the_tree_prefixes():
    p = AcceptanceProfile(((0.5, 0.2), (0.4,)))
    costs = StepCosts(verify=((1, 10.0), (4, 12.0)), draft_fixed=1.0, level=((1, 0.5),))
    opts = gate_options([[0, 0], [1], [0]], p, costs)               # any order: tree order is (depth, path)
    assert [o.nodes for o in opts] == [1, 2, 3]
    assert [o.expected_accepted for o in opts] == pytest.approx([0.5, 0.7, 0.9])
    for o, prefix in zip(opts, (((0,),), ((0,), (1,)), ((0,), (1,), (0, 0)))):
        shape = modelled_shape(prefix, p, costs)
        assert o.cost_ratio == pytest.approx(shape.step_ms / 10.0) and shape.step_ms == tree_cost(prefix, costs)


def test_adaptive_drafting_key_is_checked():
    with pytest.raises(SpecConfigError, match="adaptive_drafting"):
        SpeculativeConfig.from_dict({"method": "eagle3", "adaptive_drafting": "yes"})
    with pytest.raises(SpecConfigError, match="adaptive_drafting"):
        SpeculativeConfig.from_dict({"method": "medusa", "adaptive_drafting": 1})
    with pytest.raises(SpecConfigError, match="adaptive_drafting"):
        SpeculativeConfig.from_dict({"method": "suffix", "adaptive_drafting": "no"})
    with pytest.raises(SpecConfigError, match="applies to method"):
        SpeculativeConfig.from_dict({"method": "hybrid", "adaptive_drafting": True})


def test_which_configs_get_a_gate(packed_target, tmp_path):
    default = LLM(loaded=packed_target, speculative_config={"method": "eagle3"})
    gate = default.make_engine(1, 64).gate
    shape = default.draft_shape
    assert isinstance(gate, DraftGate) and shape is not None
    assert [o.nodes for o in gate.options] == list(range(1, len(shape.choices) + 1))
    assert gate.options[-1].expected_accepted == pytest.approx(shape.expected_tokens - 1)
    off = LLM(loaded=packed_target, speculative_config={"method": "eagle3", "adaptive_drafting": False})
    assert off.make_engine(1, 64).gate is None and off.draft_shape is not None
    assert LLM(loaded=packed_target, speculative_config={"method": "medusa", "tree": [[0], [1]]}) \
        .make_engine(1, 64).gate is None                              # a user's shape: off unless asked
    chain = LLM(loaded=packed_target, speculative_config={"method": "medusa", "num_speculative_tokens": 2,
                                                         "adaptive_drafting": True})
    g = chain.make_engine(1, 64).gate                                 # asked for: the user's chain
    p = AcceptanceProfile.load(ROOT / "smollm2-135m-medusa")
    assert chain.draft_shape is None and [o.expected_accepted for o in g.options] == \
        pytest.approx([p.p(1, 0), p.p(1, 0) * (1 + p.p(2, 0))])
    with pytest.raises(SpecConfigError, match="dynamic tree"):
        LLM(loaded=packed_target, speculative_config={"method": "eagle3", "topk": 4, "adaptive_drafting": True})
    bare = tmp_path / "eagle3"
    shutil.copytree(ROOT / "smollm2-135m-eagle3", bare)
    (bare / "acceptance.json").unlink()
    with pytest.raises(SpecConfigError, match="acceptance.json"):
        LLM(loaded=packed_target, speculative_config={"method": "eagle3", "adaptive_drafting": True,
                                                     "model": str(bare)})
    assert LLM(loaded=packed_target, speculative_config={"method": "eagle3", "model": str(bare)}) \
        .make_engine(1, 64).gate is None                              # no profile: no gate by default


class _Rotating:
    """A stub gate: each row's budget cycles through 0, 1 and 2 nodes, so steps mix plain rows,
    cut trees and whole ones."""

    def __init__(self):
        self.calls, self.seen = 0, []

    def plan(self, requests):
        return [self.budget(i) for i, _ in requests]

    def budget(self, seq_id):
        self.calls += 1
        return (seq_id + self.calls // 3) % 3

    def observe(self, seq_id, drafted, accepted):
        self.seen.append(drafted)

    def observe_step(self, seq_ids, budgets, time_s):
        pass

    def modelled(self, seq_id):
        return 1.0, 1.0

    def release(self, seq_id):
        pass


@pytest.mark.parametrize("method", ["eagle3", "medusa"])
def test_rows_switching_between_drafted_and_plain_steps_stay_lossless(packed_target, chat_prompts, method,
                                                                     monkeypatch):
    """Greedy output equals vanilla when the gate stops drafting (a break-even no head reaches:
    EAGLE then catches up on many pending positions at each trial) and when rows of one batch
    get different budgets (plain, a cut tree, the whole tree)."""
    params = SamplingParams(temperature=0, max_tokens=48)
    prompts = [{"prompt_token_ids": ids} for ids in chat_prompts[:3]]
    ref = LLM(loaded=packed_target).generate(prompts, params)
    # A pinned three-node tree: budgets 0, 1 and 2 must all be reachable whatever shape this
    # machine's measured costs would pick (the default shape can be one node on a fast machine).
    spec = LLM(loaded=packed_target, speculative_config={"method": method, "tree": [[0], [0, 0], [1]]})
    gates = []
    never = [GateOption(1, 0.5, 10.0)]                  # no request reaches this break-even
    monkeypatch.setattr(spec, "_make_gate", lambda n=0: gates.append(DraftGate(never)) or gates[-1])
    for p, o, r in zip(prompts, spec.generate(prompts[:1], params) + spec.generate(prompts[1:], params), ref):
        assert_same_or_tie(spec.target.model, p["prompt_token_ids"], o.token_ids, r.token_ids, method + " gated")
    assert all(g.stats.plain > 0 and g.stats.trials >= 1 for g in gates)
    stub = _Rotating()
    monkeypatch.setattr(spec, "_make_gate", lambda n=0: stub)
    for p, o, r in zip(prompts, spec.generate(prompts, params), ref):
        assert_same_or_tie(spec.target.model, p["prompt_token_ids"], o.token_ids, r.token_ids, method + " mixed")
    assert {0, 1, 2} <= set(stub.seen)


def test_sampled_requests_are_not_timed_and_stay_reproducible(packed_target, chat_prompts, monkeypatch):
    """A sampled request's draws depend on which steps drafted: its budgets follow from its seed
    (acceptance counts, modelled costs), never from step timings, so a seeded request gives the same
    output twice; greedy requests are timed."""
    spec = LLM(loaded=packed_target, speculative_config={"method": "eagle3"})
    seen = []
    real = spec._make_gate

    def spy(n=0):
        gate = real(n)
        observe_step = gate.observe_step
        gate.observe_step = lambda ids, budgets, t: seen.append(list(ids)) or observe_step(ids, budgets, t)
        return gate
    monkeypatch.setattr(spec, "_make_gate", spy)
    prompt = {"prompt_token_ids": chat_prompts[0]}
    sampled = SamplingParams(temperature=0.8, max_tokens=40, seed=3)
    first, second = (spec.generate([prompt], sampled)[0].token_ids for _ in range(2))
    assert first == second and seen and all(ids == [None] for ids in seen)
    seen.clear()
    spec.generate([prompt], SamplingParams(temperature=0, max_tokens=8))
    assert seen and all(ids[0] is not None for ids in seen)


def test_per_depth_profiles_and_learning():
    """Options carry the hit probability of each depth (``hit_by_depth``: V_d / V_{d-1}); a request
    whose first draft token is always accepted and its second never learns exactly that, and
    drafts one node, where one scale for the whole tree would keep drafting three."""
    from verispec.drafting.draft_shape import hit_by_depth
    p = AcceptanceProfile(((0.5, 0.2), (0.5,), (0.5,)))
    assert hit_by_depth([[0], [1], [0, 0]], p) == pytest.approx((0.7, 0.25 / 0.7))
    costs = StepCosts(verify=((1, 10.0), (2, 10.5), (4, 11.5)), draft_fixed=0.5, level=((1, 0.3),))
    opts = gate_options([[0], [0, 0], [0, 0, 0]], p, costs)
    assert [o.hit_by_depth for o in opts] == [(0.5,), (0.5, 0.5), (0.5, 0.5, 0.5)]
    for o in opts:
        assert o.accepted((1.0,) * 3) == pytest.approx(o.expected_accepted)
        assert o.accepted(2.0) == pytest.approx(2 * o.expected_accepted)
    gate = DraftGate(opts)
    assert gate.by_depth and gate.best(gate.calibration(7)) == 3
    for _ in range(24):                               # depth 1 always accepted, depth 2 never
        b = gate.budget(7)
        gate.observe(7, b, 1)
    c = gate.depth_factors(7)
    assert c[0] > 1.5 and c[1] < 0.5, c               # 1 of 0.5 modelled at depth 1; 0 of 0.5 at depth 2
    assert gate.best(c) == 1 and gate.budget(7) == 1
    legacy = DraftGate(tuple(GateOption(o.nodes, o.expected_accepted, o.cost_ratio) for o in opts))
    for _ in range(24):
        legacy.observe(7, legacy.budget(7), 1)
    assert not legacy.by_depth and legacy.budget(7) == 3      # one scale: 1 accepted > 0.875 modelled
