"""What a drafted step costs at batch size B, modelled from this machine's costs and then measured.

At batch 1 a verify forward over a few tokens costs about a one-token forward (weight reads
dominate), so drafting is cheap. As the batch grows the forward turns compute bound: a step
drafting ``m`` nodes per sequence verifies ``B (1 + m)`` rows and costs about ``1 + m`` plain
steps, so drafting must be accepted far more to pay. ``BatchCosts`` gives the draft-budget
estimator (``draft_gate.DraftGate``) the cost ratio ``R_m(B) = T_m(B) / T_0(B)`` of a batch-B step
whose widest request drafts ``m`` nodes (the verify forward is padded to the widest tree):

- *modelled* from the batch-1 costs measured at start-up (``draft_shape.StepCosts``): a batch of
  B rows of ``1 + m`` tokens costs the verify forward of ``B (1 + m)`` tokens (the same weight
  reads and flops), plus the draft at batch 1 scaled as the target's forward scales with B:
  ``R_m(B) = (draft_m x v(B) / v(1) + v(B (1 + m))) / v(B)``, ``v`` the measured verify curve;
- *measured* once steps of that batch-size bucket (1, 2, 3-4, 5-8, ...) were timed both at width
  ``m`` and plain: the ratio of the medians of their latest ``window`` step times. Measured
  steps include what the model leaves out (bookkeeping per row, caches a draft finds cold).

A plain step of a bucket is timed only when every request of the step drafts nothing; a batch
that keeps drafting would never time one, so ``probe_due`` asks for a plain step (a probe) every
``probe_every`` steps of a bucket until ``min_timed`` were timed, then every ``4 x probe_every``.
Pure Python, deterministic given its observations. Also the cost-curve helpers the step-cost
model shares (``interpolate``: a monotone piecewise-linear fit of measured points).
"""
from __future__ import annotations

import functools
import math
import statistics
from collections import deque
from typing import Sequence


def bucket(batch_size: int) -> int:
    """Batch-size bucket: 1, 2, 3-4, 5-8, ... -> 0, 1, 2, 3, ..."""
    return max(0, math.ceil(math.log2(max(1, batch_size))))


class BatchCosts:
    """Step cost ratios by batch size (see the module docstring). ``verify``: the measured
    ``(T, ms)`` points of a batch-1 verify forward over T tokens (``StepCosts.verify``);
    ``draft_ms``: nodes -> the modelled batch-1 draft milliseconds of that budget."""

    def __init__(self, verify: Sequence[tuple[int, float]], draft_ms: dict[int, float], *,
                 window: int = 32, min_timed: int = 4, probe_every: int = 16):
        if not verify:
            raise ValueError("BatchCosts needs the measured verify costs")
        if window < 1 or not 1 <= min_timed <= window or probe_every < 2:
            raise ValueError(f"need window >= 1, 1 <= min_timed <= window and probe_every >= 2, got "
                             f"{window}, {min_timed}, {probe_every}")
        self._verify = tuple((int(t), float(ms)) for t, ms in verify)
        self.draft_ms = dict(draft_ms)
        self.window, self.min_timed, self.probe_every = window, min_timed, probe_every
        self._times: dict[tuple[int, int], deque] = {}     # (bucket, width) -> latest step seconds
        self._steps: dict[int, int] = {}                  # bucket -> steps since its last plain one
        # asked for every request of every step: memoised (the measured ones until the next observe)
        self._modelled: dict[tuple[int, int], float] = {}
        self._measured: dict[tuple[int, int], float | None] = {}

    def verify_ms(self, tokens: int) -> float:
        return interpolate(self._verify, max(1, tokens))

    def modelled(self, batch_size: int, nodes: int) -> float:
        """``T_m(B) / T_0(B)`` from the batch-1 costs (``nodes`` 0: 1)."""
        if nodes == 0:
            return 1.0
        b = max(1, batch_size)
        key = (b, nodes)
        if key not in self._modelled:
            plain = self.verify_ms(b)
            draft = self.draft_ms.get(nodes, 0.0) * plain / self.verify_ms(1)
            self._modelled[key] = (draft + self.verify_ms(b * (1 + nodes))) / plain
        return self._modelled[key]

    def measured(self, batch_size: int, nodes: int) -> float | None:
        """``T_m(B) / T_0(B)`` from timed steps of B's bucket; None until both were timed enough."""
        key = (bucket(batch_size), nodes)
        if key not in self._measured:
            plain, drafted = self._times.get((key[0], 0), ()), self._times.get(key, ())
            self._measured[key] = None if len(plain) < self.min_timed or len(drafted) < self.min_timed \
                else statistics.median(drafted) / statistics.median(plain)
        return self._measured[key]

    def ratio(self, batch_size: int, nodes: int, timed: bool = True) -> float:
        """The measured ratio where there is one (and ``timed``), else the modelled one."""
        m = self.measured(batch_size, nodes) if timed and nodes else None
        return self.modelled(batch_size, nodes) if m is None else m

    def observe(self, batch_size: int, width: int, seconds: float) -> None:
        """A timed step of ``batch_size`` requests whose widest drafted ``width`` nodes (0: plain)."""
        if batch_size < 1 or not seconds > 0:
            return
        b = bucket(batch_size)
        self._measured.clear()
        self._times.setdefault((b, width), deque(maxlen=self.window)).append(seconds)
        self._steps[b] = 0 if width == 0 else self._steps.get(b, 0) + 1

    def probe_due(self, batch_size: int) -> bool:
        """Whether a step of this bucket should be plain, to time it (see the module docstring)."""
        b = bucket(batch_size)
        short = len(self._times.get((b, 0), ())) < self.min_timed
        return self._steps.get(b, 0) >= (self.probe_every if short else 4 * self.probe_every)

    def describe(self) -> dict:
        """Timed steps and median milliseconds per (bucket, width)."""
        return {f"batch<={2 ** b}": {str(w): {"steps": len(t), "median_ms": round(statistics.median(t) * 1e3, 3)}
                                     for (bb, w), t in sorted(self._times.items()) if bb == b}
                for b in sorted({b for b, _ in self._times})}


@functools.lru_cache(maxsize=256)
def _monotone(points: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
    """The points made non-decreasing by pooling adjacent violators (isotonic regression): a
    noisy spike or dip is averaged with its neighbours, not taken as a real cost step."""
    blocks: list[list[float]] = []                      # [sum, count] per pooled block
    xs = []
    for x, y in sorted(points):
        xs.append(x)
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    ys = [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]
    return tuple(zip(xs, ys))


def interpolate(points: tuple[tuple[int, float], ...], x: int) -> float:
    """Piecewise-linear through the monotone fit of the measured points, extended past the last
    point with the last segment's slope."""
    pts = _monotone(tuple(map(tuple, points)))
    if len(pts) == 1 or x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)
