"""The speculative decoding loop, for a batch of sequences in rows of one KV cache (static rows,
or a paged pool: ``kv``).

    prefill ──► [ propose ──► verify ──► accept ──► emit ] ──► done

The engine knows the target ``Transformer``, a ``Drafter`` (or none: vanilla decoding) and its
acceptance rule (``acceptance``: lossless by default; see ``acceptance``). Each sequence's target
rows go through its ``LogitsPipeline`` (penalties, min_tokens, bias, allowed ids) before the rule
sees them. It knows nothing about tokenization (stop strings are the output layer's: a sequence's
``stop_hook`` says after which new token to stop), HTTP, or which drafter it drives.

Continuous batching: ``add`` sequences at any time between ``step`` calls; finished sequences free
their rows at once. What a scheduler needs is offered here and nowhere else: ``can_admit``,
``add`` / ``add_many`` (all or nothing: a failure leaves no row taken), chunked prefill
(``begin`` takes a row, ``prefill_step(n)`` prefills at most n prompt tokens between two steps;
see ``prefill``), ``abort``, and a per-step draft budget (``step(budget=k)`` caps every tree at
its first k nodes, 0 = plain decoding), with a ``StepReport`` of what the step ran.

Prefix caching (``prefix_cache``, see ``prefix_cache``): at admission a sequence whose prompt starts
with cached blocks gets their K/V (on a paged cache: the blocks themselves, shared) into its row and
prefills only the rest (positions from the hit on); requests asking ``prompt_logprobs`` skip the lookup (they need every position's
logits). The prompt's whole blocks are inserted after prefill, and the committed prompt + output
tokens' blocks when the sequence retires. Drafters are started as without a cache, with the full
prompt's target features (cached ones joined to the prefilled rest's).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from .acceptance import LOSSLESS, AcceptanceRule, batched
from ..models.device import same_device
from ..drafting.draft_gate import DraftGate
from ..drafting.base import DraftRequest, Drafter
from .features import TargetFeatures, join_features
from .logits import LogitsPipeline, TokenConstraint
from .logprobs import TokenLogprob, token_logprobs
from .metrics import SpecStats
from .kv_budget import KVBudget, PagedKV, make_cache
from ..models.transformer import Transformer
from .params import SamplingParams
from .prefill import PrefillJob, chunked_prefill, run_all
from .row_padding import ghost_rows, pad_rows, take_rows
from .prefix_cache import CacheLayout, PrefixCache, PrefixHit, features_to, num_positions
from .sampling import make_generator, sample
from .tree import DraftTree
from .tree_batch import TreeBatch
from .verify import BatchAccept

PREFILL_CHUNK = 512
_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One request's decoding state. ``context[-1]`` is the root: chosen, not yet in the cache."""
    prompt_ids: list[int]
    params: SamplingParams
    on_tokens: Callable[["Sequence", list[int]], None] | None = None
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None     # one per output token when params.logprobs is set
    prompt_logprobs: list[TokenLogprob] | None = None   # prompt tokens 1.. when params.prompt_logprobs is set
    row: int = -1
    finished: bool = False
    finish_reason: str | None = None      # "stop" | "length" | "abort"
    stats: SpecStats = field(default_factory=SpecStats)
    generator: torch.Generator | None = None
    root: int = -1
    first_token_time: float | None = None
    start_time: float = field(default_factory=time.perf_counter)
    end_time: float | None = None
    # The output layer's stop check: given the tokens a step is about to emit, k when the k-th of
    # them completes a stop string (the sequence then ends after it, reason "stop"), else None.
    stop_hook: Callable[[list[int]], int | None] | None = None
    pipeline: LogitsPipeline | None = None   # built from ``params`` at admission
    # What the output must match (structured output: a grammar matcher, ``grammar``), or None.
    # The pipeline owns it from admission: it prunes draft trees, masks rows, sees emitted tokens.
    constraint: TokenConstraint | None = None


@dataclass(frozen=True)
class StepReport:
    """What one ``step`` ran: for a scheduler's policy and metrics."""
    seqs: list[Sequence]     # the sequences stepped
    budget: int              # draft nodes allowed per sequence (the drafter's own size when not capped)
    rows: int                # target rows of the verify forward: batch x (1 + longest tree)
    emitted: int             # tokens emitted to the sequences
    time_s: float


