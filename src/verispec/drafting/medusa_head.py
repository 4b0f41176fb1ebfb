"""Medusa heads (the nn.Module): K heads on the target's final-normed last hidden state.

Each head: ``num_layers`` residual blocks ``x + SiLU(W x + b)`` then a vocabulary projection (its
own weight, or tied to the target's ``lm_head``). Head k (0-based) reading f_t predicts
x_{t+2+k}; the drafter that turns the heads into candidate trees is ``drafters.medusa``.
Parameter names follow vLLM's (``blocks.{i}.layers.{j}``, ``lm_heads.{i}``); ``formats.medusa``
reads and writes them and FasterDecoding's.

Drafting may project onto a reduced vocabulary (``restrict_vocab_``: the D most frequent target
tokens, ``draft_vocab``): the heads then read D rows of their projection instead of V (SmolLM2:
8k of 49k rows, the projection being most of a proposal's cost) and never propose another token,
which verification rejects anyway; so only acceptance can drop, by at most the share of accepted
tokens outside the subset.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    tied_lm_head: bool = False      # True: every head projects with the target's lm_head
    block_bias: bool = True         # FasterDecoding's blocks have biases; vLLM's may not

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 0:
            raise ValueError(f"medusa needs >= 1 head and >= 0 layers, got {self.num_heads}, {self.num_layers}")


class ResidualBlock(nn.Module):
    """``x + SiLU(linear(x))`` for each of ``layers`` in turn."""

    def __init__(self, hidden: int, num_layers: int, bias: bool):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, bias=bias) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    """``forward(f [..., h]) -> logits [..., K, V]``. Parameter names follow vLLM's
    (``blocks.{i}.layers.{j}``, ``lm_heads.{i}``); ``formats.medusa`` maps FasterDecoding's."""

    def __init__(self, cfg: MedusaConfig, target_lm_head: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(ResidualBlock(cfg.hidden_size, cfg.num_layers, cfg.block_bias)
                                    for _ in range(cfg.num_heads))
        if cfg.tied_lm_head:
            if target_lm_head is None:
                raise ValueError("tied Medusa heads need the target's lm_head weight")
            self.lm_heads = None
            self.register_buffer("target_lm_head", target_lm_head, persistent=False)
        else:
            self.lm_heads = nn.ModuleList(nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
                                          for _ in range(cfg.num_heads))
        self.vocab_head: nn.Linear | None = None      # tied heads over a reduced vocabulary
        self.register_buffer("vocab_ids", None, persistent=False)   # [D] target ids of output columns

    def restrict_vocab_(self, ids: torch.Tensor) -> "MedusaHeads":
        """Project onto the target ids ``ids`` [D] only (increasing, distinct, in range): output
        column j is target id ``ids[j]``. Tied heads get one shared projection of those rows of the
        target's LM head (a copy: the target's own head is untouched); untied heads keep those rows of
        their own. Call before ``pack_``; once only."""
        from .draft_vocab import check_ids, rows_linear
        if self.vocab_ids is not None:
            raise ValueError("the Medusa heads' vocabulary is already restricted")
        ids = check_ids(ids, self.cfg.vocab_size).to(next(self.parameters()).device)
        with torch.no_grad():
            if self.lm_heads is None:
                self.vocab_head = rows_linear(self.target_lm_head, ids)
                self.target_lm_head = None
            else:
                for lm in self.lm_heads:
                    lm.weight = nn.Parameter(lm.weight[ids].contiguous(), requires_grad=False)
                    lm.out_features = ids.numel()
        self.vocab_ids = ids
        return self

    def pack_(self, packing: "DraftPacking | str" = "fp16", target_lm_head: nn.Module | None = None) -> "MedusaHeads":
        """Packed matmuls (``models.draft_packing.pack_linears_``: fp16, int4 or int8), for heads drafting
        beside a packed target (``target_lm_head``: the target's packed LM head, which tied heads
        read through)."""
        from ..models.draft_packing import DraftPacking, pack_linears_
        from ..models.packed import shared_reader
        pack_linears_(self, DraftPacking(packing))
        if self.lm_heads is None and self.vocab_head is None:
            self.__dict__["_lm_reader"] = shared_reader(self.target_lm_head, target_lm_head)   # not a submodule
        return self

    def head_states(self, f: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """[..., n, h]: the residual blocks' output of the first ``num_heads`` heads (default all)."""
        return torch.stack([blk(f) for blk in self.blocks[:num_heads]], dim=-2)

    def forward(self, f: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """Logits [..., n, V] of the first ``num_heads`` heads (default all K) at features f [..., h];
        [..., n, D] over ``vocab_ids`` after ``restrict_vocab_``."""
        states = self.head_states(f, num_heads)
        if self.vocab_head is not None:
            return self.vocab_head(states)
        if self.lm_heads is None:
            reader = self.__dict__.get("_lm_reader")
            return reader(states) if reader is not None else F.linear(states, self.target_lm_head)
        return torch.stack([lm(states[..., k, :]) for k, lm in enumerate(self.lm_heads[:states.shape[-2]])], dim=-2)
