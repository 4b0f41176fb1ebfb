"""Admission against a paged KV pool: a sequence is admitted only when the pool can hold the most
slots it may ever use, so a running sequence never finds the pool full.

Contract
- ``PagedKV(blocks, block_size, preallocate)``: a paged pool's settings. ``make_cache(cfg,
  max_batch, max_len, dtype, device, kv)``: a ``PagedKVCache`` of ``kv.blocks`` blocks, or static
  rows (``KVCache``) when ``kv`` is None. Without ``preallocate`` the host commits a block's pages
  when it is first used (memory follows the tokens in use); with it, the whole pool at once
  (``PagedKVCache``: decode steps ran 5-10% faster at 8-32 rows of 400 tokens on a pre-touched
  pool, whose pages lie together, than on pages committed block by block).
- ``KVBudget(cache, slack)``: ``worst(prompt, max_tokens, max_context)`` is the slots a sequence
  may use at most: its prompt, its output (``max_tokens``, or up to ``max_context``) and ``slack``
  (a verify step's scratch slots: the drafter's largest tree and its root). ``fits(tokens)``:
  whether the blocks of ``tokens`` more slots fit beside those committed to the admitted
  sequences; ``commit(seq_id, tokens)`` / ``release(seq_id)`` book and free them. Static rows
  always fit (their slots exist).
- Why the worst case: a request then waits in the queue instead of being preempted mid-answer
  (a recomputed prefix may round a near-tie differently and change a greedy answer). The pool's
  real use is lower, and blocks of sequences that finish early go back at once; what a prefix
  cache holds beyond the rows is freed on demand (``PagedKVCache.reclaim``), so it never blocks
  an admission.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.kv_cache import KVCache
from ..models.paged_kv import BLOCK_SIZE, KVPoolFullError, PagedKVCache, blocks_for


@dataclass(frozen=True)
class PagedKV:
    """A paged KV pool: ``blocks`` of ``block_size`` slots; ``preallocate``: commit its memory now."""
    blocks: int
    block_size: int = BLOCK_SIZE
    preallocate: bool = False


def make_cache(cfg, max_batch: int, max_len: int, dtype: torch.dtype, device: torch.device,
               kv: PagedKV | None = None) -> KVCache:
    if kv is None:
        return KVCache.for_model(cfg, max_batch, max_len, dtype, device=device)
    return PagedKVCache.for_model(cfg, max_batch, max_len, dtype, device, num_blocks=kv.blocks,
                                  block_size=kv.block_size, preallocate=kv.preallocate)


def pool_blocks(cfg, dtype: torch.dtype, kv_cache_mb: float | None, max_num_seqs: int, max_len: int,
                block_size: int = BLOCK_SIZE) -> int:
    """Blocks of a server's pool: as many as ``kv_cache_mb`` MiB of K/V hold, or (None) as many as
    ``max_num_seqs`` rows of ``max_len`` slots (host pages are committed only as blocks are
    used). A pool that cannot hold one row of ``max_len`` slots is a ValueError."""
    row = blocks_for(max_len, block_size)
    if kv_cache_mb is None:
        return max_num_seqs * row
    blocks = PagedKVCache.blocks_in_budget(cfg, int(kv_cache_mb * (1 << 20)), dtype, block_size)
    if blocks < row:
        per = PagedKVCache.blocks_in_budget(cfg, 1 << 20, dtype, block_size) or 1
        raise ValueError(f"a KV cache of {kv_cache_mb:g} MiB holds {blocks * block_size} tokens, less than one "
                         f"sequence of {max_len} (max_model_len plus draft slack); give at least "
                         f"{-(-row // per)} MiB or a smaller max_model_len")
    return blocks


class KVBudget:
    def __init__(self, cache: KVCache, slack: int):
        self.cache, self.slack = cache, slack
        self._booked: dict[int, int] = {}          # seq_id -> blocks committed

    @property
    def paged(self) -> bool:
        return self.cache.paged

    @property
    def committed_blocks(self) -> int:
        return sum(self._booked.values())

    def worst(self, prompt_tokens: int, max_tokens: int, max_context: int) -> int:
        return min(prompt_tokens + max_tokens, max_context) + self.slack

    def _blocks(self, tokens: int) -> int:
        return blocks_for(tokens, self.cache.block_size)

    def fits(self, tokens: int | None = None) -> bool:
        """Whether a sequence of at most ``tokens`` slots (default: a whole row) can be admitted."""
        if not self.paged:
            return True
        n = self._blocks(self.cache.max_len if tokens is None else tokens)
        return self.committed_blocks + n <= self.cache.num_blocks

    def commit(self, seq_id: int, tokens: int) -> None:
        if not self.paged:
            return
        if not self.fits(tokens):
            raise KVPoolFullError(f"the KV pool cannot hold another {tokens} slots: {self.committed_blocks} of "
                                  f"{self.cache.num_blocks} blocks of {self.cache.block_size} are committed; "
                                  "check can_admit() first")
        self._booked[seq_id] = self._blocks(tokens)

    def release(self, seq_id: int) -> None:
        self._booked.pop(seq_id, None)

    def holds(self, tokens: int) -> bool:
        """Whether the whole pool could ever hold a sequence of ``tokens`` slots."""
        return not self.paged or self._blocks(tokens) <= self.cache.num_blocks


__all__ = ["KVBudget", "PagedKV", "make_cache", "PagedKVCache", "KVPoolFullError"]
