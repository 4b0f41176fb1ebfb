"""Caps on speculation under load that a user sets: the most draft nodes per sequence, by batch size.

The draft budget itself is decided by the engine's one draft-budget estimator
(``drafting.draft_gate.DraftGate`` with ``drafting.batch_cost.BatchCosts``): each step it gives each
running request the prefix of its tree that pays at this step's batch size, from the request's own
acceptance and the batch's modelled and measured step costs, down to none. A ``SpecPolicy`` only
caps it, for users who want vLLM's ``num_speculative_tokens_per_batch_size`` table:

- ``StaticPolicy``: no cap (the drafter's own size).
- ``TablePolicy``: ``{1: 4, 8: 2, 16: 0}``: the entry with the largest batch size <= the current
  one applies (below the smallest key the drafter's own size applies).

The scheduler asks the policy for each step's cap and passes it to ``Engine.step(budget=k)``,
which cuts every request's tree at its first k nodes (nodes are in topological order, so a prefix
is still a tree and verification stays lossless). No policy (``"auto"``, the default) leaves the
estimator alone.
"""
from __future__ import annotations

import json
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


def parse_policy(value: str | dict | None) -> SpecPolicy | None:
    """Build a policy from ``num_speculative_tokens_per_batch_size``.

    ``None`` or ``"auto"``: None (the engine's draft-budget estimator alone); ``"static"``/``"off"``:
    ``StaticPolicy``; a dict or a JSON object string ``{batch_size: num_speculative_tokens}``:
    ``TablePolicy``. Raises ``ValueError`` with the reason for anything else."""
    if value is None or value == "auto":
        return None
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
