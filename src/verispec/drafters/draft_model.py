"""Independent draft model drafter: a small LM sharing the target's tokenizer.

It keeps its own static KV cache, one row per target row. Before each proposal the row is brought
in step with the context by prefix matching: the committed draft slots whose tokens still agree
with the context are kept (rolling back is setting a length) and the rest of the context is fed
in one ragged batched forward. Then it drafts
- a chain of ``k`` tokens (one cached forward per token), or
- a static tree (``tree`` choices, top-k ranks per path), level by level with tree attention.
Greedy requests get deterministic drafts (argmax / top-k, q = None). Sampled requests draw from
the draft distribution processed like the target's, siblings without replacement, and report
the exact distribution each node was drawn from as ``q``.
"""
from __future__ import annotations

import torch

from ..models.kv_cache import KVCache
from ..models.transformer import Transformer
from ..sampling import target_probs
from ..tree import DraftTree, validate_choices
from .base import DraftRequest


class DraftModelDrafter:
    hidden_layers: tuple[int, ...] = ()
    needs_last_hidden = False

    def __init__(self, model: Transformer, *, max_batch: int, max_len: int, num_speculative_tokens: int = 4,
                 tree: list | None = None):
        if num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        self.model = model
        self.k = num_speculative_tokens
        self.choices = validate_choices(tree) if tree else None
        self.max_tree_nodes = len(self.choices) if self.choices else self.k
        dtype = next(model.parameters()).dtype
        self.cache = KVCache.for_model(model.cfg, max_batch, max_len + self.max_tree_nodes + 1, dtype)
        self.cached: dict[int, list[int]] = {}

    # -- protocol --------------------------------------------------------------------------
    def start(self, row: int, prompt_ids: list[int], features) -> None:
        self.cache.reset(row)
        self.cached[row] = []

    def accept(self, row: int, committed_ids: list[int], features) -> None:
        pass   # prefix matching in propose() finds what survived

    def release(self, row: int) -> None:
        self.cache.reset(row)
        self.cached.pop(row, None)

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        if not requests:
            return []
        logits = self._catch_up(requests)              # [B, V]: next-token logits after each root
        if self.choices is not None:
            trees = [self._tree(r, lg) for r, lg in zip(requests, logits)]
        else:
            trees = self._chains(requests, logits)
        return [_truncate(t, r.max_nodes) for t, r in zip(trees, requests)]

    # -- internals -------------------------------------------------------------------------
    def _catch_up(self, requests: list[DraftRequest]) -> torch.Tensor:
        rows = torch.tensor([r.row for r in requests])
        feeds = []
        for r in requests:
            have = self.cached.setdefault(r.row, [])
            m = _common_prefix(have, r.context[:-1])
            self.cache.rollback(torch.tensor([r.row]), m)
            del have[m:]
            feeds.append(r.context[m:])
        t = max(len(f) for f in feeds)
        tokens = torch.zeros(len(feeds), t, dtype=torch.long)
        for i, f in enumerate(feeds):
            tokens[i, :len(f)] = torch.tensor(f)
        start = self.cache.lengths[rows]
        positions = start[:, None] + torch.arange(t)
        last = torch.tensor([[len(f) - 1] for f in feeds])
        out = self.model(tokens, positions, self.cache, rows=rows, logits_index=last)
        for i, (r, f) in enumerate(zip(requests, feeds)):
            self.cache.advance(torch.tensor([r.row]), len(f))
            self.cached[r.row].extend(f)
        return out.logits[:, 0]

    def _pick(self, logits: torch.Tensor, r: DraftRequest) -> tuple[int, torch.Tensor | None]:
        if r.params.greedy:
            return int(logits.argmax()), None
        q = target_probs(logits, r.params)
        return int(torch.multinomial(q, 1, generator=r.generator)), q

    def _chains(self, requests, logits) -> list[DraftTree]:
        rows = torch.tensor([r.row for r in requests])
        toks: list[list[int]] = [[] for _ in requests]
        qs: list[list[torch.Tensor]] = [[] for _ in requests]
        for step in range(self.k):
            for i, r in enumerate(requests):
                x, q = self._pick(logits[i], r)
                toks[i].append(x)
                if q is not None:
                    qs[i].append(q)
            if step == self.k - 1:
                break
            feed = torch.tensor([[t[-1]] for t in toks])
            pos = self.cache.lengths[rows][:, None].clone()
            logits = self.model(feed, pos, self.cache, rows=rows).logits[:, 0]
            self.cache.advance(rows, 1)
            for i, r in enumerate(requests):
                self.cached[r.row].append(toks[i][-1])
        return [DraftTree.chain(t, torch.stack(q) if q else None) for t, q in zip(toks, qs)]

    def _tree(self, r: DraftRequest, root_logits: torch.Tensor) -> DraftTree:
        """Static tree, one forward per level over the whole partial tree (never committed)."""
        index: dict[tuple, int] = {(): -1}
        toks, pars, qs = [], [], []
        dist: dict[tuple, tuple] = {(): self._ranked(root_logits, r)}
        row = torch.tensor([r.row])
        base = int(self.cache.lengths[r.row])
        for depth in range(1, max(len(c) for c in self.choices) + 1):
            for c in (c for c in self.choices if len(c) == depth):
                if c[:-1] not in dist or c[-1] >= len(dist[c[:-1]][0]):
                    continue
                tok, q = dist[c[:-1]][0][c[-1]], dist[c[:-1]][1][c[-1]]
                index[c] = len(toks)
                toks.append(tok)
                pars.append(index[c[:-1]])
                qs.append(q)
            parents_next = [c for c in index if len(c) == depth and any(
                len(d) == depth + 1 and d[:-1] == c for d in self.choices)]
            if not parents_next:
                break
            partial = DraftTree(torch.tensor(toks), torch.tensor(pars))
            mask = partial.ancestor_mask()[1:, 1:][None]
            pos = (base + partial.depth - 1)[None]
            out = self.model(torch.tensor([toks]), pos, self.cache, attn_mask=mask, rows=row)
            for c in parents_next:
                dist[c] = self._ranked(out.logits[0, index[c]], r)
        q = None if r.params.greedy else torch.stack(qs)
        return DraftTree(torch.tensor(toks, dtype=torch.long), torch.tensor(pars, dtype=torch.long), q)

    def _ranked(self, logits: torch.Tensor, r: DraftRequest) -> tuple[list[int], list]:
        """Candidates by rank: top-k (greedy) or draws without replacement with their q."""
        width = 1 + max(c[-1] for c in self.choices)
        if r.params.greedy:
            return torch.topk(logits, width).indices.tolist(), [None] * width
        q = target_probs(logits, r.params)
        toks, qs = [], []
        for _ in range(width):
            if float(q.sum()) <= 0:
                break
            q = q / q.sum()
            x = int(torch.multinomial(q, 1, generator=r.generator))
            toks.append(x)
            qs.append(q)
            q = q.clone()
            q[x] = 0.0
        return toks, qs


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _truncate(tree: DraftTree, max_nodes: int | None) -> DraftTree:
    if max_nodes is None or len(tree) <= max_nodes:
        return tree
    q = tree.q[:max_nodes] if tree.q is not None else None
    return DraftTree(tree.tokens[:max_nodes], tree.parents[:max_nodes], q)
