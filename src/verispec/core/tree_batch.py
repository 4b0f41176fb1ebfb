"""``TreeBatch``: B draft trees packed once per step, for the verify forward and for acceptance.

The structure of every tree is read on the host once (the trees are small, their tokens and
parents are a few hundred ints) and sent to the device as a handful of tensors, so that batched
acceptance (``verify``) runs as a fixed number of tensor operations with no host reads.

Layout, with T = 1 + the largest tree (entry 0 of a row is its root, entry i + 1 its node i) and
N = T - 1 node columns (padding columns are ``valid`` False):
- forward inputs (``pack_trees``): ``tokens [B, T]``, ``positions [B, T]``, ``mask [B, T, T]``;
- ``node_tokens [B, N]``: each node's draft token (0 in padding);
- ``parent_entry [B, N]``: entry index of each node's parent (0 = the root; 0 in padding);
- ``valid [B, N]``: the column holds a node of that row;
- ``earlier_sibling [B, N, N]``: [b, i, j] True iff j is a sibling of i tried before it;
- ``ancestor [B, N, N]``: [b, i, j] True iff node j is node i or one of its ancestors;
- ``has_children [B, T]``: the entry has at least one child;
- ``rank_groups``: for each sibling rank k (0 = first child), the (row, parent slot, child node)
  index triples of every rank-k child in the batch: what sequential sibling-by-sibling rejection
  needs, one group of tensor operations per rank; a parent's *slot* is its column's index in
  ``parent_cols``;
- ``parent_cols [P]``: the entries (columns) that are a parent in at least one row, ascending, and
  ``parent_slot [T]``: each column's index in ``parent_cols``, -1 for columns no row branches from
  (rejection sampling keeps residuals for these P columns only, not for all T);
- ``q [B, N, V]`` float32 or None: the draft distributions; None when every tree is deterministic;
  a deterministic tree in a batch with q gets one-hot rows (the same acceptance test and residual);
- host facts: ``sizes`` (nodes per row), ``depths`` (deepest node per row), ``max_depth``.
Knows nothing about models or drafters.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .tree import DraftTree, pack_trees


@dataclass(frozen=True)
class TreeBatch:
    tokens: torch.Tensor             # [B, T] int64: root then nodes, 0 in padding
    positions: torch.Tensor          # [B, T] int64: RoPE positions
    mask: torch.Tensor               # [B, T, T] bool: ancestor-or-self over entries
    node_tokens: torch.Tensor        # [B, N] int64
    parent_entry: torch.Tensor       # [B, N] int64
    valid: torch.Tensor              # [B, N] bool
    earlier_sibling: torch.Tensor    # [B, N, N] bool
    ancestor: torch.Tensor           # [B, N, N] bool
    has_children: torch.Tensor       # [B, T] bool
    rank_groups: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]   # per rank: rows, parent slots, children
    parent_cols: torch.Tensor        # [P] int64: entries that are a parent in some row
    parent_slot: torch.Tensor        # [T] int64: index in parent_cols, -1 if none
    q: torch.Tensor | None           # [B, N, V] float32
    sizes: tuple[int, ...]           # nodes per row (host)
    depths: tuple[int, ...]          # deepest node per row, 0 for an empty tree (host)

    @property
    def batch(self) -> int:
        return len(self.sizes)

    @property
    def num_nodes(self) -> int:
        """N: node columns (the largest tree)."""
        return int(self.node_tokens.shape[1])

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    @staticmethod
    def pack(trees: Sequence[DraftTree], starts: Sequence[int] | torch.Tensor, roots: Sequence[int],
             device: torch.device | str | None = None, vocab: int | None = None) -> "TreeBatch":
        """Pack ``trees`` (row b's root token ``roots[b]`` at position ``starts[b]``) onto
        ``device`` (default: that of the first tree). ``vocab``: q's width when no tree has q
        (unused then); trees with q must agree on it."""
        if not trees:
            raise ValueError("TreeBatch.pack needs at least one tree")
        if len(roots) != len(trees):
            raise ValueError(f"{len(trees)} trees but {len(roots)} roots")
        device = torch.device(device) if device is not None else trees[0].tokens.device
        sizes = _chain_sizes(trees)
        if sizes is not None:
            return _chains(trees, sizes, starts, roots, device)
        return _pack(trees, starts, roots, device, vocab)


def _pack(trees: Sequence[DraftTree], starts: Sequence[int] | torch.Tensor, roots: Sequence[int],
          device: torch.device, vocab: int | None) -> TreeBatch:
    """``TreeBatch.pack``'s general path (any trees)."""
    tokens, positions, mask = pack_trees(trees, starts, roots=roots)
    b, n = len(trees), tokens.shape[1] - 1           # staged on the host, then moved
    parents = [t.parents.tolist() for t in trees]
    node_tokens = tokens[:, 1:].clone()
    parent_entry = torch.zeros(b, n, dtype=torch.long, device="cpu")
    valid = torch.zeros(b, n, dtype=torch.bool, device="cpu")
    earlier = torch.zeros(b, n, n, dtype=torch.bool, device="cpu")
    has_children = torch.zeros(b, n + 1, dtype=torch.bool, device="cpu")
    groups: list[list[list[int]]] = []            # rank -> [rows, parent entries, children]
    depths = []
    for row, par in enumerate(parents):
        kids: dict[int, list[int]] = {}
        depth = [0] * len(par)
        for i, p in enumerate(par):
            kids.setdefault(p, []).append(i)
            depth[i] = 1 if p < 0 else depth[p] + 1
        depths.append(max(depth, default=0))
        valid[row, :len(par)] = True
        parent_entry[row, :len(par)] = torch.tensor(par, dtype=torch.long, device="cpu") + 1
        for p, sibs in kids.items():
            has_children[row, p + 1] = True
            for k, c in enumerate(sibs):
                earlier[row, c, sibs[:k]] = True
                while len(groups) <= k:
                    groups.append([[], [], []])
                for lst, val in zip(groups[k], (row, p + 1, c)):
                    lst.append(val)
    cols = sorted({p for g in groups for p in g[1]})
    slot = torch.full((n + 1,), -1, dtype=torch.long, device="cpu")
    slot[cols] = torch.arange(len(cols), dtype=torch.long, device="cpu")
    groups = [[g[0], slot[g[1]].tolist(), g[2]] for g in groups]
    q = _stack_q(trees, n, vocab)
    to = lambda x: x.to(device, non_blocking=True)  # noqa: E731
    return TreeBatch(
        tokens=to(tokens), positions=to(positions), mask=to(mask), node_tokens=to(node_tokens),
        parent_entry=to(parent_entry), valid=to(valid), earlier_sibling=to(earlier),
        ancestor=to(mask[:, 1:, 1:] & valid[:, :, None]), has_children=to(has_children),
        rank_groups=tuple(tuple(torch.tensor(x, dtype=torch.long, device=device) for x in g) for g in groups),
        parent_cols=torch.tensor(cols, dtype=torch.long, device=device), parent_slot=to(slot),
        q=None if q is None else q.to(device), sizes=tuple(len(p) for p in parents), depths=tuple(depths))


def _chain_sizes(trees: Sequence[DraftTree]) -> list[int] | None:
    """Each tree's size when every tree is a chain (node i's parent is node i - 1) without q, else None."""
    sizes = []
    for t in trees:
        n = len(t)
        if t.q is not None or (n and t.parents.tolist() != list(range(-1, n - 1))):
            return None
        sizes.append(n)
    return sizes


def _chains(trees: Sequence[DraftTree], sizes: list[int], starts: Sequence[int] | torch.Tensor,
            roots: Sequence[int], device: torch.device) -> TreeBatch:
    """``TreeBatch.pack`` of B chains without q (plain steps, chain drafters, n-gram and suffix
    lookups): the same fields as the general path builds (``_pack``), without its per-node walk.
    Everything but the tokens and positions follows from the sizes alone (``_chain_structure``,
    kept per sizes and device), so a step makes two tensors: a one-node chain packs in about 20 us,
    against 170 us on the general path."""
    n, offsets, fields = _chain_structure(tuple(sizes), device)
    starts = starts.tolist() if isinstance(starts, torch.Tensor) else [int(x) for x in starts]
    tokens = [[root] + (tree.tokens.tolist() if size else []) + [0] * (n - size)
              for root, tree, size in zip(roots, trees, sizes)]
    positions = [[s + o for o in row] for s, row in zip(starts, offsets)]
    tokens = torch.tensor(tokens, dtype=torch.long, device="cpu").to(device, non_blocking=True)
    return TreeBatch(
        tokens=tokens, positions=torch.tensor(positions, dtype=torch.long, device="cpu").to(device, non_blocking=True),
        node_tokens=tokens[:, 1:].clone(), q=None, sizes=tuple(sizes), depths=tuple(sizes), **fields)


_STRUCTURES: dict = {}


def _chain_structure(sizes: tuple[int, ...], device: torch.device) -> tuple[int, list, dict]:
    """(node columns N, each row's position offsets [B][T], the size-only ``TreeBatch`` fields) of a
    batch of chains (see ``_chains``), cached: every batch that uses them reads them only (no
    consumer of a ``TreeBatch`` writes to its tensors)."""
    key = (sizes, device)
    hit = _STRUCTURES.get(key)
    if hit is not None:
        return hit
    b, n = len(sizes), max(sizes)
    t = n + 1
    host = dict(dtype=torch.long, device="cpu")
    size_t = torch.tensor(sizes, **host)[:, None]
    entry = torch.arange(t, **host)
    inside = entry[None] <= size_t                                    # [B, T]: root and nodes
    mask = torch.where(inside[:, :, None], torch.ones(t, t, dtype=torch.bool, device="cpu").tril()[None],
                       torch.eye(t, dtype=torch.bool, device="cpu")[None])   # padding sees only itself
    valid = entry[None, 1:] <= size_t
    rows = [r for r, size in enumerate(sizes) for _ in range(size)]
    nodes = [i for size in sizes for i in range(size)]
    to = lambda x: x.to(device)  # noqa: E731
    on = dict(dtype=torch.long, device=device)
    fields = dict(
        mask=to(mask),
        parent_entry=to(torch.where(valid, entry[None, :-1], 0)), valid=to(valid),
        earlier_sibling=torch.zeros(b, n, n, dtype=torch.bool, device=device),
        ancestor=to(mask[:, 1:, 1:] & valid[:, :, None]), has_children=to(entry[None] < size_t),
        rank_groups=((torch.tensor(rows, **on), torch.tensor(nodes, **on), torch.tensor(nodes, **on)),) if n else (),
        parent_cols=torch.arange(n, **on), parent_slot=to(torch.where(entry < n, entry, -1)))
    hit = (n, torch.where(inside, entry[None], 0).tolist(), fields)
    if len(_STRUCTURES) >= 512:
        _STRUCTURES.clear()
    _STRUCTURES[key] = hit
    return hit


def _stack_q(trees: Sequence[DraftTree], n: int, vocab: int | None) -> torch.Tensor | None:
    """[B, N, V] float32 of the trees' q (one-hot rows for deterministic trees), or None."""
    widths = {int(t.q.shape[1]) for t in trees if t.q is not None}
    if not widths:
        return None
    if len(widths) > 1 or (vocab is not None and widths != {vocab}):
        raise ValueError(f"draft distributions of widths {sorted(widths)} in one batch (vocabulary {vocab})")
    v = widths.pop()
    dev = next(t.q.device for t in trees if t.q is not None)
    q = torch.zeros(len(trees), n, v, dtype=torch.float32, device=dev)
    for row, t in enumerate(trees):
        if not len(t):
            continue
        if t.q is not None:
            q[row, :len(t)] = t.q.float()
        else:
            q[row, torch.arange(len(t), device=dev), t.tokens.to(dev)] = 1.0
    return q
