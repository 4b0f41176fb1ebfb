"""Adaptive drafting: each request drafts the part of its tree that pays for it, or nothing.

A drafted step costs more than a plain one (the draft forward, a wider verify, more bookkeeping),
so it pays only while enough of its draft tokens are accepted. With ``T_m`` the wall time of a
step drafting ``m`` nodes (``T_0``: a plain step) and ``a_m`` the tokens such a step gets
accepted, the request decodes fastest with the ``m`` that maximises ``(1 + a_m) / T_m``.
Acceptance differs a lot between prompts (Spec-Bench, shipped SmolLM2 EAGLE-3 head: tau 1.15 on
translation, 1.77 on math_reasoning) and within one answer, and a head's measured profile comes
from its own training distribution; so one shape for every request either loses on the hard
ones or forgoes the easy ones.

Options are the nested prefixes of the configured tree (its first ``m`` nodes, which the engine
cuts with a request's node budget; a cut EAGLE tree also skips the levels it no longer needs),
each with the modelled accepted tokens ``E_m`` (the head's acceptance profile) and cost ratio
``R_m = T_m / T_0`` (this machine's measured step costs): ``draft_shape.gate_options``.

Per request, ``DraftGate`` learns acceptance depth by depth from its real steps. Each option
carries the modelled probability ``h_d`` that depth d's token is accepted once depth d-1's was
(``draft_shape.hit_by_depth``); over the request's last ``window`` drafted steps, the gate counts
for each depth the steps that reached it (every earlier depth accepted), the tokens accepted
there and the hits modelled there, and scales ``h_d`` by ``c_d = (accepted + n0 h_d) / (modelled
+ n0 h_d)``, shrunk towards 1 with the weight of ``n0 = prior_steps`` steps: one step's outcome is
noisy, and a few unlucky steps must not stop a request that gains. ``E_m`` is then recomputed
from the scaled ``h_d`` (each capped at 1), so a request whose first draft token is accepted but
not its second drafts one node, not the whole tree. Options without per-depth probabilities
(hand-made ones) are scaled as a whole: ``c = (sum of accepted + n0 E) / (sum of modelled E_m +
n0 E)``. Each step it drafts the budget ``m`` with the best
``(1 + E_m(c)) / R_m``. When that is ``m = 0`` (plain decoding beats every prefix) the request
stops drafting for ``min_wait`` steps, then drafts a trial of ``trial`` steps (the budget its
history favours, at least the first node): if the trial's own ``c`` makes some prefix pay, it
drafts again with the trial as its window, otherwise it waits twice as long (at most
``max_wait``) before the next trial. A trial whose first half accepts nothing ends there, as a
failed one: on a long context a drafted step costs some 40% more than a plain one, so a
hopeless request's trials were most of what it lost. Acceptance changes within an answer (a
list, an equation, a passage quoted from the prompt), so a stopped request is tried again, at a
cost that shrinks the longer it keeps failing.

``R_m`` is the modelled ratio until batch-1 steps of budget ``m`` and plain steps of the same
request have both been timed (``observe_step``): then the ratio of the medians of the last
``time_window`` of each, which includes what the model leaves out (per-step work outside the
forwards, caches a draft forward finds cold). A request that keeps drafting would never time a
plain step, so a timed request's drafting is interrupted by *probe* steps, plain steps taken for
their time: one every ``probe_every // 4`` drafted steps until ``min_timed`` plain steps are
timed, then one every ``probe_every`` (a re-check: a step's time grows with its context). A probe
costs one step's draft (about 1/16 of the gain at the defaults); without probes a gate that pays
3 ms of per-step work no model counts keeps drafting at 0.97x. Only greedy requests are timed (the engine's
choice: a sampled request's draws depend on which steps drafted, so its budgets must follow from
its seed alone to be reproducible). Per request, because a step's time grows with its
context: an engine serves short and long prompts one after another, and a request that stops
drafting is often a long one (summaries, retrieval), whose plain steps would make every
drafted step of a short one look cheap.

Until a request is timed itself, its ratios are the median of those that finished requests
measured (``GateConfig.learned``), when at least three did, over every engine of the ``LLM``
(``LearnedRatios``, one per drafter factory): the load-time model comes from
the fastest of a few isolated forwards, so it runs low beside whole engine steps. Every budget's
tokens per time must beat a plain step's by ``GateConfig.margin`` (3%): near break-even the
estimate's noise decides, and a plain step is the choice that is never slower. For each step the
gate also states the model behind its choice (``modelled``: expected tokens and cost ratio), which
the engine sums per request, so that the benchmarks set the expected speed-up beside the measured.

At batch > 1 the ratios are the batch's (``batch_cost.BatchCosts``: modelled from the measured
verify curve at B x (1 + m) rows, then measured per batch-size bucket, with plain probe steps of
the whole batch); ``plan`` decides all requests of a step at its batch size. The verify forward is
padded to the widest request, so a batch step costs the same whichever of its requests draft: a
step of greedy requests drafts one width for all that want to draft (their own state machines at
batch-1 costs say which), the width with the most tokens of the whole batch per time, or none. A
request whose budget is 0 only because the batch is large (at batch 1 it would draft) takes a
plain step and keeps its mode, so it drafts again as soon as the batch shrinks. This is the one draft-budget
estimator: the engine asks it every step, for ``LLM.generate`` and the server alike.

Lossless by construction: the gate only chooses how many draft nodes a request gets this step; a
step without any is a plain decoding step. Knows nothing about drafters or models.
"""
from __future__ import annotations

