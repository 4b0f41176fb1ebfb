"""Draft-tree builders driven level by level: the EAGLE-2 dynamic tree and static choices trees.

A builder owns the candidate nodes of one request; the drafter asks it which nodes to expand
(``frontier``), runs its head on them and hands back their children's ranked log-probabilities
(``grow``, a ``Ranked`` of the config's ``width`` best children per node, from ``rank``);
``select`` returns the final tree. Tokens here are draft-vocabulary ids.

EAGLE-2 dynamic tree (``DynamicTreeBuilder``), ``topk`` k, ``depth`` D, budget m:
1. depth 1: the k most likely children of the root are the candidates and the frontier;
2. depth d = 2..D: each frontier node gets its k most likely children as candidates; the frontier
   becomes the k candidates of depth d with the best *rank score* (not expanded at d = D);
3. rerank: the tree is the m best candidates by rank score, taken best-first among candidates
   whose parent is already taken (root counts), so it is connected and has at most m nodes.
The rank score is the *path score* (sum of draft log-probs from the root, EAGLE-2) by default.
A child's path score never exceeds its parent's, so the best-first pick equals the plain top-m
(ties broken by creation order, parents first). Ablations: ``RankBy.CONFIDENCE`` ranks by the
node's own log-prob only (frontier and rerank); ``rerank=False`` keeps the first m candidates
in creation order (depth by depth, frontier order, child rank), i.e. no global reranking.

Static trees (``StaticTreeBuilder``): the EAGLE-1 / Medusa choices format (``tree.validate_choices``),
rank r below a node = its r-th most likely child.
"""
from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from ..core.tree import ChoicesFiller, validate_choices


# Default node budget of a draft tree (EAGLE-2 dynamic tree, Medusa tree), chosen from the measured
# target cost curve by the rule in benchmarks/tree_cost.py (results: benchmarks/results/tree_cost.md).
DEFAULT_NUM_DRAFT_TOKENS = 12


class Ranked(NamedTuple):
    """The best children of F nodes, best first: draft log-probs and draft token ids."""
    logp: torch.Tensor      # [F, width] (or [width])
    ids: torch.Tensor       # [F, width] (or [width]) int64


def rank(logits: torch.Tensor, width: int, normalise: bool = True) -> Ranked:
    """Top-``width`` log-probs of ``logits [..., V]`` without materialising a log-softmax.
    ``normalise=False``: the top logits themselves (same order, no logsumexp over V), for callers
    that need the ranking only (static trees of a deterministic drafter)."""
    lg = logits.float()
    vals, ids = torch.topk(lg, min(width, lg.shape[-1]), dim=-1)
    return Ranked(vals - torch.logsumexp(lg, dim=-1, keepdim=True) if normalise else vals, ids)


class RankBy(str, enum.Enum):
    PATH = "path"                # EAGLE-2: sum of draft log-probs along the path
    CONFIDENCE = "confidence"    # ablation: the node's own draft log-prob


@dataclass(frozen=True)
class DynamicTreeConfig:
    topk: int = 8
    depth: int = 6
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    rank_by: RankBy = RankBy.PATH
    rerank: bool = True

    def __post_init__(self) -> None:
        for key in ("topk", "depth", "num_draft_tokens"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"dynamic tree '{key}' must be a positive integer, got {v!r}")

    @property
    def max_nodes(self) -> int:
        return self.num_draft_tokens

    @property
    def max_depth(self) -> int:
        return self.depth

    @property
    def max_expanded(self) -> int:
        """Upper bound on nodes expanded (fed to the head) per proposal."""
        return self.topk * (self.depth - 1)

    @property
    def width(self) -> int:
        """Ranked children needed per expanded node."""
        return self.topk

    def builder(self, root: Ranked, budget: int) -> "DynamicTreeBuilder":
        return DynamicTreeBuilder(self, root, budget)


@dataclass(frozen=True)
class StaticTreeConfig:
    choices: tuple[tuple[int, ...], ...]

    @staticmethod
    def from_choices(choices: Sequence[Sequence[int]]) -> "StaticTreeConfig":
        return StaticTreeConfig(tuple(validate_choices(choices)))

    @staticmethod
    def chain(k: int) -> "StaticTreeConfig":
        return StaticTreeConfig(tuple((0,) * d for d in range(1, k + 1)))

    @property
    def max_nodes(self) -> int:
        return len(self.choices)

    @property
    def max_depth(self) -> int:
        return max(len(c) for c in self.choices)

    @property
    def max_expanded(self) -> int:
        return len({c[:-1] for c in self.choices if len(c) > 1})

    @property
    def width(self) -> int:
        return 1 + max(c[-1] for c in self.choices)

    def builder(self, root: Ranked, budget: int) -> "StaticTreeBuilder":
        return StaticTreeBuilder(self.choices, root, budget)


