"""Speculation under load: how many draft tokens each sequence may get, given the batch size.

Verification of a draft tree costs the target one forward over (root + tree) tokens per row. At
batch size 1 on any hardware that forward is bound by weight reads, so extra tree tokens are
nearly free; as the batch grows the forward becomes compute bound, every draft token costs about
what a generated token costs, and speculation stops paying. A ``SpecPolicy`` maps the batch size
of a step to a draft *budget* (tree nodes per sequence, 0 = plain decoding for that step):

- ``StaticPolicy``: always the drafter's own size (no policy).
- ``TablePolicy``: ``num_speculative_tokens_per_batch_size``, e.g. ``{1: 4, 8: 2, 16: 0}``: the
  entry with the largest batch size <= the current one applies (below the smallest key the
  drafter's own size applies).
- ``AutoPolicy``: measured, with acceptance and cost learned apart. Budgets ("arms"): 0, the
  powers of two below the drafter's size, its size.
  *Acceptance* does not depend on the batch size: ``tau(k)``, emitted tokens per sequence-step at
  budget k, is one moving average per budget fed by the steps of every batch size, kept
  consistent across budgets (nondecreasing and concave in k, so fresh estimates bound the
  others), and when the running budget's estimate moves the others move along (a drafter that
  stops being accepted turns every budget off, not one after the other).
  *Cost* depends on the batch size: a moving average of step time per sequence for each
  batch-size bucket (1, 2, 3-4, 5-8, ...) and budget actually run. An unmeasured (bucket, k) is
  predicted conservatively as cost(bucket, 0) x max(R, B(1+k)) / max(R, B) x overhead(k): a
  forward flat up to R rows and linear beyond, R the most rows ever seen run within 25% of the
  cheapest plain step (never flatter than observed; at B >= R the ratio is the compute-bound
  1+k), overhead(k) the measured excess over that model at the smallest bucket.
  *Choice*: the budget with the best predicted ``B x tau(k) / cost(B, k)``, plain decoding unless
  speculation is predicted more than 2% faster. Another budget is explored only while its
  optimistic prediction (acceptance + its standard error, or its upper bound if unmeasured) is
  within 10% of the best: unmeasured ones at once, smallest first (a bounded number of steps);
  measured ones, and budget 0, as re-checks taking at most 1 step in 32 of a bucket. So where
  speculation is predicted to lose it is essentially never run, and what was learned at one
  batch size is used at all others without re-learning.

The scheduler asks the policy for each step's budget and passes it to ``Engine.step(budget=k)``,
which caps every request's tree at its first k nodes (0: no proposal; nodes are in topological
order, so a prefix is still a tree, and since a node's ``q`` depends only on earlier nodes the
verification stays lossless). The engine's ``StepReport`` (budget, verified rows = batch x (1 +
longest tree), emitted tokens, time) goes back to ``observe``. Drafters keep their state in
steps without a proposal: they learn the committed tokens from ``accept`` / the context.
Speculation is lossless, so no policy changes what is generated, only how fast.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Protocol



class SpecPolicy(Protocol):
    def bind(self, max_nodes: int) -> None:
        """Learn the drafter's largest tree (``Engine.max_tree_nodes``; the scheduler calls it)."""

    def budget(self, batch_size: int) -> int:
        """Draft tree nodes allowed per sequence in a step of ``batch_size`` sequences."""

    def observe(self, batch_size: int, budget: int, step_s: float, emitted_tokens: int, *,
                rows: int | None = None) -> None:
        """Feedback after a step: its batch size, the budget used, its time and tokens emitted;
        ``rows`` (optional): target rows its verify forward ran (``StepReport.rows``)."""


class StaticPolicy:
    """No policy: the drafter's full size at every batch size."""

    def __init__(self) -> None:
        self.max_nodes = 0

    def bind(self, max_nodes: int) -> None:
        self.max_nodes = max_nodes

    def budget(self, batch_size: int) -> int:
        return self.max_nodes

    def observe(self, batch_size: int, budget: int, step_s: float, emitted_tokens: int, *,
                rows: int | None = None) -> None:
        pass

    def describe(self) -> dict:
        return {"policy": "static", "max_nodes": self.max_nodes}


