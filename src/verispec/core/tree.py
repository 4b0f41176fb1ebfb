"""``DraftTree``: the one contract between every drafter and the verifier.

A tree hangs below the *root*, the last token already chosen (its K/V not yet in the target
cache). Nodes are numbered 0..N-1 in topological order (a parent before its children); siblings
are tried by the verifier in node order. A chain is a tree with one branch; an empty tree means
plain decoding. The verifier never knows which drafter made a tree.

Shared by every drafter and the engine: ``ChoicesFiller`` fills a static EAGLE / Medusa choices
tree with ranked candidates (``tree_from_choices`` is its one-shot use), and ``pack_trees`` pads
per-row trees into one batched tree-attention forward (tokens, positions, mask).
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
        # trees are small: a walk over the host list costs less than tensor comparisons
        if n and not all(-1 <= p < i for i, p in enumerate(self.parents.tolist())):
            raise ValueError("parents must satisfy -1 <= parent[i] < i (topological order)")
        if self.q is not None and (self.q.dim() != 2 or self.q.shape[0] != n):
            raise ValueError(f"q must be [N, V] with N={n}, got {tuple(self.q.shape)}")

    # -- constructors ------------------------------------------------------------------------
    @staticmethod
    def empty(device: torch.device | str = "cpu") -> "DraftTree":
        return DraftTree(torch.zeros(0, dtype=torch.long, device=device), torch.zeros(0, dtype=torch.long, device=device))

    @staticmethod
    def chain(tokens: Sequence[int] | torch.Tensor, q: torch.Tensor | None = None) -> "DraftTree":
        toks = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        return DraftTree(toks, torch.arange(toks.numel(), dtype=torch.long, device=toks.device) - 1, q)

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
        d: list[int] = []
        for p in self.parents.tolist():
            d.append(1 if p < 0 else d[p] + 1)
        return torch.tensor(d, dtype=torch.long, device=self.parents.device)

    def children(self) -> list[list[int]]:
        """children()[p + 1] = node indices whose parent is p (index 0 = the root's children)."""
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents.tolist()):
            out[p + 1].append(i)
        return out

    def root_paths(self) -> list[list[int]]:
        """For each entry of (root, nodes...) (entry 0 = the root, node i = entry i + 1): the
        entries on its path from the root, itself last."""
        out = [[0]]
        for i, p in enumerate(self.parents.tolist()):
            out.append(out[p + 1] + [i + 1])
        return out

    def ancestor_mask(self) -> torch.Tensor:
        """[N+1, N+1] bool over (root, nodes...): entry [i, j] True if j is i or an ancestor of i."""
        paths = self.root_paths()
        m = torch.zeros(len(paths), len(paths), dtype=torch.bool, device=self.tokens.device)
        m[[i for i, path in enumerate(paths) for _ in path], [j for path in paths for j in path]] = True
        return m

    def positions(self, start: int) -> torch.Tensor:
        """[N+1] RoPE positions of (root, nodes...) when the root sits at position ``start``."""
        return start + torch.cat([torch.zeros(1, dtype=torch.long, device=self.parents.device), self.depth])

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


