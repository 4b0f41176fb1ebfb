"""Acceptance of verified draft trees, for a whole batch at once: greedy and lossless rejection sampling.

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

How it is batched (``TreeBatch`` holds the structure; no host reads until ``BatchAccept.to_host``):
1. Every node gets its own uniform u. For each sibling rank k (one group of tensor operations per
   rank, all parents of the batch at once), child c of parent entry e is tested against the
   residual of e left after its first k children were rejected, ``u_c q_c(x) < P_k[e](x)``, and
   then ``P_{k+1}[e] = norm(relu(P_k[e] - q_c))``. A test only matters when the earlier siblings
   failed, and then it is exactly the sequential test.
2. A node is *chosen* when its test passes and no earlier sibling's does; it is *on the path* when
   it and all its ancestors are chosen (one masked reduction over the ancestor matrix).
3. The last accepted entry is the deepest node on the path (0: the root). The final token is drawn
   from its residual after all its children (the target itself when it has none) by inverse CDF
   with the row's last uniform.
Random draws per row, from the request's generator: ``len(tree) + 1`` uniforms in one call (node
i's test uses the i-th, the final token the last); greedy rows draw nothing. So a request's draws
depend on its own tree only, never on the batch it shares a step with.
Knows nothing about models or drafters.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .sampling import SamplingParams, target_probs
from .tree import DraftTree
from .tree_batch import TreeBatch

RESIDUAL_EPS = 1e-12    # a residual summing to no more than this is left as it was (p)
# Greedy rows of CPU logits are walked on the host (``accept_greedy_host``); the batched,
# sync-free path is for devices where a host read stalls the stream. Tests of that path's
# no-sync property turn this off.
HOST_WALK_ON_CPU = True


@dataclass(frozen=True)
class AcceptResult:
    nodes: list[int]        # accepted node indices, root to leaf (root excluded)
    tokens: list[int]       # accepted draft tokens followed by the recovered/bonus token
    bonus: bool             # True: final token is a bonus (path ended at a leaf); False: recovered

    @property
    def num_accepted(self) -> int:
        return len(self.nodes)


@dataclass(frozen=True)
class BatchAccept:
    """Acceptance of a whole batch, on the device. ``nodes [B, D]``: accepted node indices, root
    to leaf, -1 after ``num_accepted``; ``keep [B, D + 1]``: entries to commit (0 = the root, node
    i = i + 1), 0 past ``num_accepted + 1``; ``tokens [B, D + 1]``: accepted tokens then the
    final one at column ``num_accepted``, -1 after; ``bonus [B]``."""
    num_accepted: torch.Tensor
    nodes: torch.Tensor
    keep: torch.Tensor
    tokens: torch.Tensor
    bonus: torch.Tensor

    @staticmethod
    def from_results(results: Sequence[AcceptResult], depth: int, device: torch.device | str) -> "BatchAccept":
        """Pack per-row results (a rule without ``accept_batch``) into the batched layout."""
        b = len(results)
        nodes = [r.nodes + [-1] * (depth - r.num_accepted) for r in results]
        tokens = [r.tokens + [-1] * (depth + 1 - len(r.tokens)) for r in results]
        t = lambda x, dt=torch.long: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
        return BatchAccept(t([r.num_accepted for r in results]), t(nodes), t([[0] + [n + 1 for n in row] for row in nodes]),
                           t(tokens), t([r.bonus for r in results], torch.bool))

    def to_host(self) -> list[AcceptResult]:
        """The one host copy of a step: every row's ``AcceptResult``."""
        packed = torch.cat([self.num_accepted[:, None], self.bonus[:, None].long(), self.nodes, self.tokens], 1)
        d = self.nodes.shape[1]
        out = []
        for row in packed.tolist():
            n = row[0]
            out.append(AcceptResult(row[2:2 + n], row[2 + d:2 + d + n + 1], bool(row[1])))
        return out


