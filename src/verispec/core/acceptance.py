"""The acceptance rule: the engine's one slot for deciding which draft tokens to keep.

The engine is built with a rule (``Engine(..., acceptance=...)``), as vLLM keeps its rejection
sampler apart from its proposers; drafters never choose it. A rule decides a whole step at once:
``rule.accept_batch(batch, logits, params, generators) -> BatchAccept`` on the packed trees
(``TreeBatch``) and the processed target rows ``[B, T, V]`` of (root, tree nodes..., padding),
in a fixed number of tensor operations with no host reads (see ``verify`` for accepted /
recovered / bonus tokens). ``rule(tree, logits, params, generator) -> AcceptResult`` decides one
tree (a batch of one). A rule with only ``__call__`` still works in the engine (``batched``
loops over its rows, with the host reads that brings).

- ``LosslessAcceptance`` (the default): greedy, or recursive rejection sampling; the output
  follows the target distribution exactly.
- ``LossyTypicalAcceptance``: Medusa's typical acceptance. **Lossy**: the output no longer
  follows the target distribution. Opt-in only, by name (``typical_acceptance: true``); its
  ``lossy`` flag is reported in request metrics, server responses and ``/metrics``.
Knows nothing about models or drafters.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Protocol, Sequence, runtime_checkable

import torch

from .params import SamplingParams
from .tree import DraftTree
from .tree_batch import TreeBatch
from .verify import (AcceptResult, BatchAccept, accept_batch, batch_target_probs, draw_uniforms, finish_path,
                     path_from_mask, rows_at, sample_inverse_cdf, with_greedy_rows)

BatchRule = Callable[[TreeBatch, torch.Tensor, Sequence[SamplingParams], Sequence[torch.Generator | None]],
                     BatchAccept]


@runtime_checkable
class AcceptanceRule(Protocol):
    name: str          # reported in metrics; a lossy rule's name says "lossy"
    lossy: bool        # True: the output does not follow the target distribution

    def __call__(self, tree: DraftTree, logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None) -> AcceptResult: ...


def batched(rule: AcceptanceRule) -> BatchRule:
    """The rule's ``accept_batch``; for a rule without one, a loop calling it row by row."""
    if hasattr(rule, "accept_batch"):
        return rule.accept_batch

    def per_row(batch: TreeBatch, logits, params, generators) -> BatchAccept:
        trees = [DraftTree(batch.node_tokens[b, :n], batch.parent_entry[b, :n] - 1,
                           batch.q[b, :n] if batch.q is not None else None) for b, n in enumerate(batch.sizes)]
        return BatchAccept.from_results([rule(t, logits[b, :len(t) + 1], p, g)
                                         for b, (t, p, g) in enumerate(zip(trees, params, generators))],
                                        batch.max_depth, logits.device)
    return per_row


class _OneTree:
    """``__call__`` on one tree through the rule's ``accept_batch`` (a batch of one)."""

    def __call__(self, tree: DraftTree, logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None) -> AcceptResult:
        batch = TreeBatch.pack([tree], [0], [0], device=logits.device)
        return self.accept_batch(batch, logits[None], [params], [generator]).to_host()[0]


@dataclass(frozen=True)
class LosslessAcceptance(_OneTree):
    """Greedy or lossless recursive rejection sampling (``verify.accept_batch``)."""
    name: ClassVar[str] = "lossless"
    lossy: ClassVar[bool] = False

    def accept_batch(self, batch: TreeBatch, logits: torch.Tensor, params: Sequence[SamplingParams],
                     generators: Sequence[torch.Generator | None]) -> BatchAccept:
        return accept_batch(batch, logits, params, generators)


@dataclass(frozen=True)
class LossyTypicalAcceptance(_OneTree):
    """Medusa's typical acceptance, **lossy**. A draft token x below a node whose target
    distribution is p (temperature, top-k, top-p applied) passes when
    ``p(x) > min(posterior_threshold, posterior_alpha * exp(-H(p)))``. Among root-to-node paths
    whose every token passes, the longest is taken (ties: the larger sum of target log-probs,
    then the earlier node). The final token is a draw from p at the path's end. Greedy requests
    get the ordinary greedy rule, as in Medusa."""
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    name: ClassVar[str] = "lossy_typical"
    lossy: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not (0 < self.posterior_threshold <= 1) or not (0 < self.posterior_alpha <= 1):
            raise ValueError("posterior_threshold and posterior_alpha must lie in (0, 1]")

    def accept_batch(self, batch: TreeBatch, logits: torch.Tensor, params: Sequence[SamplingParams],
                     generators: Sequence[torch.Generator | None]) -> BatchAccept:
        def typical() -> BatchAccept:
            probs = batch_target_probs(logits, params)                           # [B, T, V]
            last, walked = path_from_mask(batch, self._typical_path(batch, probs))
            u = draw_uniforms(batch, [not p.greedy for p in params], generators)
            final_dist = rows_at(probs, last[:, None])[:, 0]
            return finish_path(batch, walked, sample_inverse_cdf(final_dist, u[:, -1]), last)
        return with_greedy_rows(batch, logits, params, typical)

    def _typical_path(self, batch: TreeBatch, probs: torch.Tensor) -> torch.Tensor:
        """``on_path [B, N]``: the longest all-passing root path (ties: larger log-prob sum, then
        the earlier node)."""
        b, n = batch.valid.shape
        if n == 0:
            return batch.valid
        ent = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)              # [B, T]
        thresh = torch.clamp(self.posterior_alpha * torch.exp(-ent), max=self.posterior_threshold)
        rows = torch.arange(b, device=probs.device)
        px = probs[rows[:, None], batch.parent_entry, batch.node_tokens]         # [B, N]
        passed = (px > thresh.gather(1, batch.parent_entry)) & batch.valid
        ok = ~(batch.ancestor & ~passed[:, None, :]).any(-1) & batch.valid      # the whole path passes
        logp = torch.where(batch.valid, torch.log(px.clamp_min(1e-30)), 0.0)
        score = (batch.ancestor.float() @ logp[..., None])[..., 0]              # sum of log p on the path
        length = batch.ancestor.sum(-1)
        cand = ok & (length == torch.where(ok, length, 0).amax(-1, keepdim=True))
        best = torch.where(cand, score, float("-inf")).argmax(-1)               # first of the best
        return batch.ancestor[rows, best] & cand.any(-1, keepdim=True)


LOSSLESS = LosslessAcceptance()
