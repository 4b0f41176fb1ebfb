"""Static KV cache: preallocated, indexed by absolute slot, one length per sequence row.

Contract
- ``k[layer]`` and ``v[layer]`` have shape ``[max_batch, num_kv_heads, max_len, head_dim]``.
- ``lengths[row]`` is the number of committed slots of that row. Slots ``>= lengths[row]`` hold
  scratch data (draft-tree nodes, padding) that no later query sees unless committed.
- A forward writes its T new tokens into slots ``lengths[row] .. lengths[row] + T - 1``; it does
  not change ``lengths``. The caller commits with ``advance`` (append) or ``compact`` (keep
  chosen scratch slots, e.g. an accepted tree path). Rolling back is setting a length.
- ``read_slots`` / ``write_prefix`` copy committed K/V out of a row and into a fresh row (the
  prefix cache's copy-out and copy-in): copies, never views, so later writes change neither side.
Knows nothing about models, drafters or sampling.
"""
from __future__ import annotations

import torch


class CacheFullError(RuntimeError):
    """A write would go past the preallocated length of the cache."""


class KVCache:
    def __init__(self, num_layers: int, max_batch: int, num_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (max_batch, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.max_len = max_len
        self.max_batch = max_batch

    @classmethod
    def for_model(cls, cfg, max_batch: int, max_len: int, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu") -> "KVCache":
        return cls(cfg.num_layers, max_batch, cfg.num_kv_heads, max_len, cfg.head_dim, dtype, device)

    # -- writes and reads used by attention ---------------------------------------------------
    def write(self, layer: int, rows: torch.Tensor, slots: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v [B, H, T, D]`` at ``slots [B, T]`` of ``rows [B]``."""
        idx_r = rows[:, None]
        self.k[layer][idx_r, :, slots] = k.transpose(1, 2)
        self.v[layer][idx_r, :, slots] = v.transpose(1, 2)

    def read(self, layer: int, rows: torch.Tensor, used: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the first ``used`` slots of ``rows``: a view when rows are contiguous."""
        r0 = int(rows[0])
        if rows.numel() == int(rows[-1]) - r0 + 1 and bool((rows[1:] - rows[:-1] == 1).all()):
            sl = slice(r0, r0 + rows.numel())
            return self.k[layer][sl, :, :used], self.v[layer][sl, :, :used]
        return self.k[layer][rows, :, :used], self.v[layer][rows, :, :used]

    def check_room(self, rows: torch.Tensor, new_tokens: int) -> None:
        need = int(self.lengths[rows].max()) + new_tokens
        if need > self.max_len:
            raise CacheFullError(f"KV cache holds {self.max_len} slots per sequence, {need} needed")

    # -- commits -----------------------------------------------------------------------------
    def advance(self, rows: torch.Tensor, counts: torch.Tensor | int) -> None:
        """Commit the first ``counts`` scratch slots of each row (plain append)."""
        self.lengths[rows] += counts

    def rollback(self, rows: torch.Tensor, lengths: torch.Tensor | int) -> None:
        self.lengths[rows] = lengths

    def compact(self, row: int, keep: torch.Tensor) -> None:
        """Commit scratch slots ``lengths[row] + keep`` (offsets, increasing) as contiguous slots.

        After the call the kept entries occupy ``old_len .. old_len + len(keep) - 1`` in the given
        order and ``lengths[row] == old_len + len(keep)``; the cache is then identical to the cache
        of having appended exactly those tokens one by one.
        """
        n = int(keep.numel())
        start = int(self.lengths[row])
        src = keep.to(self.lengths.device) + start
        if n and not bool((src == torch.arange(start, start + n, device=src.device)).all()):
            dst = slice(start, start + n)
            for kk, vv in zip(self.k, self.v):
                kk[row, :, dst] = kk[row, :, src]
                vv[row, :, dst] = vv[row, :, src]
        self.lengths[row] = start + n

    # -- copies out and in (prefix caching) ---------------------------------------------------
    def read_slots(self, row: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the K and V of slots ``start .. stop - 1`` of ``row`` in every layer:
        ``[num_layers, num_kv_heads, stop - start, head_dim]`` each, contiguous."""
        if not 0 <= start <= stop <= int(self.lengths[row]):
            raise ValueError(f"slots {start}..{stop} are not committed in row {row} "
                             f"(length {int(self.lengths[row])})")
        return (torch.stack([k[row, :, start:stop] for k in self.k]),
                torch.stack([v[row, :, start:stop] for v in self.v]))

    def write_prefix(self, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Make ``k, v [num_layers, num_kv_heads, T, head_dim]`` the first T committed slots of
        an empty ``row`` (``lengths[row]`` becomes T)."""
        t = int(k.shape[2])
        if int(self.lengths[row]) != 0:
            raise ValueError(f"row {row} is not empty (length {int(self.lengths[row])})")
        heads, dim = self.k[0].shape[1], self.k[0].shape[3]
        if tuple(k.shape) != (len(self.k), heads, t, dim) or k.shape != v.shape:
            raise ValueError(f"K/V of shape {tuple(k.shape)} / {tuple(v.shape)} do not fit this cache "
                             f"({len(self.k)} layers, {heads} KV heads, head dim {dim})")
        if t > self.max_len:
            raise CacheFullError(f"KV cache holds {self.max_len} slots per sequence, {t} needed")
        for layer in range(len(self.k)):
            self.k[layer][row, :, :t] = k[layer]
            self.v[layer][row, :, :t] = v[layer]
        self.lengths[row] = t

    def reset(self, rows: torch.Tensor | int | None = None) -> None:
        if rows is None:
            self.lengths.zero_()
        else:
            self.lengths[rows] = 0
