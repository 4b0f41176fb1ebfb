"""Draft shapes chosen from measured costs: the static tree that maximises expected tokens per
second on this machine, for a head whose acceptance per depth and rank is known.

Inputs:
- ``AcceptanceProfile``: ``rank_probs[d][r]`` = P(the target's next token is the head's rank-r
  candidate at depth d+1 | every earlier token on the path was the target's), measured on held-out
  on-policy data (``verispec train eagle3|medusa --eval-only`` writes it as ``acceptance.json``; the
  shipped heads carry one in their folder).
- ``StepCosts``: measured milliseconds of one target forward over T tokens (batch 1, the verify
  forward), of the fixed drafting work per step (EAGLE: catch-up on the committed pairs, which
  also gives depth 1; Medusa: the heads' one forward) and, for heads that draft level by level
  (EAGLE), of one level over w nodes.

Model. Under greedy verification a node is accepted iff every node on its path is the target's
token, so a choices tree's expected tokens per step is ``1 + sum over nodes of prod_j p_j(r_j)``
(depths treated as independent given a correct path). Its cost per step is
``draft_fixed + sum_{d >= 1} level(nodes at depth d with children) + verify(1 + nodes)``
(levels only for per-level heads). The best tree of m nodes holds the m most valuable paths:
values fall along a path and across sibling ranks, so a best-first walk over (child rank 0,
next sibling) yields them in order and every prefix is a connected choices tree. The chosen m
maximises expected tokens / cost; ``vanilla_ms`` (= verify(1)) gives the modelled speed-up.

Costs are measured once per machine, model, weights, threads and head and cached as JSON
(``$VERISPEC_COST_CACHE``, default ``~/.cache/verispec/step_costs.json``); they describe batch 1.
``$VERISPEC_STEP_COSTS`` names a JSON file of ``StepCosts`` fields instead: those costs are used
for every target and head, nothing is measured, and the gates ignore step times
(``GateConfig.use_step_times``), so every drafting decision is the same on any machine (the test
suite pins its costs this way).
"""
from __future__ import annotations

import hashlib
import heapq
import inspect
import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import torch

from .batch_cost import interpolate

from ..core.tree import validate_choices

log = logging.getLogger("verispec")

PROFILE_FILE = "acceptance.json"
VERIFY_POINTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
LEVEL_WIDTHS = (1, 2, 4, 8)


@dataclass(frozen=True)
class AcceptanceProfile:
    """``rank_probs[d][r]``: probability that depth d+1's target token is the rank-r candidate."""
    rank_probs: tuple[tuple[float, ...], ...]
    source: str = ""

    def __post_init__(self) -> None:
        if not self.rank_probs or not all(self.rank_probs):
            raise ValueError("an acceptance profile needs at least one depth with one rank")
        for d, row in enumerate(self.rank_probs):
            if any(not 0.0 <= p <= 1.0 for p in row) or sum(row) > 1.0 + 1e-6:
                raise ValueError(f"acceptance profile depth {d + 1}: probabilities must lie in [0, 1] "
                                 f"and sum to at most 1, got {list(row)}")

    @property
    def depth(self) -> int:
        return len(self.rank_probs)

    def p(self, depth: int, rank: int) -> float:
        """P for 1-based ``depth``; 0 beyond the measured depths or ranks."""
        if depth > self.depth:
            return 0.0
        row = self.rank_probs[depth - 1]
        return row[rank] if rank < len(row) else 0.0

    @classmethod
    def from_hits(cls, hits: list[list[float]], source: str = "") -> "AcceptanceProfile":
        """From cumulative hit rates ``hits[d][k-1]`` = P(target token in the head's top k) at
        depth d+1; made non-decreasing in k, then differenced."""
        rows = []
        for row in hits:
            cum, probs, prev = 0.0, [], 0.0
            for h in row:
                cum = min(1.0, max(cum, float(h)))
                probs.append(max(0.0, cum - prev))
                prev = cum
            rows.append(tuple(probs))
        return cls(tuple(rows), source)

    @classmethod
    def load(cls, folder: str | Path) -> "AcceptanceProfile | None":
        """The profile in ``folder/acceptance.json``, None when the folder has none."""
        path = Path(folder) / PROFILE_FILE
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
            return cls(tuple(tuple(float(p) for p in row) for row in data["rank_probs"]), str(path))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: not an acceptance profile ({e})") from e

    def save(self, folder: str | Path, **meta) -> Path:
        path = Path(folder) / PROFILE_FILE
        path.write_text(json.dumps({"rank_probs": [list(r) for r in self.rank_probs], **meta}, indent=1) + "\n")
        return path