import enum
import statistics
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from .batch_cost import BatchCosts


@dataclass(frozen=True)
class GateConfig:
    """Tuning of ``DraftGate`` (chosen on Spec-Bench with the shipped SmolLM2 heads)."""
    window: int = 24           # a request's latest drafted steps its estimate averages
    prior_steps: float = 4.0   # weight of the profile (c = 1), in drafted steps like the window's
    trial: int = 4             # drafted steps of a trial after a wait
    min_wait: int = 8          # plain steps after a request stops drafting, before its first trial
    max_wait: int = 64         # longest wait between trials (doubled after each failed one)
    time_window: int = 32      # a request's batch-1 step times kept per budget for its measured ratios
    min_timed: int = 4         # steps of a budget (and plain ones) timed before its measured ratio is used
    probe_every: int = 16      # a timed request drafting takes a plain (probe) step every this many steps
    time_requests: bool = True  # batch-1 steps time each request (probes, measured ratios); False: the
                                # modelled ratios at batch 1 (a drafter whose proposals are host work)
    use_step_times: bool = True  # False: step times are ignored at every batch size (no probes, no
                                 # measured ratios): decisions follow the modelled costs and the
                                 # acceptance alone, the same on every machine (pinned step costs)
    margin: float = 0.03       # drafting must beat plain decoding's tokens per time by this share:
                               # the estimates are noisy, and near break-even a plain step is the safe choice
    learned: int = 16          # finished requests whose measured ratios, per budget, stand in for the
                               # modelled ones in a timed request not yet timed itself

    def __post_init__(self) -> None:
        if self.window < 1 or not self.prior_steps >= 0.0 or self.trial < 1:
            raise ValueError(f"need window >= 1, prior_steps >= 0 and trial >= 1, got {self.window}, "
                             f"{self.prior_steps}, {self.trial}")
        if not 1 <= self.min_wait <= self.max_wait:
            raise ValueError(f"need 1 <= min_wait <= max_wait, got {self.min_wait}, {self.max_wait}")
        if self.time_window < 1 or not 1 <= self.min_timed <= self.time_window:
            raise ValueError(f"need 1 <= min_timed <= time_window, got {self.min_timed}, {self.time_window}")
        if self.probe_every < 4:
            raise ValueError(f"need probe_every >= 4, got {self.probe_every}")
        if not 0.0 <= self.margin < 1.0 or self.learned < 0:
            raise ValueError(f"need 0 <= margin < 1 and learned >= 0, got {self.margin}, {self.learned}")