TreeConfig = DynamicTreeConfig | StaticTreeConfig


class _Nodes:
    """Candidate storage shared by the builders (creation order is topological)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.logp: list[float] = []      # own draft log-prob given the parent
        self.score: list[float] = []     # path score: sum of logp from the root

    def add(self, parent: int, token: int, logp: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.logp.append(logp)
        self.score.append(logp + (self.score[parent] if parent >= 0 else 0.0))
        return len(self.tokens) - 1

    def add_children(self, parent: int, logp: list[float], ids: list[int], k: int) -> list[int]:
        """The first k of the ranked children (draws of probability 0 are skipped)."""
        return [self.add(parent, i, v) for v, i in zip(logp[:k], ids[:k]) if v != float("-inf")]

    def __len__(self) -> int:
        return len(self.tokens)


class DynamicTreeBuilder:
    """EAGLE-2 dynamic tree for one request (see the module docstring)."""

    def __init__(self, cfg: DynamicTreeConfig, root: Ranked, budget: int):
        self.cfg = cfg
        self.budget = min(budget, cfg.num_draft_tokens)
        self.nodes = _Nodes()
        self._level = 1
        first = self.nodes.add_children(-1, root.logp.tolist(), root.ids.tolist(), cfg.topk)
        self._frontier = self._best(first) if self._more_levels() else []

    def _key(self, i: int) -> float:
        return self.nodes.score[i] if self.cfg.rank_by is RankBy.PATH else self.nodes.logp[i]

    def _best(self, cands: list[int]) -> list[int]:
        return sorted(cands, key=lambda i: (-self._key(i), i))[:self.cfg.topk]

    def _more_levels(self) -> bool:
        # a level deeper than the budget can never be kept (each level adds at least one node)
        return self._level < min(self.cfg.depth, self.budget)

    def frontier(self) -> list[int]:
        return list(self._frontier)

    def grow(self, ranked: Ranked) -> None:
        """Ranked children ([F, width]) of the frontier nodes, in frontier order."""
        new = []
        for node, lp, ids in zip(self._frontier, ranked.logp.tolist(), ranked.ids.tolist()):
            new += self.nodes.add_children(node, lp, ids, self.cfg.topk)
        self._level += 1
        self._frontier = self._best(new) if self._more_levels() else []

    def select(self) -> list[int]:
        """Node ids of the final tree in creation (topological) order."""
        m = self.budget
        if not self.cfg.rerank:
            return list(range(min(m, len(self.nodes))))
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(self.nodes.parents):
            kids.setdefault(p, []).append(i)
        heap = [(-self._key(i), i) for i in kids.get(-1, [])]
        heapq.heapify(heap)
        chosen = []
        while heap and len(chosen) < m:
            _, i = heapq.heappop(heap)
            chosen.append(i)
            for c in kids.get(i, []):
                heapq.heappush(heap, (-self._key(c), c))
        return sorted(chosen)


class StaticTreeBuilder:
    """A choices tree filled with the ranked children of each expanded node. ``nodes`` is its
    ``ChoicesFiller`` (tokens, parents; payload: each node's ranking score as given: a draft
    log-prob, or a raw logit from ``rank(normalise=False)``; only the order matters here)."""

    def __init__(self, choices: tuple[tuple[int, ...], ...], root: Ranked, budget: int):
        self.nodes = ChoicesFiller(choices, budget)
        self._level = 0
        self.nodes.add_children((), root.ids.tolist(), root.logp.tolist())
        self._frontier = self._next_frontier()

    def _next_frontier(self) -> list[tuple[int, ...]]:
        self._level += 1
        return [] if self.nodes.full else self.nodes.expandable(self._level)

    def frontier(self) -> list[int]:
        return [self.nodes.index[p] for p in self._frontier]

    def grow(self, ranked: Ranked) -> None:
        for path, lp, ids in zip(self._frontier, ranked.logp.tolist(), ranked.ids.tolist()):
            self.nodes.add_children(path, ids, lp)
        self._frontier = self._next_frontier()

    def select(self) -> list[int]:
        return list(range(len(self.nodes)))


TreeBuilder = DynamicTreeBuilder | StaticTreeBuilder
