"""Adaptive drafting: each sequence drafts only while drafting pays for it.

A drafted step costs more than a plain one (the draft forward, a wider verify, more bookkeeping),
so it pays only while enough of its draft tokens are accepted. With ``T_d`` / ``T_p`` the wall
time of a drafted / plain step, a sequence whose drafted steps accept ``a`` tokens on average
gains iff ``(1 + a) / T_d > 1 / T_p``, i.e. ``a > a* = T_d / T_p - 1`` (the break-even).
Acceptance differs a lot between prompts (Spec-Bench, shipped SmolLM2 EAGLE-3 head: tau 1.15 on
translation, 1.77 on math_reasoning) and within one answer, so one shape for all requests either
loses on the hard ones or forgoes the easy ones.

``DraftGate`` estimates, per sequence, the accepted tokens per drafted step as the mean of its
last ``window`` drafted steps, shrunk towards the modelled value (the ``ShapeChoice``: the head's
acceptance profile on this machine's measured costs) with the weight of ``prior_steps`` steps:
one step's count is noisy (0 or 1 most of the time), and a few unlucky steps must not stop a
sequence that gains. A sequence whose estimate falls below the break-even stops drafting for
``min_wait`` steps, then drafts a trial of ``trial`` steps: if their mean reaches the
break-even it drafts again (the trial becomes its window), otherwise it waits twice as long
(at most ``max_wait``) before the next trial. Acceptance changes within an answer (a list, an
equation, a passage quoted from the prompt), so a stopped sequence is tried again, at a cost
that shrinks the longer it keeps failing.

The break-even comes from the modelled costs until batch-1 steps of both kinds have been timed in
this engine (``observe_step``): then from the medians of the last ``time_window`` of each, which
include what the model leaves out (per-step work outside the forwards, caches a draft forward
finds cold). At batch > 1 the modelled ratio is used.

Lossless by construction: the gate only chooses whether a sequence gets a draft tree this step;
a step without one is a plain decoding step. Knows nothing about drafters or models.
"""
from __future__ import annotations

import enum
import statistics
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class GateConfig:
    """Tuning of ``DraftGate`` (chosen on Spec-Bench with the shipped SmolLM2 heads)."""
    window: int = 16           # a sequence's latest drafted steps its estimate averages
    prior_steps: float = 2.0   # weight of the modelled acceptance, in drafted steps
    trial: int = 2             # drafted steps of a trial after a wait
    min_wait: int = 8          # plain steps after a sequence stops drafting, before its first trial
    max_wait: int = 64         # longest wait between trials (doubled after each failed one)
    time_window: int = 32      # batch-1 step times kept per kind for the measured break-even
    min_timed: int = 4         # steps of each kind timed before the measured break-even is used

    def __post_init__(self) -> None:
        if self.window < 1 or not self.prior_steps >= 0.0 or self.trial < 1:
            raise ValueError(f"need window >= 1, prior_steps >= 0 and trial >= 1, got {self.window}, "
                             f"{self.prior_steps}, {self.trial}")
        if not 1 <= self.min_wait <= self.max_wait:
            raise ValueError(f"need 1 <= min_wait <= max_wait, got {self.min_wait}, {self.max_wait}")
        if self.time_window < 1 or not 1 <= self.min_timed <= self.time_window:
            raise ValueError(f"need 1 <= min_timed <= time_window, got {self.min_timed}, {self.time_window}")


class Mode(enum.Enum):
    DRAFT = "draft"            # drafting every step
    WAIT = "wait"              # plain steps until the next trial
    TRIAL = "trial"            # drafting a trial


@dataclass
class _SeqState:
    accepted: deque            # accepted draft tokens of the latest drafted steps (DRAFT) / of the trial
    mode: Mode = Mode.DRAFT
    left: int = 0              # WAIT: plain steps left
    wait: int = 0              # the current wait between trials


@dataclass
class GateStats:
    """What the gate decided: sequence steps it let draft, steps it kept plain, trials run."""
    drafted: int = 0
    plain: int = 0
    trials: int = 0

    def as_dict(self) -> dict:
        return {"drafted_steps": self.drafted, "plain_steps": self.plain, "trials": self.trials}