@dataclass(frozen=True)
class StepCosts:
    """Measured milliseconds (batch 1): ``verify`` [(T, ms)], ``draft_fixed``, ``level`` [(w, ms)]
    (empty for heads that draft every depth in one forward) of a tree, and for heads that draft
    chains through a program of their own (``eagle_chain``) ``chain`` = (fixed, each further
    level), or None."""
    verify: tuple[tuple[int, float], ...]
    draft_fixed: float
    level: tuple[tuple[int, float], ...] = ()
    note: str = ""
    chain: tuple[float, float] | None = None

    def verify_ms(self, t: int) -> float:
        return interpolate(self.verify, t)

    def level_ms(self, w: int) -> float:
        return interpolate(self.level, w) if self.level else 0.0

    @property
    def vanilla_ms(self) -> float:
        return self.verify_ms(1)


class ShapedFactory:
    """A drafter factory that carries the draft shape it chose (``shape``; None when the user
    gave a shape or no profile was found) and, with ``gate_options`` (``gate_options``), makes
    each engine a ``draft_gate.DraftGate`` over them (``make_gate``: adaptive drafting). A
    drafter with a KV cache of its own (the draft model) takes the engine's paged pool ``kv``
    (``make(max_batch, max_len, kv=...)``); the others are made without it."""

    def __init__(self, make: Callable, shape: "ShapeChoice | None", gate_options: tuple = (),
                 costs: "StepCosts | None" = None, generic: bool = False):
        self.make, self.shape, self.gate_options = make, shape, tuple(gate_options)
        self.costs = costs            # the measured step costs the shape was chosen from (None: none measured)
        self.generic = generic        # a drafter without a profile: gated with ``generic_options``
        self.takes_kv = "kv" in inspect.signature(make).parameters
        self._learned = None          # finished requests' measured cost ratios, shared by the gates made here

    def __call__(self, max_batch: int, max_len: int, kv=None):
        """One engine's drafter; ``kv``: the engine's paged pool (``core.kv_budget.PagedKV``) or None."""
        return self.make(max_batch, max_len, kv=kv) if self.takes_kv else self.make(max_batch, max_len)

    def make_gate(self, max_nodes: int = 0):
        """A new gate for one engine whose drafter drafts at most ``max_nodes`` nodes, with the
        batch-size costs of ``costs`` (``batch_cost``), or None (adaptive drafting off). Every
        gate made here shares one ``LearnedRatios``: an ``LLM`` makes an engine per call."""
        from .batch_cost import BatchCosts
        from .draft_gate import DraftGate, GateConfig, LearnedRatios
        times = pinned_costs() is None             # pinned costs: decisions from the model alone
        options, config = self.gate_options, GateConfig(use_step_times=times)
        if not options and self.generic and self.costs is not None and max_nodes > 0:
            # a prior, not a profile: no per-request probes at batch 1, where drafting is near free
            # and a probe step would cost more than it tells (measured: suffix 1.37x -> 1.29x)
            options = generic_options(max_nodes, self.costs.verify)
            config = GateConfig(time_requests=False, use_step_times=times)
        if not options:
            return None
        costs = None if self.costs is None else BatchCosts(self.costs.verify, {o.nodes: o.draft_ms for o in options})
        if self._learned is None:
            self._learned = LearnedRatios(config.learned)
        return DraftGate(options, config, costs=costs, learned=self._learned)


