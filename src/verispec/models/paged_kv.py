"""Paged KV cache: K/V in fixed-size blocks of one shared pool, a block table per sequence row.

The same contract as ``KVCache`` (slots, lengths, commits, host mirror, bucketed ``kv_len``), with
memory that grows with the tokens in use instead of ``max_batch x max_len``:

- The pool: ``k[layer]`` and ``v[layer]`` are ``[num_blocks + 1, num_kv_heads, block_size, head_dim]``:
  a block's keys of one head lie together (attention streams them as it streams a static row).
  Slot ``j`` of row ``r`` is slot ``j % block_size`` of block ``table[r, j // block_size]``; a
  *physical slot* numbers them ``block * block_size + j % block_size``.
- ``table [max_batch, blocks_per_row]`` (long, on the cache device: a GPU forward reads it in the
  graph) and a host copy of each row's block list. Entries past a row's blocks point at block 0,
  the null block: never handed out; a write of a row with holes (a ghost row) may land there, and
  what lies there is only read under a mask.
- ``reserve(rows, new_tokens)`` hands out the blocks a forward of ``new_tokens`` on each row will
  write, all or nothing (``KVPoolFullError`` when the pool is short; nothing changes). Every eager
  forward calls it for its rows (``transformer._cache_shape``); a compiled forward's caller calls
  it for the rows it will commit (``Engine``: not for ghost rows, whose writes land in the null
  block). A shared block about to be written is copied first (copy-on-write).
- ``reset(row)`` gives the row's blocks back. Blocks are reference-counted: ``share(row, blocks)``
  starts an empty row with blocks another owner holds (the prefix cache's blocks), and ``retain``
  / ``release`` let an owner outside the rows (the prefix cache) keep blocks alive. A block goes
  back to the free list when its last reference is dropped.
- Rolling back keeps a row's blocks (the next step writes them again); ``reset`` frees them.
- Attention reads the pool through the table: the row-invariant C++ op takes the pool and table
  as they are (``attention.attend_paged``; bit-identical to the static cache's), other paths
  gather the attended slots first.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .kv_cache import CacheFullError, KVCache, Rows, _host_counts, _host_rows, _index

# Slots per block. Attention streams a block's keys of one head (block_size x head_dim floats in a
# row); at 16 slots (4 KiB for head_dim 64) the op ran 10-30% slower than over static rows, at 64
# within 5% (B=32, S=400, SmolLM2's heads; allocation contiguous or interleaved across rows).
BLOCK_SIZE = 64


class KVPoolFullError(CacheFullError):
    """The pool has fewer free blocks than a forward needs (not the per-row slot limit)."""


def blocks_for(tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-tokens // block_size)


class PagedKVCache(KVCache):
    paged = True

    def __init__(self, num_layers: int, max_batch: int, num_kv_heads: int, max_len: int, head_dim: int,
                 num_blocks: int, block_size: int = BLOCK_SIZE, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", preallocate: bool = False):
        """``num_blocks``: blocks a sequence can use, all rows together (one more, the null block,
        is allocated); ``max_len``: the most slots one row may use, as in ``KVCache``;
        ``preallocate``: commit the pool's memory now (zeros) instead of block by block."""
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        if num_blocks < 1:
            raise ValueError(f"a paged KV cache needs at least one block, got {num_blocks}")
        self.block_size, self.shift = block_size, block_size.bit_length() - 1
        self.num_blocks = num_blocks
        self.blocks_per_row = blocks_for(max_len, block_size) + 1      # + 1 spare: see KVCache
        pool = (num_blocks + 1, num_kv_heads, block_size, head_dim)
        # empty: the host's pages are committed as blocks are first used (``_zero`` clears a block
        # when it is handed out: a masked slot must never hold a NaN that 0 x NaN would spread)
        alloc = torch.zeros if preallocate else torch.empty
        self.k = [alloc(pool, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [alloc(pool, dtype=dtype, device=device) for _ in range(num_layers)]
        for t in (*self.k, *self.v):
            t[0] = 0                                                     # the null block
        with torch.inference_mode(False):
            self.lengths = torch.zeros(max_batch, dtype=torch.long, device=device)
            self.table = torch.zeros(max_batch, self.blocks_per_row, dtype=torch.long, device=device)
        self.max_len, self.max_batch = max_len, max_batch
        self._host, self._seen = [0] * max_batch, self.lengths._version
        self._blocks: list[list[int]] = [[] for _ in range(max_batch)]
        self._refs = [0] * (num_blocks + 1)
        self._free = list(range(num_blocks, 0, -1))                      # pop() hands out the lowest
        self.reclaim: Callable[[int], int] | None = None                 # frees blocks on demand (prefix cache)

    @classmethod
    def for_model(cls, cfg, max_batch: int, max_len: int, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu", *, num_blocks: int | None = None,
                  block_size: int = BLOCK_SIZE, preallocate: bool = False) -> "PagedKVCache":
        """``num_blocks`` defaults to what static rows would hold (``max_batch x max_len``)."""
        n = num_blocks if num_blocks is not None else max_batch * blocks_for(max_len, block_size)
        return cls(cfg.num_layers, max_batch, cfg.num_kv_heads, max_len, cfg.head_dim, n, block_size, dtype, device,
                   preallocate)

    @staticmethod
    def blocks_in_budget(cfg, budget_bytes: int, dtype: torch.dtype, block_size: int = BLOCK_SIZE) -> int:
        """How many blocks of K and V for every layer of ``cfg`` fit in ``budget_bytes``."""
        per_block = 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
        return budget_bytes // per_block

    # -- the pool ------------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        return 2 * len(self.k) * self.k[0][0].numel() * self.k[0].element_size()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_of(self, row: int) -> list[int]:
        return list(self._blocks[row])

    def ref_count(self, block: int) -> int:
        """References to ``block`` (rows using it, plus owners such as the prefix cache)."""
        return self._refs[block]

    def shortfall(self, rows: Rows, new_tokens: int | Sequence[int]) -> int:
        """Free blocks missing for ``reserve(rows, new_tokens)`` (0: it would succeed). Shared
        blocks that would be copied count as new."""
        host = _host_rows(rows)
        return self._missing(host, self.lengths_of(host), _host_counts(new_tokens, host))

    def _missing(self, host: list[int], lengths: list[int], counts: list[int]) -> int:
        need = sum(self._new_blocks(r, n, c) for r, n, c in zip(host, lengths, counts))
        return max(0, need - len(self._free))

    def _new_blocks(self, row: int, length: int, count: int) -> int:
        have = self._blocks[row]
        want = blocks_for(length + count, self.block_size)
        shared = sum(1 for b in have[length // self.block_size:want] if self._refs[b] > 1)
        return max(0, want - len(have)) + shared

    def reserve(self, rows: Rows, new_tokens: int | Sequence[int]) -> None:
        """Blocks for slots ``lengths[row] .. lengths[row] + new_tokens - 1`` of every row, all or
        nothing: ``CacheFullError`` past ``max_len``, ``KVPoolFullError`` when the pool is short
        (after asking ``reclaim`` for the missing blocks)."""
        host = _host_rows(rows)
        counts, lengths = _host_counts(new_tokens, host), self.lengths_of(host)
        need = max((n + c for n, c in zip(lengths, counts)), default=0)
        if need > self.max_len:
            raise CacheFullError(f"KV cache holds {self.max_len} slots per sequence, {need} needed")
        missing = self._missing(host, lengths, counts)
        if missing and self.reclaim is not None:
            self.reclaim(missing)
            missing = self._missing(host, lengths, counts)
        if missing:
            raise KVPoolFullError(f"KV pool is full: {missing} more block(s) of {self.block_size} slots needed, "
                                  f"{self.num_blocks} in all ({self.num_free_blocks} free)")
        for row, length, count in zip(host, lengths, counts):
            self._grow(row, length, count)

    def _grow(self, row: int, length: int, count: int) -> None:
        have = self._blocks[row]
        want = blocks_for(length + count, self.block_size)
        for i in range(length // self.block_size, min(want, len(have))):
            if self._refs[have[i]] > 1:                                    # copy-on-write
                fresh = self._take()
                self._copy_block(have[i], fresh)
                self._drop(have[i])
                have[i] = fresh
                self.table[row, i] = fresh
        new = [self._take() for _ in range(want - len(have))]
        if new:
            index = torch.tensor(new, dtype=torch.long).to(self.device)
            self._zero(index)
            self.table[row, len(have):want] = index
            have.extend(new)

    def _zero(self, blocks: torch.Tensor) -> None:
        for t in (*self.k, *self.v):
            t.view(t.shape[0], -1).index_fill_(0, blocks, 0)

    def _take(self) -> int:
        block = self._free.pop()
        self._refs[block] = 1
        return block

    def _drop(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)

    def _copy_block(self, src: int, dst: int) -> None:
        for t in (*self.k, *self.v):
            t[dst] = t[src]

    def retain(self, blocks: Sequence[int]) -> None:
        """One more reference to each of ``blocks`` (held by a row)."""
        for b in blocks:
            if self._refs[b] < 1:
                raise ValueError(f"block {b} is not in use")
            self._refs[b] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each of ``blocks``; a block with none left is free."""
        for b in blocks:
            if self._refs[b] < 1:
                raise ValueError(f"block {b} is not in use")
            self._drop(b)

    def share(self, row: int, blocks: Sequence[int], length: int) -> None:
        """Start the empty ``row`` with ``blocks`` (held elsewhere: one more reference each) as its
        first ``length`` committed slots."""
        if self.lengths_of(row)[0] != 0 or self._blocks[row]:
            raise ValueError(f"row {row} is not empty")
        if blocks_for(length, self.block_size) != len(blocks) or length > self.max_len:
            raise ValueError(f"{len(blocks)} blocks do not hold exactly {length} slots")
        self.retain(blocks)
        self._blocks[row] = list(blocks)
        if blocks:
            self.table[row, :len(blocks)] = torch.tensor(list(blocks), dtype=torch.long).to(self.device)
        self._set(row, [length])

    def select(self, rows: Rows | None, batch: int) -> tuple[torch.Tensor, slice | torch.Tensor]:
        """As ``KVCache.select``, but a row tensor is the index as is, never read on the host
        (a compiled graph takes any rows: reading a paged row is a gather of its table row)."""
        if isinstance(rows, torch.Tensor):
            return rows.reshape(-1), rows.reshape(-1)
        return super().select(rows, batch)

    # -- writes and reads used by attention ---------------------------------------------------
    def physical(self, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Physical slots ``[B, T]`` of ``slots [B, T]`` of ``rows [B]`` (through the table)."""
        blocks = self.table[rows[:, None], torch.div(slots, self.block_size, rounding_mode="floor")]
        return blocks * self.block_size + slots % self.block_size

    def write(self, layer: int, rows: torch.Tensor, slots: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v [B, H, T, D]`` at the physical slots ``slots [B, T]`` (``physical``)."""
        block, off = self._split(slots[:, None, :])
        heads = torch.arange(k.shape[1], device=k.device)[None, :, None]
        self.k[layer][block, heads, off] = k
        self.v[layer][block, heads, off] = v

    def _split(self, phys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.div(phys, self.block_size, rounding_mode="floor"), phys % self.block_size

    def read(self, layer: int, rows: slice | torch.Tensor, used: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies ``[B, H, used, D]`` of the first ``used`` slots of ``rows`` (a gather through the
        table; ``attention.attend_paged`` reads the pool in place where it can)."""
        return (gather_slots(self.k[layer], self.table[rows], used),
                gather_slots(self.v[layer], self.table[rows], used))

    def slot_index(self, rows: slice | torch.Tensor, used: int) -> torch.Tensor:
        """Physical slots ``[B, used]`` of slots ``0 .. used - 1`` of ``rows``."""
        nb = -(-used // self.block_size)
        offs = torch.arange(self.block_size, device=self.device)
        return (self.table[rows, :nb, None] * self.block_size + offs).flatten(1)[:, :used]

    # -- commits -------------------------------------------------------------------------------
    def compact(self, row: int, keep: torch.Tensor) -> None:
        n = int(keep.numel())
        self.compact_batch([row], keep.reshape(1, n).to(self.device), [n])

    def _move(self, index: torch.Tensor, start: torch.Tensor, keep: torch.Tensor, cnt: torch.Tensor) -> None:
        """Copy slots ``start + keep[b, j]`` to ``start + j`` (j < cnt[b]) of rows ``index``, in
        every layer, through the table: one gather and one scatter per tensor."""
        dim = self.k[0].shape[3]
        j = torch.arange(keep.shape[1], device=self.device)[None, :]
        jj = torch.where(j < cnt[:, None], j, (cnt[:, None] - 1).clamp(min=0))
        has = cnt[:, None] > 0
        dst = torch.where(has, start[:, None] + jj, 0)
        src = torch.where(has, start[:, None] + keep.gather(1, jj), 0)
        # a row that keeps nothing writes its slot 0 to itself; rows with no block there: block 0
        src, dst = self._flat(self.physical(index, src)), self._flat(self.physical(index, dst))
        for t in (*self.k, *self.v):
            flat = t.view(-1, dim)
            flat.index_copy_(0, dst, flat.index_select(0, src))

    def _flat(self, phys: torch.Tensor) -> torch.Tensor:
        """Rows of the ``[blocks * heads * block_size, D]`` view holding physical slots ``phys``
        of every head (flattened)."""
        block, off = self._split(phys[..., None])
        h = torch.arange(self.k[0].shape[1], device=self.device)
        return ((block * self.k[0].shape[1] + h) * self.block_size + off).reshape(-1)

    def read_slots(self, row: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        length = self.lengths_of(row)[0]
        if not 0 <= start <= stop <= length:
            raise ValueError(f"slots {start}..{stop} are not committed in row {row} (length {length})")
        block, off = self._split(self.slot_index(slice(row, row + 1), stop)[0, start:])
        return (torch.stack([k[block, :, off].transpose(0, 1) for k in self.k]),
                torch.stack([v[block, :, off].transpose(0, 1) for v in self.v]))

    def write_prefix(self, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        t = self._check_prefix(row, k, v)
        self.reserve(row, t)
        block, off = self._split(self.slot_index(slice(row, row + 1), t)[0])
        for layer in range(len(self.k)):
            self.k[layer][block, :, off] = k[layer].transpose(0, 1)
            self.v[layer][block, :, off] = v[layer].transpose(0, 1)
        self._set(row, [t])

    def reset(self, rows: Rows | None = None) -> None:
        host = list(range(self.max_batch)) if rows is None else _host_rows(rows)
        for r in host:
            for b in self._blocks[r]:
                self._drop(b)
            self._blocks[r] = []
        self.table[_index(host, self.device)] = 0
        super().reset(rows)

    # -- compile -------------------------------------------------------------------------------
    def mark_static_addresses(self) -> "PagedKVCache":
        super().mark_static_addresses()
        torch._dynamo.mark_static_address(self.table)
        return self

    def mark_dynamic(self) -> None:
        for t in (*self.k, *self.v):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        for t in (self.lengths, self.table):
            if t.shape[0] > 1:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(self.table, 1)


def gather_slots(pool: torch.Tensor, table: torch.Tensor, used: int) -> torch.Tensor:
    """``[B, H, used, D]`` copies of slots ``0 .. used - 1`` of the rows of ``table [B, blocks]``
    from ``pool [blocks, H, block_size, D]``."""
    size = pool.shape[2]
    blocks = -(-used // size)
    got = pool[table[:, :blocks]]                                   # [B, blocks, H, size, D]
    b, _, h, _, d = got.shape
    return got.transpose(1, 2).reshape(b, h, blocks * size, d)[:, :, :used]
