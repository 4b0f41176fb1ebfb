"""Adaptive drafting (``verispec.draft_gate``): the per-sequence decisions, the measured
break-even, the configs that turn it on and off, and the engine staying lossless while rows
switch between drafted and plain steps."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helpers import assert_same_or_tie

from verispec import LLM, SamplingParams
from verispec.draft_gate import DraftGate, GateConfig, Mode
from verispec.draft_shape import AcceptanceProfile, StepCosts, modelled_shape, tree_cost
from verispec.spec_config import SpecConfigError, SpeculativeConfig

ROOT = Path(__file__).resolve().parents[1] / "checkpoints"


def run(gate: DraftGate, seq: int, accepted: list[int]) -> list[bool]:
    """Step until the steps the gate lets draft have used ``accepted`` (their accepted counts);
    return each step's decision."""
    decisions, todo = [], list(accepted)
    while todo:
        d = gate.wants_draft(seq)
        decisions.append(d)
        gate.observe(seq, 2 if d else 0, todo.pop(0) if d else 0)   # a plain step changes nothing
    return decisions


def test_a_sequence_that_gains_keeps_drafting():
    gate = DraftGate(expected_accepted=0.8, cost_ratio=1.5)           # break-even 0.5 accepted per step
    assert gate.break_even == pytest.approx(0.5)
    counts = [1, 0, 1, 1, 0, 2, 1, 0, 1, 1] * 5                        # mean 0.8
    decisions = run(gate, 1, counts)
    assert all(decisions) and gate.mode(1) is Mode.DRAFT
    assert gate.estimate(1) == pytest.approx((sum(counts[-16:]) + 2 * 0.8) / 18)      # window 16, prior 2


def test_a_sequence_that_loses_stops_then_backs_off():
    c = GateConfig()
    gate = DraftGate(expected_accepted=0.8, cost_ratio=1.5, config=c)
    decisions = run(gate, 7, [0] * 8)
    # (2 x 0.8 + 0 + 0) / 4 = 0.4 < 0.5: off after the second drafted step
    assert decisions[:2] == [True, True] and gate.mode(7) is Mode.WAIT
    plain = decisions[2:]
    # wait min_wait, trial of 2 (fails), wait 2 x min_wait, trial of 2 (fails), wait 4 x min_wait, ...
    expect = [False] * c.min_wait + [True] * c.trial + [False] * (2 * c.min_wait) + [True] * c.trial + \
        [False] * (4 * c.min_wait) + [True] * c.trial
    assert plain == expect[:len(plain)] and len(plain) == len(expect)
    assert gate.stats.trials == 3 and gate.stats.plain == 7 * c.min_wait
    gate.wants_draft(7)
    assert gate.mode(7) is Mode.WAIT


def test_a_trial_that_reaches_the_break_even_resumes_drafting():
    gate = DraftGate(expected_accepted=0.8, cost_ratio=1.5)
    run(gate, 3, [0, 0])
    assert gate.mode(3) is Mode.WAIT
    decisions = run(gate, 3, [1, 1, 1, 1, 1])
    assert decisions[:GateConfig().min_wait] == [False] * GateConfig().min_wait
    assert gate.mode(3) is Mode.DRAFT and all(decisions[GateConfig().min_wait:])
    gate.release(3)
    assert gate.mode(3) is None


def test_the_break_even_comes_from_timed_batch_one_steps():
    gate = DraftGate(expected_accepted=0.8, cost_ratio=1.5, config=GateConfig(min_timed=3))
    for _ in range(3):
        gate.observe_step(1, 1, 0.012)
        gate.observe_step(1, 0, 0.010)
        gate.observe_step(4, 4, 0.100)                 # batch > 1: not timed
    gate.observe_step(1, 0, 9.0)                        # one outlier (a compile) does not move a median
    assert gate.measured_ratio == pytest.approx(1.2)
    assert gate.break_even == pytest.approx(0.2)
    assert DraftGate(0.5, 0.9).break_even == 0.0         # drafting modelled cheaper than a plain step


def test_gate_config_is_checked():
    with pytest.raises(ValueError, match="min_wait"):
        GateConfig(min_wait=9, max_wait=4)
    with pytest.raises(ValueError, match="window"):
        GateConfig(window=0)
    with pytest.raises(ValueError, match="min_timed"):
        GateConfig(min_timed=0)
    with pytest.raises(ValueError, match="cost_ratio"):
        DraftGate(0.5, 0.0)


