"""Acceptance of a verified draft tree: greedy and lossless rejection sampling.

Terms, defined once:
- **accepted** tokens: draft tokens the verifier keeps, a path from the root down the tree.
- **recovered** token: when every child of the last accepted node is rejected, one token drawn
  from the residual distribution left after those rejections.
- **bonus** token: when the last accepted node has no children, one token drawn from the
  target distribution there.
Each step emits ``accepted + 1`` tokens (the one is recovered or bonus).

Sampling is multi-candidate recursive rejection sampling (SpecInfer, EAGLE): at node u with target
distribution p, try its children in order; child x drawn from q is accepted with probability
min(1, p(x)/q(x)); on rejection p <- norm(relu(p - q)) and the next sibling is tried. A
deterministic drafter has q = one-hot(x). For any proposal distributions (also ones that depend on
earlier siblings, like sampling without replacement) the emitted tokens follow the target exactly.
Greedy (temperature 0): follow the child equal to the target argmax, then the argmax is the bonus.

Random draws, in order: one uniform per child tried, then one multinomial draw for the final token.
Knows nothing about models or drafters.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import SamplingParams, target_probs
from .tree import DraftTree


@dataclass(frozen=True)
class AcceptResult:
    nodes: list[int]        # accepted node indices, root to leaf (root excluded)
    tokens: list[int]       # accepted draft tokens followed by the recovered/bonus token
    bonus: bool             # True: final token is a bonus (path ended at a leaf); False: recovered

    @property
    def num_accepted(self) -> int:
        return len(self.nodes)


def accept_greedy(tree: DraftTree, logits: torch.Tensor) -> AcceptResult:
    """``logits [N+1, V]`` of (root, nodes...) from the verify forward."""
    best = logits.argmax(-1).tolist()
    kids = tree.children()
    toks = tree.tokens.tolist()
    cur, nodes = -1, []
    while True:
        nxt = next((c for c in kids[cur + 1] if toks[c] == best[cur + 1]), None)
        if nxt is None:
            break
        nodes.append(nxt)
        cur = nxt
    return AcceptResult(nodes, [toks[n] for n in nodes] + [best[cur + 1]], bonus=not kids[cur + 1])


def accept_sampled(tree: DraftTree, logits: torch.Tensor, params: SamplingParams,
                   generator: torch.Generator | None) -> AcceptResult:
    """Lossless recursive rejection sampling over the tree (see module docstring)."""
    return accept_from_probs(tree, target_probs(logits, params), generator)


def accept_from_probs(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None) -> AcceptResult:
    """Recursive rejection sampling given target distributions ``probs [N+1, V]`` of
    (root, nodes...) already processed by temperature / top-k / top-p."""
    kids = tree.children()
    toks = tree.tokens.tolist()
    cur, nodes = -1, []
    while True:
        p = probs[cur + 1]
        residual = False
        chosen = None
        for c in kids[cur + 1]:
            x = toks[c]
            qx = 1.0 if tree.q is None else float(tree.q[c, x])
            u = float(torch.rand((), generator=generator))
            if u * qx < float(p[x]):
                chosen = c
                break
            p = _residual(p, tree.q[c] if tree.q is not None else None, x)
            residual = True
        if chosen is None:
            final = int(torch.multinomial(p, 1, generator=generator))
            return AcceptResult(nodes, [toks[n] for n in nodes] + [final], bonus=not residual)
        nodes.append(chosen)
        cur = chosen


def _residual(p: torch.Tensor, q: torch.Tensor | None, x: int) -> torch.Tensor:
    """norm(relu(p - q)); q None = one-hot at x."""
    if q is None:
        r = p.clone()
        r[x] = 0.0
    else:
        r = (p - q).clamp_min_(0.0)
    s = float(r.sum())
    return r / s if s > 1e-12 else p


def accept(tree: DraftTree, logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> AcceptResult:
    """Dispatch on the request's temperature."""
    if params.greedy:
        return accept_greedy(tree, logits)
    return accept_sampled(tree, logits, params, generator)
