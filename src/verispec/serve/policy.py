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
- ``AutoPolicy``: measured. For each batch-size bucket (1, 2, 3-4, 5-8, ...) it keeps a moving
  average of emitted tokens per second of step time for a few budgets (0, half, full), uses the
  best and now and then re-measures the others (the slower they were, the more rarely).

``PolicyDrafter`` wraps any ``Drafter``: it asks the policy for the budget of the step, shortens
the requests' ``max_nodes`` to it (or skips proposing when it is 0, returning empty trees) and
truncates the returned trees to their first ``budget`` nodes (nodes are in topological order, so
a prefix is still a tree; ``q`` rows are cut alike, and since a node's ``q`` depends only on
earlier nodes the verification stays lossless). ``start``, ``accept`` and ``release`` always go
to the inner drafter, so drafters keep their state; a drafter must tolerate steps in which
``propose`` was not called (it learns the committed tokens from ``accept`` / the context).
Speculation is lossless, so no policy changes what is generated, only how fast.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Protocol

from ..drafters.base import DraftRequest, Drafter, TargetFeatures
from ..tree import DraftTree


class SpecPolicy(Protocol):
    def bind(self, max_nodes: int) -> None:
        """Learn the drafter's largest tree (called by ``PolicyDrafter``)."""

    def budget(self, batch_size: int) -> int:
        """Draft tree nodes allowed per sequence in a step of ``batch_size`` sequences."""

    def observe(self, batch_size: int, budget: int, step_s: float, emitted_tokens: int) -> None:
        """Feedback after a step: its batch size, the budget used, its time and tokens emitted."""


class StaticPolicy:
    """No policy: the drafter's full size at every batch size."""

    def __init__(self) -> None:
        self.max_nodes = 0

    def bind(self, max_nodes: int) -> None:
        self.max_nodes = max_nodes

    def budget(self, batch_size: int) -> int:
        return self.max_nodes

    def observe(self, batch_size: int, budget: int, step_s: float, emitted_tokens: int) -> None:
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

    def observe(self, batch_size: int, budget: int, step_s: float, emitted_tokens: int) -> None:
        pass

    def describe(self) -> dict:
        return {"policy": "table", "max_nodes": self.max_nodes,
                "num_speculative_tokens_per_batch_size": {str(b): n for b, n in self.table}}


class AutoPolicy:
    """Per batch-size bucket, the budget with the best measured tokens/s (see module docstring).

    Every budget is measured once first; afterwards the best one is used and another budget is
    re-measured when ``explore_every`` x (best rate / its rate) steps of the bucket passed since
    its last use (at most 8 x ``explore_every``): a budget half as fast is re-checked half as often,
    so exploring costs little where drafting is much slower."""

    def __init__(self, explore_every: int = 16, alpha: float = 0.25):
        if explore_every < 2:
            raise ValueError("explore_every must be >= 2")
        self.explore_every = explore_every
        self.alpha = alpha
        self.max_nodes = 0
        self.arms = [0]
        self.rate: dict[tuple[int, int], float] = {}      # (bucket, budget) -> tokens/s (EMA)
        self.last: dict[tuple[int, int], int] = {}        # (bucket, budget) -> step last used
        self.steps: dict[int, int] = {}

    def bind(self, max_nodes: int) -> None:
        if max_nodes != self.max_nodes:
            self.max_nodes = max_nodes
            self.arms = sorted({0, max(1, max_nodes // 2), max_nodes})
            self.rate.clear()
            self.last.clear()

    @staticmethod
    def bucket(batch_size: int) -> int:
        return max(0, math.ceil(math.log2(max(1, batch_size))))

    def budget(self, batch_size: int) -> int:
        b = self.bucket(batch_size)
        n = self.steps[b] = self.steps.get(b, 0) + 1
        untried = [a for a in self.arms if (b, a) not in self.rate]
        choice = untried[-1] if untried else max(self.arms, key=lambda a: self.rate[(b, a)])
        if not untried:
            best = self.rate[(b, choice)]
            for a in sorted(self.arms, key=lambda a: self.last.get((b, a), 0)):     # stalest first
                wait = self.explore_every * min(8.0, best / max(self.rate[(b, a)], 1e-9))
                if a != choice and n - self.last.get((b, a), 0) >= wait:
                    choice = a
                    break
        self.last[(b, choice)] = n
        return choice

    def observe(self, batch_size: int, budget: int, step_s: float, emitted_tokens: int) -> None:
        if step_s <= 0 or budget not in self.arms:
            return
        key = (self.bucket(batch_size), budget)
        r = emitted_tokens / step_s
        old = self.rate.get(key)
        self.rate[key] = r if old is None else (1 - self.alpha) * old + self.alpha * r

    def describe(self) -> dict:
        return {"policy": "auto", "max_nodes": self.max_nodes, "arms": self.arms,
                "tokens_per_s": {f"batch<={2 ** b} budget={a}": round(v, 2)
                                 for (b, a), v in sorted(self.rate.items())}}


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


class PolicyDrafter:
    """A ``Drafter`` that delegates to ``inner`` and caps its trees by ``policy.budget``."""

    def __init__(self, inner: Drafter, policy: SpecPolicy):
        self.inner = inner
        self.policy = policy
        policy.bind(inner.max_tree_nodes)
        self.last_budget = inner.max_tree_nodes

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return self.inner.hidden_layers

    @property
    def needs_last_hidden(self) -> bool:
        return self.inner.needs_last_hidden

    @property
    def max_tree_nodes(self) -> int:
        return self.inner.max_tree_nodes

    def start(self, row: int, prompt_ids: list[int], features: TargetFeatures | None) -> None:
        self.inner.start(row, prompt_ids, features)

    def accept(self, row: int, committed_ids: list[int], features: TargetFeatures | None) -> None:
        self.inner.accept(row, committed_ids, features)

    def release(self, row: int) -> None:
        self.inner.release(row)

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        budget = max(0, min(self.policy.budget(len(requests)), self.inner.max_tree_nodes))
        self.last_budget = budget
        if budget == 0 or not requests:
            return [DraftTree.empty() for _ in requests]
        capped = [replace(r, max_nodes=budget if r.max_nodes is None else min(r.max_nodes, budget))
                  for r in requests]
        trees = self.inner.propose(capped)
        return [truncate(t, r.max_nodes) for t, r in zip(trees, capped)]


def truncate(tree: DraftTree, max_nodes: int) -> DraftTree:
    """The first ``max_nodes`` nodes of ``tree`` (a connected subtree: parents come first)."""
    if len(tree) <= max_nodes:
        return tree
    q = tree.q[:max_nodes] if tree.q is not None else None
    return DraftTree(tree.tokens[:max_nodes], tree.parents[:max_nodes], q)
