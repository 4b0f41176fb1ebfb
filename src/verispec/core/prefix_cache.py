"""Prefix caching: the K/V of whole token blocks, kept across requests and copied into new rows.

A prompt that starts with tokens decoded before (a shared system prompt, the history of a
multi-turn chat) gets the K/V of those tokens copied into its cache row instead of recomputed;
only the rest of the prompt is prefilled. Output is unchanged: the copied K/V are those the
target computed for the same tokens at the same positions.

Contract
- Tokens are cut into blocks of ``block_size`` (only whole blocks are stored). A block's key is a
  chain hash, sha256(parent block's key + the block's token ids), the first block's parent being
  a fixed salt: a key names the whole prefix up to the block's end. The block's tokens are
  compared too, so a lookup never matches other tokens.
- ``lookup(prompt)`` returns the longest run of cached blocks from the start of the prompt, at
  most ``len(prompt) - 1`` tokens (the last prompt token is always prefilled: its logits choose
  the first output token), with their K/V concatenated and, when stored, their features.
  Stats as vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``: ``queries`` counts the prompt
  tokens looked up, ``hits`` those served from the cache.
- ``insert(tokens, cache, row, features)`` stores each whole block of ``tokens`` not cached yet,
  copying its K/V out of ``row`` of a ``KVCache`` (slot i holds token i) and slicing ``features``
  (``TargetFeatures`` at positions 0.., when the drafter uses target features). Blocks are copies:
  nothing written later to the engine's cache changes them, nothing refers to their memory.
- Memory: ``budget_bytes`` bounds the bytes of the stored tensors (K and V of every layer plus
  features), counted exactly (numel x element size). Over budget the least recently used *leaf*
  (a block no cached block continues) goes first: a block is never evicted before its children,
  so every cached block's parent is cached and every block stays reachable from the start. A
  block that does not fit even in an empty cache is not stored.
- One cache serves one target model (and one feature set): the first engine ``bind``\\ s its
  ``CacheLayout``; an engine with another layout is refused with a ValueError.
- Thread-safe: one lock around the index (``LLM.generate`` calls on threads share the cache).
- Device: blocks are copied out of the engine's cache, so they live on its device (GPU memory on
  CUDA, counted in ``budget_bytes`` all the same); a hit is copied into a row on that device.
- Exact reuse (``exact=True``, the server's default): a hit's rest is prefilled from the hit on,
  so its sums run in another order than a cold prefill's, and a near-tie token can flip (on
  Spec-Bench answers of SmolLM2 int4, 11 of 99 did). With ``exact`` the engine cuts hits to
  whole chunks of its prefill grid (``Engine.prefill_chunk``) and stores only the blocks a
  prefill computed (a prompt's, not an answer's decoded tokens): the rest of a prompt is then
  prefilled in the very chunks a cold prefill runs, over bit-identical K/V, and every answer is
  bit-identical to the cache-off server's. It reuses long shared prefixes (system prompts,
  documents, few-shot examples of 512 tokens and more), not a chat's earlier answers.
- Shared blocks (an engine on a ``PagedKVCache``, the server's): ``attach(pool)`` makes the cache
  keep references to the pool's blocks instead of copies. ``insert`` takes one more reference to
  each new block of the row; ``lookup`` returns the block ids (``PrefixHit.blocks``), which the
  engine puts at the start of the new row's block table (``PagedKVCache.share``): no copy, and a
  block a row would write is copied first (copy-on-write). K/V then live in the pool, within its
  budget: when the pool runs short it calls ``reclaim``, which drops the least recently used
  leaves that no row uses. ``budget_bytes`` bounds the features alone. Attaching to another pool
  (a rebuilt engine) forgets every block.

Store vs rebuild (measured, ``benchmarks/results/prefix_cache.md``): drafter state that depends on
the prefix is not stored, only the target's features. Drafters are rebuilt by their own
``start(row, prompt_ids, features)`` with the full prompt's features; the rebuild cost shows up
in ``start`` and the first ``propose`` (which catches up over the prompt). Measured on
SmolLM2-135M fp32, a 737-token chat prompt, 2 shared cores (load average ~7): the target prefill
takes 3.4-4.0 s on a miss and 0.15 s on a hit (736 tokens cached; copying them in 27-32 ms,
copying a prompt's blocks out 31-35 ms). Rebuild after a hit, start + (first propose - steady
propose): ngram 0 ms; EAGLE-1 head 0.1 + (540 - 406) ms; EAGLE-3 head 23 + (305 - 154) ms;
self-draft model (8 layers) 0.0 + (1079 - 161) ms. So storing drafter state would save at most
~0.17 s for the EAGLE heads (about 5% of the prefill saved) and ~0.9 s for the self-draft model, which
re-runs 8 of the target's 30 layers over the prompt: the case where storing its K/V would pay.
"""
from __future__ import annotations