@dataclass(frozen=True)
class ShapeChoice:
    """The chosen tree (choices format) with its modelled numbers."""
    choices: tuple[tuple[int, ...], ...]
    expected_tokens: float
    step_ms: float
    vanilla_ms: float
    reason: str = ""

    @property
    def speedup(self) -> float:
        return self.expected_tokens * self.vanilla_ms / self.step_ms

    @property
    def depth(self) -> int:
        return max(len(c) for c in self.choices)

    @property
    def topk(self) -> int:
        return 1 + max(c[-1] for c in self.choices)

    @property
    def pays(self) -> bool:
        """Whether the best shape is modelled to beat decoding without a drafter."""
        return self.speedup >= 1.0

    def describe(self) -> str:
        shape = "chain" if self.topk == 1 else f"tree (topk {self.topk})"
        nodes = "node" if len(self.choices) == 1 else "nodes"
        text = (f"{shape} of {len(self.choices)} {nodes}, depth {self.depth}: modelled {self.expected_tokens:.2f} "
                f"tokens per {self.step_ms:.1f} ms step, {self.speedup:.2f}x over {self.vanilla_ms:.1f} ms decoding")
        if not self.pays:
            text += ("; no shape pays with this head on this machine: decoding without speculation is "
                     "modelled faster")
        return text

    def as_dict(self) -> dict:
        return {"choices": [list(c) for c in self.choices], "num_nodes": len(self.choices), "depth": self.depth,
                "topk": self.topk, "expected_tokens": self.expected_tokens, "step_ms": self.step_ms,
                "vanilla_ms": self.vanilla_ms, "modelled_speedup": self.speedup, "reason": self.reason}


def best_paths(profile: AcceptanceProfile, max_nodes: int, max_depth: int, max_width: int):
    """Up to ``max_nodes`` (path, value) in decreasing value; every prefix is a choices tree."""
    heap = [(-profile.p(1, 0), (0,))]
    out = []
    while heap and len(out) < max_nodes:
        neg, path = heapq.heappop(heap)
        if -neg <= 0.0:
            break
        out.append((path, -neg))
        parent_value = -neg / profile.p(len(path), path[-1])
        if path[-1] + 1 < max_width:                              # next sibling
            sib = path[:-1] + (path[-1] + 1,)
            heapq.heappush(heap, (-parent_value * profile.p(len(sib), sib[-1]), sib))
        if len(path) < max_depth:                                 # first child
            child = path + (0,)
            heapq.heappush(heap, (neg * profile.p(len(child), 0), child))
    return out


def tree_cost(choices, costs: StepCosts) -> float:
    """Modelled milliseconds of one step drafting and verifying ``choices`` (a chain at the chain
    program's costs where the head has them)."""
    if costs.chain is not None and all(c[-1] == 0 for c in choices):
        depth = max(len(c) for c in choices)
        return costs.chain[0] + (depth - 1) * costs.chain[1] + costs.verify_ms(1 + len(choices))
    expanded: dict[int, int] = {}
    for parent in {c[:-1] for c in choices if len(c) > 1}:
        expanded[len(parent)] = expanded.get(len(parent), 0) + 1
    draft = costs.draft_fixed + sum(costs.level_ms(w) for w in expanded.values())
    return draft + costs.verify_ms(1 + len(choices))


def best_tree(profile: AcceptanceProfile, costs: StepCosts, *, max_nodes: int = 32, max_depth: int = 8,
              max_width: int = 8) -> ShapeChoice:
    """The tree of at most ``max_nodes`` nodes with the most expected tokens per millisecond:
    for each depth limit, every value-ordered prefix of the best paths (a level's cost can make
    a shallower tree with more siblings beat the value order of a deeper one)."""
    best, tried = None, 0
    for depth in range(1, max_depth + 1):
        paths = best_paths(profile, max_nodes, depth, max_width)
        expected = 1.0
        for m, (_, value) in enumerate(paths, start=1):
            expected += value
            choices = tuple(sorted((p for p, _ in paths[:m]), key=lambda c: (len(c), c)))
            cand = ShapeChoice(choices, expected, tree_cost(choices, costs), costs.vanilla_ms)
            tried += 1
            if best is None or cand.expected_tokens / cand.step_ms > best.expected_tokens / best.step_ms + 1e-12:
                best = cand
    if best is None:
        raise ValueError("the acceptance profile gives every draft token probability 0")
    return replace(best, reason=f"best of {tried} trees by modelled tokens/ms ({profile.source or 'profile'})")