class TablePolicy:
    """Budget from a ``{batch_size: num_speculative_tokens}`` table (step function)."""

    def __init__(self, table: dict[int, int]):
        self.table = sorted(table.items())
        self.max_nodes = 0

    def bind(self, max_nodes: int) -> None:
        self.max_nodes = max_nodes

    def budget(self, batch_size: int) -> int:
        k = self.max_nodes
        for size, n in self.table:
            if size > batch_size:
                break
            k = n
        return min(k, self.max_nodes)

    def observe(self, batch_size: int, budget: int, step_s: float, emitted_tokens: int, *,
                rows: int | None = None) -> None:
        pass

    def describe(self) -> dict:
        return {"policy": "table", "max_nodes": self.max_nodes,
                "num_speculative_tokens_per_batch_size": {str(b): n for b, n in self.table}}


@dataclass
class _Cost:
    """Measured step cost of one (bucket, budget): moving averages over its steps."""
    per_seq: float       # step seconds / batch size
    batch: float         # batch size
    rows: float          # target rows verified per sequence (1 + tree nodes, padded)
    n: int = 1

    @property
    def step_s(self) -> float:
        return self.per_seq * self.batch

    @property
    def total_rows(self) -> float:
        return self.rows * self.batch


@dataclass
class _Acceptance:
    """Emitted tokens per sequence-step at one budget: sums decayed per sequence-step."""
    tokens: float = 0.0
    seqs: float = 0.0
    stamp: float = -1.0  # the policy's speculative sequence-step count at the last update
    ever: bool = False   # was trusted once (exploring it again continues a re-check)


