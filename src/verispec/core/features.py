"""Target features: what the engine hands a drafter (and the prefix cache keeps) beside the
committed tokens: hidden states of the layers the drafter asked for, and the final-normed state.
One ``TargetFeatures`` covers consecutive positions, in order."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class TargetFeatures:
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)   # layer -> [T, hidden]
    last_hidden: torch.Tensor | None = None                         # [T, hidden], post final norm


def join_features(parts: list[TargetFeatures | None]) -> TargetFeatures | None:
    """Features of consecutive positions concatenated (None parts are skipped; all None: None)."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    last = [p.last_hidden for p in parts]
    return TargetFeatures({i: torch.cat([p.hidden[i] for p in parts]) for i in parts[0].hidden},
                          None if last[0] is None else torch.cat(last))
