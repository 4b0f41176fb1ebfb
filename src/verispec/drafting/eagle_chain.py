"""EAGLE chain drafting with static shapes: the catch-up and each level as one call of a small
program, compiled beside a compiled target, with no host sync inside a draft step.

A chain (one child per node, ``StaticTreeConfig.chain``) is what a CPU verify affords best, and
the general tree path (``eagle.EagleDrafter._grow``) pays for its generality on every level: ranked
candidates copied to the host, Python tree builders, masks packed on the host. A chain needs none
of it. Each level is one head forward over the new pairs whose K/V go to slot == RoPE position;
query position p attends key slots <= p. That mask is exact for a chain: slots below the
committed length hold committed pairs, and slots from there up to p were written by this very
draft step (the catch-up's pairs, then one slot per level), so stale scratch from an earlier
step is never read.

Contract of ``ChainProgram``:
- ``catch_up(tokens [B,P], parts, lengths [B], counts [B], rows [B], kv_len)``:
  ``counts[i] <= P`` pending pairs of row i (target features, the head's ``feature_parts`` [B,P,d]
  each, which the program fuses, with the next context tokens)
  at slots ``lengths[i]..``; columns past ``counts[i]`` are padding (their K/V land in scratch
  slots that later levels overwrite or never read). Returns the state at the root pair [B,1,h]
  and depth-1's draft token (target id) [B,1].
- ``level(token [B,1], state [B,1,h], positions [B,1], rows [B], kv_len)``: one more level.
- ``first_rows``: the rows are 0..B-1 (as a batch-1 engine's row 0 is), so attention reads the
  cache through views; otherwise through the row index, which copies the attended K/V.
- ``kv_len``: a host int >= every slot the call attends plus one (a bucket: ``bucket_len``); only
  the first ``kv_len`` slots are read. The committed lengths move on the host (``KVCache.advance``)
  by the caller, after the catch-up.
- Greedy child = the head's argmax over its draft vocabulary, as the tree path's top-1 child:
  the same tokens, so a chain from here and from ``_grow`` verify the same way (lossless for
  greedy and sampled requests alike: the tree is deterministic, q is one-hot).
- Compiled (``compile=True``): one graph for one-token levels and one for the catch-up at any
  P > 1 (P, the batch and ``kv_len`` are marked dynamic), per head: each head gets its own copy
  of the code object, so a graph never serves another head (guards on the head's modules are
  dropped, as in ``models.compiled``).
"""
from __future__ import annotations

import types

import torch

from ..models.kv_cache import KVCache


def _catch_up(head, tokens, positions, parts, key, pick, cache, rows, first_rows: bool):
    """Commit P pairs (the head fuses their target features ``parts`` here); state and argmax
    token at column ``pick`` [B,1]."""
    hidden = head.fuse_parts(parts)
    mask = (key[None, None, :] <= positions[:, :, None])[:, None]
    cos, sin = head._rope(positions, hidden.dtype)
    state, out = head.layer(tokens, hidden, cos, sin, mask, cache, rows, positions, key.shape[0],
                            select=_reads(rows, tokens, first_rows))
    idx = pick[:, None, None].expand(-1, 1, state.shape[-1])
    state, out = torch.gather(state, 1, idx), torch.gather(out, 1, idx)
    return state, head.draft_to_target(head.logits_of(out).argmax(-1))


def _level(head, token, positions, state, key, cache, rows, first_rows: bool):
    """One chain level: the pair (parent state, token) at ``positions`` [B,1]."""
    mask = (key[None, None, :] <= positions[:, :, None])[:, None]
    cos, sin = head._rope(positions, state.dtype)
    state, out = head.layer(token, state, cos, sin, mask, cache, rows, positions, key.shape[0],
                            select=_reads(rows, token, first_rows))
    return state, head.draft_to_target(head.logits_of(out).argmax(-1))


def _reads(rows: torch.Tensor, tokens: torch.Tensor, first_rows: bool):
    """What the attention reads the cache through: rows 0..B-1 as a slice (views of the cache), or
    the row index (a gather that copies every attended slot's K/V: 400 KB a call at 256 slots)."""
    return slice(0, tokens.shape[0]) if first_rows else rows


def _own_copy(fn):
    """``fn`` over a fresh code object (dynamo keeps graphs per code object)."""
    fresh = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    fresh.__kwdefaults__ = fn.__kwdefaults__
    return fresh


class ChainProgram:
    """The chain draft step of one head (see the module docstring)."""

    def __init__(self, head, compile: bool = False):
        self.head = head
        self.compiled = compile
        self._catch, self._lvl = _catch_up, _level
        if compile:
            from ..models.compiled import _load_ops, compile_options
            _load_ops()
            options = compile_options(head.embed_tokens.device)
            self._catch = torch.compile(_own_copy(_catch_up), dynamic=None, options=options)
            self._lvl = torch.compile(_own_copy(_level), dynamic=None, options=options)
        self._marked: set[int] = set()
        self.gather_warmed = False            # the graphs for rows other than 0..B-1 compiled (``eagle.warm_chain``)

    def _key(self, kv_len: int, device) -> torch.Tensor:
        key = torch.arange(kv_len, device=device)
        if self.compiled:
            torch._dynamo.mark_dynamic(key, 0)
        return key

    def _mark(self, cache: KVCache) -> None:
        """Each drafter sizes its own cache: its slot dimension is dynamic, so a new engine's
        cache reuses the graphs."""
        if self.compiled and id(cache) not in self._marked:
            for t in (*cache.k, *cache.v):
                torch._dynamo.mark_dynamic(t, 2)
            self._marked.add(id(cache))

    def catch_up(self, cache: KVCache, rows: torch.Tensor, tokens: torch.Tensor, parts: tuple[torch.Tensor, ...],
                 lengths: torch.Tensor, counts: torch.Tensor, kv_len: int, first_rows: bool = False):
        b, p = tokens.shape
        positions = lengths[:, None] + torch.arange(p, device=tokens.device)
        if self.compiled and p > 1:
            for t in (tokens, positions, *parts):
                torch._dynamo.maybe_mark_dynamic(t, 1)
        self._mark(cache)
        return self._catch(self.head, tokens, positions, parts, self._key(kv_len, tokens.device), counts - 1,
                           cache, rows, first_rows)

    def level(self, cache: KVCache, rows: torch.Tensor, token: torch.Tensor, state: torch.Tensor,
              positions: torch.Tensor, kv_len: int, first_rows: bool = False):
        self._mark(cache)
        return self._lvl(self.head, token, positions, state, self._key(kv_len, token.device), cache, rows,
                         first_rows)


def chain_program(head, compile: bool) -> ChainProgram:
    """The head's one ``ChainProgram`` of each kind, shared by every drafter over it (so its graphs
    are compiled once per process)."""
    key = "_chain_program_compiled" if compile else "_chain_program"
    if key not in head.__dict__:
        head.__dict__[key] = ChainProgram(head, compile)
    return head.__dict__[key]
