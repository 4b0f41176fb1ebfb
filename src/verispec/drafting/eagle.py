"""EAGLE drafters: EAGLE-1 / EAGLE-2 (feature head, static or dynamic tree) and EAGLE-3 / 3.1.

One ``EagleDrafter`` drives any head of ``eagle_head`` (see there for the pair alignment:
feature at t with token at t+1, RoPE position t, predicting token t+2).

Per batch row the drafter keeps
- the head's ``KVCache`` row: committed pairs (f_t, x_{t+1}) for t = 0..L-1, all made from
  *target* features (never from the head's own guesses);
- ``pending``: target features that arrived (``start``: the prompt's positions, or its last
  ``context_window`` ones; ``accept``: the committed positions) whose following token was not
  known yet. They are fused (``head.fuse``) at the next catch-up, all at once: a row that skips
  drafting for a while (adaptive drafting, ``draft_gate``) pays one fused matmul when it drafts
  again, not one per step.
Each ``propose``:
1. catch up: feed the pending pairs (pending features with the context tokens one position
   later; the last pair uses the root) in one ragged batched forward and commit them; the output
   at the root pair gives the state and the draft distribution for depth 1;
2. grow the tree level by level (``dynamic_tree`` builders), one batched head forward per level
   over the nodes to expand. A node's pair is (parent's output state, node token) at position
   L + depth - 1; its K/V go to scratch slots after the committed ones, visible to its
   descendants only, and are dropped by the next catch-up (rollback = keep the length).
Rejected draft tokens therefore never leave a trace: after ``accept`` the next catch-up rewrites
those positions from the target's own features.

Sampling: every tree is deterministic (the top-k children of each expanded node, ``q = None``),
for greedy and sampled requests alike. The verifier treats q as one-hot, which is lossless for
any tree whose siblings are distinct tokens.
"""
from __future__ import annotations

import torch

from .draft_shape import head_factory, load_head, time_ms
from ..models.draft_packing import draft_packing
from ..core.params import SamplingParams
from .spec_config import SpecConfigError, TreeHeadConfig
from ..core.tree import DraftTree, pack_trees
from ..core.features import TargetFeatures, join_features
from .base import DraftRequest, tree_on
from .dynamic_tree import DynamicTreeConfig, RankBy, Ranked, StaticTreeConfig, TreeBuilder, TreeConfig, rank
from .eagle_chain import chain_program
from .eagle_head import Eagle3Head, EagleHead, HeadKind

# Default dynamic tree: EAGLE-2's top-k 8 and depth 6; the node budget (DEFAULT_NUM_DRAFT_TOKENS)
# comes from the measured cost curve (benchmarks/results/tree_cost.md).
DEFAULT_DYNAMIC_TREE = DynamicTreeConfig(topk=8, depth=6)

# A prompt's last pairs a head catches up on when a request starts (``head_context``). The shipped
# EAGLE-3 heads drafted as well from their last 128 as from all of them (tokens per step of a fixed
# 3-chain on long Spec-Bench prompts: SmolLM2 1.308 against 1.309, 1.299 at 32; Qwen2.5-Coder-1.5B
# 1.307 against 1.304), and a request's first draft step after a 1024-token prompt took 7.7 ms
# against 62.5 (SmolLM2) and 41.6 against 344.5 (Qwen): benchmarks/results/head_context_*.md.
HEAD_CONTEXT = 128