class DraftGate:
    """Per-sequence drafting decisions (see the module docstring). ``expected_accepted``: the
    modelled accepted draft tokens per drafted step; ``cost_ratio``: modelled ``T_d / T_p``."""

    def __init__(self, expected_accepted: float, cost_ratio: float, config: GateConfig = GateConfig()):
        if not expected_accepted >= 0.0 or not cost_ratio > 0.0:
            raise ValueError(f"need expected_accepted >= 0 and cost_ratio > 0, got {expected_accepted}, {cost_ratio}")
        self.expected_accepted, self.cost_ratio, self.config = float(expected_accepted), float(cost_ratio), config
        self._seqs: dict[int, _SeqState] = {}
        self._times = {True: deque(maxlen=config.time_window), False: deque(maxlen=config.time_window)}
        self.stats = GateStats()

    @classmethod
    def from_shape(cls, shape, config: GateConfig = GateConfig()) -> "DraftGate":
        """A gate for a ``draft_shape.ShapeChoice`` (its modelled tokens and step costs)."""
        return cls(shape.expected_tokens - 1.0, shape.step_ms / shape.vanilla_ms, config)

    # -- the break-even ----------------------------------------------------------------------------
    @property
    def measured_ratio(self) -> float | None:
        """``T_d / T_p`` from this engine's timed batch-1 steps; None until enough of each kind."""
        d, p = self._times[True], self._times[False]
        if min(len(d), len(p)) < self.config.min_timed:
            return None
        return statistics.median(d) / statistics.median(p)

    @property
    def break_even(self) -> float:
        """Accepted draft tokens per drafted step at which drafting and plain steps tie."""
        ratio = self.measured_ratio
        return max(0.0, (self.cost_ratio if ratio is None else ratio) - 1.0)

    # -- decisions -----------------------------------------------------------------------------------
    def wants_draft(self, seq_id: int) -> bool:
        """Whether sequence ``seq_id`` gets a draft tree this step (call once per step)."""
        st = self._seqs.get(seq_id)
        if st is None:
            st = self._seqs[seq_id] = _SeqState(deque(maxlen=self.config.window))
        if st.mode is Mode.WAIT:
            if st.left > 0:
                st.left -= 1
                self.stats.plain += 1
                return False
            st.mode, st.accepted = Mode.TRIAL, deque(maxlen=self.config.window)
            self.stats.trials += 1
        self.stats.drafted += 1
        return True

    def observe(self, seq_id: int, drafted: int, accepted: int) -> None:
        """A step of ``seq_id`` verified ``drafted`` draft nodes and accepted ``accepted``.
        Steps without a draft (none asked, or the drafter found nothing) change nothing."""
        st = self._seqs.get(seq_id)
        if st is None or drafted == 0 or st.mode is Mode.WAIT:
            return
        c = self.config
        st.accepted.append(accepted)
        target = self.break_even
        if st.mode is Mode.DRAFT:
            if self.estimate(seq_id) < target:
                st.mode, st.wait = Mode.WAIT, c.min_wait
                st.left = st.wait
        elif len(st.accepted) >= c.trial:
            if sum(st.accepted) / len(st.accepted) >= target:
                st.mode = Mode.DRAFT
            else:
                st.mode, st.wait = Mode.WAIT, min(2 * st.wait, c.max_wait)
                st.left = st.wait

    def estimate(self, seq_id: int) -> float:
        """The sequence's expected accepted draft tokens per drafted step (the prior before any)."""
        st = self._seqs.get(seq_id)
        n0, acc = self.config.prior_steps, (st.accepted if st is not None else ())
        if not acc and n0 == 0:
            return self.expected_accepted
        return (sum(acc) + n0 * self.expected_accepted) / (len(acc) + n0)

    def observe_step(self, rows: int, drafted_rows: int, time_s: float) -> None:
        """A whole engine step's wall time; batch-1 steps feed the measured break-even."""
        if rows == 1:
            self._times[drafted_rows > 0].append(time_s)

    def release(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def mode(self, seq_id: int) -> Mode | None:
        """The sequence's current mode (None: unknown sequence)."""
        st = self._seqs.get(seq_id)
        return None if st is None else st.mode
