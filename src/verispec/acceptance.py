"""The acceptance rule: the engine's one slot for deciding which draft tokens to keep.

The engine is built with a rule (``Engine(..., acceptance=...)``), as vLLM keeps its rejection
sampler apart from its proposers; drafters never choose it. A rule is called as
``rule(tree, logits, params, generator) -> AcceptResult`` on one request's processed target rows
``[N+1, V]`` of (root, tree nodes...) (see ``verify`` for accepted / recovered / bonus tokens).

- ``LosslessAcceptance`` (the default): greedy, or recursive rejection sampling; the output
  follows the target distribution exactly.
- ``LossyTypicalAcceptance``: Medusa's typical acceptance. **Lossy**: the output no longer
  follows the target distribution. Opt-in only, by name (``typical_acceptance: true``); its
  ``lossy`` flag is reported in request metrics, server responses and ``/metrics``.
Knows nothing about models or drafters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch

from .logits import target_probs
from .params import SamplingParams
from .tree import DraftTree
from .verify import AcceptResult, accept, accept_greedy


@runtime_checkable
class AcceptanceRule(Protocol):
    name: str          # reported in metrics; a lossy rule's name says "lossy"
    lossy: bool        # True: the output does not follow the target distribution

    def __call__(self, tree: DraftTree, logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None) -> AcceptResult: ...


@dataclass(frozen=True)
class LosslessAcceptance:
    """Greedy or lossless recursive rejection sampling (``verify.accept``)."""
    name: ClassVar[str] = "lossless"
    lossy: ClassVar[bool] = False

    def __call__(self, tree: DraftTree, logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None) -> AcceptResult:
        return accept(tree, logits, params, generator)


@dataclass(frozen=True)
class LossyTypicalAcceptance:
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

    def __call__(self, tree: DraftTree, logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None) -> AcceptResult:
        if params.greedy:
            return accept_greedy(tree, logits)
        probs = target_probs(logits, params)                                # [N+1, V]
        ent = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
        thresh = torch.clamp(self.posterior_alpha * torch.exp(-ent), max=self.posterior_threshold)
        toks, par = tree.tokens.tolist(), tree.parents.tolist()
        ok, length, score = {-1: True}, {-1: 0}, {-1: 0.0}
        best = -1
        for i in range(len(tree)):                                         # topological order
            p_row = par[i] + 1
            px = float(probs[p_row, toks[i]])
            ok[i] = ok[par[i]] and px > float(thresh[p_row])
            if not ok[i]:
                continue
            length[i], score[i] = length[par[i]] + 1, score[par[i]] + math.log(max(px, 1e-30))
            if (length[i], score[i]) > (length[best], score[best]):
                best = i
        path, n = [], best
        while n >= 0:
            path.append(n)
            n = par[n]
        path.reverse()
        final = int(torch.multinomial(probs[best + 1], 1, generator=generator))
        return AcceptResult(path, [toks[n] for n in path] + [final], bonus=not any(p == best for p in par))


LOSSLESS = LosslessAcceptance()