import array
import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch

from .features import TargetFeatures, join_features  # noqa: F401  (re-exported)
from ..models.kv_cache import KVCache

_SALT = hashlib.sha256(b"verispec prefix cache v1").digest()
MIB = 1 << 20


@dataclass(frozen=True)
class CacheLayout:
    """What a block holds: K/V shape and dtype of the target, and which target features."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    hidden_layers: tuple[int, ...] = ()     # target layers whose outputs are stored (EAGLE-3)
    last_hidden: bool = False               # the final-normed state is stored (EAGLE-1, Medusa)

    @property
    def needs_features(self) -> bool:
        return bool(self.hidden_layers) or self.last_hidden


@dataclass
class PrefixCacheStats:
    """Cumulative counters of one cache (``PrefixCache.stats()`` returns a snapshot)."""
    queries: int = 0            # prompt tokens looked up
    hits: int = 0               # of those, tokens served from the cache (their prefill skipped)
    inserted_blocks: int = 0
    evicted_blocks: int = 0
    num_blocks: int = 0         # blocks held now
    bytes_used: int = 0         # bytes of K/V and features held now (K/V in a pool's blocks included)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(frozen=True)
class PrefixHit:
    """A lookup's result: the first ``num_tokens`` prompt tokens are cached (0: a miss)."""
    num_tokens: int
    k: torch.Tensor | None = None              # [num_layers, num_kv_heads, num_tokens, head_dim]
    v: torch.Tensor | None = None
    features: TargetFeatures | None = None     # at positions 0 .. num_tokens - 1, when stored
    blocks: tuple[int, ...] = ()               # attached to a pool: its block ids (no k, v)


@dataclass(eq=False)
class _Block:
    key: bytes
    parent: bytes | None
    tokens: tuple[int, ...]
    k: torch.Tensor | None                     # [num_layers, num_kv_heads, block_size, head_dim]
    v: torch.Tensor | None
    features: TargetFeatures | None
    nbytes: int                                # bytes counted against ``budget_bytes``
    children: int = 0
    block: int | None = None                   # attached to a pool: the block held (k, v None)


def block_keys(tokens: list[int], block_size: int) -> list[bytes]:
    """Chain hashes of the whole blocks of ``tokens``: key i names tokens[: (i + 1) * block_size]."""
    keys, h = [], _SALT
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hashlib.sha256(h + array.array("q", tokens[start:start + block_size]).tobytes()).digest()
        keys.append(h)
    return keys


def slice_features(f: TargetFeatures | None, start: int, stop: int) -> TargetFeatures | None:
    """Contiguous copies of ``f`` at positions ``start .. stop - 1``."""
    if f is None:
        return None
    return TargetFeatures({i: h[start:stop].clone() for i, h in f.hidden.items()},
                          None if f.last_hidden is None else f.last_hidden[start:stop].clone())


def features_to(f: TargetFeatures | None, device: torch.device) -> TargetFeatures | None:
    """``f`` with every tensor on ``device`` (the same object when it is there already)."""
    tensors = [] if f is None else [*f.hidden.values(), f.last_hidden]
    if all(t is None or t.device == device for t in tensors):
        return f
    return TargetFeatures({i: h.to(device) for i, h in f.hidden.items()},
                          None if f.last_hidden is None else f.last_hidden.to(device))


