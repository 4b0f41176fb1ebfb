"""The logits pipeline: one ordered list of processors built from ``SamplingParams``.

    target logits of (root, tree nodes...) ──► processors ──► warpers ──► distribution
                     [N+1, V]                 (per row)      (per row)     [N+1, V]

Processors change the target's next-token logits given what comes before each row, in this
order (as HF's ``LogitsProcessorList``, vLLM's logits processors):
1. ``repetition_penalty`` (HF / CTRL, prompt and generated tokens): a positive logit is divided
   by it, a negative one multiplied;
2. ``frequency_penalty`` f and ``presence_penalty`` r (OpenAI's, generated tokens):
   ``logit[t] -= f * count(t) + r * (count(t) > 0)``;
3. ``logit_bias`` (OpenAI's): a fixed value added per token id;
4. ``allowed_token_ids`` (vLLM's): every other token gets -inf;
5. ``min_tokens``: end tokens (EOS unless ignored, ``stop_token_ids``) get -inf in rows that
   would emit an output token before that count;
6. a grammar (``constraint``, structured output): tokens it forbids after each row's path get
   -inf. It is a hard constraint: a row where the processors above leave no token the grammar
   allows falls back to the grammar alone (e.g. ``min_tokens`` against a complete JSON document,
   where only an end token may follow). Its ``prune`` runs on a draft tree before verification
   and ``commit`` on emitted tokens (see ``grammar``).
Warpers then turn a row into the distribution a token is drawn from: temperature, top-k,
softmax, min-p, top-p (greedy: one-hot at the argmax). ``target_probs`` is the warper stage
alone; drafters apply it to their own logits so that target and draft are warped alike.

In a draft tree the "generated" tokens of a row are the request's output so far (which ends with
the root) plus the node's own root path, and its output index is the output length plus the
node's depth: every row of the verification forward gets its own counts and depth. The verifier
samples from these processed target rows; drafters keep drafting from their own distributions
(q is whatever a draft was drawn from), so acceptance stays lossless with respect to the
processed target. Knows nothing about models or drafters.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import torch

from .params import SamplingParams
from .tree import DraftTree


@dataclass(frozen=True)
class RowContext:
    """What processors know of the rows of one request: ``rows`` logit rows, root first;
    ``tree`` None means one row, the token after ``output_ids``. Every tensor it makes is on
    ``device`` (the logits')."""
    prompt_ids: list[int]
    output_ids: list[int]
    tree: DraftTree | None
    rows: int
    vocab: int
    device: torch.device = torch.device("cpu")

    @cached_property
    def counts(self) -> torch.Tensor:
        """[rows, V] float: how often each token was generated before each row."""
        dev = self.device
        out = torch.tensor(self.output_ids, dtype=torch.long, device=dev)
        counts = torch.bincount(out, minlength=self.vocab)[:self.vocab].float().expand(self.rows, self.vocab).clone()
        if self.tree is not None and len(self.tree):
            path = self.tree.ancestor_mask()[:, 1:].to(dev).float()          # [N+1, N]: node j on row i's path
            onehot = torch.zeros(len(self.tree), self.vocab, device=dev).scatter_(
                1, self.tree.tokens[:, None].to(dev), 1.0)
            counts += path @ onehot
        return counts

    @cached_property
    def depth(self) -> torch.Tensor:
        """[rows] long: 0 for the root row, the node's depth for the others."""
        depth = torch.zeros(self.rows, dtype=torch.long, device=self.device)
        if self.tree is not None and len(self.tree):
            depth[1:] = self.tree.depth.to(self.device)
        return depth


class LogitsProcessor(Protocol):
    def __call__(self, logits: torch.Tensor, ctx: RowContext) -> torch.Tensor:
        """Processed float32 logits ``[rows, V]`` (may modify ``logits``: the pipeline passes a copy)."""


@dataclass(frozen=True)
class RepetitionPenalty:
    penalty: float

    def __call__(self, logits: torch.Tensor, ctx: RowContext) -> torch.Tensor:
        seen = ctx.counts > 0
        if ctx.prompt_ids:
            seen[:, torch.tensor(ctx.prompt_ids, dtype=torch.long, device=seen.device)] = True
        rp = self.penalty
        return torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)


@dataclass(frozen=True)
class FrequencyPresencePenalty:
    frequency: float
    presence: float

    def __call__(self, logits: torch.Tensor, ctx: RowContext) -> torch.Tensor:
        if self.frequency:
            logits -= self.frequency * ctx.counts
        if self.presence:
            logits -= self.presence * (ctx.counts > 0).float()
        return logits


def _ids_in_vocab(ids, v: int, what: str, device: torch.device) -> torch.Tensor:
    ids = list(ids)
    if max(ids) >= v:
        raise ValueError(f"{what} names token {max(ids)}, outside the vocabulary of {v}")
    return torch.tensor(ids, dtype=torch.long, device=device)


@dataclass(frozen=True)
class LogitBias:
    bias: tuple[tuple[int, float], ...]

    def __call__(self, logits: torch.Tensor, ctx: RowContext) -> torch.Tensor:
        ids = _ids_in_vocab((t for t, _ in self.bias), ctx.vocab, "logit_bias", logits.device)
        logits[:, ids] += torch.tensor([b for _, b in self.bias], dtype=logits.dtype, device=logits.device)
        return logits


