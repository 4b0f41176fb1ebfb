"""Independent draft model drafter: a small LM sharing the target's tokenizer.

It keeps its own KV cache, one row per target row: static rows, or (``kv``: the engine's cache is
paged) a paged pool of its own that holds every row at full length but commits its memory block
by block as tokens arrive, so it grows with the tokens in use, as the target's does. Before each
proposal the row is brought
in step with the context by prefix matching: the committed draft slots whose tokens still agree
with the context are kept (rolling back is setting a length) and the rest of the context is fed
in one ragged batched forward. Then it drafts
- a chain of ``k`` tokens (one cached forward per token), or
- a static tree (``tree`` choices, top-k ranks per path), level by level with tree attention.
Greedy requests get deterministic drafts (argmax / top-k, q = None). Sampled requests draw from
the draft distribution processed like the target's, siblings without replacement, and report
the exact distribution each node was drawn from as ``q``.

With a reduced draft vocabulary (``vocab``) the draft model's LM head keeps only those rows (the
caller cuts it once with ``with_vocab_head``; drafters are made per engine): its logits are
spread back over the full vocabulary with -inf elsewhere, so tokens outside it get draft
probability 0 and every ``q`` stays a distribution over the target's vocabulary.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from .draft_vocab import DraftVocab
from ..core.kv_budget import PagedKV
from ..models.kv_cache import KVCache
from ..models.paged_kv import PagedKVCache
from ..models.packed import PackedFP16Linear, PackedLinear
from ..models.transformer import Transformer
from ..core.sampling import target_probs
from ..core.tree import ChoicesFiller, DraftTree, pack_trees, validate_choices
from .base import DraftRequest, tree_from_lists, tree_on


class DraftModelDrafter:
    hidden_layers: tuple[int, ...] = ()
    needs_last_hidden = False

    def __init__(self, model: Transformer, *, max_batch: int, max_len: int, num_speculative_tokens: int = 4,
                 tree: list | None = None, vocab: DraftVocab | None = None,
                 confidence_threshold: float | None = None, forward=None, kv: PagedKV | None = None):
        """``confidence_threshold`` (chains only): a row's chain ends after a token the draft gave
        less than this probability (its own, after temperature / top-k / top-p; the argmax's at
        temperature 0). The draft forwards a chain would spend past a doubtful token are the ones
        most likely wasted. The chain's length depends on draft-side numbers only, so the
        verification stays lossless.
        ``forward``: a ``models.compiled.CompiledForward`` of ``model`` (the LLM compiles): a
        forward over the draft rows 0..B-1 in order (batch 1, or a batch drafted together) runs
        it with a bucketed ``kv_len``; any other runs the eager model. Draft numbers only move
        which tokens are proposed, never what is accepted.
        ``kv``: the engine's paged pool (None: static rows). The draft cache is then paged with
        the same block size, in a pool of its own sized for every row at full length (the
        target's pool shares prefix blocks between rows, the draft's rows do not, so a pool of
        the target's size could run short) and never committed ahead: its memory grows with the
        draft tokens in use and ``reset`` hands a row's blocks back."""
        if num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if confidence_threshold is not None and not 0.0 < confidence_threshold < 1.0:
            raise ValueError(f"confidence_threshold must be in (0, 1), got {confidence_threshold}")
        if confidence_threshold is not None and tree:
            raise ValueError("confidence_threshold applies to chains, not to a static tree")
        self.confidence_threshold = confidence_threshold
        if vocab is not None and model.lm_head.out_features != vocab.size:
            raise ValueError(f"with a draft vocabulary of {vocab.size} tokens the draft model's LM head must "
                             f"have that many rows (cut it once with with_vocab_head), it has "
                             f"{model.lm_head.out_features}")
        self.vocab_size = model.cfg.vocab_size
        self.device = next(model.parameters()).device      # the target's: cache, inputs and trees live there
        self.draft_ids = None if vocab is None else vocab.draft_ids.to(self.device)
        self.model = model
        self._compiled = forward
        self.k = num_speculative_tokens
        self.choices = validate_choices(tree) if tree else None
        self.max_tree_nodes = len(self.choices) if self.choices else self.k
        dtype = next(model.parameters()).dtype
        row_len = max_len + self.max_tree_nodes + 1
        self.cache = KVCache.for_model(model.cfg, max_batch, row_len, dtype, device=self.device) if kv is None \
            else PagedKVCache.for_model(model.cfg, max_batch, row_len, dtype, self.device, block_size=kv.block_size)
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
            trees = self._trees(requests, logits)
        else:
            trees = self._chains(requests, logits)
        return [t.prefix(r.max_nodes) for t, r in zip(trees, requests)]

    # -- internals -------------------------------------------------------------------------
    def _catch_up(self, requests: list[DraftRequest]) -> torch.Tensor:
        """Feed each row the context it has not seen; return next-token logits [B, V] at the root.

        Short feeds (the usual accepted tokens + root) share one right-padded forward; long feeds
        (a newly started prompt) run alone, so padding never writes past a row's cache room."""
        feeds = []
        for r in requests:
            have = self.cached.setdefault(r.row, [])
            m = _common_prefix(have, r.context[:-1])
            self.cache.rollback(torch.tensor([r.row], device=self.device), m)
            del have[m:]
            feeds.append(r.context[m:])
        short = [i for i, f in enumerate(feeds) if self._short(len(f))]
        groups = ([short] if short else []) + [[i] for i in range(len(feeds)) if i not in set(short)]
        logits = [None] * len(feeds)
        for group in groups:
            out = self._feed([requests[i] for i in group], [feeds[i] for i in group])
            for j, i in enumerate(group):
                logits[i] = out[j]
        return torch.stack(logits)

    def _short(self, length: int) -> bool:
        """A feed of ``length`` tokens is a step's (accepted tokens + root, or a chain step): such
        feeds share one padded forward, through the compiled forward when there is one."""
        return length <= self.max_tree_nodes + 2

    def _feed(self, requests: list[DraftRequest], feeds: list[list[int]]) -> torch.Tensor:
        dev = self.device
        rows = torch.tensor([r.row for r in requests], device=dev)
        t = max(len(f) for f in feeds)
        tokens = torch.tensor([f + [0] * (t - len(f)) for f in feeds], dtype=torch.long, device=dev)
        positions = self.cache.lengths[rows][:, None] + torch.arange(t, device=dev)
        last = torch.tensor([[len(f) - 1] for f in feeds], device=dev)
        out = self._logits(tokens, positions, rows=rows, logits_index=last)
        for i, (r, f) in enumerate(zip(requests, feeds)):
            self.cache.advance(rows[i:i + 1], len(f))
            self.cached[r.row].extend(f)
        return out[:, 0]

    def _logits(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, **kw) -> torch.Tensor:
        """Draft forward on the draft cache; logits over the full target vocabulary. The compiled
        forward serves the step shapes (chain steps and short catch-ups); a long feed (a new
        prompt) runs eager: at prefill lengths the forward takes other branches (SDPA, the fp32
        BLAS), which would compile a new graph in the middle of a timed run."""
        host = rows.tolist() if self._compiled is not None and self._short(tokens.shape[1]) else None
        if host is not None and host == list(range(len(host))):
            if "logits_index" not in kw and "attn_mask" not in kw:        # chain steps: the catch-up's graph
                kw["logits_index"] = torch.full((len(host), 1), tokens.shape[1] - 1, device=self.device)
            self.cache.reserve(host, tokens.shape[1])        # a paged cache's blocks (eager forwards reserve)
            logits = self._compiled(tokens, positions, self.cache, kv_len=self.cache.kv_len(host, tokens.shape[1]),
                                    **kw).logits
        else:
            logits = self.model(tokens, positions, self.cache, rows=rows, **kw).logits
        if self.draft_ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.draft_ids] = logits
        return full

    def _pick(self, logits: torch.Tensor, r: DraftRequest) -> tuple[int, torch.Tensor | None]:
        if r.params.greedy:
            return int(logits.argmax()), None
        q = target_probs(logits, r.params)
        return int(torch.multinomial(q, 1, generator=r.generator)), q

    def _chains(self, requests, logits) -> list[DraftTree]:
        rows = torch.tensor([r.row for r in requests], device=self.device)
        toks: list[list[int]] = [[] for _ in requests]
        qs: list[list[torch.Tensor]] = [[] for _ in requests]
        caps = [self.k if r.max_nodes is None else min(self.k, r.max_nodes) for r in requests]
        live = [c > 0 for c in caps]
        for step in range(max(caps)):
            for i, r in enumerate(requests):
                if not live[i]:
                    continue
                x, q = self._pick(logits[i], r)
                toks[i].append(x)
                if q is not None:
                    qs[i].append(q)
                live[i] = len(toks[i]) < caps[i] and self._confident(logits[i], x, q, r)
            if not any(live):
                break
            # every row is fed (its last token): rows that stopped keep their cache in step and
            # their extra slot is rolled back by prefix matching at the next catch-up
            feed = torch.tensor([[t[-1] if t else r.context[-1]] for t, r in zip(toks, requests)],
                                device=self.device)
            pos = self.cache.lengths[rows][:, None].clone()
            logits = self._logits(feed, pos, rows=rows)[:, 0]
            self.cache.advance(rows, 1)
            for i, r in enumerate(requests):
                self.cached[r.row].append(toks[i][-1] if toks[i] else r.context[-1])
        return [tree_from_lists(t, list(range(-1, len(t) - 1)), self.device, torch.stack(q) if q else None)
                for t, q in zip(toks, qs)]

    def _confident(self, logits: torch.Tensor, x: int, q: torch.Tensor | None, r: DraftRequest) -> bool:
        """Whether drafting goes on after token ``x`` (always, without a threshold)."""
        if self.confidence_threshold is None:
            return True
        probs = q if q is not None else torch.softmax(logits.float(), dim=-1)
        return float(probs[x]) >= self.confidence_threshold

    def _trees(self, requests: list[DraftRequest], root_logits: torch.Tensor) -> list[DraftTree]:
        """Static trees for all rows, one batched forward per level over each partial tree.

        Scratch K/V of the partial trees is written after each row's committed prefix and never
        committed. Rows whose candidates run out (sampling without replacement over a small
        support) simply get fewer nodes; padded nodes attend only to themselves."""
        rows = torch.tensor([r.row for r in requests], device=self.device)
        base = self.cache.lengths[rows].clone()
        fillers = [ChoicesFiller(self.choices) for _ in requests]
        for f, r, lg in zip(fillers, requests, root_logits):
            f.add_children((), *self._ranked(lg, r))
        for depth in range(1, fillers[0].max_depth):
            expand = [f.expandable(depth) for f in fillers]
            if not any(expand):
                break
            packed = pack_trees([f.tree() for f in fillers], base)      # all nodes so far, built on the host
            tokens, positions, mask = (x.to(self.device) for x in packed)
            logits = self._logits(tokens, positions, attn_mask=mask, rows=rows)
            for b, (f, r) in enumerate(zip(fillers, requests)):
                for path in expand[b]:
                    f.add_children(path, *self._ranked(logits[b, f.index[path]], r))
        return [tree_on(f.tree(q=not r.params.greedy), self.device) for f, r in zip(fillers, requests)]

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


