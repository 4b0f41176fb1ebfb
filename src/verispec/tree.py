"""``DraftTree``: the one contract between every drafter and the verifier.

A tree hangs below the *root*, the last token already chosen (its K/V not yet in the target
cache). Nodes are numbered 0..N-1 in topological order (a parent before its children); siblings
are tried by the verifier in node order. A chain is a tree with one branch; an empty tree means
plain decoding. The verifier never knows which drafter made a tree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor            # [N] int64, the draft token of each node
    parents: torch.Tensor           # [N] int64, parent node index, -1 = the root
    q: torch.Tensor | None = None   # [N, V] float32: distribution node i was drawn from
                                    # (given its earlier siblings); None = deterministic (one-hot)

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        if self.tokens.dim() != 1 or self.parents.shape != (n,):
            raise ValueError(f"tokens {tuple(self.tokens.shape)} and parents {tuple(self.parents.shape)} "
                             "must both be 1-D of the same length")
        if n and not bool((self.parents < torch.arange(n)).all() and (self.parents >= -1).all()):
            raise ValueError("parents must satisfy -1 <= parent[i] < i (topological order)")
        if self.q is not None and (self.q.dim() != 2 or self.q.shape[0] != n):
            raise ValueError(f"q must be [N, V] with N={n}, got {tuple(self.q.shape)}")

    # -- constructors ------------------------------------------------------------------------
    @staticmethod
    def empty() -> "DraftTree":
        return DraftTree(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))

    @staticmethod
    def chain(tokens: Sequence[int] | torch.Tensor, q: torch.Tensor | None = None) -> "DraftTree":
        toks = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        return DraftTree(toks, torch.arange(toks.numel(), dtype=torch.long) - 1, q)

    def prefix(self, max_nodes: int | None) -> "DraftTree":
        """The first ``max_nodes`` nodes (None: all). Nodes are in topological order, so a prefix
        is a connected tree, and since a node's ``q`` depends only on earlier nodes the cut tree
        is verified as losslessly as the whole one."""
        if max_nodes is None or len(self) <= max_nodes:
            return self
        n = max(0, max_nodes)
        return DraftTree(self.tokens[:n], self.parents[:n], self.q[:n] if self.q is not None else None)

    # -- structure ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def depth(self) -> torch.Tensor:
        """[N] depth of each node (children of the root have depth 1)."""
        d = torch.zeros(len(self), dtype=torch.long)
        par = self.parents.tolist()
        for i, p in enumerate(par):
            d[i] = 1 if p < 0 else d[p] + 1
        return d

    def children(self) -> list[list[int]]:
        """children()[p + 1] = node indices whose parent is p (index 0 = the root's children)."""
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents.tolist()):
            out[p + 1].append(i)
        return out

    def ancestor_mask(self) -> torch.Tensor:
        """[N+1, N+1] bool over (root, nodes...): entry [i, j] True if j is i or an ancestor of i."""
        n = len(self)
        m = torch.eye(n + 1, dtype=torch.bool)
        m[:, 0] = True
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:
                m[i + 1] |= m[p + 1]
        return m

    def positions(self, start: int) -> torch.Tensor:
        """[N+1] RoPE positions of (root, nodes...) when the root sits at position ``start``."""
        return start + torch.cat([torch.zeros(1, dtype=torch.long), self.depth])

    def paths(self) -> list[list[int]]:
        """Root-to-leaf node paths (root excluded)."""
        kids = self.children()
        leaves = [i for i in range(len(self)) if not kids[i + 1]]
        par = self.parents.tolist()
        out = []
        for leaf in leaves:
            path, i = [], leaf
            while i >= 0:
                path.append(i)
                i = par[i]
            out.append(path[::-1])
        return out


def validate_choices(choices: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """Normalise a static tree in the EAGLE-1 / Medusa "choices" format (top-k index paths).

    Each entry is a path of top-k ranks from the root, e.g. ``[(0,), (1,), (0, 0)]``. Every
    prefix of an entry must itself be an entry. Returned sorted by (depth, path)."""
    norm = []
    for c in choices:
        if not isinstance(c, (list, tuple)) or not c or not all(isinstance(x, int) and x >= 0 for x in c):
            raise ValueError(f"tree choice {c!r} must be a non-empty list of non-negative ints")
        norm.append(tuple(c))
    if len(set(norm)) != len(norm):
        raise ValueError("tree choices contain duplicates")
    s = set(norm)
    for c in norm:
        if len(c) > 1 and c[:-1] not in s:
            raise ValueError(f"tree choice {list(c)} lacks its parent {list(c[:-1])}")
    return sorted(norm, key=lambda c: (len(c), c))


def tree_from_choices(choices: Sequence[Sequence[int]], ranked: "callable") -> DraftTree:
    """Build a tree from validated choices. ``ranked(parent_path) -> list[int]`` returns the
    candidate tokens below a path in rank order (rank r = ``ranked(path)[r]``)."""
    choices = validate_choices(choices)
    index = {(): -1}
    toks, pars = [], []
    for c in choices:
        if c[:-1] not in index:
            continue
        cands = ranked(c[:-1])
        if c[-1] >= len(cands):
            continue
        index[c] = len(toks)
        toks.append(int(cands[c[-1]]))
        pars.append(index[c[:-1]])
    return DraftTree(torch.tensor(toks, dtype=torch.long), torch.tensor(pars, dtype=torch.long))
