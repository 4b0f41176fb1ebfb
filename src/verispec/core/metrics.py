"""``SpecStats``: speculative-decoding counters, kept by the engine, never by drafters.

Convention, stated once: **mean acceptance length includes the bonus/recovered token**, i.e.
tokens emitted per verification step = 1 + accepted draft tokens. A vanilla step has length 1.
Positions are 1-based draft depths; ``accepted_per_pos[i]`` counts steps whose accepted path
reached depth i + 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_steps: int = 0               # target verification forwards (incl. vanilla steps)
    num_drafts: int = 0              # steps that verified at least one draft token
    num_draft_tokens: int = 0        # tree nodes proposed, summed over steps
    num_accepted_tokens: int = 0     # accepted draft tokens (bonus/recovered excluded)
    num_emitted_tokens: int = 0      # tokens produced by steps (accepted + 1 each step)
    accepted_per_pos: list[int] = field(default_factory=list)
    drafted_per_pos: list[int] = field(default_factory=list)   # steps whose tree reached depth i+1
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    overhead_time_s: float = 0.0     # engine-wide: a step's time after the verify forward (acceptance,
                                     # cache compaction, drafter hand-over, emission)
    budgets: dict = field(default_factory=dict)   # draft budget -> steps given it (0: plain; the
                                     # draft-budget estimator's choice, capped by room and any policy)
    modelled_tokens: float = 0.0     # the draft-budget estimator's expected tokens, summed over steps
    modelled_cost: float = 0.0       # and its expected step costs, in plain steps (``DraftGate.modelled``)
    acceptance: str = "lossless"     # the engine's acceptance rule (``acceptance.AcceptanceRule.name``)
    lossy: bool = False              # True: that rule does not keep the target distribution

    def observe(self, num_draft_tokens: int, tree_depth: int, num_accepted: int) -> None:
        """Record one verification step of one sequence."""
        self.num_steps += 1
        self.num_emitted_tokens += num_accepted + 1
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        _grow(self.accepted_per_pos, num_accepted)
        _grow(self.drafted_per_pos, tree_depth)

    def merge(self, other: "SpecStats") -> None:
        for name in ("num_steps", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
                     "num_emitted_tokens", "draft_time_s", "verify_time_s", "overhead_time_s",
                     "modelled_tokens", "modelled_cost"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for k, v in other.budgets.items():
            self.budgets[k] = self.budgets.get(k, 0) + v
        for mine, theirs in ((self.accepted_per_pos, other.accepted_per_pos),
                             (self.drafted_per_pos, other.drafted_per_pos)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v

    def observe_budget(self, budget: int) -> None:
        """Record the draft budget one step gave the sequence (0: a plain step)."""
        self.budgets[budget] = self.budgets.get(budget, 0) + 1

    def observe_model(self, tokens: float, cost: float) -> None:
        """Record the estimator's model of one step: its expected tokens and cost (plain step = 1)."""
        self.modelled_tokens += tokens
        self.modelled_cost += cost

    @property
    def modelled_speedup(self) -> float | None:
        """The decode speed-up over plain steps that the estimator expected (None: no estimator)."""
        return self.modelled_tokens / self.modelled_cost if self.modelled_cost > 0 else None

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per drafted step, bonus included (1.0 when nothing was drafted)."""
        if self.num_drafts == 0:
            return 1.0
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """Share of drafted steps whose accepted path reached each depth."""
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_pos]

    def as_dict(self) -> dict:
        return {
            "num_steps": self.num_steps, "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens, "num_accepted_tokens": self.num_accepted_tokens,
            "mean_acceptance_length": self.mean_acceptance_length,
            "accepted_per_pos": list(self.accepted_per_pos),
            "acceptance_rate_per_pos": self.acceptance_rate_per_pos,
            "draft_budgets": {str(k): v for k, v in sorted(self.budgets.items())},
            "draft_time_s": self.draft_time_s, "verify_time_s": self.verify_time_s,
            "overhead_time_s": self.overhead_time_s,
            "modelled_tokens": self.modelled_tokens, "modelled_cost": self.modelled_cost,
            "acceptance": self.acceptance, "lossy": self.lossy,
        }


def _grow(counts: list[int], depth: int) -> None:
    counts.extend([0] * (depth - len(counts)))
    for i in range(depth):
        counts[i] += 1