# -- measuring ---------------------------------------------------------------------------------------
def time_ms(fn: Callable[[], object], reps: int = 7, warmup: int = 2,
            between: Callable[[], object] | None = None) -> float:
    """Fastest wall milliseconds of ``fn()`` over ``reps`` runs: other work on the machine only
    ever adds time, so the minimum is the least disturbed estimate. ``between`` (untimed) runs
    before each call: a target forward, so that a draft step meets caches as cold as in an engine
    step, where the target's weights have just streamed through them (timed back to back, a
    SmolLM2 EAGLE-3 step measured 0.8 ms; in engine steps it took 1.5-2.3 ms)."""
    for _ in range(warmup):
        if between is not None:
            between()
        fn()
    best = float("inf")
    for _ in range(reps):
        if between is not None:
            between()
        t0 = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def _scratch_cache(model, slots: int, context: int):
    """A batch-1 cache of ``slots`` slots, ``context`` of them counted as committed."""
    from ..models.kv_cache import KVCache
    p = next(model.parameters())
    cache = KVCache.for_model(model.cfg, 1, slots, p.dtype, device=p.device)
    cache.advance([0], context)
    return cache


def _forward_call(model, forward, cache, context: int, t: int, hidden_layers: tuple[int, ...] = ()):
    """A batch-1 forward over ``t`` tokens after ``context`` cached ones, called as the engine calls
    its verify forward, through ``forward`` (default the model), and in the caller's grad mode, as
    the engine's steps run: dynamo guards the grad mode, so timing a compiled forward under
    ``no_grad`` compiled a second set of graphs that the engine never ran (a cold ``make demo``
    without cached costs: 8 graphs, against the engine's 4)."""
    dev = next(model.parameters()).device
    tokens = torch.zeros(1, t, dtype=torch.long, device=dev)
    positions = torch.arange(context, context + t, device=dev)[None]
    mask = torch.ones(t, t, dtype=torch.bool, device=dev).tril()[None]
    run = forward or model
    return lambda: run(tokens, positions, cache, attn_mask=mask, rows=[0], hidden_layers=hidden_layers,
                       kv_len=cache.kv_len([0], t))


def measure_verify(model, points: tuple[int, ...] = VERIFY_POINTS, context: int = 256,
                   hidden_layers: tuple[int, ...] = (), reps: int = 7,
                   forward=None) -> tuple[tuple[int, float], ...]:
    """The target forward over T tokens (batch 1) after ``context`` cached tokens, as the engine's
    verify forward calls it, through ``forward`` (what the engine runs: a ``CompiledForward`` of
    ``model``; default the model itself); the cache is a scratch one."""
    cache = _scratch_cache(model, context + max(points) + 64, context)
    calls = {t: _forward_call(model, forward, cache, context, t, hidden_layers) for t in points}
    return tuple(time_round_robin(calls, reps).items())


def target_step(model, forward=None, context: int = 256) -> Callable[[], object]:
    """A one-token target forward (batch 1, ``context`` cached tokens, scratch cache) through
    ``forward`` (default the model): what runs between two draft steps in an engine."""
    return _forward_call(model, forward, _scratch_cache(model, context + 64, context), context, 1)


def time_round_robin(calls: dict, reps: int = 7, warmup: int = 1) -> dict:
    """Fastest milliseconds of each of ``calls`` (key -> fn), timed in turns so that a burst of
    other work on the machine falls on every key alike."""
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    best = {k: float("inf") for k in calls}
    for _ in range(reps):
        for k, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], (time.perf_counter() - t0) * 1e3)
    return best


# bumped when what is measured changes (2: draft steps timed after a target forward, cold caches;
# 3: heads beside int4 / int8 targets packed int4 / int8; 4: trees on the tree path, chains apart)
COST_VERSION = 4