@dataclass(frozen=True)
class GateOption:
    """Drafting the tree's first ``nodes`` nodes: modelled accepted tokens per step and step time
    over a plain step's. ``hit_by_depth`` (optional): the modelled probability that depth d's
    token is accepted given depth d-1's was, for d = 1..the prefix's depth (then
    ``expected_accepted`` = sum over L of the product of the first L); with it the gate learns
    each request's acceptance depth by depth instead of one scale for the whole tree."""
    nodes: int
    expected_accepted: float
    cost_ratio: float
    hit_by_depth: tuple[float, ...] = ()
    draft_ms: float = 0.0      # the modelled batch-1 draft time of this prefix (``batch_cost``)

    def accepted(self, factors: "Sequence[float] | float") -> float:
        """Modelled accepted tokens with the profile scaled by ``factors``: per depth (each hit
        probability times its factor, at most 1) or, given one number, as a whole."""
        if isinstance(factors, (int, float)):
            return factors * self.expected_accepted
        total, reach = 0.0, 1.0
        for d, h in enumerate(self.hit_by_depth):
            reach *= min(1.0, h * (factors[d] if d < len(factors) else 1.0))
            total += reach
        return total


class Mode(enum.Enum):
    DRAFT = "draft"            # drafting the best budget every step
    WAIT = "wait"              # plain steps until the next trial
    TRIAL = "trial"            # drafting a trial


@dataclass
class _SeqState:
    steps: deque               # (accepted, budget drafted) of the latest drafted steps
    trial_steps: list = field(default_factory=list)   # TRIAL: the same for the trial's steps
    mode: Mode = Mode.DRAFT
    left: int = 0              # WAIT: plain steps left
    wait: int = 0              # the current wait between trials
    budget: int = 0            # the budget given this step
    times: dict = field(default_factory=dict)   # budget -> its latest batch-1 step times (s)
    timed: bool = False        # its latest step was timed (batch 1, greedy): probes measure plain steps
    since_plain: int = 0       # drafted steps since its latest plain step
    model: tuple = (1.0, 1.0)  # this step's modelled (tokens, cost over a plain step's): ``modelled``


@dataclass
class GateStats:
    """What the gate decided: request steps it let draft, steps it kept plain, trials run, and
    drafted steps per budget."""
    drafted: int = 0
    plain: int = 0
    trials: int = 0
    probes: int = 0            # plain steps taken to time them (counted in ``plain`` too)
    budgets: dict = field(default_factory=dict)     # budget -> drafted steps

    def as_dict(self) -> dict:
        return {"drafted_steps": self.drafted, "plain_steps": self.plain, "trials": self.trials,
                "probes": self.probes, "budgets": dict(sorted(self.budgets.items()))}


class LearnedRatios:
    """The batch-1 cost ratios that finished requests measured, per budget (the last ``keep`` of
    each; their median once there are 3): what a timed request not yet timed itself starts from
    (``GateConfig.learned``). One object serves every gate of a drafter factory, because
    ``LLM.generate`` makes a new engine, and so a new gate, for each call: kept per gate, a
    benchmark that asks one question per call never used them, and every request started from
    the load-time model (SmolLM2 EAGLE-3, int4 + compile: 1.13 for one node, against 1.2-1.3
    measured), drafting some 15 rejected steps before its own timings stopped it. Thread-safe
    (``LLM`` may be called from several threads)."""

    def __init__(self, keep: int):
        self.keep = keep
        self.ratio: dict[int, float] = {}             # budget -> median (replaced whole: readers take no lock)
        self._seen: dict[int, deque] = {}
        self._lock = threading.Lock()

    def add(self, nodes: int, ratio: float) -> None:
        with self._lock:
            seen = self._seen.setdefault(nodes, deque(maxlen=self.keep))
            seen.append(ratio)
            if len(seen) >= 3:
                self.ratio = {**self.ratio, nodes: statistics.median(seen)}


