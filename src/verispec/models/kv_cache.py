"""Static KV cache: preallocated, indexed by absolute slot, one length per sequence row.

Contract
- ``k[layer]`` and ``v[layer]`` have shape ``[max_batch, num_kv_heads, max_len + 1, head_dim]``:
  ``max_len`` slots a sequence may use and one spare that nothing reads. A forward attends at most
  ``max_len`` slots, so its K/V read is never the whole slot dimension, and a compiled graph is
  never specialised on "reads every slot" (which recompiled it when a prompt filled its cache).
- ``lengths[row]`` is the number of committed slots of that row. Slots ``>= lengths[row]`` hold
  scratch data (draft-tree nodes, padding) that no later query sees unless committed.
- A forward writes its T new tokens into slots ``lengths[row] .. lengths[row] + T - 1``; it does
  not change ``lengths``. The caller commits with ``advance`` (append), ``compact`` /
  ``compact_batch`` (keep chosen scratch slots, e.g. accepted tree paths). Rolling back is
  setting a length.
- ``read_slots`` / ``write_prefix`` copy committed K/V out of a row and into a fresh row (the
  prefix cache's copy-out and copy-in): copies, never views, so later writes change neither side.
- Host mirror: every commit method also updates a Python list of the lengths, so a caller learns
  shapes (``lengths_of``, ``kv_len``, ``check_room``) with no device sync. ``lengths`` is changed
  in place only (never replaced: a captured graph reads it); a write to it from outside the
  commit methods is noticed through the tensor's version counter and the mirror is re-read once.
- Bucketed shapes: ``kv_len(rows, t)`` is an upper bound on the slots a forward of T new tokens
  attends, rounded up by ``bucket_len``, so repeated steps share one shape (one CUDA graph, one
  compiled graph); slots past a row's ``length + T`` are masked by the model.
Knows nothing about models, drafters or sampling.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

Rows = torch.Tensor | Sequence[int] | int


class CacheFullError(RuntimeError):
    """A write would go past the preallocated length of the cache."""


KV_GRANULE = 64          # slots per ``kv_len`` bucket


def bucket_len(n: int, max_len: int, granule: int = KV_GRANULE) -> int:
    """``n`` rounded up to a multiple of ``granule``, at most ``max_len`` (CacheFullError past it)."""
    if n > max_len:
        raise CacheFullError(f"KV cache holds {max_len} slots per sequence, {n} needed")
    return min(max_len, -(-n // granule) * granule)


class KVCache:
    paged = False            # ``paged_kv.PagedKVCache``: the same contract over a block pool

    def __init__(self, num_layers: int, max_batch: int, num_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (max_batch, num_kv_heads, max_len + 1, head_dim)     # + 1 spare slot: see above
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        with torch.inference_mode(False):             # a normal tensor: it has a version counter
            self.lengths = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.max_len = max_len
        self.max_batch = max_batch
        self._host = [0] * max_batch                  # mirror of ``lengths``
        self._seen = self.lengths._version            # version of ``lengths`` the mirror matches

    @classmethod
    def for_model(cls, cfg, max_batch: int, max_len: int, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu") -> "KVCache":
        return cls(cfg.num_layers, max_batch, cfg.num_kv_heads, max_len, cfg.head_dim, dtype, device)

    @property
    def device(self) -> torch.device:
        return self.lengths.device

    # -- host-side shapes --------------------------------------------------------------------
    def lengths_of(self, rows: Rows) -> list[int]:
        """Committed lengths of ``rows`` from the host mirror (no device sync)."""
        if self.lengths._version != self._seen:       # written from outside the commit methods
            self._host, self._seen = self.lengths.tolist(), self.lengths._version
        return [self._host[r] for r in _host_rows(rows)]

    def kv_len(self, rows: Rows, new_tokens: int, granule: int = KV_GRANULE) -> int:
        """Bucketed slot count for a forward of ``new_tokens`` on ``rows`` (pass it to the model's
        ``kv_len``): ``max(lengths) + new_tokens`` rounded up by ``bucket_len``."""
        return bucket_len(max(self.lengths_of(rows), default=0) + new_tokens, self.max_len, granule)

    def check_room(self, rows: Rows, new_tokens: int) -> None:
        need = max(self.lengths_of(rows), default=0) + new_tokens
        if need > self.max_len:
            raise CacheFullError(f"KV cache holds {self.max_len} slots per sequence, {need} needed")

    def select(self, rows: Rows | None, batch: int) -> tuple[torch.Tensor, slice | torch.Tensor]:
        """(index [B] long on the cache device, selector for ``read``), with no device sync: the
        selector is a slice when host rows (``None`` = 0..B-1, ints, a CPU tensor) are
        consecutive, else the index (a gather). A tensor on an accelerator is the index as is."""
        if rows is None:
            return torch.arange(batch, device=self.device), slice(0, batch)
        if isinstance(rows, torch.Tensor) and rows.device.type != "cpu":
            return rows, rows
        host = _host_rows(rows)
        first, stop = host[0], host[0] + len(host)
        if host == list(range(first, stop)):
            return torch.arange(first, stop, device=self.device), slice(first, stop)
        index = _on(host, self.device)
        return index, index

    @staticmethod
    def view_rows(rows: torch.Tensor) -> slice | torch.Tensor:
        """``rows`` as a slice when they are consecutive (checked on their values: a device sync
        for a tensor on an accelerator), so ``read`` returns views; else ``rows``."""
        r0 = int(rows[0])
        if rows.numel() == int(rows[-1]) - r0 + 1 and bool((rows[1:] - rows[:-1] == 1).all()):
            return slice(r0, r0 + rows.numel())
        return rows

    def reserve(self, rows: Rows, new_tokens: int | Sequence[int]) -> None:
        """Make room for a forward of ``new_tokens`` on ``rows``: every slot of a static row
        exists already (a paged cache hands out blocks here)."""

    def mark_dynamic(self) -> None:
        """Mark for ``torch.compile`` the dimensions that differ between engines' caches: the slot
        dimension, and the row dimension of caches of several rows."""
        for t in (*self.k, *self.v):
            torch._dynamo.mark_dynamic(t, 2)
            if t.shape[0] > 1:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        if self.lengths.shape[0] > 1:
            torch._dynamo.maybe_mark_dynamic(self.lengths, 0)

    # -- writes and reads used by attention ---------------------------------------------------
    @staticmethod
    def physical(rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Where ``write`` puts slots ``[B, T]`` of ``rows``: the slots themselves in static rows."""
        return slots

    def write(self, layer: int, rows: torch.Tensor, slots: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v [B, H, T, D]`` at ``slots [B, T]`` of ``rows [B]``."""
        idx_r = rows[:, None]
        self.k[layer][idx_r, :, slots] = k.transpose(1, 2)
        self.v[layer][idx_r, :, slots] = v.transpose(1, 2)

    def read(self, layer: int, rows: slice | torch.Tensor, used: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the first ``used`` slots of ``rows``: views for a slice, a gather for a tensor
        (``select`` and ``view_rows`` turn consecutive rows into a slice)."""
        return self.k[layer][rows, :, :used], self.v[layer][rows, :, :used]

    # -- commits -----------------------------------------------------------------------------
    def advance(self, rows: Rows, counts: torch.Tensor | Sequence[int] | int) -> None:
        """Commit the first ``counts`` scratch slots of each row (plain append). Host ``rows`` and
        ``counts`` keep this free of device syncs."""
        add = _host_counts(counts, rows)
        self._set(rows, [n + c for n, c in zip(self.lengths_of(rows), add)])

    def rollback(self, rows: Rows, lengths: torch.Tensor | Sequence[int] | int) -> None:
        self._set(rows, _host_counts(lengths, rows))

    def compact(self, row: int, keep: torch.Tensor) -> None:
        """Commit scratch slots ``lengths[row] + keep`` (offsets, increasing) as contiguous slots.

        After the call the kept entries occupy ``old_len .. old_len + len(keep) - 1`` in the given
        order and ``lengths[row] == old_len + len(keep)``; the cache is then identical to the cache
        of having appended exactly those tokens one by one.
        """
        n = int(keep.numel())
        start = self.lengths_of(row)[0]
        identity = (keep.tolist() == list(range(n))) if keep.device.type == "cpu" else False
        if n and not identity:
            src, dst = keep.to(self.device) + start, slice(start, start + n)
            for kk, vv in zip(self.k, self.v):
                kk[row, :, dst] = kk[row, :, src]
                vv[row, :, dst] = vv[row, :, src]
        self._set(row, [start + n])

    def compact_batch(self, rows: Rows, keep: torch.Tensor, counts: Sequence[int]) -> None:
        """``compact`` of many rows at once, with no device sync: row ``rows[b]`` keeps scratch
        offsets ``keep[b, :counts[b]]`` (``keep [B, K]`` long on the cache device, increasing per
        row, entries past ``counts[b]`` ignored; ``counts`` host ints; ``rows`` distinct host
        ints or a CPU tensor). One gather and one scatter per layer for K and for V (``_move``);
        the result equals ``compact`` row by row. On a CPU cache rows whose keep is the identity (a chain's
        accepted prefix) are skipped, as ``compact`` skips them."""
        host = _host_rows(rows)
        index, cnt = _index(rows, self.device), _on(list(counts), self.device)
        start = self.lengths[index]                                             # [B]
        moved = list(range(len(host)))
        if keep.device.type == "cpu":                                          # host data: free
            moved = [b for b, n in enumerate(counts) if keep[b, :n].tolist() != list(range(n))]
        if len(moved) == len(host):
            self._move(index, start, keep, cnt)
        elif moved:
            at = torch.tensor(moved, device=self.device)
            self._move(index[at], start[at], keep[at], cnt[at])
        self._commit(host, [n + c for n, c in zip(self.lengths_of(host), counts)])
        self.lengths[index] = start + cnt
        self._seen = self.lengths._version

    def _move(self, index: torch.Tensor, start: torch.Tensor, keep: torch.Tensor, cnt: torch.Tensor) -> None:
        """Copy slots ``start + keep[b, j]`` to ``start + j`` (j < cnt[b]) of rows ``index``, in
        every layer: one ``index_select`` and one ``index_copy_`` over the [rows*heads*slots, D]
        view per tensor (the K/V tensors are contiguous and never reallocated)."""
        heads, dim = self.k[0].shape[1], self.k[0].shape[3]
        j = torch.arange(keep.shape[1], device=self.device)[None, :]
        # padding repeats the row's last kept entry (same value written twice), or slot 0 of a
        # row that keeps nothing (its own value written back): every write is harmless
        jj = torch.where(j < cnt[:, None], j, (cnt[:, None] - 1).clamp(min=0))
        has = cnt[:, None] > 0
        dst = torch.where(has, start[:, None] + jj, 0)
        src = torch.where(has, start[:, None] + keep.gather(1, jj), 0)
        stride = self.k[0].shape[2]                                  # physical slots per head
        base = (index[:, None, None] * heads + torch.arange(heads, device=self.device)) * stride  # [B,1,H]
        src, dst = (base + src[:, :, None]).reshape(-1), (base + dst[:, :, None]).reshape(-1)
        for t in (*self.k, *self.v):
            flat = t.view(-1, dim)
            flat.index_copy_(0, dst, flat.index_select(0, src))

    # -- copies out and in (prefix caching) ---------------------------------------------------
    def read_slots(self, row: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the K and V of slots ``start .. stop - 1`` of ``row`` in every layer:
        ``[num_layers, num_kv_heads, stop - start, head_dim]`` each, contiguous."""
        length = self.lengths_of(row)[0]
        if not 0 <= start <= stop <= length:
            raise ValueError(f"slots {start}..{stop} are not committed in row {row} (length {length})")
        return (torch.stack([k[row, :, start:stop] for k in self.k]),
                torch.stack([v[row, :, start:stop] for v in self.v]))

    def write_prefix(self, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Make ``k, v [num_layers, num_kv_heads, T, head_dim]`` the first T committed slots of
        an empty ``row`` (``lengths[row]`` becomes T)."""
        t = self._check_prefix(row, k, v)
        if t > self.max_len:
            raise CacheFullError(f"KV cache holds {self.max_len} slots per sequence, {t} needed")
        for layer in range(len(self.k)):
            self.k[layer][row, :, :t] = k[layer]
            self.v[layer][row, :, :t] = v[layer]
        self._set(row, [t])

    def _check_prefix(self, row: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """T of ``k, v [num_layers, num_kv_heads, T, head_dim]`` for the empty ``row`` (a
        ValueError when the row is not empty or the shapes do not fit)."""
        t = int(k.shape[2])
        if self.lengths_of(row)[0] != 0:
            raise ValueError(f"row {row} is not empty (length {self.lengths_of(row)[0]})")
        heads, dim = self.k[0].shape[1], self.k[0].shape[-1]
        if tuple(k.shape) != (len(self.k), heads, t, dim) or k.shape != v.shape:
            raise ValueError(f"K/V of shape {tuple(k.shape)} / {tuple(v.shape)} do not fit this cache "
                             f"({len(self.k)} layers, {heads} KV heads, head dim {dim})")
        return t

    def reset(self, rows: Rows | None = None) -> None:
        if rows is None:
            self.lengths.zero_()
            self._host, self._seen = [0] * self.max_batch, self.lengths._version
        else:
            self._set(rows, [0] * len(_host_rows(rows)))

    # -- the mirror --------------------------------------------------------------------------
    def mark_static_addresses(self) -> "KVCache":
        """Tell ``torch.compile`` the K/V and length tensors keep their addresses (CUDA-graph
        trees then capture forwards that write them instead of skipping them)."""
        for t in (*self.k, *self.v, self.lengths):
            torch._dynamo.mark_static_address(t)
        return self

    def _set(self, rows: Rows, values: list[int]) -> None:
        """Set ``lengths[rows] = values`` on the device (in place) and in the mirror."""
        host = _host_rows(rows)
        self.lengths_of(host)                         # pick up any outside write first
        self._commit(host, values)
        self.lengths[_index(rows, self.device)] = _on(values, self.device)
        self._seen = self.lengths._version

    def _commit(self, host: list[int], values: list[int]) -> None:
        for r, n in zip(host, values):
            self._host[r] = int(n)


def _host_rows(rows: Rows) -> list[int]:
    """Row numbers as a host list (``tolist`` syncs only for a tensor on an accelerator)."""
    if isinstance(rows, int):
        return [rows]
    if isinstance(rows, torch.Tensor):
        return [int(rows)] if rows.dim() == 0 else rows.tolist()
    return list(rows)


def _host_counts(counts: torch.Tensor | Sequence[int] | int, rows: Rows) -> list[int]:
    n = len(_host_rows(rows))
    if isinstance(counts, int):
        return [counts] * n
    if isinstance(counts, torch.Tensor):
        return [int(counts)] * n if counts.dim() == 0 else counts.tolist()
    return list(counts)


def _index(rows: Rows, device: torch.device) -> torch.Tensor:
    """Rows as a 1-d long index tensor on ``device``."""
    if isinstance(rows, torch.Tensor):
        return rows.reshape(-1).to(device, non_blocking=True)
    return _on(_host_rows(rows), device)


def _on(values: list[int], device: torch.device) -> torch.Tensor:
    """Host ints as a long tensor on ``device`` (an asynchronous copy: no device sync)."""
    t = torch.tensor(values, dtype=torch.long, device="cpu")       # staged on the host
    return t if device.type == "cpu" else t.to(device, non_blocking=True)
