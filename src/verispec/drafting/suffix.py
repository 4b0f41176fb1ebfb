"""Suffix decoding (SuffixDecoding, Oliaro et al., arXiv 2411.04975): deterministic trees (q = None)
drawn from suffix trees of what was already seen, no draft model.

**Implementation: a wrapper of arctic-inference's native suffix tree** (``arctic_inference.
suffix_decoding.SuffixDecodingCache``, the code vLLM's ``method: "suffix"`` calls), not our own.
arctic-inference 0.3.0 ships only an sdist; checked on this CPU machine (Python 3.11, no GPU, no
vLLM): it builds in about 1.5 minutes (its build requirements pull cmake, ninja, nanobind 2.9.2,
grpcio-tools and torch >= 2.10, here the local torch 2.13.0+cpu wheel: torch only gives CMake a
prefix path, the suffix tree is plain C++20 bound with nanobind, no CUDA), and at run time
``arctic_inference.suffix_decoding`` imports only numpy (which the package does not declare) and its
``_C`` module, nothing of vLLM or torch. A step costs microseconds (below), so a Python copy would
only add code to keep in step with upstream. Without the package ``method: "suffix"`` fails at
``LLM(...)`` with a ``SpecConfigError`` that says how to install it.

The trees, each over windows of at most D = ``suffix_decoding_max_tree_depth`` tokens, every node
counting the windows that pass through it (so D bounds match length + speculation depth):

- per request: its prompt and its output so far, built at ``start`` and extended by each new token
  (O(D) per token), dropped at ``release``;
- global: the outputs of every request started through one ``SuffixCache`` (running ones
  included, as arctic does); at most ``suffix_decoding_max_cached_requests`` outputs, the oldest
  evicted whole (FIFO); 0 turns it off. The builder makes one ``SuffixCache`` per
  ``speculative_config`` it builds, i.e. one per ``LLM`` and so one per server, and every engine the
  factory makes shares it: a later ``generate`` call drafts from the outputs of earlier ones.
  ``suffix_decoding_corpus`` preloads it with answers the target wrote earlier (``suffix_corpus``;
  off by default).

A proposal, in each tree: for every length L (1 <= L < min(len(context), D)) of the context's
suffix that occurs in the tree, a tree grown best-first from the matched node: a child's estimated
probability is its parent's times child count / parent count (counts include the current
occurrence, which has no continuation yet), nodes are kept while that product >=
``suffix_decoding_min_token_prob``, at most min(``num_speculative_tokens``, floor(
``suffix_decoding_max_spec_factor`` x L), the request's ``max_nodes``) of them. A draft's score is the
sum of its nodes' probabilities; the best over L (ties: the longer match), then over the two trees
(ties: the request's own) is proposed. Nodes come in order of decreasing probability (best-first),
so a parent precedes its children and siblings come most likely first, as the verifier tries them.

Cost, measured on this 2-core machine (``benchmarks/results/suffix_step_cost.md``): with a
2000-token prompt ``start`` takes 1-5 ms; a decode step (``propose`` from both trees plus ``accept`` of the committed tokens,
``DraftTree`` tensors included) takes about 15 us when nothing matches (random text) and 40-70 us
on a repetitive 2000-token context with trees of 12 nodes on average (up to 24), of which arctic's
speculate + extend is about 5 us. A decode step of SmolLM2-135M takes 50-100 ms here
(``benchmarks/results/suffix_decoding.md``: the drafter's share in the engine is 0.2 ms per step).
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Sequence

import torch

from .spec_config import SpecConfigError, SuffixConfig
from ..core.tree import DraftTree
from .base import DraftRequest, tree_from_lists

INSTALL_HINT = ("method 'suffix' needs arctic-inference (`pip install arctic-inference==0.3.0` or "
                "`pip install verispec[suffix]`: an sdist, built with cmake and a C++20 compiler; "
                "`make setup` installs it)")


def _native_cache_class():
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as e:
        raise SpecConfigError(f"{INSTALL_HINT}: {e}") from None
    return SuffixDecodingCache


@dataclass(frozen=True)
class SuffixDraft:
    """One proposal: node i is ``tokens[i]`` below node ``parents[i]`` (-1 = the root), with the
    estimated probability ``probs[i]``; ``score`` = sum of ``probs``; ``match_len`` = the length of
    the context suffix it was drawn after (0: nothing matched)."""
    tokens: list[int]
    parents: list[int]
    probs: list[float]
    score: float
    match_len: int

    def tree(self, device: str | torch.device = "cpu") -> DraftTree:
        return tree_from_lists(self.tokens, self.parents, torch.device(device))


class SuffixCache:
    """The suffix trees of one LLM / server: arctic's ``SuffixDecodingCache`` behind a lock (engines
    of several threads may share it), with request ids unique across all of them."""

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000):
        if max_tree_depth < 1 or max_cached_requests < 0:
            raise ValueError(f"need max_tree_depth >= 1 and max_cached_requests >= 0, got "
                             f"{max_tree_depth}, {max_cached_requests}")
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self._native = _native_cache_class()(max_tree_depth=max_tree_depth, max_cached_requests=max_cached_requests)
        self._lock = threading.Lock()
        self._ids = itertools.count()

    def start(self, prompt_ids: Sequence[int]) -> int:
        """A new request: its prompt's tree, and a slot for its output in the global tree (which
        may evict the oldest cached output). Returns its id."""
        with self._lock:
            rid = next(self._ids)
            self._native.start_request(rid, list(prompt_ids))
            return rid

    def preload(self, answers: Sequence[Sequence[int]]) -> int:
        """Put ``answers`` into the global tree as outputs of finished requests (a suffix corpus:
        ``suffix_corpus``); the last ``max_cached_requests`` of them are kept. Returns how many."""
        keep = list(answers)[-self.max_cached_requests:] if self.max_cached_requests else []
        with self._lock:
            for ids in keep:
                rid = next(self._ids)
                self._native.start_request(rid, [])
                self._native.add_active_response(rid, list(ids))
                self._native.stop_request(rid)
        return len(keep)

    def extend(self, rid: int, tokens: Sequence[int]) -> None:
        """Append output tokens of request ``rid`` to its own tree and to its global output."""
        with self._lock:
            self._native.add_active_response(rid, list(tokens))

    def stop(self, rid: int) -> None:
        """Request ``rid`` ended: its prompt tree is dropped, its output stays cached until evicted."""
        with self._lock:
            self._native.stop_request(rid)

    def speculate(self, rid: int, context: Sequence[int], max_nodes: int, max_spec_factor: float = 1.0,
                  min_token_prob: float = 0.1) -> SuffixDraft:
        """The best draft tree after ``context`` (its last D tokens are used) from request ``rid``'s
        tree and the global tree (see the module docstring)."""
        ctx = list(context[-self.max_tree_depth:])
        with self._lock:
            d = self._native.speculate(rid, ctx, max_spec_tokens=max_nodes, max_spec_factor=max_spec_factor,
                                       min_token_prob=min_token_prob, use_tree_spec=True)
        return SuffixDraft(list(d.token_ids), list(d.parents), list(d.probs), float(d.score), int(d.match_len))

    @property
    def cached_requests(self) -> int:
        """Outputs now in the global tree."""
        return len(self._native.cached_requests)

    @property
    def active_requests(self) -> int:
        """Requests started and not stopped."""
        return len(self._native.active_requests)


@dataclass
class _Row:
    request: int        # id in the SuffixCache
    known: int          # tokens of the sequence (prompt first) already in the trees
    committed: int      # position of the first token the next ``accept`` brings


class SuffixDrafter:
    """The ``Drafter`` of ``method: "suffix"``: one ``SuffixCache`` request per batch row. A row's
    trees learn every token of its context: ``propose`` adds what its context has beyond them (the
    new root), ``accept`` the committed tokens beyond them (so the last step's tokens are learnt too).
    Not learnt: a finished sequence's last token (a root no later step commits). Learnt although
    not emitted: accepted tokens after a stop token or string (the target's own continuation)."""
    hidden_layers: tuple[int, ...] = ()
    needs_last_hidden: bool = False

    def __init__(self, cache: SuffixCache, num_speculative_tokens: int = 24, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1, device: str | torch.device = "cpu"):
        """``device``: where the proposed trees' tensors go (the engine's; the trees are host C++)."""
        if num_speculative_tokens < 1 or max_spec_factor < 0 or not 0 <= min_token_prob <= 1:
            raise ValueError("need num_speculative_tokens >= 1, max_spec_factor >= 0 and 0 <= min_token_prob "
                             f"<= 1, got {num_speculative_tokens}, {max_spec_factor}, {min_token_prob}")
        self.cache = cache
        self.max_tree_nodes = num_speculative_tokens
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.device = torch.device(device)
        self._rows: dict[int, _Row] = {}

    def start(self, row: int, prompt_ids: list[int], features=None) -> None:
        if row in self._rows:                  # a row restarted without release: end the old request
            self.release(row)
        self._rows[row] = _Row(self.cache.start(prompt_ids), len(prompt_ids), len(prompt_ids))

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        return [self.draft(r).tree(self.device) for r in requests]

    def draft(self, r: DraftRequest) -> SuffixDraft:
        """The proposal for ``r`` with its probabilities (``propose`` returns its ``tree()``)."""
        st = self._row(r.row)
        ctx = r.context
        if len(ctx) < st.known:
            raise RuntimeError(f"row {r.row}: context of {len(ctx)} tokens is shorter than the "
                               f"{st.known} already seen (a row reused without start?)")
        if len(ctx) > st.known:
            self.cache.extend(st.request, ctx[st.known:])
            st.known = len(ctx)
        budget = self.max_tree_nodes if r.max_nodes is None else min(self.max_tree_nodes, r.max_nodes)
        if budget <= 0:
            return SuffixDraft([], [], [], 0.0, 0)
        return self.cache.speculate(st.request, ctx, budget, self.max_spec_factor, self.min_token_prob)

    def accept(self, row: int, committed_ids: list[int], features=None) -> None:
        st = self._row(row)
        new = committed_ids[max(0, st.known - st.committed):]
        if new:
            self.cache.extend(st.request, new)
        st.committed += len(committed_ids)
        st.known = max(st.known, st.committed)

    def release(self, row: int) -> None:
        st = self._rows.pop(row, None)
        if st is not None:
            self.cache.stop(st.request)

    def _row(self, row: int) -> _Row:
        st = self._rows.get(row)
        if st is None:
            raise RuntimeError(f"row {row} was not started (Drafter.start comes before propose / accept)")
        return st


def build_suffix_factory(config: SuffixConfig, device: str | torch.device = "cpu", target=None):
    """One ``SuffixCache`` for ``config`` (the global tree of every engine made by the factory),
    with the config's ``suffix_decoding_corpus`` for ``target`` preloaded into it
    (``suffix_corpus.resolve_corpus``); drafters hand their trees over on ``device``."""
    from .suffix_corpus import resolve_corpus
    cache = SuffixCache(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests)
    corpus = resolve_corpus(config.suffix_decoding_corpus, target)
    if corpus:
        cache.preload(corpus)
    return lambda max_batch, max_len: SuffixDrafter(cache, config.max_nodes, config.suffix_decoding_max_spec_factor,
                                                    config.suffix_decoding_min_token_prob, device)