# ------------------------------------------------------------------ batched rules
def accept_batch(batch: TreeBatch, logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None]) -> BatchAccept:
    """Lossless acceptance of every row: greedy rows follow the argmax, sampled rows do recursive
    rejection sampling. ``logits [B, T, V]``: the processed target rows (root, nodes..., padding).
    Target distributions are computed only where they are read: at the ``parent_cols`` entries and
    at each row's last accepted entry."""
    def sampled() -> BatchAccept:
        u = draw_uniforms(batch, [not p.greedy for p in params], generators)
        return _reject_sample(batch, lambda idx: batch_target_probs(rows_at(logits, idx), params), u)
    return with_greedy_rows(batch, logits, params, sampled)


def with_greedy_rows(batch: TreeBatch, logits: torch.Tensor, params: Sequence[SamplingParams],
                     sampled: Callable[[], BatchAccept]) -> BatchAccept:
    """Greedy rows follow the argmax (``accept_greedy_batch``), sampled rows take the decision of
    ``sampled()`` (a rule's decision for the whole batch, called only when some row samples)."""
    sampled_rows = [b for b, p in enumerate(params) if not p.greedy]
    if not sampled_rows:
        return accept_greedy_batch(batch, logits)
    decided = sampled()
    if len(sampled_rows) == batch.batch:
        return decided
    greedy = accept_greedy_batch(batch, logits)
    pick = torch.zeros(batch.batch, dtype=torch.bool, device=logits.device)
    pick[sampled_rows] = True
    return select_rows(pick, decided, greedy)


def accept_greedy_batch(batch: TreeBatch, logits: torch.Tensor) -> BatchAccept:
    """Greedy acceptance: a node passes when its token is the target argmax at its parent. The
    argmax is taken at the ``parent_cols`` entries and at each row's last accepted entry only.
    On the CPU, where reading a result costs nothing, the rows are walked on the host instead
    (``accept_greedy_host``: the same decision, a handful of operations instead of some thirty)."""
    if HOST_WALK_ON_CPU and logits.device.type == "cpu":
        return accept_greedy_host(batch, logits)
    best = rows_at(logits, batch.parent_cols[None].expand(batch.batch, -1)).argmax(-1)   # [B, P]
    at_parent = best.gather(1, batch.parent_slot[batch.parent_entry].clamp_min(0)) if best.shape[1] \
        else torch.zeros_like(batch.node_tokens)
    passed = (batch.node_tokens == at_parent) & batch.valid
    last, result = _walk(batch, passed)
    return finish_path(batch, result, rows_at(logits, last[:, None])[:, 0].argmax(-1), last)


def accept_greedy_host(batch: TreeBatch, logits: torch.Tensor) -> BatchAccept:
    """``accept_greedy_batch``'s decision by a walk on the host: from the root, take the first
    child (in node order, as the batched rule's sibling order) whose token is the argmax at the
    current entry, until none is; the argmax at the last entry is the final token. Only the
    entries on the path are reduced (depth + 1 argmaxes per row)."""
    tokens, parents = batch.node_tokens.tolist(), batch.parent_entry.tolist()
    results = []
    for b, n in enumerate(batch.sizes):
        kids: dict[int, list[int]] = {}
        for i in range(n):
            kids.setdefault(parents[b][i], []).append(i)
        entry, nodes, path = 0, [], []
        while True:
            path.append(int(logits[b, entry].argmax()))
            nxt = next((i for i in kids.get(entry, ()) if tokens[b][i] == path[-1]), None)
            if nxt is None:
                break
            nodes.append(nxt)
            entry = nxt + 1
        results.append(AcceptResult(nodes, path, entry not in kids))
    return BatchAccept.from_results(results, batch.max_depth, logits.device)


def accept_from_probs_batch(batch: TreeBatch, probs: torch.Tensor, u: torch.Tensor) -> BatchAccept:
    """Recursive rejection sampling given target distributions ``probs [B, T, V]`` (warped) and
    uniforms ``u [B, N + 1]`` (node i's test: column i; the final draw: column N)."""
    return _reject_sample(batch, lambda idx: rows_at(probs, idx), u)


