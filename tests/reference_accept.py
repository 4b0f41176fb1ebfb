"""Sequential reference verifiers (the per-node loops verispec used before batched acceptance):
the oracles the batched code in ``verify`` / ``acceptance`` is checked against, path for path.

``reference_sampled`` takes node-indexed uniforms (node i's test uses ``u[i]``, the final draw
``u[-1]`` by inverse CDF), so with the same uniforms it must give exactly the batched result.
"""
from __future__ import annotations

import math

import torch

from verispec.core.tree import DraftTree
from verispec.core.verify import AcceptResult, sample_inverse_cdf


def reference_greedy(tree: DraftTree, logits: torch.Tensor) -> AcceptResult:
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


def reference_sampled(tree: DraftTree, probs: torch.Tensor, u: torch.Tensor) -> AcceptResult:
    """Recursive rejection sampling, sibling by sibling, child c tested with ``u[c]``."""
    kids = tree.children()
    toks = tree.tokens.tolist()
    cur, nodes = -1, []
    while True:
        p = probs[cur + 1].float()
        tried = False
        chosen = None
        for c in kids[cur + 1]:
            x = toks[c]
            qx = 1.0 if tree.q is None else float(tree.q[c, x])
            if float(u[c]) * qx < float(p[x]):
                chosen = c
                break
            if tree.q is None:
                r = p.clone()
                r[x] = 0.0
            else:
                r = (p - tree.q[c].float()).clamp_min(0.0)
            s = float(r.sum())
            p = r / s if s > 1e-12 else p
            tried = True
        if chosen is None:
            final = int(sample_inverse_cdf(p[None], u[-1:])[0])
            return AcceptResult(nodes, [toks[n] for n in nodes] + [final], bonus=not tried)
        nodes.append(chosen)
        cur = chosen


def reference_typical(tree: DraftTree, probs: torch.Tensor, u_final: float,
                      threshold: float = 0.09, alpha: float = 0.3) -> AcceptResult:
    """Medusa's typical acceptance, node by node (the rule's former per-tree loop)."""
    ent = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
    thresh = torch.clamp(alpha * torch.exp(-ent), max=threshold)
    toks, par = tree.tokens.tolist(), tree.parents.tolist()
    ok, length, score = {-1: True}, {-1: 0}, {-1: 0.0}
    best = -1
    for i in range(len(tree)):
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
    final = int(sample_inverse_cdf(probs[best + 1][None], torch.tensor([u_final]))[0])
    return AcceptResult(path, [toks[n] for n in path] + [final], bonus=not any(p == best for p in par))