class ChoicesFiller:
    """A static choices tree (``validate_choices``) filled level by level with ranked candidates.

    Driven level by level (for depth 0, 1, ...: ``add_children(path, ...)`` for each path of
    ``expandable(depth)``, in that order, once its ranked candidates are known), nodes come in
    choices order, (depth, path), which is topological. A choice whose rank is beyond the
    candidates given, or whose parent was never created, is skipped; no node is created once
    ``budget`` nodes exist, so a budget keeps the first ``budget`` nodes of the unbounded tree.

    State (one entry per node, node order): ``tokens`` [N] and ``parents`` [N] (node index, -1 =
    the root), ``payload`` [N] (what the caller gave with each candidate, None where nothing),
    ``index``: choices path -> node index (``()`` -> -1)."""

    def __init__(self, choices: Sequence[Sequence[int]], budget: int | None = None):
        self.choices = validate_choices(choices)
        self.budget = budget
        self._kids: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        for c in self.choices:
            self._kids.setdefault(c[:-1], []).append(c)
        self.index: dict[tuple[int, ...], int] = {(): -1}
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.payload: list = []

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return max((len(c) for c in self.choices), default=0)

    @property
    def full(self) -> bool:
        return self.budget is not None and len(self.tokens) >= self.budget

    def expandable(self, depth: int) -> list[tuple[int, ...]]:
        """Paths of the existing nodes of ``depth`` (0: the root ``()``) that the choices give
        children, in node order: the nodes whose candidates a level needs."""
        return [p for p in self.index if len(p) == depth and p in self._kids]

    def add_children(self, path: tuple[int, ...], tokens: Sequence[int], payload: Sequence | None = None) -> None:
        """Create the children of node ``path`` that the choices name: rank r becomes token
        ``tokens[r]`` (candidates best first) with ``payload[r]`` (None: no payload)."""
        for c in self._kids.get(path, ()):
            if self.full:
                return
            if c[-1] < len(tokens):
                self.index[c] = len(self.tokens)
                self.tokens.append(int(tokens[c[-1]]))
                self.parents.append(self.index[path])
                self.payload.append(None if payload is None else payload[c[-1]])

    def tree(self, q: bool = False) -> DraftTree:
        """The nodes so far; ``q``: the payloads are the nodes' q rows ([V] tensors), stacked to
        ``q`` [N, V] (None for an empty tree)."""
        return DraftTree(torch.tensor(self.tokens, dtype=torch.long, device="cpu"),        # host-built;
                         torch.tensor(self.parents, dtype=torch.long, device="cpu"),       # callers move it
                         torch.stack(self.payload) if q and self.payload else None)


def tree_from_choices(choices: Sequence[Sequence[int]], ranked: "callable") -> DraftTree:
    """Build a tree from choices. ``ranked(parent_path) -> list[int]`` returns the candidate
    tokens below a path in rank order (rank r = ``ranked(path)[r]``); it is called once per
    node that has children in the choices, parents first."""
    filler = ChoicesFiller(choices)
    for depth in range(filler.max_depth):
        for path in filler.expandable(depth):
            filler.add_children(path, ranked(path))
    return filler.tree()


def pack_trees(trees: Sequence[DraftTree], starts: Sequence[int] | torch.Tensor,
               roots: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad B per-row trees (of any sizes) into one batch for a forward with tree attention.

    Row b holds ``roots[b]`` and then the nodes of ``trees[b]`` when ``roots`` is given (the root
    is not in the cache yet), else the nodes alone (the root already is). T = the longest row, at
    least 1. ``starts`` [B]: position of the root (with ``roots``) or of depth-1 nodes (without).
    Returns
    - tokens [B, T] int64: the row's tokens, 0 in padding;
    - positions [B, T] int64: ``starts[b] + depth`` (the root has depth 0) with ``roots``,
      ``starts[b] + depth - 1`` without; ``starts[b]`` in padding;
    - mask [B, T, T] bool: [b, i, j] True iff entry j of row b is entry i or its ancestor (the
      root is every node's ancestor); a padding entry sees only itself."""
    k = 0 if roots is not None else 1          # entries of (root, nodes...) a row leaves out
    starts = starts.tolist() if isinstance(starts, torch.Tensor) else [int(x) for x in starts]
    t = max([1] + [len(tree) + 1 - k for tree in trees])
    tokens = [[0] * t for _ in trees]
    positions = [[s] * t for s in starts]
    seen: list[int] = []                       # flat indices (b * T + i) * T + j of the True entries
    for b, tree in enumerate(trees):
        toks = ([roots[b]] if roots is not None else []) + tree.tokens.tolist()
        tokens[b][:len(toks)] = toks
        for i, path in enumerate(tree.root_paths()[k:]):
            positions[b][i] = starts[b] + len(path) - 1 - k
            seen += [(b * t + i) * t + j - k for j in path[k:]]
        seen += [(b * t + i) * t + i for i in range(len(toks), t)]
    host = "cpu"                               # built on the host: callers move what they need
    mask = torch.zeros(len(trees) * t * t, dtype=torch.bool, device=host)
    mask[torch.tensor(seen, dtype=torch.long, device=host)] = True
    return (torch.tensor(tokens, dtype=torch.long, device=host), torch.tensor(positions, dtype=torch.long, device=host),
            mask.view(len(trees), t, t))
