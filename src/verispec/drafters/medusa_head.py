"""Medusa heads (the nn.Module): K heads on the target's final-normed last hidden state.

Each head: ``num_layers`` residual blocks ``x + SiLU(W x + b)`` then a vocabulary projection (its
own weight, or tied to the target's ``lm_head``). Head k (0-based) reading f_t predicts
x_{t+2+k}; the drafter that turns the heads into candidate trees is ``drafters.medusa``.
Parameter names follow vLLM's (``blocks.{i}.layers.{j}``, ``lm_heads.{i}``); ``formats.medusa``
reads and writes them and FasterDecoding's.
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

    def pack_fp16_(self, target_lm_head: nn.Module | None = None) -> "MedusaHeads":
        """fp16-packed matmuls (``models.packed``), for heads drafting for an fp16-packed target
        (``target_lm_head``: the target's packed LM head, which tied heads read through)."""
        from ..models.packed import pack_linears_fp16_, shared_reader
        pack_linears_fp16_(self)
        if self.lm_heads is None:
            self.__dict__["_lm_reader"] = shared_reader(self.target_lm_head, target_lm_head)   # not a submodule
        return self

    def head_states(self, f: torch.Tensor) -> torch.Tensor:
        """[..., K, h]: the residual blocks' output of each head."""
        return torch.stack([blk(f) for blk in self.blocks], dim=-2)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        states = self.head_states(f)
        if self.lm_heads is None:
            reader = self.__dict__.get("_lm_reader")
            return reader(states) if reader is not None else F.linear(states, self.target_lm_head)
        return torch.stack([lm(states[..., k, :]) for k, lm in enumerate(self.lm_heads)], dim=-2)