def cost_key(target, head_folder: str | Path | None, kind: str, compiled: bool = False) -> str:
    """Machine, torch, threads, OpenMP wait policy, model, weights (and their kernel), the forward
    (compiled or eager) and head: what the costs depend on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    model = next(target.model.parameters())
    # the matmul kernel and OpenMP's wait policy change every cost (a thread hand-off is ~50 us
    # under PASSIVE): the packed modules' backend and the policy are part of the key
    backends = sorted({getattr(m, "backend", "") for m in target.model.modules() if hasattr(m, "backend")})
    omp = os.environ.get("OMP_WAIT_POLICY", "default")
    from ..models import attention
    cfg = getattr(target.model, "cfg", None)
    attn = "op" if cfg is not None and attention.row_invariant(cfg) else "sdpa"      # which attention runs
    stamp = ["no head"]
    if head_folder is not None:                  # None: costs of the target alone
        head = Path(head_folder)
        stamp = [str(head.resolve())] + [f"{p.name}:{p.stat().st_size}:{int(p.stat().st_mtime)}"
                                         for p in sorted(head.glob("*")) if p.is_file()]
    parts = [f"v{COST_VERSION}", cpu, str(os.cpu_count()), torch.__version__, str(torch.get_num_threads()), str(target.name),
             str(getattr(target, "weights", "")) + "/" + "+".join(b for b in backends if b), f"omp={omp}",
             f"attn={attn}", "compiled" if compiled else "eager", str(model.dtype), str(model.device), kind,
             hashlib.sha1("|".join(stamp).encode()).hexdigest()[:12]]
    return "|".join(parts)


def cache_path() -> Path:
    return Path(os.environ.get("VERISPEC_COST_CACHE", Path.home() / ".cache" / "verispec" / "step_costs.json"))


PINNED_ENV = "VERISPEC_STEP_COSTS"


def pinned_costs() -> StepCosts | None:
    """The step costs of the JSON file ``$VERISPEC_STEP_COSTS`` (``verify`` [[T, ms], ...],
    ``draft_fixed``, optional ``level`` [[w, ms], ...] and ``chain`` [fixed, level]), or None when
    the variable is unset. A file that is missing or not such costs is a ``ValueError``."""
    name = os.environ.get(PINNED_ENV)
    if not name:
        return None
    try:
        d = json.loads(Path(name).read_text())
        chain = d.get("chain")
        costs = StepCosts(tuple((int(t), float(ms)) for t, ms in d["verify"]), float(d["draft_fixed"]),
                          tuple((int(w), float(ms)) for w, ms in d.get("level", ())),
                          f"pinned by ${PINNED_ENV}", tuple(map(float, chain)) if chain else None)
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"${PINNED_ENV}={name}: not step costs ({e})") from e
    if not costs.verify or any(ms <= 0 for _, ms in costs.verify):
        raise ValueError(f"${PINNED_ENV}={name}: 'verify' needs positive [T, ms] points")
    return costs


def cached_costs(key: str, measure: Callable[[], StepCosts]) -> StepCosts:
    """The costs stored under ``key``, else measured now and stored (a broken cache is rewritten);
    the pinned costs instead where ``$VERISPEC_STEP_COSTS`` is set (``pinned_costs``)."""
    pinned = pinned_costs()
    if pinned is not None:
        return pinned
    path = cache_path()
    try:
        table = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, json.JSONDecodeError):
        table = {}
    if key in table:
        d = table[key]
        chain = d.get("chain")
        return StepCosts(tuple(map(tuple, d["verify"])), d["draft_fixed"], tuple(map(tuple, d["level"])),
                         d.get("note", ""), tuple(chain) if chain else None)
    costs = measure()
    table[key] = {**asdict(costs), "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(table, indent=1))
        tmp.replace(path)
    except OSError:
        pass                                     # read-only home: measure again next time
    return costs


@dataclass
class ShapeRequest:
    """What a head factory asks: its profile, how to measure its drafting, its limits."""
    profile: AcceptanceProfile
    # measure_draft(between) -> (fixed ms, ((w, level ms), ...)) or the same with a third item,
    # the chain program's (fixed ms, level ms); ``between`` runs a target forward before each
    # timed draft step (see ``time_ms``)
    measure_draft: Callable[[Callable[[], object]], tuple[float, tuple[tuple[int, float], ...]]]
    max_depth: int
    max_nodes: int = 32
    max_width: int = 8
    extra: dict = field(default_factory=dict)


def step_costs(target, head_folder: str | Path, kind: str, req: ShapeRequest,
               hidden_layers: tuple[int, ...] = (), forward=None) -> StepCosts:
    """This machine's step costs for ``target`` with this head, measured now or read cached.
    ``forward``: the target forward the engines run (a ``CompiledForward``; default the model):
    a compiled forward's fixed cost per call is lower, which makes drafting relatively dearer."""
    def measure() -> StepCosts:
        verify = measure_verify(target.model, hidden_layers=hidden_layers, forward=forward)
        fixed, levels, *chain = req.measure_draft(target_step(target.model, forward))
        how = "compiled" if forward is not None else "eager"
        return StepCosts(verify, fixed, levels,
                         note=f"measured at start-up, {torch.get_num_threads()} threads, {how} target forward",
                         chain=chain[0] if chain else None)
    return cached_costs(cost_key(target, head_folder, kind, compiled=forward is not None), measure)