def _reject_sample(batch: TreeBatch, probs_at, u: torch.Tensor) -> BatchAccept:
    """Recursive rejection sampling; ``probs_at(idx [B, K]) -> [B, K, V]``: the target
    distributions at entries ``idx`` of each row, as a new tensor (it is reduced in place).
    Residuals are kept for the ``parent_cols`` entries only (leaves are never reduced), so a step
    touches P + 1 rows of V per tree, not T."""
    resid = probs_at(batch.parent_cols[None].expand(batch.batch, -1)).float()   # [B, P, V]
    passed = torch.zeros_like(batch.valid)
    q = batch.q
    for rows, slot, kid in batch.rank_groups:
        x = batch.node_tokens[rows, kid]
        p_rows = resid[rows, slot]                                             # [M, V]
        px = p_rows.gather(1, x[:, None])[:, 0]
        qx = q[rows, kid].gather(1, x[:, None])[:, 0] if q is not None else torch.ones_like(px)
        passed[rows, kid] = u[rows, kid] * qx < px
        if q is not None:
            r = (p_rows - q[rows, kid]).clamp_min_(0.0)
        else:
            r = p_rows.scatter(1, x[:, None], 0.0)
        s = r.sum(-1, keepdim=True)
        resid[rows, slot] = torch.where(s > RESIDUAL_EPS, r / s.clamp_min(RESIDUAL_EPS), p_rows)
    last, result = _walk(batch, passed)
    slot = batch.parent_slot[last]                                             # [B], -1: a leaf
    leaf = probs_at(last[:, None])[:, 0].float()
    if resid.shape[1]:
        branched = rows_at(resid, slot.clamp_min(0)[:, None])[:, 0]
        leaf = torch.where((slot >= 0)[:, None], branched, leaf)
    return finish_path(batch, result, sample_inverse_cdf(leaf, u[:, -1]), last)


