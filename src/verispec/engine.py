"""The speculative decoding loop, for a batch of sequences in rows of one static KV cache.

    prefill ──► [ propose ──► verify ──► accept ──► emit ] ──► done

The engine knows the target ``Transformer``, a ``Drafter`` (or none: vanilla decoding) and the
verifier. It knows nothing about tokenization (stop strings are checked through an optional
``decode`` function), HTTP, or which drafter it drives. Continuous batching: ``add`` sequences
at any time between ``step`` calls; finished sequences free their rows at once.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .drafters.base import DraftRequest, Drafter, TargetFeatures
from .logprobs import TokenLogprob, token_logprobs
from .metrics import SpecStats
from .models.kv_cache import KVCache
from .models.transformer import Transformer
from .penalties import apply_penalties, penalized
from .sampling import SamplingParams, make_generator, sample, target_probs
from .tree import DraftTree
from .verify import accept

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
    _stop_text_len: int = 0


class Engine:
    def __init__(self, model: Transformer, drafter: Drafter | None = None, *, max_batch: int,
                 max_len: int, eos_token_ids: tuple[int, ...] = (),
                 decode: Callable[[list[int]], str] | None = None,
                 max_context: int | None = None):
        """``max_len``: cache slots per row (prompt + output + tree slack). ``max_context``: the
        model's usable context; generation stops with reason "length" when it is reached."""
        self.model = model
        self.drafter = drafter
        dtype = next(model.parameters()).dtype
        self.cache = KVCache.for_model(model.cfg, max_batch, max_len, dtype)
        self.eos = set(eos_token_ids)
        self.decode = decode
        self.max_context = min(max_context or max_len, max_len - 1 - self._tree_slack())
        self.free_rows = list(range(max_batch))[::-1]
        self.running: list[Sequence] = []
        self.stats = SpecStats()

    def _tree_slack(self) -> int:
        return self.drafter.max_tree_nodes if self.drafter is not None else 0

    # ------------------------------------------------------------------ admission and prefill
    def can_admit(self) -> bool:
        return bool(self.free_rows)

    def add(self, seq: Sequence) -> None:
        """Prefill ``seq`` into a free row and choose its first token."""
        self.add_many([seq])

    def add_many(self, seqs: list[Sequence]) -> None:
        """Prefill several sequences (one right-padded forward when their prompts are short)."""
        for seq in seqs:
            n = len(seq.prompt_ids)
            if n == 0:
                raise ValueError("prompt is empty")
            if n >= self.max_context:
                raise ValueError(f"prompt has {n} tokens; the context holds {self.max_context}")
        if len(seqs) > len(self.free_rows):
            raise RuntimeError("not enough free batch rows; check can_admit() first")
        for seq in seqs:
            seq.row = self.free_rows.pop()
            seq.generator = seq.generator or make_generator(seq.params.seed)
            self.cache.reset(seq.row)
        try:
            if len(seqs) > 1 and max(len(s.prompt_ids) for s in seqs) <= PREFILL_CHUNK and \
                    all(s.params.prompt_logprobs is None for s in seqs):
                results = self._prefill_batch(seqs)
            else:
                results = [self._prefill(s.row, s.prompt_ids, s) for s in seqs]
        except BaseException:
            for seq in seqs:                       # give the rows back; nothing was admitted
                self.cache.reset(seq.row)
                self.free_rows.append(seq.row)
                seq.row = -1
            raise
        for seq, (logits, feats) in zip(seqs, results):
            seq.root = self._sample(self._target_rows(seq, logits[None])[0], seq)
            self.running.append(seq)
            if self.drafter is not None:
                self.drafter.start(seq.row, list(seq.prompt_ids), feats)
            self._emit(seq, [seq.root], self._logprobs(seq, logits[None], [seq.root]))

    def _prefill_batch(self, seqs: list[Sequence]) -> list[tuple[torch.Tensor, TargetFeatures | None]]:
        lens = [len(s.prompt_ids) for s in seqs]
        tokens = torch.zeros(len(seqs), max(lens), dtype=torch.long)
        for i, s in enumerate(seqs):
            tokens[i, :lens[i]] = torch.tensor(s.prompt_ids)
        rows = torch.tensor([s.row for s in seqs])
        layers, want_last = self._feature_request()
        positions = torch.arange(max(lens))[None].repeat(len(seqs), 1)
        out = self.model(tokens, positions, self.cache, rows=rows, hidden_layers=layers,
                         logits_index=torch.tensor(lens)[:, None] - 1)
        results = []
        for i, s in enumerate(seqs):
            self.cache.advance(rows[i:i + 1], lens[i])
            feats = None
            if layers or want_last:
                feats = TargetFeatures({k: out.hidden[k][i, :lens[i]] for k in layers},
                                       out.last_hidden[i, :lens[i]] if want_last else None)
            results.append((out.logits[i, 0], feats))
        return results

    def _prefill(self, row: int, ids: list[int], seq: Sequence | None = None
                 ) -> tuple[torch.Tensor, TargetFeatures | None]:
        """Chunked prefill of one row; fills ``seq.prompt_logprobs`` when its params ask (logits
        at every prompt position, entries for prompt tokens 1..n-1)."""
        rows = torch.tensor([row])
        layers, want_last = self._feature_request()
        hid_parts, last_parts, logits = {i: [] for i in layers}, [], None
        k = seq.params.prompt_logprobs if seq is not None else None
        if k is not None:
            seq.prompt_logprobs = []
        for s in range(0, len(ids), PREFILL_CHUNK):
            chunk = torch.tensor([ids[s:s + PREFILL_CHUNK]])
            pos = torch.arange(s, s + chunk.shape[1])[None]
            is_last = s + PREFILL_CHUNK >= len(ids)
            out = self.model(chunk, pos, self.cache, rows=rows, hidden_layers=layers,
                             logits_index=None if k is not None else torch.tensor([[chunk.shape[1] - 1]]),
                             compute_logits=is_last or k is not None)
            self.cache.advance(rows, chunk.shape[1])
            if k is not None:
                nxt = ids[s + 1:s + 1 + chunk.shape[1]]          # the token each position predicts
                seq.prompt_logprobs += token_logprobs(out.logits[0, :len(nxt)], nxt, k)
            for i in layers:
                hid_parts[i].append(out.hidden[i][0])
            if want_last:
                last_parts.append(out.last_hidden[0])
            logits = out.logits[0, -1] if is_last else logits
        feats = None
        if layers or want_last:
            feats = TargetFeatures({i: torch.cat(v) for i, v in hid_parts.items()},
                                   torch.cat(last_parts) if want_last else None)
        return logits, feats

    def _feature_request(self) -> tuple[tuple[int, ...], bool]:
        if self.drafter is None:
            return (), False
        return tuple(dict.fromkeys(self.drafter.hidden_layers)), bool(self.drafter.needs_last_hidden)

    def _target_rows(self, seq: Sequence, logits: torch.Tensor, tree: DraftTree | None = None) -> torch.Tensor:
        """The target rows the request samples from (root, nodes...): penalised when it asks for
        penalties; with ``min_tokens``, end tokens (EOS unless ignored, ``stop_token_ids``) get
        -inf in rows that would emit an output token before that count."""
        p = seq.params
        if penalized(p):
            logits = apply_penalties(logits, p, seq.prompt_ids, seq.output_ids, tree)
        if p.min_tokens > len(seq.output_ids):
            ends = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos))
            depth = torch.zeros(logits.shape[0], dtype=torch.long)
            if tree is not None and len(tree):
                depth[1:] = tree.depth
            early = (len(seq.output_ids) + depth) < p.min_tokens        # output index each row emits
            if ends and bool(early.any()):
                logits = logits.clone()
                logits[early.nonzero().flatten()[:, None], torch.tensor(ends)[None, :]] = float("-inf")
        return logits

    @staticmethod
    def _logprobs(seq: Sequence, logits: torch.Tensor, tokens: list[int]) -> list[TokenLogprob] | None:
        """Entries for ``tokens`` emitted from the rows of ``logits`` (when the request asks)."""
        k = seq.params.logprobs
        return None if k is None else token_logprobs(logits, tokens, k)

    def _sample(self, logits: torch.Tensor, seq: Sequence) -> int:
        if seq.params.greedy:
            return int(logits.argmax())
        return sample(target_probs(logits, seq.params), seq.generator)

    # ------------------------------------------------------------------ one decoding step
    def step(self) -> list[Sequence]:
        """One draft-verify-accept step for every running sequence; returns those touched."""
        seqs = [s for s in self.running if not s.finished]
        if not seqs:
            return []
        # 1) propose
        t0 = time.perf_counter()
        trees = self._propose(seqs)
        t1 = time.perf_counter()
        # 2) verify: one target forward over (root, tree nodes) of every row
        out, rows = self._verify_forward(seqs, trees)
        t2 = time.perf_counter()
        # 3) accept, compact, hand the drafter its tokens and features, emit
        for b, (seq, tree) in enumerate(zip(seqs, trees)):
            logits = self._target_rows(seq, out.logits[b, :len(tree) + 1], tree)
            res = self._accept(tree, logits, seq.params, seq.generator)
            keep = torch.tensor([0] + [n + 1 for n in res.nodes])
            self.cache.compact(seq.row, keep)
            committed = [seq.root] + res.tokens[:-1]
            depth = int(tree.depth.max()) if len(tree) else 0
            seq.stats.observe(len(tree), depth, res.num_accepted)
            self.stats.observe(len(tree), depth, res.num_accepted)
            if self.drafter is not None:
                self.drafter.accept(seq.row, committed, self._features(out, b, keep))
            seq.root = res.tokens[-1]
            self._emit(seq, res.tokens, self._logprobs(seq, out.logits[b, keep], res.tokens))
        t3 = time.perf_counter()
        self.stats.draft_time_s += t1 - t0
        self.stats.verify_time_s += t2 - t1
        for s in seqs:
            s.stats.draft_time_s += t1 - t0
            s.stats.verify_time_s += t3 - t1
        return seqs

    def _accept(self, tree, logits, params, generator):
        """The lossless verifier, unless the drafter opted into its own (lossy) acceptance, e.g.
        Medusa's typical acceptance, which exists only when a user asked for it by name."""
        custom = getattr(self.drafter, "acceptance", None)
        return (custom or accept)(tree, logits, params, generator)

    def _propose(self, seqs: list[Sequence]) -> list[DraftTree]:
        if self.drafter is None:
            return [DraftTree.empty() for _ in seqs]
        reqs = [DraftRequest(s.row, s.prompt_ids + s.output_ids, s.params, s.generator,
                             max_nodes=self._room(s)) for s in seqs]
        trees = self.drafter.propose(reqs)
        out = []
        for s, t in zip(seqs, trees):
            if len(t) > self.drafter.max_tree_nodes:
                raise RuntimeError(f"drafter proposed {len(t)} nodes, more than its max_tree_nodes "
                                   f"{self.drafter.max_tree_nodes}")
            out.append(t)
        return out

    def _room(self, seq: Sequence) -> int:
        """Draft tokens worth proposing: never more than what max_tokens and context leave."""
        left_tokens = seq.params.max_tokens - len(seq.output_ids)
        left_ctx = self.max_context - len(seq.prompt_ids) - len(seq.output_ids)
        return max(0, min(left_tokens, left_ctx) - 1)

    def _verify_forward(self, seqs, trees):
        t = 1 + max(len(tr) for tr in trees)
        b = len(seqs)
        tokens = torch.zeros(b, t, dtype=torch.long)
        positions = torch.zeros(b, t, dtype=torch.long)
        mask = torch.eye(t, dtype=torch.bool).repeat(b, 1, 1)
        rows = torch.tensor([s.row for s in seqs])
        lengths = self.cache.lengths[rows].tolist()
        for i, (seq, tree) in enumerate(zip(seqs, trees)):
            n = len(tree) + 1
            tokens[i, 0] = seq.root
            tokens[i, 1:n] = tree.tokens
            positions[i, :n] = tree.positions(lengths[i])
            positions[i, n:] = lengths[i]
            mask[i, :n, :n] = tree.ancestor_mask()
        layers, want_last = self._feature_request()
        out = self.model(tokens, positions, self.cache, attn_mask=mask, rows=rows, hidden_layers=layers)
        return out, rows

    def _features(self, out, b: int, keep: torch.Tensor) -> TargetFeatures | None:
        layers, want_last = self._feature_request()
        if not layers and not want_last:
            return None
        return TargetFeatures({i: out.hidden[i][b, keep] for i in layers},
                              out.last_hidden[b, keep] if want_last else None)

    # ------------------------------------------------------------------ output and retirement
    def _emit(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        """Append tokens (and their logprobs) up to the first stop condition; notify; retire if
        finished."""
        new: list[int] = []
        p = seq.params
        if logprobs is not None and seq.logprobs is None:
            seq.logprobs = []
        for i, tok in enumerate(tokens):
            if (tok in self.eos and not p.ignore_eos) or tok in p.stop_token_ids:
                self._finish(seq, "stop")
                break
            new.append(tok)
            seq.output_ids.append(tok)
            if logprobs is not None:
                seq.logprobs.append(logprobs[i])
            if p.stop and self._hit_stop_string(seq):
                self._finish(seq, "stop")
                break
            if len(seq.output_ids) >= p.max_tokens or \
                    len(seq.prompt_ids) + len(seq.output_ids) >= self.max_context:
                self._finish(seq, "length")
                break
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        if seq.on_tokens is not None and (new or seq.finished):
            seq.on_tokens(seq, new)
        if seq.finished:
            self._release(seq)

    def _hit_stop_string(self, seq: Sequence) -> bool:
        if self.decode is None:
            return False
        text = self.decode(seq.output_ids)
        return any(s in text for s in seq.params.stop)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finished, seq.finish_reason = True, reason
        seq.end_time = time.perf_counter()

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self.cache.reset(seq.row)
            if self.drafter is not None:
                self.drafter.release(seq.row)
            self.free_rows.append(seq.row)

    def abort(self, seq: Sequence) -> None:
        """Cancel a running sequence and free its row (e.g. a client disconnected)."""
        if not seq.finished:
            self._finish(seq, "abort")
        self._release(seq)

    def run(self, seqs: list[Sequence]) -> list[Sequence]:
        """Decode ``seqs`` to completion, admitting them as rows free up."""
        waiting = list(seqs)
        while waiting or self.running:
            if waiting and self.free_rows:
                batch, waiting = waiting[:len(self.free_rows)], waiting[len(self.free_rows):]
                self.add_many(batch)
            self.step()
        return seqs