class AutoPolicy:
    """Measured budgets: acceptance shared across batch sizes, cost per bucket, conservative
    extrapolation of unmeasured costs (see the module docstring for the model).

    ``explore_every``: re-checks take at most one step in that many of a bucket; ``margin``: an
    alternative is explored or re-checked only while its optimistic prediction is within that
    fraction of the best; ``min_gain``: speculation is used only when predicted faster than plain
    decoding by that fraction; ``alpha``: moving-average weight of a step's cost;
    ``half_life``: sequence-steps after which an acceptance sample weighs half; ``min_samples``:
    sequence-steps before a budget's acceptance is trusted; ``stale_after``: speculative
    sequence-steps at other budgets after which a budget's estimate no longer bounds the others;
    ``share``: how much the other budgets' acceptance follows the running one's (0: not, 1:
    fully; see ``_observe_acceptance``); ``flat_tol``: a step within that fraction of the
    cheapest plain step counts as "flat". Deterministic given the observations; pure Python."""

    def __init__(self, explore_every: int = 32, margin: float = 0.1, min_gain: float = 0.02,
                 alpha: float = 0.25, half_life: float = 16.0, min_samples: float = 12.0,
                 stale_after: float = 64.0, share: float = 0.5, flat_tol: float = 0.25):
        if explore_every < 2:
            raise ValueError("explore_every must be >= 2")
        if not (0 <= margin < 1 and 0 <= min_gain < 1 and 0 < alpha <= 1 and half_life > 0
                and min_samples > 0 and stale_after > 0 and 0 <= share <= 1 and flat_tol >= 0):
            raise ValueError("AutoPolicy: need 0 <= margin, min_gain < 1, 0 < alpha <= 1, half_life > 0, "
                             "min_samples > 0, stale_after > 0, 0 <= share <= 1, flat_tol >= 0")
        self.explore_every, self.margin, self.min_gain = explore_every, margin, min_gain
        self.alpha, self.half_life, self.min_samples = alpha, half_life, min_samples
        self.stale_after, self.share, self.flat_tol = stale_after, share, flat_tol
        self.max_nodes = 0
        self.arms = [0]
        self._reset()

    def _reset(self) -> None:
        self.acc = {k: _Acceptance() for k in self.arms}
        self.tau = {k: (1.0, 1.0 + k) for k in self.arms}    # budget -> (point, optimistic) tokens/seq
        self.cost: dict[tuple[int, int], _Cost] = {}        # (bucket, budget) -> measured cost
        self.steps: dict[int, int] = {}                     # bucket -> steps asked for
        self.last: dict[tuple[int, int], int] = {}          # (bucket, budget) -> step last chosen
        self.credit: dict[int, float] = {}                  # bucket -> re-check steps allowed
        self.spec_seq_steps = 0.0                           # sequence-steps run with budget > 0
        self.flat_rows = 1.0                                # most rows seen verified "flat"
        self.knee_opt = 1.0                                 # the knee used for exploring
        self.overhead = {k: 1.0 for k in self.arms}         # measured / modelled cost ratio
        self._refresh_acceptance()

    def bind(self, max_nodes: int) -> None:
        """Set the drafter's largest tree; a new size forgets everything measured."""
        if max_nodes != self.max_nodes:
            self.max_nodes = max_nodes
            self.arms = self.arms_for(max_nodes)
            self._reset()

    @staticmethod
    def arms_for(max_nodes: int) -> list[int]:
        """Budgets tried: 0, the powers of two below ``max_nodes``, and ``max_nodes``."""
        arms, p = {0, max(0, max_nodes)}, 1
        while p < max_nodes:
            arms.add(p)
            p *= 2
        return sorted(arms)

    @staticmethod
    def bucket(batch_size: int) -> int:
        """Batch-size bucket: 1, 2, 3-4, 5-8, ... -> 0, 1, 2, 3, ..."""
        return max(0, math.ceil(math.log2(max(1, batch_size))))

    def trusted(self, k: int) -> bool:
        """Whether budget ``k``'s acceptance has enough samples (budget 0 always: 1 token/seq)."""
        return k == 0 or self.acc[k].seqs >= self.min_samples

    # ------------------------------------------------------------------ choosing
    def budget(self, batch_size: int) -> int:
        """The budget for a step of ``batch_size`` sequences (one of ``arms``).

        A bucket's first step is plain (budget 0 is always measured first). Afterwards the arm
        with the best conservative prediction (``_best``), except:
        (a) an arm whose cost in this bucket or whose acceptance is not yet measured (trusted),
        if its optimistic prediction is within ``margin`` of the best: tried at once, smallest
        first (a bounded number of steps per bucket and arm);
        (b) a re-check, when the bucket's credit allows: budget 0 if not run for
        ``2 x explore_every`` steps, else, of the arms optimistically within ``margin`` and not
        run for ``explore_every`` steps, the most promising (``_recheck``). The credit earns
        ``1 / explore_every`` per step (at most 1); a re-check step costs 1, and so do the steps
        continuing it under (a), so re-checks take at most one step in ``explore_every``.
        Arms optimistically predicted to lose by more than ``margin`` are never used."""
        b = self.bucket(batch_size)
        n = self.steps[b] = self.steps.get(b, 0) + 1
        choice = 0 if (b, 0) not in self.cost else self._choose(b, batch_size, n)
        self.last[(b, choice)] = n
        return choice

    def _choose(self, b: int, batch_size: int, n: int) -> int:
        point = {k: self.predict(b, batch_size, k) for k in self.arms}
        best = self._best(point)
        floor = (1.0 - self.margin) * point[best]
        near = [k for k in self.arms
                if k != best and self.predict(b, batch_size, k, optimistic=True) >= floor]
        new = [k for k in near if (b, k) not in self.cost or not self.trusted(k)]
        credit = self.credit[b] = min(1.0, self.credit.get(b, 0.0) + 1.0 / self.explore_every)
        if new:
            if (b, new[0]) in self.cost and self.acc[new[0]].ever:
                self.credit[b] -= 1.0                # the rest of a re-check (see observe)
            return new[0]
        if credit < 1.0:
            return best
        if best and n - self.last.get((b, 0), 0) >= 2 * self.explore_every:
            due = [0]                                # plain decoding: re-measured, one cheap step
        else:                                        # not run lately, the most promising first
            due = sorted((k for k in near if n - self.last.get((b, k), 0) >= self.explore_every),
                         key=lambda k: -self.predict(b, batch_size, k, optimistic=True))
        if not due:
            return best
        self.credit[b] -= 1.0
        if due[0]:                                   # the new samples decide (see ``_recheck``)
            self._recheck(due[0])
        return due[0]

    def _recheck(self, k: int) -> None:
        """Cut budget k's acceptance samples to ``min_samples / 2``: it is no longer trusted, so
        ``budget`` explores it on (charging the credit) while it looks worth it, until new samples
        make it trusted again. An unlucky early estimate, or one from another regime, does not
        stick, and one re-check gathers enough samples to decide even at batch size 1."""
        a = self.acc[k]
        cut = min(1.0, 0.5 * self.min_samples / a.seqs) if a.seqs else 1.0
        a.tokens, a.seqs = a.tokens * cut, a.seqs * cut
        self._refresh_acceptance()

    def _best(self, point: dict[int, float]) -> int:
        """The budget predicted fastest, but plain decoding (the safe choice) unless speculation
        is predicted faster by more than ``min_gain`` (more than the noise of the estimates)."""
        top = max(point, key=lambda k: (point[k], -k))
        return top if point[top] > (1.0 + self.min_gain) * point[0] else 0

    def predict(self, b: int, batch_size: int, k: int, optimistic: bool = False) -> float:
        """Predicted emitted tokens per second per sequence at budget ``k`` in bucket ``b``
        (times ``batch_size``: tokens/s). Needs budget 0 measured in ``b``.

        Acceptance: ``tau[k]`` (point, or optimistic upper bound). Cost: the measured moving
        average of (b, k) if any; else cost(b, 0) x rows ratio x ``overhead[k]``, where the
        rows ratio ``max(R, B(1+k)) / max(R, B)`` models a forward flat up to R rows and linear
        beyond, with R = ``flat_rows`` (the most rows measured flat: never more than seen, so the
        prediction is conservative; at B >= R it is the compute-bound (1+k)). Optimistic
        predictions use R = ``knee_opt`` (twice ``flat_rows`` once anything beyond the cheapest
        plain step was seen flat), so exploring climbs the knee one doubling at a time."""
        tau = self.tau[k][1 if optimistic else 0]
        c = self.cost.get((b, k))
        if c is not None:
            return tau / c.per_seq
        knee = self.knee_opt if optimistic else self.flat_rows
        ratio = max(knee, batch_size * (1 + k)) / max(knee, batch_size)
        return tau / (self.cost[(b, 0)].per_seq * ratio * self.overhead.get(k, 1.0))

    # ------------------------------------------------------------------ learning
    def observe(self, batch_size: int, budget: int, step_s: float, emitted_tokens: int, *,
                rows: int | None = None) -> None:
        """Feedback after a step. ``rows``, optional: target rows the verify forward ran
        (batch x (1 + longest tree), ``StepReport.rows``); default batch x (1 + budget).
        Steps with a budget that is not an arm, no time or no sequences are ignored."""
        if step_s <= 0 or batch_size < 1 or budget not in self.acc:
            return
        self._observe_acceptance(batch_size, budget, emitted_tokens)
        self._observe_cost(batch_size, budget, step_s, rows)
        self._refresh_acceptance()
        self._refresh_costs()

    def _observe_acceptance(self, batch_size: int, k: int, emitted_tokens: int) -> None:
        """Add the step's ``batch_size`` samples to budget k's moving average. When k was and
        stays trusted, the other trusted budgets' excess (tau - 1) is scaled by (new excess_k /
        old excess_k) ** ``share``: a change of acceptance moves every budget at once. The
        factors telescope (what k's estimate gives back, the others give back), so the shape
        across budgets is learned from each budget's own steps only, without drift."""
        a = self.acc[k]
        before = a.tokens / a.seqs - 1.0 if k and self.trusted(k) else None
        keep = 0.5 ** (batch_size / self.half_life)
        a.tokens = a.tokens * keep + emitted_tokens
        a.seqs = a.seqs * keep + batch_size
        if not k:
            return
        self.spec_seq_steps += batch_size
        a.stamp = self.spec_seq_steps
        a.ever = a.ever or self.trusted(k)
        if before is None or not self.share:
            return
        floor = 0.02                                 # excess treated as at least this
        f = (max(floor, a.tokens / a.seqs - 1.0) / max(floor, before)) ** self.share
        for j, other in self.acc.items():
            if j and j != k and self.trusted(j):
                other.tokens = other.seqs * (1.0 + (other.tokens / other.seqs - 1.0) * f)

    def _observe_cost(self, batch_size: int, budget: int, step_s: float, rows: int | None) -> None:
        """Moving averages of the (bucket, budget): time per sequence (a step more than 3x off
        counts as 3x), batch size, verified rows per sequence."""
        key = (self.bucket(batch_size), budget)
        per_row = rows / batch_size if rows else 1.0 + budget
        c = self.cost.get(key)
        if c is None:
            self.cost[key] = _Cost(step_s / batch_size, batch_size, per_row)
            return
        x = min(max(step_s / batch_size, c.per_seq / 3), c.per_seq * 3)     # damp outliers
        c.per_seq += self.alpha * (x - c.per_seq)
        c.batch += self.alpha * (batch_size - c.batch)
        c.rows += self.alpha * (per_row - c.rows)
        c.n += 1

    def fresh(self, k: int) -> bool:
        """Trusted, and not ``stale_after`` speculative sequence-steps behind (budget 0: always)."""
        return k == 0 or (self.trusted(k) and self.spec_seq_steps - self.acc[k].stamp <= self.stale_after)

    def _refresh_acceptance(self) -> None:
        """``tau[k]`` = (point, optimistic) emitted tokens per sequence-step at budget k.

        tau is nondecreasing in k (a larger budget's tree extends a smaller one's) and concave
        (each extra node adds at most what the previous one did). Going up in k, from the fresh
        budgets other than k (budget 0: tau 1; smaller ones with their final point values):
        ``lo = max(tau[j<k])``, ``hi = min(1 + k, tau[j>k], the chord of the two largest j<k
        extended to k)``. Only fresh budgets bound others (a stale one's own samples may be from
        another regime; ``_observe_acceptance`` keeps its level current). Fresh k: point =
        min(own, hi); stale k: point = own clipped to [lo, hi]; optimistic = point + stderr, at
        most hi. Untrusted k: point = lo, optimistic = hi."""
        own = {k: a.tokens / a.seqs for k, a in self.acc.items() if k and self.trusted(k)}
        fresh = {k: v for k, v in own.items() if self.fresh(k)}
        below = [(0, 1.0)]                                   # fresh budgets done, with their points
        self.tau[0] = (1.0, 1.0)
        for k in self.arms[1:]:
            lo = max(v for _, v in below)
            hi = min([1.0 + k] + [v for j, v in fresh.items() if j > k])
            if len(below) >= 2:
                (ja, va), (jc, vc) = below[-2:]
                hi = min(hi, vc + (k - jc) * max(0.0, (vc - va) / (jc - ja)))
            lo = min(lo, hi)
            if k in own:
                v = min(own[k] if k in fresh else max(own[k], lo), hi)
                self.tau[k] = (v, min(v + self._stderr(k), hi))
                if k in fresh:
                    below.append((k, v))
            else:
                self.tau[k] = (lo, hi)

    def _stderr(self, k: int) -> float:
        """Standard error of budget k's estimate over its (decayed) sample count: the variance of
        a count in [1, 1 + k] with mean tau is at most (tau - 1)(1 + k - tau) (Bhatia-Davis);
        plus 1/4, so that it is never 0."""
        a = self.acc[k]
        tau = a.tokens / a.seqs
        return math.sqrt((max(0.0, (tau - 1.0) * (1.0 + k - tau)) + 0.25) / a.seqs)

    def _refresh_costs(self) -> None:
        """``flat_rows``, ``knee_opt`` and ``overhead`` from the measured costs.

        Reference: the cheapest measured plain step. ``flat_rows`` = the most rows of any measured
        (bucket, budget) whose step took at most ``1 + flat_tol`` x the reference (the forward is
        flat up to there, as far as seen). ``overhead[k]`` = at the smallest bucket where budget k
        was measured, measured cost ratio to budget 0 / the modelled rows ratio (>= 1): drafting
        and tree-attention cost that rows do not explain."""
        plain = [c for (_, k), c in self.cost.items() if k == 0]
        if not plain:
            return
        ref = min(plain, key=lambda c: c.step_s)
        limit = (1.0 + self.flat_tol) * ref.step_s
        self.flat_rows = max([ref.total_rows] + [c.total_rows for c in self.cost.values()
                                                 if c.step_s <= limit])
        self.knee_opt = 2 * self.flat_rows if self.flat_rows > ref.total_rows else self.flat_rows
        for k in self.arms[1:]:
            both = sorted(b for (b, j) in self.cost if j == k and (b, 0) in self.cost)
            if both:
                ck, c0 = self.cost[(both[0], k)], self.cost[(both[0], 0)]
                model = max(self.flat_rows, ck.batch * (1 + k)) / max(self.flat_rows, ck.batch)
                self.overhead[k] = max(1.0, (ck.per_seq / c0.per_seq) / model)

    def describe(self) -> dict:
        """JSON-serializable state: acceptance per budget, knee, overheads, per-bucket costs."""
        return {"policy": "auto", "max_nodes": self.max_nodes, "arms": self.arms,
                "tokens_per_seq": {str(k): round(self.tau[k][0], 4) for k in self.arms},
                "acceptance": {str(k): {"tokens_per_seq": round(a.tokens / a.seqs, 4) if a.seqs else None,
                                        "samples": round(a.seqs, 2), "fresh": self.fresh(k)}
                               for k, a in self.acc.items()},
                "flat_rows": round(self.flat_rows, 2),
                "overhead": {str(k): round(v, 4) for k, v in self.overhead.items()},
                "buckets": {f"batch<={2 ** b}": self._describe_bucket(b)
                            for b in sorted({b for b, _ in self.cost})}}

    def _describe_bucket(self, b: int) -> dict:
        """Measured step times and step counts per budget; predicted tokens/s and the choice at
        the bucket's usual batch size."""
        mine = [(k, c) for (bb, k), c in sorted(self.cost.items()) if bb == b]
        out: dict = {"step_ms": {str(k): round(c.step_s * 1e3, 4) for k, c in mine},
                     "steps": {str(k): c.n for k, c in mine}}
        c0 = self.cost.get((b, 0))
        if c0 is not None:
            batch = max(1, round(c0.batch))
            pred = {k: batch * self.predict(b, batch, k) for k in self.arms}
            out["batch"] = round(c0.batch, 2)
            out["predicted_tokens_per_s"] = {str(k): round(v, 3) for k, v in pred.items()}
            out["best"] = self._best(pred)
        return out