def with_vocab_head(model: Transformer, vocab: DraftVocab) -> Transformer:
    """``model`` sharing every module but an LM head cut to ``vocab``'s rows (packed like the
    original head). The original model is left as it is."""
    v = model.cfg.vocab_size
    if vocab.t2d.numel() != v:
        raise ValueError(f"draft vocabulary is made for {vocab.t2d.numel()} tokens, the draft model has {v}")
    head = model.lm_head
    rows = head.weight.detach()[vocab.draft_ids].clone()
    small = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device="meta")    # no wasted init
    small.weight = nn.Parameter(rows, requires_grad=False)
    new = copy.copy(model)
    new._modules = dict(model._modules)       # a shallow copy must not share the module table
    new.lm_head = _packed_like(head, small) if isinstance(head, PackedLinear) else small.to(rows.dtype)
    return new


def _packed_like(head: PackedLinear, small: nn.Linear) -> PackedLinear:
    """``small`` packed as ``head`` is: int4 (an ``int4-all`` draft; the rows already sit on the
    int4 grid, so their codes are kept) where the row count allows, int8 (``int4-head8``: each
    row's codes and scale are found again), fp16 otherwise."""
    from ..models.int4 import PackedInt4Linear
    from ..models.int8 import PackedInt8Linear
    if isinstance(head, PackedInt4Linear) and small.out_features % 16 == 0:
        return PackedInt4Linear(small, int8_activations=head.int8_activations)
    if isinstance(head, PackedInt8Linear):
        return PackedInt8Linear(small)
    return PackedFP16Linear(small)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