def choose_shape(target, head_folder: str | Path, kind: str, req: ShapeRequest,
                 hidden_layers: tuple[int, ...] = (), forward=None, costs: StepCosts | None = None) -> ShapeChoice:
    """The best tree for this head on this machine's step costs (``costs``; default ``step_costs``)."""
    if costs is None:
        costs = step_costs(target, head_folder, kind, req, hidden_layers, forward)
    shape = best_tree(req.profile, costs, max_nodes=req.max_nodes, max_depth=req.max_depth,
                      max_width=req.max_width)
    if not shape.pays:
        log.warning("%s head %s: %s", kind, head_folder, shape.describe())
    return shape


def modelled_shape(choices, profile: AcceptanceProfile, costs: StepCosts) -> ShapeChoice:
    """A given static tree (choices format) with its modelled tokens and step cost."""
    expected = 1.0
    for path in choices:
        value = 1.0
        for depth, rank in enumerate(path, start=1):
            value *= profile.p(depth, rank)
        expected += value
    choices = tuple(tuple(c) for c in choices)
    return ShapeChoice(choices, expected, tree_cost(choices, costs), costs.vanilla_ms, reason="the configured tree")


def gate_options(choices, profile: AcceptanceProfile, costs: StepCosts) -> tuple:
    """``draft_gate.GateOption`` of every prefix of ``choices`` (in tree order, (depth, path): the
    nodes a node budget keeps): modelled accepted tokens and step cost over a plain step's."""
    from .draft_gate import GateOption
    ordered = tuple(validate_choices(choices))
    if not all(c[-1] == 0 for c in ordered):
        costs = replace(costs, chain=None)     # a tree drafts on the tree path, also when cut to a chain
    out = []
    for m in range(1, len(ordered) + 1):
        shape = modelled_shape(ordered[:m], profile, costs)
        out.append(GateOption(m, shape.expected_tokens - 1.0, shape.step_ms / shape.vanilla_ms,
                              hit_by_depth(ordered[:m], profile), shape.step_ms - costs.verify_ms(1 + m)))
    return tuple(out)


def hit_by_depth(choices, profile: AcceptanceProfile) -> tuple[float, ...]:
    """Per depth d of ``choices``: the modelled probability that depth d's token is accepted given
    depth d-1's was, V_d / V_{d-1} (V_d: the summed values of the paths of length d, V_0 = 1)."""
    depth = max(len(c) for c in choices)
    v = [1.0] + [0.0] * depth
    for path in choices:
        value = 1.0
        for d, rank in enumerate(path, start=1):
            value *= profile.p(d, rank)
        v[len(path)] += value
    return tuple(v[d] / v[d - 1] if v[d - 1] > 0 else 0.0 for d in range(1, depth + 1))