class DraftGate:
    """Per-request draft budgets (see the module docstring). ``options``: the nested prefixes of
    the tree, by increasing ``nodes``; the last is the whole tree."""

    def __init__(self, options: Sequence[GateOption], config: GateConfig = GateConfig(),
                 costs: BatchCosts | None = None, learned: LearnedRatios | None = None):
        """``costs``: step costs by batch size (``batch_cost.BatchCosts``); None: at batch > 1
        the batch-1 modelled ratios (an engine that serves one request at a time). ``learned``:
        finished requests' measured ratios, shared with other gates (default: this gate's own)."""
        options = tuple(options)
        if not options:
            raise ValueError("a gate needs at least one option")
        for o in options:
            if o.nodes < 1 or not o.expected_accepted >= 0.0 or not o.cost_ratio > 0.0:
                raise ValueError(f"an option needs nodes >= 1, expected_accepted >= 0 and cost_ratio > 0, got {o}")
        if [o.nodes for o in options] != sorted({o.nodes for o in options}):
            raise ValueError(f"options must have increasing node counts, got {[o.nodes for o in options]}")
        self.options, self.config, self.costs = options, config, costs
        self._by_nodes = {o.nodes: o for o in options}
        self._seqs: dict[int, _SeqState] = {}
        self.learned = learned if learned is not None else LearnedRatios(config.learned)
        self.stats = GateStats()

    # -- costs -------------------------------------------------------------------------------------
    def cost_ratio(self, nodes: int, seq_id: int | None = None, batch_size: int = 1, timed: bool = True) -> float:
        """``T_m / T_0`` for budget ``nodes`` in a step of ``batch_size`` requests: at batch 1
        measured for request ``seq_id`` when both are timed enough, else modelled; at batch > 1
        from ``costs`` (measured per batch-size bucket where ``timed``, else modelled)."""
        return self._ratios(seq_id, batch_size, timed)(nodes)

    def _ratios(self, seq_id: int | None, batch_size: int, timed: bool = True):
        """``nodes -> T_m / T_0`` of a request in a step of ``batch_size`` (see ``cost_ratio``)."""
        if batch_size > 1:
            if self.costs is None:
                return lambda nodes: self._by_nodes[nodes].cost_ratio
            return lambda nodes: self.costs.ratio(batch_size, nodes, timed)
        measured, learned = self._measured(seq_id), (self.learned.ratio if timed else {})

        def ratio(nodes: int) -> float:
            r = measured(nodes)
            r = learned.get(nodes) if r is None else r
            return self._by_nodes[nodes].cost_ratio if r is None else r
        return ratio

    def measured_ratio(self, nodes: int, seq_id: int | None) -> float | None:
        """``T_m / T_0`` from the request's timed batch-1 steps; None until enough of each."""
        return self._measured(seq_id)(nodes)

    def _measured(self, seq_id: int | None):
        """``nodes -> measured T_m / T_0 or None`` for request ``seq_id`` (its plain steps' median
        taken once, however many budgets are asked)."""
        st = self._seqs.get(seq_id)
        times, n = (st.times if st is not None else {}), self.config.min_timed
        plain = statistics.median(times[0]) if len(times.get(0, ())) >= n else None

        def ratio(nodes: int) -> float | None:
            d = times.get(nodes, ())
            return statistics.median(d) / plain if plain is not None and len(d) >= n else None
        return ratio

    def best(self, scale: "float | Sequence[float]", seq_id: int | None = None, batch_size: int = 1,
             timed: bool = True) -> int:
        """The budget (0: plain) with the most tokens per time when the profile is scaled by
        ``scale`` (one number, or one factor per depth: ``GateOption.accepted``), at the cost
        ratios of a step of ``batch_size`` (``cost_ratio``)."""
        return self._choose(scale, seq_id, batch_size, timed)[0]

    def _choose(self, scale, seq_id, batch_size, timed, floor: bool = False) -> tuple[int, float, float]:
        """``best`` with its model: (budget, modelled tokens of the step, its cost ratio). A budget
        must beat plain decoding by the config's ``margin``; with ``floor`` (a trial) the first
        option stands in for plain when nothing does."""
        ratio = self._ratios(seq_id, batch_size, timed)
        choice, value = (0, 1.0, 1.0), 1.0 + self.config.margin
        for o in self.options:
            tokens, r = 1.0 + o.accepted(scale), ratio(o.nodes)
            if floor and o is self.options[0]:
                first = (o.nodes, tokens, r)
            if tokens / r > value + 1e-12:
                choice, value = (o.nodes, tokens, r), tokens / r
        return first if floor and choice[0] == 0 else choice

    @property
    def by_depth(self) -> bool:
        """Whether every option carries its per-depth profile (then requests are calibrated by depth)."""
        return all(o.hit_by_depth for o in self.options)

    def calibration(self, seq_id: int, steps=None) -> "float | tuple[float, ...]":
        """How the request's recent drafted steps (or ``steps``) did against the profile:
        ``depth_factors`` when the options carry per-depth profiles, else ``scale``."""
        if not self.by_depth:
            return self.scale(seq_id) if steps is None else self._scale_of(steps)
        return self.depth_factors(seq_id, steps)

    def depth_factors(self, seq_id: int, steps=None, prior_steps: float | None = None) -> tuple[float, ...]:
        """Per depth d: (tokens accepted at depth d + n0 h_d f_{d-1}) / (modelled hits at depth d
        + n0 h_d) over the request's latest drafted steps (or ``steps``: (accepted, budget)
        pairs) that reached depth d (every earlier depth accepted), h_d the whole tree's modelled
        hit probability there, n0 = ``prior_steps`` (default: the config's) and f_{d-1} the factor
        of the depth above (f_0 = 1): 1 without steps, lower where the request's drafts are
        rejected earlier than modelled, and a depth the request's budgets never reached follows
        the depths above it (a request accepted far better than modelled is tried deeper)."""
        if steps is None:
            st = self._seqs.get(seq_id)
            steps = st.steps if st is not None else ()
        prior = self.options[-1].hit_by_depth
        hits, expected = [0.0] * len(prior), [0.0] * len(prior)
        for accepted, nodes in steps:
            for d, h in enumerate(self._by_nodes[nodes].hit_by_depth):
                if accepted < d:                       # depth d+1 (0-based d) never reached
                    break
                expected[d] += h
                hits[d] += accepted > d
        n0 = self.config.prior_steps if prior_steps is None else prior_steps
        factors, inherit = [], 1.0
        for d, h in enumerate(prior):           # a depth's prior: the calibration of the one above it
            f = (hits[d] + n0 * h * inherit) / (expected[d] + n0 * h) if expected[d] + n0 * h > 0 else inherit
            factors.append(f)
            inherit = f
        return tuple(factors)

    def scale(self, seq_id: int) -> float:
        """How the request's recent drafted steps did against the profile as a whole (1: as
        modelled)."""
        st = self._seqs.get(seq_id)
        return self._scale_of(st.steps if st is not None else ())

    def _scale_of(self, steps) -> float:
        modelled_of = [self._by_nodes[b].expected_accepted for _, b in steps]
        typical = sum(modelled_of) / len(modelled_of) if modelled_of else self.options[-1].expected_accepted
        n0 = self.config.prior_steps * typical
        got = sum(a for a, _ in steps) + n0
        modelled = sum(modelled_of) + n0
        return got / modelled if modelled > 0 else 1.0

    # -- decisions -----------------------------------------------------------------------------------
    def plan(self, requests: Sequence[tuple[int, bool]]) -> list[int]:
        """Draft nodes of every request of one engine step, given as ``(seq_id, timed)`` (timed:
        its budgets may follow measured times, i.e. it is greedy): ``budget`` of each at this
        step's batch size, or all 0 when ``costs`` wants a plain step of this batch size timed
        (only in steps whose requests are all timed). Call once per step."""
        n = len(requests)
        if n > 1 and self.costs is not None and all(t for _, t in requests):
            if self.costs.probe_due(n):
                self.stats.probes += 1
                return [self._plain(self._state(i)) for i, _ in requests]
            if not self._may_pay(n):                  # no acceptance pays at this batch size: all
                return [self._plain(self._state(i)) for i, _ in requests]   # plain, states kept
            return self._plan_batch([i for i, _ in requests])
        return [self.budget(i, n, t) for i, t in requests]

    def _plan_batch(self, seq_ids: Sequence[int]) -> list[int]:
        """One width for a step of timed requests. The verify forward is padded to the widest
        request, so the step costs ``R_m(B)`` of its widest budget ``m`` whichever requests draft:
        one request's acceptance cannot pay for a batch's wider step. Each request's own state
        machine says whether it drafts (``_wish`` at batch-1 costs: its mode, trials and waits
        follow its acceptance alone); the step then drafts the width ``m`` that gives the batch
        the most tokens per time, ``(B + sum of E_i(m) over the drafting requests) / R_m(B)``,
        if that beats ``B`` plain tokens by the margin. Every drafting request gets ``m``, or the
        whole step is plain (the requests keep their modes)."""
        n = len(seq_ids)
        wishes = [self._wish(i, 1, True) for i in seq_ids]
        drafting = [w[3] for w in wishes if w is not None]       # their calibrations
        best, value, ratio = 0, n * (1.0 + self.config.margin), 1.0
        for o in self.options if drafting else ():
            r = self.costs.ratio(n, o.nodes)
            tokens = n + sum(o.accepted(cal) for cal in drafting)
            if tokens / r > value + 1e-12:
                best, value, ratio = o.nodes, tokens / r, r
        for i, w in zip(seq_ids, wishes):
            if w is not None and best:
                self._draft(self._seqs[i], best, 1.0 + self._by_nodes[best].accepted(w[3]), ratio)
            else:
                self._plain(self._seqs[i])
        return [best if w is not None else 0 for w in wishes]

    def _may_pay(self, batch_size: int) -> bool:
        """Whether some budget could pay at ``batch_size`` if every draft token were accepted
        (1 + the option's depth where it carries its per-depth profile, else 1 + its nodes, over
        its cost ratio): when none could, a step's requests need no per-request estimate (32 of
        them cost ~5 ms a step in Python)."""
        return any(1.0 + (len(o.hit_by_depth) or o.nodes) > self.cost_ratio(o.nodes, None, batch_size)
                   for o in self.options)

    def _state(self, seq_id: int) -> _SeqState:
        st = self._seqs.get(seq_id)
        if st is None:
            st = self._seqs[seq_id] = _SeqState(deque(maxlen=self.config.window))
        return st

    def budget(self, seq_id: int, batch_size: int = 1, timed: bool = True) -> int:
        """Draft nodes for request ``seq_id`` this step (0: a plain step), in a step of
        ``batch_size`` requests; call once per step. An untimed (sampled) request is given the
        budgets of batch 1 in any batch (modelled costs only), so that a seeded request draws
        the same tokens alone or beside others. At batch > 1 a step where plain decoding
        wins only because of the batch's cost (the request's acceptance would pay at batch 1) is
        plain without stopping the request's drafting, and trials wait for such steps to pass."""
        wish = self._wish(seq_id, batch_size, timed)
        st = self._seqs[seq_id]
        return self._plain(st) if wish is None else self._draft(st, *wish[:3])

    def _wish(self, seq_id: int, batch_size: int, timed: bool):
        """``budget``'s decision before it is counted: the request's state machine runs (waits,
        trials, probes, stops) and says None for a plain step, or ``(nodes > 0, modelled tokens,
        cost ratio, calibration)`` for a drafted one; the caller counts the step it takes
        (``_plain`` or ``_draft``), and may overrule a drafted one with a plain step."""
        st = self._state(seq_id)
        batch_size = batch_size if timed else 1       # a seeded sampled request: the same budgets in any batch
        if st.mode is Mode.WAIT:
            if st.left > 0:
                st.left -= 1
                return None
            st.mode, st.trial_steps = Mode.TRIAL, []
            self.stats.trials += 1
        cal = self.calibration(seq_id)
        if st.mode is Mode.TRIAL:                     # the budget the request's history favours
            choice = self._choose(cal, seq_id, batch_size, timed, floor=batch_size == 1)
            if choice[0] == 0:                        # (at batch 1 a trial drafts at least the first node)
                return None                           # too dear at this batch size: not now
        else:
            if self._probe_due(st):
                self.stats.probes += 1
                return None
            choice = self._choose(cal, seq_id, batch_size, timed)
            if choice[0] == 0 and batch_size > 1 and self.best(cal, seq_id) > 0:
                return None                           # the batch's cost, not the acceptance
            if choice[0] == 0:                        # plain beats every prefix: stop drafting
                self._wait(st, self.config.min_wait)
                return self._wish(seq_id, batch_size, timed)
        return (*choice, cal)

    def _draft(self, st: _SeqState, nodes: int, tokens: float, ratio: float) -> int:
        """Count a drafted step of ``nodes`` for the request, with its model (``modelled``)."""
        st.budget, st.model = nodes, (tokens, ratio)
        st.since_plain += 1
        self.stats.drafted += 1
        self.stats.budgets[nodes] = self.stats.budgets.get(nodes, 0) + 1
        return nodes

    def _plain(self, st: _SeqState) -> int:
        st.budget, st.since_plain, st.model = 0, 0, (1.0, 1.0)
        self.stats.plain += 1
        return 0

    def _probe_due(self, st: _SeqState) -> bool:
        """Whether a drafting request takes a plain step now, to time it (see the module docstring)."""
        if not st.timed:
            return False
        every = self.config.probe_every
        short = len(st.times.get(0, ())) < self.config.min_timed
        return st.since_plain >= (every // 4 if short else every)

    def modelled(self, seq_id: int) -> tuple[float, float]:
        """The model behind the request's budget this step: the tokens it expects the step to
        emit (1 + modelled accepted, with the request's calibration) and the step's cost over a
        plain step's (measured where timed, else modelled). A plain step is (1, 1); so over a
        request, the sum of the first over the sum of the second is the speed-up over plain
        decoding the estimator expected, to set beside the one measured."""
        st = self._seqs.get(seq_id)
        return (1.0, 1.0) if st is None else st.model

    def observe(self, seq_id: int, drafted: int, accepted: int) -> None:
        """A step of ``seq_id`` verified ``drafted`` draft nodes and accepted ``accepted``.
        Steps without a draft (plain, or the drafter found nothing) change nothing."""
        st = self._seqs.get(seq_id)
        if st is None or drafted == 0 or st.budget == 0:
            return
        step = (accepted, st.budget if st.budget in self._by_nodes else self.options[-1].nodes)
        if st.mode is Mode.DRAFT:
            st.steps.append(step)
            return
        st.trial_steps.append(step)
        n = len(st.trial_steps)
        hopeless = n >= max(1, self.config.trial // 2) and not any(a for a, _ in st.trial_steps)
        if n < self.config.trial and not hopeless:
            return
        if not hopeless and self.best(self._trial_calibration(st.trial_steps), seq_id) > 0:
            st.mode = Mode.DRAFT                      # the trial's steps start a new window
            st.steps = deque(st.trial_steps, maxlen=self.config.window)
        else:
            st.steps.extend(st.trial_steps)
            self._wait(st, min(2 * st.wait, self.config.max_wait))

    def _trial_calibration(self, steps) -> "float | tuple[float, ...]":
        """A trial's own calibration, without the prior: what its steps alone say."""
        if self.by_depth:
            return self.depth_factors(-1, steps, prior_steps=0.0)
        got = sum(a for a, _ in steps)
        modelled = sum(self._by_nodes[b].expected_accepted for _, b in steps)
        return got / modelled if modelled > 0 else 1.0

    @staticmethod
    def _wait(st: _SeqState, steps: int) -> None:
        st.mode, st.wait, st.left = Mode.WAIT, steps, steps

    def observe_step(self, seq_ids: Sequence[int | None], budgets: Sequence[int], time_s: float) -> None:
        """A whole engine step's wall time, its requests and the budget each drafted (0: plain);
        batch-1 steps feed that request's measured cost ratios. A request passed as None is not
        timed: its budgets then follow from its acceptance alone (a sampled request's output
        depends on which steps drafted, so timings would make a seeded request irreproducible).
        Ignored under ``GateConfig(use_step_times=False)``."""
        if not self.config.use_step_times:
            return
        for i in seq_ids:                             # untimed this step: no probes until timed again
            if i is not None and i in self._seqs:
                self._seqs[i].timed = False
        st = self._seqs.get(seq_ids[0]) if len(seq_ids) == 1 and self.config.time_requests else None
        if st is not None:
            st.timed = True
            st.times.setdefault(budgets[0], deque(maxlen=self.config.time_window)).append(time_s)
        if len(seq_ids) > 1 and self.costs is not None and all(i is not None for i in seq_ids):
            self.costs.observe(len(seq_ids), max(budgets), time_s)

    def release(self, seq_id: int) -> None:
        """The request ended: its measured cost ratios join the learned ones (``GateConfig.learned``)."""
        measured = self._measured(seq_id) if self.config.learned else None
        self._seqs.pop(seq_id, None)
        for o in self.options if measured is not None else ():
            r = measured(o.nodes)
            if r is not None:
                self.learned.add(o.nodes, r)

    def mode(self, seq_id: int) -> Mode | None:
        """The request's current mode (None: unknown request)."""
        st = self._seqs.get(seq_id)
        return None if st is None else st.mode