class EagleDrafter:
    needs_last_hidden: bool
    hidden_layers: tuple[int, ...]

    def __init__(self, head: EagleHead, tree: TreeConfig, *, max_batch: int, max_len: int,
                 compile: bool = False, context_window: int | None = None):
        """``context_window``: the prompt pairs the head catches up on at a request's start (its
        last ones; None: all). See ``start``."""
        if context_window is not None and context_window < 1:
            raise ValueError(f"context_window must be >= 1 or None, got {context_window}")
        self.context_window = context_window
        self.head = head.eval().requires_grad_(False)
        self.tree = tree
        self.hidden_layers = tuple(head.hidden_layers)
        self.needs_last_hidden = bool(head.needs_last_hidden)
        self.max_tree_nodes = tree.max_nodes
        self._scores = not isinstance(tree, StaticTreeConfig)   # dynamic trees rank by log-probs
        self.device = head.embed_tokens.device       # the target's: cache, inputs and trees live there
        self._cap = tree.max_depth + 1        # pending pairs per row in steady state
        self.cache = head.new_cache(max_batch, max_len + self._cap + tree.max_expanded + 2)
        self.pending: dict[int, list[TargetFeatures]] = {}
        self.seen: dict[int, int] = {}        # context positions whose features arrived
        self.skipped: dict[int, int] = {}     # leading prompt positions the head never saw (window)
        # a chain (one child per node) drafts through ``eagle_chain``: static shapes, no host sync
        self._chain = chain_program(head, compile) if _is_chain(tree) else None
        if self._chain is not None and compile and max_batch > 1 and not self._chain.gather_warmed:
            self._chain.gather_warmed = True          # an engine of several rows drafts subsets of them
            warm_chain(head, tree.max_depth, gathered=True)

    # -- protocol --------------------------------------------------------------------------
    def start(self, row: int, prompt_ids: list[int], features: TargetFeatures | None) -> None:
        """Begin row ``row``: its pending pairs are the prompt's, or with a ``context_window`` its
        last ones only (the head never attends to the positions before; ``_fed``)."""
        if features is None:
            raise RuntimeError("EAGLE drafters need target features; the engine passed none")
        self.cache.reset(row)
        n = len(prompt_ids)
        keep = n if self.context_window is None else min(n, self.context_window)
        self.pending[row] = [features if keep == n else _tail(features, keep)]
        self.skipped[row] = n - keep
        self.seen[row] = n

    def accept(self, row: int, committed_ids: list[int], features: TargetFeatures | None) -> None:
        if features is None:
            raise RuntimeError("EAGLE drafters need target features; the engine passed none")
        self.pending[row].append(_own(features))
        self.seen[row] += len(committed_ids)

    def release(self, row: int) -> None:
        self.cache.reset(row)
        self.pending.pop(row, None)
        self.seen.pop(row, None)
        self.skipped.pop(row, None)

    @torch.no_grad()
    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        if not requests:
            return []
        if self._chain is not None:
            trees = self._propose_chain(requests)
            if trees is not None:
                return trees
        root_hidden, root_logits = self._catch_up(requests)
        ranked = rank(root_logits, self.tree.width, self._scores)
        builders: list[TreeBuilder | None] = []
        for i, r in enumerate(requests):
            budget = self._budget(r)
            builders.append(self.tree.builder(Ranked(ranked.logp[i], ranked.ids[i]), budget)
                            if budget > 0 else None)
        self._grow(requests, builders, root_hidden)
        return [self._to_tree(b) for b in builders]

    def _propose_chain(self, requests: list[DraftRequest]) -> list[DraftTree] | None:
        """Chains through the ``ChainProgram``; None when a row has more pending pairs than a
        step leaves (its first draft, or after plain steps): the general path catches it up."""
        depth = max(self._budget(r) for r in requests)
        if depth == 0:
            return [tree_on(DraftTree.empty(), self.device) for _ in requests]   # pending pairs wait
        if max(len(r.context) - 1 - self._fed(r.row) for r in requests) > self._cap:
            return None                       # checked before fusing: the general path fuses them
        feeds = [self._pending_pairs(r, fused=False) for r in requests]
        p = max(len(toks) for toks, _ in feeds)
        dev, rows = self.device, [r.row for r in requests]
        counts = [len(toks) for toks, _ in feeds]
        tokens = torch.tensor([toks + [0] * (p - len(toks)) for toks, _ in feeds], dtype=torch.long, device=dev)
        parts = _padded_parts([f for _, f in feeds], p)
        lengths = self.cache.lengths_of(rows)
        kv_len = self.cache.kv_len(rows, max(p, max(counts) + depth - 1))
        rows_t = torch.tensor(rows, dtype=torch.long, device=dev)     # a graph input: a tensor of its own
        counts_t, lengths_t = torch.tensor([counts, lengths], dtype=torch.long, device=dev)
        first = rows == list(range(len(rows)))
        state, tok = self._chain.catch_up(self.cache, rows_t, tokens, parts, lengths_t, counts_t, kv_len, first)
        self.cache.advance(rows, counts)
        for r in requests:
            self.pending[r.row] = []
        drafted, position = [tok], (lengths_t + counts_t)[:, None]
        for d in range(1, depth):
            state, tok = self._chain.level(self.cache, rows_t, tok, state, position + (d - 1), kv_len, first)
            drafted.append(tok)
        chains = torch.cat(drafted, 1)
        return [_chain_tree(chains[i], self._budget(r)) for i, r in enumerate(requests)]

    def _budget(self, r: DraftRequest) -> int:
        return self.tree.max_nodes if r.max_nodes is None else min(r.max_nodes, self.tree.max_nodes)

    # -- 1) catch up on the committed pairs --------------------------------------------------
    def _catch_up(self, requests: list[DraftRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        """Commit every pending pair; return the root pair's state [B,h] and logits [B,Vd]."""
        feeds = [self._pending_pairs(r) for r in requests]
        small = [i for i, f in enumerate(feeds) if len(f[0]) <= self._cap]
        groups = ([small] if small else []) + [[i] for i in range(len(feeds)) if i not in small]
        hidden: list[torch.Tensor | None] = [None] * len(feeds)
        logits: list[torch.Tensor | None] = [None] * len(feeds)
        for g in groups:
            h, lg = self._feed_pairs([requests[i].row for i in g], [feeds[i] for i in g])
            for j, i in enumerate(g):
                hidden[i], logits[i] = h[j], lg[j]
        for r in requests:
            self.pending[r.row] = []
        return torch.stack(hidden), torch.stack(logits)

    def _pending_pairs(self, r: DraftRequest, fused: bool = True):
        """The row's pending pairs: (their next tokens, features [P, h] fused by the head), or with
        ``fused=False`` the head's unfused ``feature_parts`` (the chain program fuses them)."""
        if r.row not in self.pending:
            raise RuntimeError(f"row {r.row} was not started")
        m = len(r.context) - 1                       # target cache length; context[m] is the root
        length = self._fed(r.row)
        joined = join_features(self.pending[r.row]) if self.pending[r.row] else None
        parts = None if joined is None else self.head.feature_parts(joined)
        p = 0 if parts is None else parts[0].shape[0]
        if self.seen[r.row] != m or length + p != m or p == 0:
            raise RuntimeError(f"row {r.row}: context has {m} committed tokens but the drafter saw "
                               f"{self.seen[r.row]} features and holds {length} + {p} pairs")
        return r.context[length + 1:m + 1], (self.head.fuse_parts(parts) if fused else parts)

    def _fed(self, row: int) -> int:
        """Context positions before the row's pending pairs: those skipped and those in its cache.
        The head's positions (RoPE, slots) count from its first pair: attention sees only
        distances, so a windowed row's pairs sit at slots 0.. and mean what they would at their
        context positions."""
        return self.skipped.get(row, 0) + self.cache.lengths_of([row])[0]

    def _feed_pairs(self, rows: list[int], feeds: list[tuple[list[int], torch.Tensor]]):
        t = max(len(toks) for toks, _ in feeds)
        b, dev = len(rows), self.device
        rows_t = torch.tensor(rows, device=dev)
        tokens = torch.tensor([toks + [0] * (t - len(toks)) for toks, _ in feeds], dtype=torch.long, device=dev)
        if b == 1:
            hidden = feeds[0][1][None]
        else:
            hidden = torch.zeros(b, t, feeds[0][1].shape[-1], dtype=feeds[0][1].dtype, device=dev)
            for i, (toks, feats) in enumerate(feeds):
                hidden[i, :len(toks)] = feats
        start = torch.tensor(self.cache.lengths_of(rows), dtype=torch.long, device=dev)
        positions = start[:, None] + torch.arange(t, device=dev)
        last = torch.tensor([[len(toks) - 1] for toks, _ in feeds], device=dev)
        out = self.head(tokens, positions, hidden, self.cache, rows=rows_t, logits_at=last)
        self.cache.advance(rows, [len(toks) for toks, _ in feeds])
        state = torch.gather(out.hidden, 1, last[..., None].expand(-1, -1, out.hidden.shape[-1]))[:, 0]
        return state, out.logits[:, 0]

    # -- 2) grow the trees level by level ---------------------------------------------------
    def _grow(self, requests: list[DraftRequest], builders: list[TreeBuilder | None],
              root_hidden: torch.Tensor) -> None:
        """One head forward per level over every row's frontier nodes (T = the widest frontier).
        Each level takes T scratch slots per row, after the slots of the earlier levels."""
        rows = torch.tensor([r.row for r in requests], device=self.device)
        lengths = self.cache.lengths[rows]
        scratches = [_Scratch(root_hidden[i]) for i in range(len(requests))]
        while True:
            fronts = [b.frontier() if b is not None else [] for b in builders]
            t = max(len(f) for f in fronts)
            if t == 0:
                return
            scratch = len(scratches[0])
            tokens, positions, hidden, local = self._level_inputs(builders, fronts, scratches, lengths, t)
            out = self.head(tokens, positions, hidden, self.cache, rows=rows, scratch=scratch, local_mask=local)
            ranked = rank(out.logits, self.tree.width, self._scores)
            for i, (b, f) in enumerate(zip(builders, fronts)):
                for j, node in enumerate(f):
                    scratches[i].state[node] = out.hidden[i, j]
                if f:
                    b.grow(Ranked(ranked.logp[i, :len(f)], ranked.ids[i, :len(f)]))

    def _level_inputs(self, builders, fronts: list[list[int]], scratches: list["_Scratch"],
                      lengths: torch.Tensor, t: int):
        """One level's inputs, row i's frontier nodes first, then padding up to ``t``:
        tokens [B, t] (target ids), positions [B, t] (``lengths[i] + depth - 1``), input states
        hidden [B, t, h] (each node's parent's output) and local_mask [B, t, scratch + t] over
        the row's scratch slots (a node sees itself and its ancestors' slots; padding itself)."""
        dev = self.device
        hidden = torch.zeros(len(fronts), t, self.head.cfg.hidden_size, dtype=self.head.embed_tokens.dtype,
                             device=dev)
        scratch = len(scratches[0])
        for i, (f, sc) in enumerate(zip(fronts, scratches)):
            parents, toks = [], []
            if f:
                nodes = builders[i].nodes
                parents = [nodes.parents[n] for n in f]
                toks = self._to_target([nodes.tokens[n] for n in f]).tolist()
            for j, parent in enumerate(parents):
                hidden[i, j] = sc.state[parent]
            sc.add_level(f, parents, toks, t)
        tokens, positions, mask = pack_trees([sc.tree() for sc in scratches], lengths)   # host-built
        return (tokens[:, scratch:].to(dev), positions[:, scratch:].to(dev), hidden, mask[:, scratch:].to(dev))

    def _to_target(self, draft_ids: list[int]) -> torch.Tensor:
        """Target ids [N] (on the device) of draft-vocabulary ids."""
        return self.head.draft_to_target(torch.tensor(draft_ids, dtype=torch.long, device=self.device))

    def _to_tree(self, builder: TreeBuilder | None) -> DraftTree:
        if builder is None:
            return tree_on(DraftTree.empty(), self.device)
        keep = builder.select()
        if not keep:
            return tree_on(DraftTree.empty(), self.device)
        new = {old: i for i, old in enumerate(keep)}
        nodes = builder.nodes
        toks = self._to_target([nodes.tokens[n] for n in keep])
        parents = torch.tensor([new[nodes.parents[n]] if nodes.parents[n] >= 0 else -1 for n in keep],
                               dtype=torch.long, device=self.device)
        return DraftTree(toks, parents)


def _is_chain(tree: TreeConfig) -> bool:
    return isinstance(tree, StaticTreeConfig) and tree.width == 1


def _padded_parts(feeds: list[tuple[torch.Tensor, ...]], p: int) -> tuple[torch.Tensor, ...]:
    """Each feature part of every row [P_i, d], zero-padded to ``p`` positions and stacked: [B, p, d]."""
    if len(feeds) == 1:
        return tuple(x[None] for x in feeds[0])
    return tuple(torch.stack([torch.cat([x, x.new_zeros(p - x.shape[0], x.shape[1])]) for x in xs])
                 for xs in zip(*feeds))


def _chain_tree(tokens: torch.Tensor, n: int) -> DraftTree:
    """The first ``n`` tokens of a drafted chain as a tree (no host read of the tokens)."""
    if n == 0:
        return tree_on(DraftTree.empty(), tokens.device)
    return DraftTree(tokens[:n].contiguous(), torch.arange(-1, n - 1, device=tokens.device))


def _tail(features: TargetFeatures, n: int) -> TargetFeatures:
    """The last ``n`` positions of ``features``."""
    return TargetFeatures({i: h[-n:] for i, h in features.hidden.items()},
                          None if features.last_hidden is None else features.last_hidden[-n:])


def _own(features: TargetFeatures) -> TargetFeatures:
    """``features`` in tensors of their own: the engine hands over views of a whole step's batched
    features, which a row that drafts again only after many plain steps would otherwise keep alive."""
    return TargetFeatures({i: h.clone() for i, h in features.hidden.items()},
                          None if features.last_hidden is None else features.last_hidden.clone())


class _Scratch:
    """One row's head scratch slots during ``_grow`` as a tree over slots: slot s holds a node's
    (parent state, token) pair, a padding slot token 0 below the root."""

    def __init__(self, root_state: torch.Tensor):
        self.tokens: list[int] = []               # target token of each slot
        self.parents: list[int] = []              # parent slot of each slot (-1: the root)
        self.slot: dict[int, int] = {-1: -1}      # builder node -> slot
        self.state: dict[int, torch.Tensor] = {-1: root_state}    # builder node -> head output

    def __len__(self) -> int:
        return len(self.tokens)

    def add_level(self, nodes: list[int], parents: list[int], tokens: list[int], t: int) -> None:
        """Slots for one level: ``nodes`` (builder ids, their builder ``parents`` and target
        ``tokens``), then padding up to ``t`` slots."""
        for node, parent, tok in zip(nodes, parents, tokens):
            self.slot[node] = len(self.tokens)
            self.tokens.append(tok)
            self.parents.append(self.slot[parent])
        pad = t - len(nodes)
        self.tokens += [0] * pad
        self.parents += [-1] * pad

    def tree(self) -> DraftTree:
        """The slots as a tree on the host (``pack_trees`` reads it as lists)."""
        return DraftTree(torch.tensor(self.tokens, dtype=torch.long, device="cpu"),
                         torch.tensor(self.parents, dtype=torch.long, device="cpu"))


# -- configuration -----------------------------------------------------------------------------
def tree_config(config: TreeHeadConfig, default: TreeConfig) -> TreeConfig:
    """The tree a speculative_config asks for: ``tree`` -> static; any of ``topk``, ``depth``,
    ``num_draft_tokens``, ``rank_by``, ``rerank`` -> dynamic (EAGLE-2); ``num_speculative_tokens``
    alone -> a chain; nothing -> ``default``."""
    rank_by, rerank = config.rank_by, config.rerank
    dynamic_keys = [k for k in ("topk", "depth", "num_draft_tokens") if getattr(config, k) is not None]
    if config.tree is not None:
        if rank_by is not None or rerank is not None or config.num_speculative_tokens is not None:
            raise SpecConfigError("a static 'tree' takes no 'rank_by', 'rerank' or 'num_speculative_tokens'")
        return StaticTreeConfig.from_choices(config.tree)
    if dynamic_keys or rank_by is not None or rerank is not None:
        return _dynamic(config, rank_by, rerank)
    if config.num_speculative_tokens is not None:
        return StaticTreeConfig.chain(config.num_speculative_tokens)
    return default


def _dynamic(config: TreeHeadConfig, rank_by, rerank) -> DynamicTreeConfig:
    d = DEFAULT_DYNAMIC_TREE
    depth = config.depth or config.num_speculative_tokens or d.depth
    if config.depth and config.num_speculative_tokens and config.depth != config.num_speculative_tokens:
        raise SpecConfigError("'depth' and 'num_speculative_tokens' disagree; give one")
    try:
        mode = RankBy(rank_by) if rank_by is not None else d.rank_by
    except ValueError:
        raise SpecConfigError(f"'rank_by' must be one of {[r.value for r in RankBy]}, got {rank_by!r}") from None
    if rerank is not None and not isinstance(rerank, bool):
        raise SpecConfigError(f"'rerank' must be true or false, got {rerank!r}")
    return DynamicTreeConfig(topk=config.topk or d.topk, depth=depth,
                             num_draft_tokens=config.num_draft_tokens or d.num_draft_tokens,
                             rank_by=mode, rerank=d.rerank if rerank is None else rerank)


def sets_shape(config: TreeHeadConfig) -> bool:
    """Whether the user chose the tree (any shape key set)."""
    return any(getattr(config, k, None) is not None
               for k in ("tree", "topk", "depth", "num_draft_tokens", "rank_by", "rerank", "num_speculative_tokens"))


def build_eagle_factory(config: TreeHeadConfig, target, kind: HeadKind, forward=None):
    """Load the head checkpoint named by ``config.model`` once; make a drafter per engine. Without
    shape keys, a head folder with an ``acceptance.json`` profile gets the tree that maximises
    modelled tokens/s from this machine's measured costs (``draft_shape``), and each engine a
    ``DraftGate`` (``adaptive_drafting``, see ``draft_shape.plan_shape``); otherwise the default
    dynamic tree. ``forward``: the target forward the engines run (its costs are measured)."""
    from ..formats import load_eagle_head
    aux = getattr(config, "eagle_aux_hidden_state_layer_ids", None)     # Eagle3Config only
    config, head = load_head(config, target, lambda folder: load_eagle_head(
        folder, target.model, kind, aux_layer_ids=tuple(aux) if aux is not None else None))
    cut = _restrict_vocab(head, config)
    packing = draft_packing(target, head)
    if packing is not None:
        head.pack_(packing, target.model.lm_head)   # draft on the packed kernels beside the target's
    tree = tree_config(config, DEFAULT_DYNAMIC_TREE)
    user = None
    if sets_shape(config):
        user = tree.choices if isinstance(tree, StaticTreeConfig) else ()
    compiled = _compiled(forward)
    factory = head_factory(target, config, kind.value + cut + ("/compiled" if compiled else ""), tree, user,
                           lambda between: draft_costs(head, between=between, compile=compiled), 8,
                           lambda tree, max_batch, max_len: EagleDrafter(
                               head, tree, max_batch=max_batch, max_len=max_len, compile=compiled,
                               context_window=head_context(config)),
                           hidden_layers=head.hidden_layers, forward=forward)
    chosen = StaticTreeConfig(factory.shape.choices) if factory.shape is not None else tree
    if compiled and _is_chain(chosen):
        warm_chain(head, chosen.max_depth)
    return factory


def head_context(config: TreeHeadConfig) -> int | None:
    """The drafter's ``context_window`` from the config's ``head_context`` (0: the whole prompt)."""
    n = HEAD_CONTEXT if config.head_context is None else config.head_context
    return n or None


def warm_chain(head: EagleHead, depth: int, gathered: bool = False) -> None:
    """Compile the chain program's graphs now, not in a request's first steps: the catch-up over
    one pending pair and over several (a step that accepted tokens), and the one-token level; for
    rows 0..B-1 (a batch-1 engine), or with ``gathered`` for other rows (an engine of several)."""
    with torch.no_grad():
        _run_steps(head, StaticTreeConfig.chain(depth), 32, accepts=(0, 1, depth, 0, 1), compile=True,
                   row=1 if gathered else 0)


def _compiled(forward) -> bool:
    """Whether the target runs compiled: its head's chains are compiled beside it."""
    from ..models.compiled import CompiledForward
    return isinstance(forward, CompiledForward)


# -- measured costs ------------------------------------------------------------------------------
def _restrict_vocab(head: EagleHead, config: TreeHeadConfig) -> str:
    """Cut the head's draft vocabulary as ``draft_vocab`` says (``draft_vocab.head_vocab``):
    EAGLE-3 within its own draft vocabulary, EAGLE-1 a copy of those rows of the target's LM head
    it reads tokens through. Returns a tag for the cost cache ("" for none)."""
    from .draft_vocab import head_vocab
    vocab = head_vocab(config.draft_vocab, config.model, head.cfg.vocab_size)
    if vocab is None:
        return ""
    try:
        head.restrict_vocab_(vocab.draft_ids)
    except ValueError as e:
        raise SpecConfigError(f"speculative_config 'draft_vocab': {e}") from None
    return f"/vocab{head.lm_head.out_features if isinstance(head, Eagle3Head) else head.vocab_ids.numel()}"


def draft_costs(head: EagleHead, context: int = 256, reps: int = 7, between=None, compile: bool = False):
    """Milliseconds of one step's drafting, batch 1, through the drafter's own protocol calls
    (accept one token, propose): ``fixed`` = a one-node tree (the catch-up alone, which also
    ranks depth 1) and ``[(w, level)]`` = the extra cost of one level over w expanded nodes.
    ``between``: untimed work before each step (``draft_shape.time_ms``). Trees are timed on the
    general tree path; a third item gives the chain program's costs (``compile``: compiled), which
    a chain drafts through: (a one-node chain, each further node of a three-node one)."""
    fixed = _time_steps(head, ((0,),), context, reps, between, tree_path=True)
    levels = []
    for w in (1, 2, 4, 8):
        choices = tuple((i,) for i in range(w)) + tuple((i, 0) for i in range(w))
        levels.append((w, max(0.0, _time_steps(head, choices, context, reps, between, tree_path=True) - fixed)))
    one = _time_steps(head, ((0,),), context, reps, between, compile)
    three = _time_steps(head, ((0,), (0, 0), (0, 0, 0)), context, reps, between, compile)
    return fixed, tuple(levels), (one, max(0.0, (three - one) / 2))


def _primed(head: EagleHead, tree: TreeConfig, context: int, room: int, compile: bool, tree_path: bool = False,
            row: int = 0):
    """A drafter over ``tree`` whose row ``row`` (of ``row + 1``) is started on zero features after
    a ``context``-token prompt (``room`` more tokens fit), the feature maker, the context list and
    a request maker."""
    drafter = EagleDrafter(head, tree, max_batch=row + 1, max_len=context + room + 16, compile=compile)
    if tree_path:
        drafter._chain = None
    h = torch.zeros(1, head.cfg.target_hidden_size, dtype=head.embed_tokens.dtype, device=drafter.device)
    feats = lambda n: TargetFeatures({i: h.expand(n, -1) for i in head.hidden_layers},   # noqa: E731
                                     h.expand(n, -1) if head.needs_last_hidden else None)
    ctx = [1] * (context + 1)
    drafter.start(row, ctx[:-1], feats(context))
    req = lambda: DraftRequest(row, ctx, SamplingParams(), torch.Generator(device="cpu"))   # noqa: E731
    return drafter, feats, ctx, req


def _run_steps(head: EagleHead, tree: TreeConfig, context: int, accepts, compile: bool, row: int = 0) -> None:
    """Draft steps of row ``row`` on zero features after a ``context``-token prompt, accepting
    ``accepts[i]`` draft tokens (plus the root) after step i."""
    drafter, feats, ctx, req = _primed(head, tree, context, sum(accepts) + len(accepts), compile, row=row)
    for a in accepts:
        drafter.propose([req()])
        drafter.accept(row, [1] * (a + 1), feats(a + 1))
        ctx += [1] * (a + 1)


def _time_steps(head: EagleHead, choices, context: int, reps: int, between=None, compile: bool = False,
                tree_path: bool = False) -> float:
    """Fastest ms of one step (accept one token, propose ``choices``) through the chain program
    (``compile``: compiled) where ``choices`` is a chain, else, or with ``tree_path``, the tree path."""
    drafter, feats, ctx, req = _primed(head, StaticTreeConfig.from_choices(choices), context, 3 * reps,
                                       compile, tree_path)
    drafter.propose([req()])                          # the prompt's catch-up, not timed

    def step():
        drafter.accept(0, [ctx[-1]], feats(1))
        ctx.append(1)
        drafter.propose([req()])
    return time_ms(step, reps=reps, warmup=2, between=between)