def plan_shape(target, head_folder: str | Path, kind: str, measure_draft, max_depth: int,
               user_choices, adaptive: bool | None, hidden_layers: tuple[int, ...] = (),
               forward=None) -> tuple[ShapeChoice | None, tuple, StepCosts | None]:
    """``(chosen, gate options, the costs measured or None)`` for a head factory. The head's profile is its folder's
    ``acceptance.json``, read only when needed; ``measure_draft`` and ``max_depth`` as in
    ``ShapeRequest``. ``user_choices``: None when the user set no shape, the static tree's
    choices when they gave one, ``()`` for a dynamic tree. ``adaptive``: the config's
    ``adaptive_drafting`` (None: on for a shape chosen here).

    - no user shape and a profile: the best tree (``choose_shape``), gated unless adaptive is False;
    - a user's static tree with ``adaptive_drafting: true``: that tree, gated;
    - adaptive True without a profile, or with a dynamic tree: a ``SpecConfigError``.
    The gate's options are the tree's prefixes (``gate_options``); () when not gated."""
    from .spec_config import SpecConfigError
    profile = AcceptanceProfile.load(head_folder) if user_choices is None or adaptive else None
    req = None if profile is None else ShapeRequest(profile, measure_draft, max_depth=max_depth)
    if adaptive and req is None:
        raise SpecConfigError(f"'adaptive_drafting' needs the head's measured acceptance ({head_folder}/"
                              f"{PROFILE_FILE}, written by 'verispec train ... --eval-only'); the folder has none")
    if adaptive and user_choices == ():
        raise SpecConfigError("'adaptive_drafting' applies to static trees and chains ('tree' or "
                              "'num_speculative_tokens'), not to a dynamic tree")
    if req is None or (user_choices is not None and not adaptive):
        return None, (), None
    costs = step_costs(target, head_folder, kind, req, hidden_layers, forward)
    if user_choices is None:
        shape = choose_shape(target, head_folder, kind, req, hidden_layers, forward, costs)
        return shape, (() if adaptive is False else gate_options(shape.choices, req.profile, costs)), costs
    return None, gate_options(user_choices, req.profile, costs), costs


def load_head(config, target, load):
    """``(config, head)``: ``config`` with its shipped head filled in (``shipped.with_shipped_head``)
    and ``load(folder)``'s head; a checkpoint that does not load is a ``SpecConfigError``."""
    from ..formats import CheckpointError
    from .shipped import with_shipped_head
    from .spec_config import SpecConfigError
    config = with_shipped_head(config, target)
    try:
        return config, load(config.model)
    except CheckpointError as e:
        raise SpecConfigError(f"speculative_config 'model': {e}") from e


def head_factory(target, config, kind: str, tree, user_choices, measure_draft, max_depth: int, make,
                 hidden_layers: tuple[int, ...] = (), forward=None) -> ShapedFactory:
    """The factory of a head's drafters: ``plan_shape``'s chosen tree (as a static tree) where it
    chose one, else ``tree``; ``make(tree, max_batch, max_len)`` makes one engine's drafter."""
    from .dynamic_tree import StaticTreeConfig
    shape, gate, costs = plan_shape(target, config.model, kind, measure_draft, max_depth, user_choices,
                                    config.adaptive_drafting, hidden_layers=hidden_layers, forward=forward)
    if shape is not None:
        tree = StaticTreeConfig(shape.choices)
    return ShapedFactory(lambda max_batch, max_len: make(tree, max_batch, max_len), shape, gate, costs)


# ------------------------------------------------------------------ drafters without a profile
PRIOR_HIT = 0.6      # the prior probability that a profile-less drafter's next draft token is accepted


def generic_options(max_nodes: int, verify: Sequence[tuple[int, float]]) -> tuple:
    """``draft_gate.GateOption`` of budgets 1, 2, 4, ... and ``max_nodes`` for a drafter without a
    measured acceptance profile (n-gram, suffix trees, a draft model): a chain prior of
    ``PRIOR_HIT`` per depth (each request's own steps rescale it depth by depth, as a node's
    depth in a chain: ``DraftGate.depth_factors``) and the
    verify cost of ``1 + m`` tokens over one (drafting itself is host work or is learned from
    timed steps: the modelled draft time is 0)."""
    from .draft_gate import GateOption
    if max_nodes < 1:
        raise ValueError(f"a gate needs a drafter of at least one node, got {max_nodes}")
    curve = StepCosts(tuple(verify), 0.0)
    budgets, p = {max_nodes}, 1
    while p < max_nodes:
        budgets.add(p)
        p *= 2
    return tuple(GateOption(m, sum(PRIOR_HIT ** d for d in range(1, m + 1)),
                            curve.verify_ms(1 + m) / curve.verify_ms(1), (PRIOR_HIT,) * m) for m in sorted(budgets))


def verify_costs(target, forward=None) -> tuple[tuple[int, float], ...]:
    """The target's measured batch-1 verify costs ``(T, ms)`` on this machine (through
    ``forward``, the engines' compiled forward, if any), cached with the heads' step costs."""
    def measure() -> StepCosts:
        return StepCosts(measure_verify(target.model, forward=forward), 0.0, note="target verify costs")
    return cached_costs(cost_key(target, None, "verify", compiled=forward is not None), measure).verify