def num_positions(f: TargetFeatures) -> int:
    return int(f.last_hidden.shape[0]) if f.last_hidden is not None else int(next(iter(f.hidden.values())).shape[0])


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class PrefixCache:
    def __init__(self, budget_bytes: int, block_size: int = 16, exact: bool = False):
        """``budget_bytes``: the most bytes of K/V and features held (> 0); ``block_size``: tokens
        per block (>= 1; smaller blocks match more of a prompt, cost more hashing and copies).
        ``exact``: answers bit-identical to a cold prefill's (see "Exact reuse" above)."""
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ValueError(f"prefix cache budget must be a positive number of bytes, got {budget_bytes!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"prefix cache block size must be an int >= 1, got {block_size!r}")
        self.budget_bytes = budget_bytes
        self.block_size = block_size
        self.exact = exact
        self.layout: CacheLayout | None = None
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()     # least recently used first
        self._stats = PrefixCacheStats()
        self._lock = threading.Lock()
        self._pool = None                                             # PagedKVCache when attached
        self._budgeted = 0                                            # bytes counted against the budget

    @classmethod
    def from_mib(cls, mib: float, block_size: int = 16, exact: bool = False) -> "PrefixCache":
        """A cache of ``mib`` MiB (2**20 bytes)."""
        if not isinstance(mib, (int, float)) or isinstance(mib, bool) or not mib > 0 or mib == float("inf"):
            raise ValueError(f"prefix cache size must be a positive number of MiB, got {mib!r}")
        return cls(max(1, int(mib * MIB)), block_size, exact)

    def bind(self, layout: CacheLayout) -> None:
        """Fix the layout of the blocks (first call); a different layout later is a ValueError."""
        with self._lock:
            if self.layout is None:
                self.layout = layout
            elif self.layout != layout:
                raise ValueError(f"this prefix cache holds blocks of {self.layout}; an engine with {layout} "
                                 "cannot share it (one cache serves one target model and drafter feature set)")

    def attach(self, pool) -> None:
        """Keep references to ``pool``'s blocks (a ``PagedKVCache`` of the bound layout) instead
        of copies; its ``reclaim`` then frees the blocks only this cache holds. Attaching to
        another pool forgets every block (without touching the old pool)."""
        with self._lock:
            if pool is self._pool:
                return
            if pool.block_size != self.block_size:
                raise ValueError(f"prefix cache blocks of {self.block_size} tokens cannot share a KV pool of "
                                 f"{pool.block_size}-slot blocks")
            if self._pool is not None or self._blocks:
                self._forget()
            self._pool = pool
            pool.reclaim = self.reclaim

    @property
    def attached(self) -> bool:
        return self._pool is not None

    def reclaim(self, blocks: int) -> int:
        """Drop least recently used leaves whose pool block no row uses until ``blocks`` pool
        blocks are free again (or none is left to drop). Returns the blocks freed."""
        freed = 0
        with self._lock:
            while freed < blocks:
                victim = next((b for b in self._blocks.values()
                               if b.children == 0 and self._pool.ref_count(b.block) == 1), None)
                if victim is None:
                    break
                self._evict(victim)
                freed += 1
        return freed

    def _forget(self) -> None:
        self._stats.evicted_blocks += len(self._blocks)
        self._blocks.clear()
        self._stats.num_blocks = self._stats.bytes_used = 0
        self._budgeted = 0

    @property
    def bytes_used(self) -> int:
        return self._stats.bytes_used

    def __len__(self) -> int:
        return len(self._blocks)

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            return replace(self._stats)

    def clear(self) -> None:
        """Drop every block (the counters of queries and hits stay)."""
        with self._lock:
            if self._pool is not None:
                self._pool.release([b.block for b in self._blocks.values()])
            self._forget()

    # ------------------------------------------------------------------ lookup
    def lookup(self, prompt: list[int], granule: int | None = None) -> PrefixHit:
        """The cached whole blocks at the start of ``prompt`` (at most len - 1 tokens), cut to a
        multiple of ``granule`` tokens when given (a multiple of the block size)."""
        bs = self.block_size
        if granule is not None and (granule < bs or granule % bs):
            raise ValueError(f"a hit granule of {granule} tokens is not a multiple of the {bs}-token blocks")
        usable = (len(prompt) - 1) // bs * bs if prompt else 0
        with self._lock:
            found = []
            for i, key in enumerate(block_keys(prompt[:usable], bs)):
                block = self._blocks.get(key)
                if block is None or block.tokens != tuple(prompt[i * bs:(i + 1) * bs]):
                    break
                found.append(block)
            if granule is not None:
                found = found[:len(found) * bs // granule * granule // bs]
            for block in found:                  # root first: a parent is never more recent than its child
                self._blocks.move_to_end(block.key)
            self._stats.queries += len(prompt)
            self._stats.hits += len(found) * bs
        if not found:
            return PrefixHit(0)
        if self._pool is not None:
            return PrefixHit(len(found) * bs, features=join_features([b.features for b in found]),
                             blocks=tuple(b.block for b in found))
        return PrefixHit(len(found) * bs, torch.cat([b.k for b in found], dim=2),
                         torch.cat([b.v for b in found], dim=2), join_features([b.features for b in found]))

    # ------------------------------------------------------------------ insertion and eviction
    def insert(self, tokens: list[int], cache: KVCache, row: int,
               features: TargetFeatures | None = None) -> int:
        """Store the whole blocks of ``tokens`` not cached yet, their K/V copied from slots of
        ``row`` (slot i = token i) and features sliced from ``features`` (positions 0..). Returns
        the number of blocks stored (fewer when the budget runs out)."""
        bs, layout = self.block_size, self.layout
        if layout is None:
            raise RuntimeError("bind(layout) the prefix cache before inserting")
        keys = block_keys(tokens, bs)
        self._check_features(features, len(keys) * bs)
        with self._lock:
            parent, first_new = None, len(keys)
            for i, key in enumerate(keys):
                if key not in self._blocks:
                    first_new = i
                    break
                self._blocks.move_to_end(key)
                parent = key
            added = 0
            if self._pool is not None and cache is not self._pool:
                raise ValueError("this prefix cache shares the blocks of another KV pool")
            for i in range(first_new, len(keys)):
                block = None
                if self._pool is not None:                  # a reference to the row's block
                    k = v = None
                    block = cache.blocks_of(row)[i]
                else:
                    k, v = cache.read_slots(row, i * bs, (i + 1) * bs)
                feats = slice_features(features, i * bs, (i + 1) * bs) if layout.needs_features else None
                size = _nbytes(k, v, *(feats.hidden.values() if feats else ()), feats and feats.last_hidden)
                if not self._make_room(size, protect=parent):
                    break
                if block is not None:
                    cache.retain([block])
                self._add(_Block(keys[i], parent, tuple(tokens[i * bs:(i + 1) * bs]), k, v, feats, size,
                                 block=block))
                parent, added = keys[i], added + 1
        return added

    def _check_features(self, features: TargetFeatures | None, positions: int) -> None:
        layout = self.layout
        if not layout.needs_features or positions == 0:
            return
        if features is None or set(features.hidden) != set(layout.hidden_layers) or \
                (features.last_hidden is None) == layout.last_hidden:
            raise ValueError(f"this prefix cache stores target features (layers {layout.hidden_layers}, "
                             f"last hidden {layout.last_hidden}); insert got {features!r:.120}")
        if num_positions(features) < positions:
            raise ValueError(f"features cover {num_positions(features)} positions, {positions} needed")

    def _add(self, block: _Block) -> None:
        self._blocks[block.key] = block
        if block.parent is not None:
            self._blocks[block.parent].children += 1
        self._stats.inserted_blocks += 1
        self._stats.num_blocks += 1
        self._budgeted += block.nbytes
        self._stats.bytes_used += block.nbytes + self._pool_bytes(block)

    def _make_room(self, size: int, protect: bytes | None) -> bool:
        """Evict least recently used leaves (never ``protect``) until ``size`` more bytes fit."""
        if size > self.budget_bytes:
            return False
        while self._budgeted + size > self.budget_bytes:
            victim = next((b for b in self._blocks.values() if b.children == 0 and b.key != protect), None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, victim: _Block) -> None:
        del self._blocks[victim.key]
        if victim.parent is not None:
            self._blocks[victim.parent].children -= 1
        if victim.block is not None:
            self._pool.release([victim.block])
        self._stats.evicted_blocks += 1
        self._stats.num_blocks -= 1
        self._budgeted -= victim.nbytes
        self._stats.bytes_used -= victim.nbytes + self._pool_bytes(victim)

    def _pool_bytes(self, block: _Block) -> int:
        return self._pool.bytes_per_block if block.block is not None else 0
