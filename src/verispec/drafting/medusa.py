"""Medusa drafter: K heads on the target's last hidden state, a static candidate tree.

Alignment: the engine hands the drafter the target's final-normed hidden state f_t at the last
committed position t. The target already chose the root x_{t+1} from f_t; Medusa head k
(0-based) reads f_t and predicts x_{t+2+k}, so tree depth d takes its candidates from head d-1.
Heads do not see the draft tokens, so the children of every node at depth d are the same top
ranks of head d-1 (the Medusa choices format says which ranks are kept below which path).

Each head: ``medusa_num_layers`` residual blocks ``x + SiLU(W x + b)`` then a vocabulary
projection (its own weight, or tied to the target's ``lm_head``).

Trees are deterministic (top ranks, q = None) for greedy and sampled requests, which the
engine's lossless rule accepts losslessly. Medusa's *typical acceptance* (lossy, opt-in with
``typical_acceptance``) is an acceptance rule, ``acceptance.LossyTypicalAcceptance``: the engine is
built with it, the drafter never chooses it.
"""
from __future__ import annotations

import torch
from torch import nn

from .draft_shape import head_factory, load_head, time_ms
from ..models.draft_packing import draft_packing
from ..core.params import SamplingParams
from .spec_config import MedusaSpecConfig, SpecConfigError
from ..core.tree import DraftTree, tree_from_choices, validate_choices
from ..models.device import module_device
from ..core.features import TargetFeatures
from .base import DraftRequest, tree_on
from .dynamic_tree import DEFAULT_NUM_DRAFT_TOKENS, StaticTreeConfig
from .medusa_head import MedusaHeads

# FasterDecoding's ``mc_sim_7b_63`` sparse tree. It was built greedily by estimated acceptance, so
# every prefix is a tree; the default keeps the first ``DEFAULT_NUM_DRAFT_TOKENS`` paths, the node
# budget chosen from the measured cost curve (benchmarks/results/tree_cost.md).
MC_SIM_7B_63: tuple[tuple[int, ...], ...] = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0),
    (0, 5), (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0),
    (0, 9), (8,), (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5),
    (0, 0, 0, 0), (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9),
    (6, 0), (0, 4, 0), (1, 4), (7, 0), (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5),
    (1, 0, 1), (0, 2, 1), (9, 0), (0, 6, 0), (0, 0, 0, 1), (1, 6), (0, 7, 0))
DEFAULT_MEDUSA_CHOICES = MC_SIM_7B_63[:DEFAULT_NUM_DRAFT_TOKENS]


class MedusaDrafter:
    hidden_layers: tuple[int, ...] = ()
    needs_last_hidden = True

    def __init__(self, heads: MedusaHeads, tree: StaticTreeConfig):
        if tree.max_depth > heads.cfg.num_heads:
            raise ValueError(f"tree depth {tree.max_depth} needs more than the {heads.cfg.num_heads} Medusa heads")
        self.heads = heads.eval().requires_grad_(False)
        self.choices = tuple(validate_choices(tree.choices))      # tree order: a budget keeps a prefix
        self.max_tree_nodes = tree.max_nodes
        self.width = 1 + max(c[-1] for c in self.choices)
        if heads.vocab_ids is not None and self.width > heads.vocab_ids.numel():
            raise ValueError(f"the tree takes rank {self.width - 1} of a draft vocabulary of {heads.vocab_ids.numel()}")
        self.device = module_device(heads)               # the target's: trees are handed over there
        self.last: dict[int, torch.Tensor] = {}        # row -> f_t at the last committed position

    def start(self, row: int, prompt_ids: list[int], features: TargetFeatures | None) -> None:
        self.last[row] = _last_hidden(features)

    def accept(self, row: int, committed_ids: list[int], features: TargetFeatures | None) -> None:
        self.last[row] = _last_hidden(features)

    def release(self, row: int) -> None:
        self.last.pop(row, None)

    @torch.no_grad()
    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        if not requests:
            return []
        f = torch.stack([self.last[r.row] for r in requests])
        # a node budget keeps a prefix of the tree: only the heads that prefix reaches are run
        keep = [self.choices[:r.max_nodes] if r.max_nodes is not None else self.choices for r in requests]
        depth = max((len(c) for k in keep for c in k), default=0)
        if depth == 0:
            return [tree_on(DraftTree.empty(), self.device) for _ in requests]
        top = torch.topk(self.heads(f.to(_dtype(self.heads)), depth), self.width, dim=-1).indices   # [B, d, w]
        if self.heads.vocab_ids is not None:
            top = self.heads.vocab_ids[top]                  # reduced vocabulary columns -> target ids
        ranked = top.tolist()
        trees = []
        for i, k in enumerate(keep):
            top = ranked[i]
            tree = tree_from_choices(k, lambda path, top=top: top[len(path)]) if k else DraftTree.empty()
            trees.append(tree_on(tree, self.device))
        return trees


