"""EAGLE-1 trainer: feature regression plus token loss with input noise, as the EAGLE repo trains.

Feature. The head reads the target's *final-normed* last hidden state (``ModelOutput.last_hidden``,
the vector the target's ``lm_head`` multiplies). That is what the drafter feeds at inference:
``Eagle1Head.fuse`` returns ``TargetFeatures.last_hidden``, which the engine fills with
``ModelOutput.last_hidden``, and the head's logits are ``target_lm_head(out)``, which only make
sense if ``out`` lives in the post-norm space. It is also the EAGLE repo's choice
(``hidden_states[-1]`` of a Hugging Face Llama is taken after ``model.norm``).

Alignment (see ``drafters/eagle_head.py``): column t pairs the target feature f_t with the token
x_{t+1} at RoPE position t; the head's output there is its guess of f_{t+1}, and
``lm_head(f_{t+1})`` is the target's distribution over x_{t+2}. Columns are t = 0..T-2.

Loss at column t, where x_{t+2} is an assistant token (loss mask) and t+1 < T:
- ``v``: smooth L1 between the predicted feature and f_{t+1}, averaged over the hidden size
  (the EAGLE repo's ``SmoothL1Loss`` mean over the last dimension);
- ``p``: soft cross-entropy of ``log_softmax(lm_head(predicted))`` against the target's
  distribution ``softmax(lm_head(f_{t+1}))`` (full vocabulary);
- total ``v_weight * v + p_weight * p`` (EAGLE: ``v_w`` 1.0, ``p_w`` 0.1), summed over the valid
  columns; the loop divides by their global count.

Noise. During training only, the *input* features get uniform noise ``(U[0,1) - 0.5) * noise``
(EAGLE's ``AddUniformNoise`` with std 0.2 scales by ``512 / seq_len``; at its 512-token reference
length that is our default ``noise=0.2``; we drop the length dependence so a token's noise does
not depend on how long its conversation is). The regression and token targets stay clean. The
noise comes from a generator seeded by (``noise_seed``, rank, the module's ``noise_calls`` buffer),
which counts training forwards and is part of the module's state: a resumed run draws the very
same noise as an uninterrupted one.

Statistics: ``acc0`` = share of valid columns where the head's argmax equals the target's argmax
at t+1 (the token the target would pick at t+2); ``vloss`` / ``ploss`` per valid column.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..models.device import module_device
from ..formats import save_eagle_head
from ..drafting.eagle_head import Eagle1Head, EagleHeadConfig, HeadKind, init_head_weights
from .loop import Batch, StepOut

# The EAGLE repo's defaults (``train_config``: v_w, p_w; ``AddUniformNoise(std=0.2)``).
V_WEIGHT, P_WEIGHT, NOISE = 1.0, 0.1, 0.2


@dataclass
class Eagle1Inputs:
    tokens: torch.Tensor        # [B, L] token t+1 at column t (L = T-1)
    positions: torch.Tensor     # [B, L] column index t
    hidden: torch.Tensor        # [B, L, h] target feature f_t (post final norm)
    valid: torch.Tensor         # [B, L] bool: x_{t+2} is an assistant token
    target_feat: torch.Tensor   # [N, h] f_{t+1} at the N valid columns (row-major order)
    target_p: torch.Tensor      # [N, V] softmax(lm_head(f_{t+1})) at the valid columns
    target_ids: torch.Tensor    # [N] its argmax
    count: float                # N


def new_eagle1_config(target_cfg, fc_bias: bool = True) -> EagleHeadConfig:
    """A head shaped like one target layer; ``fc`` with a bias as in the EAGLE repo."""
    return EagleHeadConfig(
        kind=HeadKind.EAGLE1, hidden_size=target_cfg.hidden_size, intermediate_size=target_cfg.intermediate_size,
        num_heads=target_cfg.num_heads, num_kv_heads=target_cfg.num_kv_heads, head_dim=target_cfg.head_dim,
        vocab_size=target_cfg.vocab_size, draft_vocab_size=target_cfg.vocab_size,
        target_hidden_size=target_cfg.hidden_size, target_num_layers=target_cfg.num_layers,
        rms_norm_eps=target_cfg.rms_norm_eps, rope_theta=target_cfg.rope_theta,
        rope_scaling=target_cfg.rope_scaling, max_position_embeddings=target_cfg.max_position_embeddings,
        attention_bias=target_cfg.attention_bias, fc_bias=fc_bias)


def init_eagle1_head(cfg: EagleHeadConfig, target, seed: int = 0) -> Eagle1Head:
    """Deterministic random init (fp32), sharing the target's embedding and lm_head (frozen)."""
    if cfg.kind is not HeadKind.EAGLE1:
        raise ValueError(f"an EAGLE-1 trainer needs an EAGLE-1 head config, got {cfg.kind.value}")
    head = Eagle1Head(cfg, target.embed.weight.detach().float(), target.lm_head.weight.detach().float())
    return init_head_weights(head, seed)


