"""N-gram prompt-lookup drafter (deterministic: q is one-hot).

Match the last n tokens of the context (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``)
against earlier positions and propose what followed. With ``num_matches > 1`` the continuations
of several distinct earlier matches (most recent first) are merged into a tree (a trie: shared
prefixes become one branch).

``extra`` (``prompt_lookup_extra``; None = off, as vLLM): a continuation found after an n-token
match is cut to ``n + extra`` tokens (and ``num_speculative_tokens``). A short match predicts
little: on a CPU each proposed token makes the verification forward dearer, so one-token matches
propose 1-2 tokens and four-token matches up to 5. Measured on SmolLM2 (26 Spec-Bench tuning
questions, greedy outputs replayed with the measured verify cost per tree size): extra = 1 with
num_speculative_tokens = 5 gives 1.43x vs 1.38x for the fixed k = 4 (benchmarks/results/spec_core.analysis.md).
"""
from __future__ import annotations

import numpy as np
import torch

from ..core.tree import DraftTree
from .base import DraftRequest, StatelessDrafter, tree_from_lists


class NgramDrafter(StatelessDrafter):
    def __init__(self, num_speculative_tokens: int = 5, prompt_lookup_min: int = 1,
                 prompt_lookup_max: int = 4, num_matches: int = 1, extra: int | None = None,
                 device: str | torch.device = "cpu"):
        """``device``: where the proposed trees' tensors go (the engine's; matching is on the host)."""
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{prompt_lookup_min}, {prompt_lookup_max}")
        if num_speculative_tokens < 1 or num_matches < 1:
            raise ValueError("num_speculative_tokens and num_matches must be >= 1")
        if extra is not None and extra < 0:
            raise ValueError(f"extra must be >= 0 (or None), got {extra}")
        self.extra = extra
        self.k = num_speculative_tokens
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max
        self.num_matches = num_matches
        self.max_tree_nodes = num_speculative_tokens * num_matches
        self.device = torch.device(device)

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        out = []
        for r in requests:
            k = self.k if r.max_nodes is None else min(self.k, r.max_nodes)
            conts = self.continuations(r.context, k) if k > 0 else []
            out.append(_trie(conts, (r.max_nodes if r.max_nodes is not None else self.max_tree_nodes), self.device))
        return out

    def continuations(self, context: list[int], k: int) -> list[list[int]]:
        """Up to ``num_matches`` distinct continuations (length <= k, and <= n + ``extra`` after an
        n-token match), longest n-gram first."""
        ctx = np.asarray(context, dtype=np.int64)
        found: list[list[int]] = []
        for n in range(min(self.n_max, len(ctx) - 1), self.n_min - 1, -1):
            pattern = ctx[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(ctx[:-1], n)   # excludes the suffix itself
            hits = np.nonzero((windows == pattern).all(axis=1))[0]
            kn = k if self.extra is None else min(k, n + self.extra)
            for start in hits[::-1]:                                           # most recent first
                cont = ctx[start + n:start + n + kn].tolist()
                if cont and cont not in found:
                    found.append(cont)
                    if len(found) >= self.num_matches:
                        return found
            if found:
                return found
        return found


def _trie(conts: list[list[int]], max_nodes: int, device: torch.device) -> DraftTree:
    toks, pars, index = [], [], {}
    for cont in conts:
        parent = -1
        for i in range(len(cont)):
            key = tuple(cont[:i + 1])
            if key not in index:
                if len(toks) >= max_nodes:
                    break
                index[key] = len(toks)
                toks.append(cont[i])
                pars.append(parent)
            parent = index[key]
    return tree_from_lists(toks, pars, device)