def test_modelled_shape_of_a_given_tree():
    p = AcceptanceProfile(((0.5, 0.2), (0.4,)))
    costs = StepCosts(verify=((1, 10.0), (4, 12.0)), draft_fixed=1.0, level=((1, 0.5),))
    choices = ((0,), (1,), (0, 0))
    shape = modelled_shape(choices, p, costs)
    assert shape.expected_tokens == pytest.approx(1 + 0.5 + 0.2 + 0.5 * 0.4)
    assert shape.step_ms == pytest.approx(tree_cost(choices, costs)) and shape.vanilla_ms == 10.0
    gate = DraftGate.from_shape(shape)
    assert gate.expected_accepted == pytest.approx(0.9) and gate.cost_ratio == pytest.approx(shape.step_ms / 10.0)


def test_adaptive_drafting_key_is_checked():
    with pytest.raises(SpecConfigError, match="adaptive_drafting"):
        SpeculativeConfig.from_dict({"method": "eagle3", "adaptive_drafting": "yes"})
    with pytest.raises(SpecConfigError, match="adaptive_drafting"):
        SpeculativeConfig.from_dict({"method": "medusa", "adaptive_drafting": 1})
    with pytest.raises(SpecConfigError, match="applies to method"):
        SpeculativeConfig.from_dict({"method": "ngram", "adaptive_drafting": True})


def test_which_configs_get_a_gate(packed_target, tmp_path):
    default = LLM(loaded=packed_target, speculative_config={"method": "eagle3"})
    gate = default.make_engine(1, 64).gate
    assert isinstance(gate, DraftGate) and default.draft_shape is not None
    assert gate.expected_accepted == pytest.approx(default.draft_shape.expected_tokens - 1)
    off = LLM(loaded=packed_target, speculative_config={"method": "eagle3", "adaptive_drafting": False})
    assert off.make_engine(1, 64).gate is None and off.draft_shape is not None
    assert LLM(loaded=packed_target, speculative_config={"method": "medusa", "tree": [[0], [1]]}) \
        .make_engine(1, 64).gate is None                              # a user's shape: off unless asked
    chain = LLM(loaded=packed_target, speculative_config={"method": "medusa", "num_speculative_tokens": 2,
                                                         "adaptive_drafting": True})
    g = chain.make_engine(1, 64).gate                                 # asked for: the user's chain, modelled
    p = AcceptanceProfile.load(ROOT / "smollm2-135m-medusa")
    assert chain.draft_shape is None and g.expected_accepted == pytest.approx(p.p(1, 0) * (1 + p.p(2, 0)))
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


class _Alternating:
    """A stub gate: rows take turns drafting, so steps mix drafted and plain rows."""

    def __init__(self):
        self.calls, self.seen = 0, []

    def wants_draft(self, seq_id):
        self.calls += 1
        return (seq_id + self.calls // 3) % 2 == 0

    def observe(self, seq_id, drafted, accepted):
        self.seen.append(drafted)

    def observe_step(self, rows, drafted_rows, time_s):
        pass

    def release(self, seq_id):
        pass


@pytest.mark.parametrize("method", ["eagle3", "medusa"])
def test_rows_switching_between_drafted_and_plain_steps_stay_lossless(packed_target, chat_prompts, method,
                                                                     monkeypatch):
    """Greedy output equals vanilla when the gate stops drafting (a break-even no head reaches:
    EAGLE then catches up on many pending positions at each trial) and when rows of one batch
    alternate between drafted and plain steps."""
    params = SamplingParams(temperature=0, max_tokens=48)
    prompts = [{"prompt_token_ids": ids} for ids in chat_prompts[:3]]
    ref = LLM(loaded=packed_target).generate(prompts, params)
    spec = LLM(loaded=packed_target, speculative_config={"method": method})
    gates = []
    monkeypatch.setattr(spec, "_make_gate", lambda: gates.append(DraftGate(1.0, 10.0)) or gates[-1])
    for p, o, r in zip(prompts, spec.generate(prompts[:1], params) + spec.generate(prompts[1:], params), ref):
        assert_same_or_tie(spec.target.model, p["prompt_token_ids"], o.token_ids, r.token_ids, method + " gated")
    assert all(g.stats.plain > 0 and g.stats.trials >= 1 for g in gates)
    stub = _Alternating()
    monkeypatch.setattr(spec, "_make_gate", lambda: stub)
    for p, o, r in zip(prompts, spec.generate(prompts, params), ref):
        assert_same_or_tie(spec.target.model, p["prompt_token_ids"], o.token_ids, r.token_ids, method + " mixed")
    assert 0 in stub.seen and any(n > 0 for n in stub.seen)
