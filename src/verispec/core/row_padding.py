"""Ghost rows: a batch whose cache rows have holes, run as the rows ``0..R-1`` in order.

A compiled forward (``models.compiled``) serves a batch whose rows are the cache's first rows in
order: it reads each layer's K/V as views of those rows. Any other row set reads them with a
gather (a copy of every attended slot of every row, per layer) and runs eagerly. Under a server's
changing load the running rows often have holes: a finished request's row is free, or its
successor is still being prefilled. Such a batch is padded with the missing rows as *ghost rows*:
each runs one dummy token per entry, attends only its own committed slots and itself, and its
outputs are dropped. Its K/V land in the scratch slots past its committed length, which its
owner (a prefilling request, or none) overwrites before reading them, so padding is unobservable.

Padding pays where a ghost row costs less than the gather and the eager forward: at most as many
ghost rows as real ones, and none whose committed length would widen the attended slots.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..models.transformer import ModelOutput


def ghost_rows(rows: Sequence[int], lengths: Sequence[int], t: int, kv_len: int) -> list[int]:
    """The rows missing from ``0..max(rows)`` when padding ``rows`` (ascending) with them pays,
    else ``[]`` (also when there is nothing to pad). ``lengths``: the committed lengths of rows
    ``0..max(rows)``; ``t``: tokens per row of the forward; ``kv_len``: the attended slots of the
    real rows, which the ghost rows must not widen."""
    if not rows or list(rows) == list(range(len(rows))):
        return []
    real = set(rows)
    ghosts = [r for r in range(max(rows) + 1) if r not in real]
    if len(ghosts) > len(rows) or any(lengths[g] + t > kv_len for g in ghosts):
        return []
    return ghosts


def pad_rows(tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, rows: Sequence[int],
             lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens, positions, mask, index)`` of the padded batch of rows ``0..max(rows)``: row ``r``
    of the padded batch is cache row ``r``; ``index`` [B] selects the real rows' outputs back.
    Ghost rows hold token 0 at their next positions under an identity mask."""
    n, t = max(rows) + 1, int(tokens.shape[1])
    dev = tokens.device
    index = torch.tensor(list(rows), dtype=torch.long, device=dev)
    start = torch.tensor(list(lengths[:n]), dtype=torch.long, device=dev)
    out_tokens = tokens.new_zeros(n, t)
    out_tokens[index] = tokens
    out_positions = start[:, None] + torch.arange(t, device=dev)
    out_positions[index] = positions
    out_mask = torch.eye(t, dtype=mask.dtype, device=dev).expand(n, t, t).clone()
    out_mask[index] = mask
    return out_tokens, out_positions, out_mask, index


def take_rows(out: ModelOutput, index: torch.Tensor) -> ModelOutput:
    """The outputs of the real rows of a padded forward, in the order of ``index``."""
    return ModelOutput(None if out.logits is None else out.logits.index_select(0, index),
                       out.last_hidden.index_select(0, index),
                       {k: v.index_select(0, index) for k, v in out.hidden.items()})