def parse_policy(value: str | dict | None) -> SpecPolicy:
    """Build a policy from ``num_speculative_tokens_per_batch_size``.

    ``None`` or ``"auto"``: ``AutoPolicy``; ``"static"``/``"off"``: ``StaticPolicy``; a dict or a
    JSON object string ``{batch_size: num_speculative_tokens}``: ``TablePolicy``.
    Raises ``ValueError`` with the reason for anything else."""
    if value is None or value == "auto":
        return AutoPolicy()
    if value in ("static", "off"):
        return StaticPolicy()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"num_speculative_tokens_per_batch_size: not 'auto', 'static' or a JSON "
                             f"object: {e}") from None
    if not isinstance(value, dict) or not value:
        raise ValueError("num_speculative_tokens_per_batch_size must be 'auto', 'static' or a non-empty "
                         "object {batch_size: num_speculative_tokens}")
    table: dict[int, int] = {}
    for k, v in value.items():
        try:
            size = int(k)
        except (TypeError, ValueError):
            raise ValueError(f"num_speculative_tokens_per_batch_size: batch size {k!r} is not an integer") from None
        if size < 1 or not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"num_speculative_tokens_per_batch_size: entry {k!r}: {v!r} needs a batch "
                             "size >= 1 and a number of tokens >= 0")
        table[size] = v
    return TablePolicy(table)