class Eagle1Module(nn.Module):
    """The trainable module: ``forward(Eagle1Inputs) -> StepOut``."""

    def __init__(self, head: Eagle1Head, v_weight: float = V_WEIGHT, p_weight: float = P_WEIGHT,
                 noise: float = NOISE, noise_seed: int = 0):
        super().__init__()
        self.head, self.v_weight, self.p_weight = head, v_weight, p_weight
        self.noise, self.noise_seed = noise, noise_seed
        self.register_buffer("noise_calls", torch.zeros((), dtype=torch.long))

    def _noisy(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.training or self.noise <= 0:
            return hidden
        rank = dist.get_rank() if dist.is_initialized() else 0
        seed = (self.noise_seed * 1_000_003 + int(self.noise_calls)) * 4099 + rank
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.noise_calls += 1
        u = torch.rand(hidden.shape, generator=g, dtype=torch.float32, device="cpu")   # the same noise on any device
        return hidden + ((u - 0.5) * self.noise).to(hidden.device, hidden.dtype)

    def forward(self, inp: Eagle1Inputs) -> StepOut:
        out = self.head(inp.tokens, inp.positions, self._noisy(inp.hidden), compute_logits=False)
        pred = out.hidden[inp.valid].float()                                     # [N, h]
        vloss = F.smooth_l1_loss(pred, inp.target_feat.float(), reduction="none").mean(-1)
        logits = F.linear(pred, self.head.target_lm_head.float())
        ploss = -(inp.target_p * F.log_softmax(logits, dim=-1)).sum(-1)
        loss = self.v_weight * vloss.sum() + self.p_weight * ploss.sum()
        n = torch.tensor(float(pred.shape[0]), device=pred.device)
        hits = (logits.argmax(-1) == inp.target_ids).sum().float()
        return StepOut(loss, {"acc0": torch.stack([hits, n]), "vloss": torch.stack([vloss.sum().detach(), n]),
                              "ploss": torch.stack([ploss.sum().detach(), n])})


class Eagle1Task:
    """Couples the frozen target with an ``Eagle1Module`` (see ``loop.Task``)."""

    def __init__(self, target, head: Eagle1Head, v_weight: float = V_WEIGHT, p_weight: float = P_WEIGHT,
                 noise: float = NOISE, noise_seed: int = 0):
        if head.cfg.kind is not HeadKind.EAGLE1:
            raise ValueError("Eagle1Task trains EAGLE-1 heads")
        if head.cfg.vocab_size != target.cfg.vocab_size or head.cfg.hidden_size != target.cfg.hidden_size:
            raise ValueError(f"head (vocab {head.cfg.vocab_size}, hidden {head.cfg.hidden_size}) does not fit "
                             f"the target (vocab {target.cfg.vocab_size}, hidden {target.cfg.hidden_size})")
        self.target = target.eval().requires_grad_(False)
        self.module = Eagle1Module(head, v_weight, p_weight, noise, noise_seed).to(module_device(target))
        self.save_dtype = torch.bfloat16

    @torch.no_grad()
    def prepare(self, batch: Batch) -> Eagle1Inputs:
        batch = batch.to(module_device(self.target))
        ids = batch.input_ids
        b, t = ids.shape
        if t < 3:
            raise ValueError("sequences need >= 3 tokens")
        pos = torch.arange(t, device=ids.device).expand(b, t)
        feat = self.target(ids, pos, compute_logits=False).last_hidden.float()     # [B, T, h]
        valid = batch.loss_mask[:, 2:] > 0                                            # x_{t+2}, t = 0..T-3
        valid = torch.cat([valid, torch.zeros(b, 1, dtype=torch.bool, device=ids.device)], dim=1)   # [B, T-1]
        nxt = feat[:, 1:][valid]                                                      # f_{t+1} [N, h]
        logits = F.linear(nxt, self.target.lm_head.weight.float())
        return Eagle1Inputs(tokens=ids[:, 1:], positions=pos[:, :-1], hidden=feat[:, :-1], valid=valid,
                            target_feat=nxt, target_p=F.softmax(logits, -1), target_ids=logits.argmax(-1),
                            count=float(valid.sum()))

    def save(self, folder: Path) -> None:
        head = copy.deepcopy(self.module.head).to(self.save_dtype)
        save_eagle_head(head, folder)