def _last_hidden(features: TargetFeatures | None) -> torch.Tensor:
    if features is None or features.last_hidden is None:
        raise RuntimeError("Medusa needs the target's last hidden state; the engine passed none")
    return features.last_hidden[-1]


def _dtype(module: nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype



# -- configuration ---------------------------------------------------------------------------------
def medusa_tree(config: MedusaSpecConfig, num_heads: int) -> StaticTreeConfig:
    """``tree`` -> that static tree; ``num_speculative_tokens`` -> a chain; nothing -> the default
    tree cut to the heads' depth (Medusa heads ignore the path: no dynamic trees)."""
    if config.tree is not None:
        tree = StaticTreeConfig.from_choices(config.tree)
    elif config.num_speculative_tokens is not None:
        tree = StaticTreeConfig.chain(config.num_speculative_tokens)
    else:
        tree = StaticTreeConfig(tuple(c for c in DEFAULT_MEDUSA_CHOICES if len(c) <= num_heads))
    if tree.max_depth > num_heads:
        raise SpecConfigError(f"the tree is {tree.max_depth} deep but the checkpoint has {num_heads} Medusa heads")
    return tree


def build_medusa_factory(config: MedusaSpecConfig, target, forward=None):
    """Load the heads once; make a drafter per engine. Without ``tree`` or
    ``num_speculative_tokens``, heads whose folder has an ``acceptance.json`` profile get the tree
    that maximises modelled tokens/s from this machine's measured costs (``draft_shape``; all
    depths come from one heads forward, so only the verify cost grows with the tree), and each
    engine a ``DraftGate`` (``adaptive_drafting``, see ``draft_shape.plan_shape``). ``forward``:
    the target forward the engines run (its costs are measured)."""
    from ..formats import load_medusa_heads
    from .draft_vocab import head_vocab
    config, heads = load_head(config, target, lambda folder: load_medusa_heads(folder, target.model))
    vocab = head_vocab(config.draft_vocab, config.model, heads.cfg.vocab_size)
    if vocab is not None:
        heads.restrict_vocab_(vocab.draft_ids)
    packing = draft_packing(target, heads)
    if packing is not None:
        heads.pack_(packing, target.model.lm_head)  # draft on the packed kernels beside the target's
    tree = medusa_tree(config, heads.cfg.num_heads)
    user = tree.choices if config.tree is not None or config.num_speculative_tokens is not None else None
    return head_factory(target, config, "medusa", tree, user,
                        lambda between: (draft_cost(heads, between=between), ()), heads.cfg.num_heads,
                        lambda tree, max_batch, max_len: MedusaDrafter(heads, tree), forward=forward)


def draft_cost(heads: MedusaHeads, reps: int = 7, between=None) -> float:
    """Milliseconds of one batch-1 proposal (accept one token's feature, heads forward, top
    ranks) with every head run: about the same for any tree, since all depths come from one
    forward whose cost is the projection's weight read. ``between``: untimed work before each
    proposal (``draft_shape.time_ms``)."""
    drafter = MedusaDrafter(heads, StaticTreeConfig.chain(heads.cfg.num_heads))
    dev = drafter.device
    h = torch.zeros(1, heads.cfg.hidden_size, dtype=_dtype(heads), device=dev)
    drafter.start(0, [1], TargetFeatures({}, h))
    req = DraftRequest(0, [1, 1], SamplingParams(), torch.Generator(device="cpu"))

    def step():
        drafter.accept(0, [1], TargetFeatures({}, h))
        drafter.propose([req])
    return time_ms(step, reps=reps, between=between)