@dataclass(frozen=True)
class AllowedTokens:
    ids: tuple[int, ...]

    def __call__(self, logits: torch.Tensor, ctx: RowContext) -> torch.Tensor:
        keep = torch.zeros(ctx.vocab, dtype=torch.bool, device=logits.device)
        keep[_ids_in_vocab(self.ids, ctx.vocab, "allowed_token_ids", logits.device)] = True
        return logits.masked_fill(~keep, float("-inf"))


@dataclass(frozen=True)
class MinTokens:
    min_tokens: int
    end_ids: tuple[int, ...]

    def __call__(self, logits: torch.Tensor, ctx: RowContext) -> torch.Tensor:
        early = (len(ctx.output_ids) + ctx.depth) < self.min_tokens     # output index each row emits
        if bool(early.any()):
            ends = torch.tensor(self.end_ids, dtype=torch.long, device=logits.device)
            logits[early.nonzero().flatten()[:, None], ends[None, :]] = float("-inf")
        return logits


class TokenConstraint(Protocol):
    """A stateful constraint on what may be emitted (a grammar matcher: ``grammar.GrammarConstraint``)."""

    def prune(self, tree: DraftTree) -> DraftTree:
        """``tree`` without nodes the constraint forbids (connected, topological, q consistent)."""

    def masks(self, tree: DraftTree | None) -> torch.Tensor:
        """bool [N+1, V] (``[1, V]`` for None): tokens allowed after (root, nodes...)."""

    def commit(self, tokens: list[int]) -> None:
        """Advance past tokens that were emitted."""


@dataclass(frozen=True)
class LogitsPipeline:
    """The processors of one request, in order, then its warpers (see the module docstring).
    Build it with ``LogitsPipeline.build``; an empty ``processors`` and no ``constraint`` leave
    target rows as they are."""
    params: SamplingParams
    processors: tuple[LogitsProcessor, ...] = field(default=())
    constraint: TokenConstraint | None = None

    @classmethod
    def build(cls, params: SamplingParams, eos_ids: tuple[int, ...] | frozenset[int] = (),
              constraint: TokenConstraint | None = None) -> "LogitsPipeline":
        """The pipeline of ``params``; ``eos_ids``: the model's end tokens (for ``min_tokens``);
        ``constraint``: the output's grammar matcher (structured output), owned by this pipeline."""
        procs: list[LogitsProcessor] = []
        if params.repetition_penalty != 1.0:
            procs.append(RepetitionPenalty(params.repetition_penalty))
        if params.frequency_penalty or params.presence_penalty:
            procs.append(FrequencyPresencePenalty(params.frequency_penalty, params.presence_penalty))
        if params.logit_bias:
            procs.append(LogitBias(tuple(params.logit_bias.items())))
        if params.allowed_token_ids is not None:
            procs.append(AllowedTokens(tuple(params.allowed_token_ids)))
        ends = tuple(sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))))
        if params.min_tokens > 0 and ends:
            procs.append(MinTokens(params.min_tokens, ends))
        return cls(params, tuple(procs), constraint)

    def active(self, num_output: int) -> bool:
        """Whether ``process`` changes anything for a request with ``num_output`` tokens so far
        (False: its target rows pass through untouched)."""
        return self.constraint is not None or any(
            not isinstance(p, MinTokens) or p.min_tokens > num_output for p in self.processors)

    def process(self, logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int],
                tree: DraftTree | None = None) -> torch.Tensor:
        """Processed target rows: ``logits [N+1, V]`` of (root, tree nodes...), or ``[1, V]`` for
        the next token after ``output_ids`` (``tree`` None). Unchanged when nothing applies."""
        rows = logits.shape[0]
        if tree is not None and rows != len(tree) + 1:
            raise ValueError(f"{rows} logit rows for a tree of {len(tree)} nodes (expected {len(tree) + 1})")
        procs = [p for p in self.processors if not isinstance(p, MinTokens) or p.min_tokens > len(output_ids)]
        if not procs and self.constraint is None:
            return logits
        ctx = RowContext(prompt_ids, output_ids, tree, rows, logits.shape[-1], logits.device)
        x = logits.float().clone()
        for proc in procs:
            x = proc(x, ctx)
        if self.constraint is not None:
            x = self._constrain(x, logits, tree)
        return x

    def _constrain(self, x: torch.Tensor, raw: torch.Tensor, tree: DraftTree | None) -> torch.Tensor:
        allowed = self.constraint.masks(tree).to(x.device)      # grammars compute masks on the CPU
        if allowed.shape != x.shape:
            raise ValueError(f"grammar masks {tuple(allowed.shape)} for logits {tuple(x.shape)}: vocabulary mismatch")
        x = x.masked_fill(~allowed, float("-inf"))
        dead = ~torch.isfinite(x).any(-1)
        if bool(dead.any()):                # the grammar wins over the other processors
            x[dead] = raw[dead].float().masked_fill(~allowed[dead], float("-inf"))
        return x

    def restrict(self, tree: DraftTree) -> DraftTree:
        """``tree`` without drafts the constraint forbids (unchanged without a constraint)."""
        return tree if self.constraint is None or not len(tree) else self.constraint.prune(tree)

    def commit(self, tokens: list[int]) -> None:
        """Tell the constraint which tokens were emitted."""
        if self.constraint is not None and tokens:
            self.constraint.commit(tokens)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The warper stage of this request's params (``target_probs``)."""
        return target_probs(logits, self.params)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Distribution [..., V] (float32) after temperature, top-k, min-p and top-p. Greedy: one-hot argmax."""
    logits = logits.float()
    if params.greedy:
        out = torch.zeros_like(logits)
        return out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if params.top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        drop_sorted = (cum - sorted_p) >= params.top_p      # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