# ------------------------------------------------------------------ shared steps
def rows_at(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x [B, T, V]`` at entries ``idx [B, K]`` of each row: ``[B, K, V]``, a new tensor."""
    return x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))


def _walk(batch: TreeBatch, passed: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """From per-node test results to the accepted path: a node is chosen when it passed and no
    earlier sibling did; the path is the chosen nodes all of whose ancestors are chosen."""
    if passed.shape[1] == 0:
        return path_from_mask(batch, passed)
    blocked = (batch.earlier_sibling & passed[:, None, :]).any(-1)
    chosen = passed & ~blocked
    return path_from_mask(batch, ~(batch.ancestor & ~chosen[:, None, :]).any(-1) & batch.valid)


def path_from_mask(batch: TreeBatch, on_path: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """``on_path [B, N]`` (a root path per row) -> (last entry [B] (0: the root), (num_accepted
    [B], nodes [B, D] in root-to-leaf order, -1 after))."""
    b, n = on_path.shape
    dev = on_path.device
    d = batch.max_depth
    if n == 0:
        zeros = torch.zeros(b, dtype=torch.long, device=dev)
        return zeros, (zeros, torch.zeros(b, 0, dtype=torch.long, device=dev))
    num = on_path.sum(-1)
    col = torch.arange(n, device=dev)
    last = torch.where(on_path, col + 1, 0).amax(-1)                          # deepest = highest index
    order = torch.where(on_path, col, n + col).sort(-1).values[:, :d]         # path nodes first, in order
    nodes = torch.where(torch.arange(d, device=dev)[None] < num[:, None], order, -1)
    return last, (num, nodes)


def finish_path(batch: TreeBatch, walked: tuple[torch.Tensor, torch.Tensor], final: torch.Tensor,
            last: torch.Tensor) -> BatchAccept:
    num, nodes = walked
    b, d = nodes.shape
    dev = nodes.device
    acc_tokens = batch.node_tokens.gather(1, nodes.clamp_min(0)) if d else nodes
    tokens = torch.cat([torch.where(nodes >= 0, acc_tokens, -1), torch.full((b, 1), -1, device=dev)], 1)
    tokens = tokens.scatter(1, num[:, None], final[:, None].long())
    keep = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=dev), nodes.clamp_min(-1) + 1], 1)
    bonus = ~batch.has_children.gather(1, last[:, None])[:, 0]
    return BatchAccept(num, nodes, keep, tokens, bonus)


def select_rows(pick: torch.Tensor, a: BatchAccept, b: BatchAccept) -> BatchAccept:
    """Row-wise choice: ``a``'s rows where ``pick [B]`` is True, else ``b``'s."""
    m = pick[:, None]
    return BatchAccept(torch.where(pick, a.num_accepted, b.num_accepted), torch.where(m, a.nodes, b.nodes),
                       torch.where(m, a.keep, b.keep), torch.where(m, a.tokens, b.tokens),
                       torch.where(pick, a.bonus, b.bonus))


def sample_inverse_cdf(dist: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``dist [M, V]`` (non-negative, any positive sum) from uniforms
    ``u [M]`` in [0, 1): the first index whose cumulative mass exceeds u * total. Never a
    zero-probability token."""
    cum = dist.float().cumsum(-1)
    idx = torch.searchsorted(cum, (u.float() * cum[:, -1])[:, None], right=True)[:, 0]
    col = torch.arange(dist.shape[-1], device=dist.device)
    last_nonzero = torch.where(dist > 0, col, 0).amax(-1)
    return torch.minimum(idx, last_nonzero)


def batch_target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``target_probs`` of every row of ``logits [B, T, V]`` with its request's warpers: one call
    per distinct (temperature, top_k, min_p, top_p) among the requests."""
    groups: dict[tuple, list[int]] = {}
    for b, p in enumerate(params):
        key = (p.greedy, p.temperature, p.top_k, p.min_p, p.top_p)
        groups.setdefault(key, []).append(b)
    if len(groups) == 1:
        return target_probs(logits, params[0])
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for rows in groups.values():
        idx = torch.tensor(rows, device=logits.device)
        out[idx] = target_probs(logits[idx], params[rows[0]])
    return out


def draw_uniforms(batch: TreeBatch, draw: Sequence[bool],
                  generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """``u [B, N + 1]``: for each row with ``draw[b]``, ``sizes[b] + 1`` draws from its generator
    (nodes, then the final draw in column N); other rows (greedy) draw nothing (0.5, unused)."""
    b, n = batch.batch, batch.num_nodes
    u = torch.full((b, n + 1), 0.5, dtype=torch.float32, device=batch.device)
    for row, (want, g) in enumerate(zip(draw, generators)):
        if not want:
            continue
        size = batch.sizes[row]
        dev = g.device if g is not None else batch.device
        draws = torch.rand(size + 1, generator=g, device=dev).to(batch.device)
        u[row, :size] = draws[:size]
        u[row, n] = draws[size]
    return u


# ------------------------------------------------------------------ one tree (tests, tools)
def _one(tree: DraftTree, root: int = 0) -> TreeBatch:
    return TreeBatch.pack([tree], [0], [root])


def accept_greedy(tree: DraftTree, logits: torch.Tensor) -> AcceptResult:
    """``logits [N+1, V]`` of (root, nodes...) from the verify forward."""
    return accept_greedy_batch(_one(tree), logits[None]).to_host()[0]


def accept_from_probs(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None) -> AcceptResult:
    """Recursive rejection sampling given target distributions ``probs [N+1, V]`` of
    (root, nodes...) already processed by temperature / top-k / top-p."""
    batch = _one(tree)
    u = draw_uniforms(batch, [True], [generator])
    return accept_from_probs_batch(batch, probs[None], u).to_host()[0]


def accept(tree: DraftTree, logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> AcceptResult:
    """Dispatch on the request's temperature."""
    return accept_batch(_one(tree), logits[None], [params], [generator]).to_host()[0]