class Engine:
    def __init__(self, model: Transformer, drafter: Drafter | None = None, *, max_batch: int,
                 max_len: int, eos_token_ids: tuple[int, ...] = (), max_context: int | None = None,
                 acceptance: AcceptanceRule = LOSSLESS, prefix_cache: PrefixCache | None = None,
                 device: str | torch.device | None = None, forward=None, gate: DraftGate | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, kv: PagedKV | None = None):
        """``max_len``: cache slots per row (prompt + output + tree slack). ``max_context``: the
        model's usable context; generation stops with reason "length" when it is reached.
        ``acceptance``: the rule that decides which draft tokens are kept (lossless default).
        ``prefix_cache``: K/V blocks shared across requests (and engines of one target).
        ``device``: where the cache, generators and every tensor the engine makes live: the
        model's parameters' device (the default; naming another one is a ValueError).
        ``forward``: what runs the decode/verify forward (default the model itself; e.g. a
        ``models.compiled.CompiledForward`` of it): called as the model, with a ``kv_len``.
        ``prefill_chunk``: the grid prompts are prefilled on (``prefill``; the same grid gives
        the same numbers, so engines that must agree token for token share it).
        ``gate``: how many draft nodes each sequence gets each step (``draft_gate.DraftGate``:
        adaptive drafting; default: the drafter's whole tree).
        ``kv``: a paged KV pool shared by the rows (``kv_budget.PagedKV``; ``max_len`` then bounds
        one row); admission books each sequence's worst case (``kv_budget``). None: static rows of
        ``max_len`` slots."""
        if not isinstance(acceptance, AcceptanceRule):
            raise TypeError(f"acceptance must be an AcceptanceRule (name, lossy, __call__), got {acceptance!r}")
        self.model = model
        self._forward = forward or model
        self._drafter = drafter
        self.gate = gate if drafter is not None else None
        self.acceptance = acceptance
        self._accept_batch = batched(acceptance)
        first = next(model.parameters())
        dtype, self.device = first.dtype, first.device
        if device is not None and not same_device(torch.device(device), self.device):
            raise ValueError(f"engine device {device} differs from the model's {self.device}")
        self.cache = make_cache(model.cfg, max_batch, max_len, dtype, self.device, kv)
        self.kv = KVBudget(self.cache, self.max_tree_nodes + 1)
        self.eos = set(eos_token_ids)
        self.max_context = min(max_context or max_len, max_len - 1 - self.max_tree_nodes)
        self.free_rows = list(range(max_batch))[::-1]
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1 token, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.running: list[Sequence] = []
        self.prefilling: list[PrefillJob] = []     # admitted by ``begin``, prompt not done yet
        self.stats = SpecStats(acceptance=acceptance.name, lossy=acceptance.lossy)
        self._prefix_cache = prefix_cache
        self._feature_log: dict[int, list[TargetFeatures]] = {}   # seq_id -> features of committed slots
        if prefix_cache is not None:
            layers, want_last = self._feature_request()
            cfg = model.cfg
            prefix_cache.bind(CacheLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype,
                                          tuple(sorted(layers)), want_last))
            if self.cache.paged:
                prefix_cache.attach(self.cache)
            if prefix_cache.exact and prefill_chunk % prefix_cache.block_size:
                raise ValueError(f"exact prefix reuse needs a prefill grid of whole {prefix_cache.block_size}-token "
                                 f"blocks, got prefill_chunk {prefill_chunk}")

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self._prefix_cache

    @property
    def drafter(self) -> Drafter | None:
        return self._drafter

    @property
    def max_tree_nodes(self) -> int:
        """The most draft nodes any step verifies per sequence (0 without a drafter)."""
        return self._drafter.max_tree_nodes if self._drafter is not None else 0

    @property
    def num_running(self) -> int:
        return sum(1 for s in self.running if not s.finished)

    # ------------------------------------------------------------------ admission and prefill
    def can_admit(self, seq: Sequence | None = None) -> bool:
        """A free row, and with ``seq`` (anything with ``prompt_ids`` and ``params``) room in a
        paged pool for its worst case (``kv_budget``)."""
        return bool(self.free_rows) and (seq is None or self.kv.fits(self._worst(seq)))

    def kv_shortfall(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """Why the KV pool could never hold a request of this size (None: it can, or static rows)."""
        need = self.kv.worst(prompt_tokens, max_tokens, self.max_context)
        if self.kv.holds(need):
            return None
        return (f"{need} KV cache slots needed (prompt, max_tokens and draft slack); the KV cache holds "
                f"{self.cache.num_blocks * self.cache.block_size}")

    def kv_usage(self) -> tuple[int, int]:
        """(blocks in use, blocks in all) of a paged KV pool; (0, 0) for static rows."""
        return (self.cache.num_used_blocks, self.cache.num_blocks) if self.cache.paged else (0, 0)

    def _worst(self, seq: Sequence) -> int:
        return self.kv.worst(len(seq.prompt_ids), seq.params.max_tokens, self.max_context)

    def add(self, seq: Sequence) -> None:
        """Prefill ``seq`` into a free row and choose its first token."""
        self.add_many([seq])

    def add_many(self, seqs: list[Sequence]) -> None:
        """Prefill several sequences (one right-padded forward when their prompts are short). All
        or nothing: when anything fails, no sequence is running and every row taken is free."""
        for seq in seqs:
            self._check_prompt(seq)
        if len(seqs) > len(self.free_rows):
            raise RuntimeError("not enough free batch rows; check can_admit() first")
        try:
            for seq in seqs:
                self._take_row(seq)
            hits = [self._load_prefix(s) for s in seqs]
            results = self._prefill_all(seqs, [h.num_tokens for h in hits])
            for seq, hit, (logits, feats) in zip(seqs, hits, results):
                self._start_decoding(seq, hit, logits, feats)
        except BaseException:
            for seq in seqs:                       # give the rows back; nothing was admitted
                self._unadmit(seq)
                seq.row = -1
            raise
        for seq, (logits, _) in zip(seqs, results):
            self._emit(seq, [seq.root], self._logprobs(seq, logits[None], [seq.root]))

    def begin(self, seq: Sequence) -> None:
        """Admit ``seq`` to a free row for chunked prefill: its prefix-cache hit is loaded now and
        ``prefill_step`` runs the rest of its prompt, chunk by chunk, between decoding steps; it
        joins the decoding batch (first token emitted) when its prompt is done. A failure leaves
        no row taken."""
        self._check_prompt(seq)
        if not self.free_rows:
            raise RuntimeError("no free batch row; check can_admit() first")
        self._take_row(seq)
        try:
            hit = self._load_prefix(seq)
            gen = self._prefill_gen(seq.row, seq.prompt_ids, seq, hit.num_tokens)
            next(gen)
        except BaseException:
            self._unadmit(seq)
            seq.row = -1
            raise
        self.prefilling.append(PrefillJob(seq, hit, gen, len(seq.prompt_ids) - hit.num_tokens))

    @property
    def num_prefilling(self) -> int:
        """Sequences admitted with ``begin`` whose prompt is not prefilled yet."""
        return len(self.prefilling)

    def prefill_step(self, max_tokens: int) -> int:
        """Prefill at most ``max_tokens`` prompt tokens of the sequences ``begin`` admitted (short
        prompts first, then the oldest: ``_next_prefill``); each one whose prompt completes starts
        decoding (its first token is emitted).
        Returns the tokens prefilled. A failure aborts that sequence only (its row is freed, its
        ``finish_reason`` is "abort") and is raised."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        done = 0
        while self.prefilling and done < max_tokens:
            job = self._next_prefill(max_tokens)
            try:
                done += job.run(max_tokens - done)
                if job.result is None:
                    continue
                self.prefilling.remove(job)
                logits, feats = job.result
                self._start_decoding(job.seq, job.hit, logits, feats)
            except BaseException:
                self.abort(job.seq)
                self._unadmit(job.seq)          # also when it failed between the two lists
                raise
            self._emit(job.seq, [job.seq.root], self._logprobs(job.seq, logits[None], [job.seq.root]))
        return done

    def _next_prefill(self, max_tokens: int) -> PrefillJob:
        """The oldest prompt that fits in half the budget, else the oldest: a short prompt that
        arrives while a long one is being prefilled starts decoding within a round or two instead
        of waiting for the whole long prompt, and the long one still gets half of every round."""
        return next((j for j in self.prefilling if j.left <= max_tokens // 2), self.prefilling[0])

    def _check_prompt(self, seq: Sequence) -> None:
        n = len(seq.prompt_ids)
        if n == 0:
            raise ValueError("prompt is empty")
        if n >= self.max_context:
            raise ValueError(f"prompt has {n} tokens; the context holds {self.max_context}")
        why = self.kv_shortfall(n, seq.params.max_tokens)
        if why:
            raise ValueError(f"the request does not fit the KV pool: {why}")

    def _take_row(self, seq: Sequence) -> None:
        self.kv.commit(seq.seq_id, self._worst(seq))
        seq.row = self.free_rows.pop()
        seq.generator = seq.generator or make_generator(seq.params.seed, self.device)
        seq.pipeline = LogitsPipeline.build(seq.params, tuple(self.eos), seq.constraint)
        seq.stats.acceptance, seq.stats.lossy = self.acceptance.name, self.acceptance.lossy
        self.cache.reset(seq.row)

    def _start_decoding(self, seq: Sequence, hit: PrefixHit, logits: torch.Tensor,
                        feats: TargetFeatures | None) -> None:
        """After its prompt is prefilled: the first token, the batch, the drafter, the prefix cache."""
        feats = join_features([hit.features, feats])
        seq.root = self._sample(self._target_rows(seq, logits[None])[0], seq)
        self.running.append(seq)
        if self._drafter is not None:
            self._drafter.start(seq.row, list(seq.prompt_ids), feats)
        self._store_prompt(seq, feats)

    def _unadmit(self, seq: Sequence) -> None:
        """Take ``seq`` out of the batch: drafter state, cache row and the row itself freed (a
        finished sequence's blocks go to the prefix cache first)."""
        if seq in self.running:
            if seq.finished:
                self._store_sequence(seq)
            self._feature_log.pop(seq.seq_id, None)
            self.running.remove(seq)
            if self._drafter is not None:
                self._drafter.release(seq.row)
            if self.gate is not None:
                self.gate.release(seq.seq_id)
        self.kv.release(seq.seq_id)
        if seq.row >= 0 and seq.row not in self.free_rows:
            self.cache.reset(seq.row)
            self.free_rows.append(seq.row)
            self.free_rows.sort(reverse=True)      # the lowest free row next: the batch stays packed

    # ------------------------------------------------------------------ prefix cache
    def _load_prefix(self, seq: Sequence) -> PrefixHit:
        """Copy the cached blocks at the start of ``seq``'s prompt into its (empty) row."""
        if self._prefix_cache is None or seq.params.prompt_logprobs is not None:
            return PrefixHit(0)
        exact = self._prefix_cache.exact              # whole chunks of the prefill grid only
        hit = self._prefix_cache.lookup(seq.prompt_ids, granule=self.prefill_chunk if exact else None)
        if hit.blocks:                                   # a paged pool's blocks, shared
            self.cache.share(seq.row, hit.blocks, hit.num_tokens)
            hit = replace(hit, features=features_to(hit.features, self.device))
        elif hit.num_tokens:
            self.cache.write_prefix(seq.row, hit.k.to(self.device), hit.v.to(self.device))
            hit = replace(hit, features=features_to(hit.features, self.device))
        return hit

    def _store_prompt(self, seq: Sequence, feats: TargetFeatures | None) -> None:
        """After prefill: the prompt's blocks to the cache; start logging committed features."""
        if self._prefix_cache is None:
            return
        self._prefix_cache.insert(seq.prompt_ids, self.cache, seq.row, feats)
        if feats is not None:
            self._feature_log[seq.seq_id] = [feats]

    def _log_features(self, seq: Sequence, feats: TargetFeatures | None) -> None:
        log = self._feature_log.get(seq.seq_id)
        if log is not None and feats is not None:
            log.append(feats)

    def _store_sequence(self, seq: Sequence) -> None:
        """At retirement, before the row is reset: the blocks of the committed tokens. Only slots
        ``[0, min(cache length, len(prompt + output)))`` are the sequence's (after a stop the cache
        may hold accepted tokens past the cut output)."""
        if self._prefix_cache is None or self._prefix_cache.exact:       # exact: prefilled blocks only
            return
        tokens = seq.prompt_ids + seq.output_ids
        valid = min(self.cache.lengths_of([seq.row])[0], len(tokens))
        feats = None
        if self._prefix_cache.layout.needs_features:
            feats = join_features(self._feature_log.get(seq.seq_id, []))
            valid = min(valid, num_positions(feats) if feats is not None else 0)
        self._prefix_cache.insert(tokens[:valid], self.cache, seq.row, feats)

    # ------------------------------------------------------------------ prefill
    def _prefill_all(self, seqs: list[Sequence], starts: list[int]
                     ) -> list[tuple[torch.Tensor, TargetFeatures | None]]:
        """Prefill each prompt from its ``starts`` offset (its cache length): one right-padded
        forward when the rests are short and fit, else one chunked prefill per sequence."""
        rest = [len(s.prompt_ids) - m for s, m in zip(seqs, starts)]
        if len(seqs) > 1 and max(rest) <= self.prefill_chunk and max(starts) + max(rest) <= self.cache.max_len and \
                all(s.params.prompt_logprobs is None for s in seqs):
            return self._prefill_batch(seqs, starts)
        return [self._prefill(s.row, s.prompt_ids, s, m) for s, m in zip(seqs, starts)]

    def _prefill_batch(self, seqs: list[Sequence], starts: list[int]
                       ) -> list[tuple[torch.Tensor, TargetFeatures | None]]:
        lens = [len(s.prompt_ids) - m for s, m in zip(seqs, starts)]
        dev = self.device
        tokens = torch.tensor([s.prompt_ids[m:] + [0] * (max(lens) - n) for s, m, n in zip(seqs, starts, lens)],
                              dtype=torch.long, device=dev)
        rows = torch.tensor([s.row for s in seqs], device=dev)
        layers, want_last = self._feature_request()
        positions = torch.tensor(starts, device=dev)[:, None] + torch.arange(max(lens), device=dev)[None]
        out = self.model(tokens, positions, self.cache, rows=rows, hidden_layers=layers,
                         logits_index=torch.tensor(lens, device=dev)[:, None] - 1)
        results = []
        for i, s in enumerate(seqs):
            self.cache.advance(rows[i:i + 1], lens[i])
            feats = None
            if layers or want_last:
                feats = TargetFeatures({k: out.hidden[k][i, :lens[i]] for k in layers},
                                       out.last_hidden[i, :lens[i]] if want_last else None)
            results.append((out.logits[i, 0], feats))
        return results

    def _prefill(self, row: int, ids: list[int], seq: Sequence | None = None, start: int = 0
                 ) -> tuple[torch.Tensor, TargetFeatures | None]:
        """Prefill of one row from position ``start`` (the row's cache length: tokens before it
        came from the prefix cache), in chunks of the grid ``prefill_chunk``; features of positions
        ``start..``. Fills ``seq.prompt_logprobs`` when its params ask (only from ``start`` 0)."""
        return run_all(self._prefill_gen(row, ids, seq, start))

    def _prefill_gen(self, row: int, ids: list[int], seq: Sequence | None, start: int):
        """The chunk generator of one row's prefill (``prefill.chunked_prefill``), with the
        drafter's feature layers and ``seq``'s prompt logprobs (reset here) when it asks."""
        layers, want_last = self._feature_request()
        k = seq.params.prompt_logprobs if seq is not None else None
        if k is not None:
            seq.prompt_logprobs = []
        return chunked_prefill(self.model, self.cache, row, ids, start, layers, want_last, k,
                               seq.prompt_logprobs if k is not None else None, grid=self.prefill_chunk)

    def _feature_request(self) -> tuple[tuple[int, ...], bool]:
        if self._drafter is None:
            return (), False
        return tuple(dict.fromkeys(self._drafter.hidden_layers)), bool(self._drafter.needs_last_hidden)

    @staticmethod
    def _target_rows(seq: Sequence, logits: torch.Tensor, tree: DraftTree | None = None) -> torch.Tensor:
        """The target rows the request samples from (root, nodes...), through its pipeline."""
        return seq.pipeline.process(logits, seq.prompt_ids, seq.output_ids, tree)

    @staticmethod
    def _logprobs(seq: Sequence, logits: torch.Tensor, tokens: list[int]) -> list[TokenLogprob] | None:
        """Entries for ``tokens`` emitted from the rows of ``logits`` (when the request asks)."""
        k = seq.params.logprobs
        return None if k is None else token_logprobs(logits, tokens, k)

    @staticmethod
    def _sample(logits: torch.Tensor, seq: Sequence) -> int:
        if seq.params.greedy:
            return int(logits.argmax())
        return sample(seq.pipeline.probs(logits), seq.generator)

    # ------------------------------------------------------------------ one decoding step
    def step(self, budget: int | None = None) -> StepReport:
        """One draft-verify-accept step for every running sequence. ``budget``: draft nodes
        allowed per sequence this step (None: the drafter's own size; 0: plain decoding).

        The whole batch is verified in one forward and accepted in one batched call of the
        acceptance rule (no host reads per node or per row); its result reaches the host in one
        copy, and the per-row loop only commits and emits what was decided."""
        # Rows in row order: a full batch then reads its KV cache rows as one view, not a gather
        # (after refills ``running`` is in admission order; this was half of a batch-64 step).
        seqs = sorted((s for s in self.running if not s.finished), key=lambda s: s.row)
        budget = self.max_tree_nodes if budget is None else max(0, min(budget, self.max_tree_nodes))
        if not seqs:
            return StepReport([], budget, 0, 0, 0.0)
        emitted0 = self.stats.num_emitted_tokens
        t0 = time.perf_counter()
        trees, caps = self._propose(seqs, budget)                             # 1) propose
        t1 = time.perf_counter()
        if self._drafter is not None:
            for s, cap, tree in zip(seqs, caps, trees):
                s.stats.observe_budget(cap)
                if self.gate is not None:             # the estimator's model, to set beside the outcome
                    model = self.gate.modelled(s.seq_id) if len(tree) else (1.0, 1.0)
                    s.stats.observe_model(*model)
                    self.stats.observe_model(*model)
        batch, out = self._verify_forward(seqs, trees)                        # 2) verify
        t2 = time.perf_counter()
        decided = self._accept(seqs, batch, out)                              # 3) accept
        results = decided.to_host()                                           # the step's one host copy
        self._commit(seqs, batch, decided, results)                           # 4) compact the caches
        feats = self._features(out, decided.keep)
        for b, (seq, res) in enumerate(zip(seqs, results)):                  # 5) hand over, emit
            n = res.num_accepted + 1
            self._observe(seq, batch, b, res.num_accepted)
            row_feats = _row_features(feats, b, n)
            if self._drafter is not None:
                self._drafter.accept(seq.row, [seq.root] + res.tokens[:-1], row_feats)
            self._log_features(seq, row_feats)
            seq.root = res.tokens[-1]
            lp = self._logprobs(seq, out.logits[b, decided.keep[b, :n]], res.tokens) \
                if seq.params.logprobs is not None else None
            self._emit(seq, res.tokens, lp)
        t3 = time.perf_counter()
        self.stats.draft_time_s += t1 - t0
        self.stats.verify_time_s += t2 - t1
        self.stats.overhead_time_s += t3 - t2
        if self.gate is not None:
            # only greedy requests are timed: a sampled request's draws depend on which steps
            # drafted, so its budgets must follow from its seed alone (modelled costs), not timings
            self.gate.observe_step([s.seq_id if s.params.greedy else None for s in seqs], caps, t3 - t0)
        for s in seqs:
            s.stats.draft_time_s += t1 - t0
            s.stats.verify_time_s += t3 - t1
        return StepReport(seqs, budget, batch.batch * (1 + batch.num_nodes),
                          self.stats.num_emitted_tokens - emitted0, t3 - t0)

    def _propose(self, seqs: list[Sequence], budget: int) -> tuple[list[DraftTree], list[int]]:
        """One tree per sequence, each cut to ``min(budget, gate's budget, room)`` nodes (a prefix
        is a tree), then without the drafts its pipeline's constraint forbids (structured output).
        Sequences with a budget of 0 get an empty tree without asking the drafter. Also returns
        each sequence's node budget (0: plain step)."""
        trees = [DraftTree.empty() for _ in seqs]
        if self._drafter is None or budget == 0:
            return trees, [0] * len(seqs)
        caps = [budget] * len(seqs) if self.gate is None else \
            [min(budget, b) for b in self.gate.plan([(s.seq_id, s.params.greedy) for s in seqs])]
        ask = [i for i, cap in enumerate(caps) if cap > 0]
        if not ask:
            return trees, caps
        reqs = [DraftRequest(seqs[i].row, seqs[i].prompt_ids + seqs[i].output_ids, seqs[i].params,
                             seqs[i].generator, max_nodes=min(caps[i], self._room(seqs[i]))) for i in ask]
        proposed = self._drafter.propose(reqs)
        for i, t, r in zip(ask, proposed, reqs):
            if len(t) > self.max_tree_nodes:
                raise RuntimeError(f"drafter proposed {len(t)} nodes, more than its max_tree_nodes "
                                   f"{self.max_tree_nodes}")
            trees[i] = seqs[i].pipeline.restrict(t.prefix(r.max_nodes))
        return trees, caps

    def _room(self, seq: Sequence) -> int:
        """Draft tokens worth proposing: never more than what max_tokens and context leave."""
        left_tokens = seq.params.max_tokens - len(seq.output_ids)
        left_ctx = self.max_context - len(seq.prompt_ids) - len(seq.output_ids)
        return max(0, min(left_tokens, left_ctx) - 1)

    def _verify_forward(self, seqs: list[Sequence], trees: list[DraftTree]):
        """One target forward over (root, tree nodes...) of every row, right-padded (``TreeBatch``),
        shaped from host data alone: rows and lengths from the cache's host mirror, the attended
        slots bucketed (``KVCache.kv_len``), so the forward makes no device sync."""
        rows = [s.row for s in seqs]
        batch = TreeBatch.pack(trees, self.cache.lengths_of(rows), [s.root for s in seqs],
                               device=self.cache.device, vocab=self.model.cfg.vocab_size)
        t = int(batch.tokens.shape[1])
        layers, _ = self._feature_request()
        self.cache.reserve(rows, t)                  # a paged cache's blocks, for the real rows only
        kv_len = self.cache.kv_len(rows, t)
        lengths = self.cache.lengths_of(range(max(rows) + 1))
        if self._forward is not self.model and not self.cache.paged and ghost_rows(rows, lengths, t, kv_len):
            # rows with holes: the compiled graph of rows 0..R-1 with ghost rows (``row_padding``)
            tokens, positions, mask, index = pad_rows(batch.tokens, batch.positions, batch.mask, rows, lengths)
            out = self._forward(tokens, positions, self.cache, attn_mask=mask, rows=range(len(tokens)),
                                hidden_layers=layers, kv_len=kv_len)
            return batch, take_rows(out, index)
        out = self._forward(batch.tokens, batch.positions, self.cache, attn_mask=batch.mask, rows=rows,
                            hidden_layers=layers, kv_len=kv_len)
        return batch, out

    def _accept(self, seqs: list[Sequence], batch: TreeBatch, out) -> BatchAccept:
        """The rule's decision for every row, on the rows' processed logits (the request's
        processors run only for requests that have any; others pass through untouched)."""
        logits = out.logits
        active = [b for b, s in enumerate(seqs) if s.pipeline.active(len(s.output_ids))]
        if active:
            logits = logits.float().clone()
            trees = [DraftTree(batch.node_tokens[b, :n], batch.parent_entry[b, :n] - 1)
                     for b, n in enumerate(batch.sizes)]
            for b in active:
                n = batch.sizes[b] + 1
                logits[b, :n] = self._target_rows(seqs[b], logits[b, :n], trees[b])
        return self._accept_batch(batch, logits, [s.params for s in seqs], [s.generator for s in seqs])

    def _commit(self, seqs: list[Sequence], batch: TreeBatch, decided: BatchAccept,
                results: list) -> None:
        """Commit every row's root and accepted nodes to its cache row (one batched copy)."""
        self.cache.compact_batch([s.row for s in seqs], decided.keep, [r.num_accepted + 1 for r in results])

    def _observe(self, seq: Sequence, batch: TreeBatch, b: int, accepted: int) -> None:
        seq.stats.observe(batch.sizes[b], batch.depths[b], accepted)
        self.stats.observe(batch.sizes[b], batch.depths[b], accepted)
        if self.gate is not None:
            self.gate.observe(seq.seq_id, batch.sizes[b], accepted)

    def _features(self, out, keep: torch.Tensor) -> TargetFeatures | None:
        """Target features of every row's kept entries ``keep [B, D + 1]`` (rows cut later)."""
        layers, want_last = self._feature_request()
        if not layers and not want_last:
            return None
        idx = keep[..., None]
        pick = lambda x: torch.gather(x, 1, idx.expand(-1, -1, x.shape[-1]))  # noqa: E731
        return TargetFeatures({i: pick(out.hidden[i]) for i in layers},
                              pick(out.last_hidden) if want_last else None)

    # ------------------------------------------------------------------ output and retirement
    def _emit(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        """Append tokens (and their logprobs) up to the first stop condition (end token, length,
        then the output layer's stop string); notify; retire if finished."""
        p = seq.params
        new: list[int] = []
        reason = None
        for tok in tokens:
            if (tok in self.eos and not p.ignore_eos) or tok in p.stop_token_ids:
                reason = "stop"
                break
            new.append(tok)
            if len(seq.output_ids) + len(new) >= p.max_tokens or \
                    len(seq.prompt_ids) + len(seq.output_ids) + len(new) >= self.max_context:
                reason = "length"
                break
        if new and seq.stop_hook is not None:
            k = seq.stop_hook(new)
            if k is not None:
                new, reason = new[:k], "stop"
        seq.output_ids.extend(new)
        seq.pipeline.commit(new)
        if logprobs is not None:
            seq.logprobs = [] if seq.logprobs is None else seq.logprobs
            seq.logprobs.extend(logprobs[:len(new)])
        if reason is not None:
            self._finish(seq, reason)
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        if seq.on_tokens is not None and (new or seq.finished):
            seq.on_tokens(seq, new)
        if seq.finished:
            self._unadmit(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finished, seq.finish_reason = True, reason
        seq.end_time = time.perf_counter()

    def abort(self, seq: Sequence) -> None:
        """Cancel a sequence and free its row (e.g. a client disconnected); a no-op for one that
        already ended or was never admitted."""
        if not seq.finished:
            self._finish(seq, "abort")
        job = next((j for j in self.prefilling if j.seq is seq), None)
        if job is not None:                       # admitted by ``begin``, still prefilling
            self.prefilling.remove(job)
            job.gen.close()
            self._unadmit(seq)
        elif seq in self.running:
            self._unadmit(seq)

    def run(self, seqs: list[Sequence]) -> list[Sequence]:
        """Decode ``seqs`` to completion, admitting them as rows free up."""
        waiting = list(seqs)
        while waiting or self.running:
            if waiting and self.free_rows:
                batch, waiting = waiting[:len(self.free_rows)], waiting[len(self.free_rows):]
                self.add_many(batch)
            self.step()
        return seqs


def _row_features(feats: TargetFeatures | None, b: int, n: int) -> TargetFeatures | None:
    """Row ``b``'s first ``n`` kept positions of batched features."""
    if feats is None:
        return None
    return TargetFeatures({i: h[b, :n] for i, h in feats.hidden.items()},
                          feats.last_hidden[b, :n] if feats.last_hidden is not None else None)
