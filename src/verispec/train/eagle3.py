"""EAGLE-3 trainer with training-time test (TTT), as EAGLE-3 / SpecForge train.

Alignment (see ``drafters/eagle_head.py``): column c pairs the target feature at position c with the
token at c+1 and predicts token c+2 from the target's distribution at position c+1. TTT unrolls
``ttt_length`` steps: step 0 reads the target's fused features; step i feeds back the head's own
output state of step i-1 at the same column, with tokens, targets and masks shifted by one
(column c at step i reads token c+1+i at RoPE position c+i and learns token c+2+i). Step i attends
to step-0 pairs at columns <= c (the committed prefix at inference) and to its own column at steps
1..i (its ancestors in the draft tree): exactly what the drafter sees at tree depth i+1.

Loss per step (``DraftLoss``), at positions that are assistant tokens and whose full-vocabulary
target argmax lies in the draft vocabulary: by default soft cross-entropy against the target's
distribution restricted (renormalised) to the draft vocabulary; step i weighted ``decay ** i`` (0.8). The sum over steps is
normalised by the number of valid step-0 positions. ``acc{i}`` = share of valid positions at step
i where the head's argmax equals the target's.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..models.device import module_device
from ..formats import save_eagle_head
from ..drafting.eagle_head import Eagle3Head, EagleHeadConfig, HeadKind, init_head_weights
from ..core.features import TargetFeatures
from ..models.transformer import apply_rope
from .common import topk_hits
from .loop import Batch, StepOut
from .vocab import DraftVocab


@dataclass
class Eagle3Inputs:
    tokens: torch.Tensor        # [B, L] token c+1 at column c (L = T-1)
    positions: torch.Tensor     # [B, L] column index
    hidden: torch.Tensor        # [B, L, n_aux*h] concatenated target features at position c
    target_p: torch.Tensor      # [B, L, D] target distribution at position c+1 over the draft vocab
    target_ids: torch.Tensor    # [B, L] draft id of the target argmax at c+1 (-1: out of vocab)
    valid: torch.Tensor         # [B, L] bool: token c+2 is an assistant token, argmax in vocab
    count: float                # valid step-0 positions


class DraftLoss(str, enum.Enum):
    """What each TTT step minimises against the target distribution p (over the draft vocabulary)
    with the head's q (compared in ``benchmarks/results/loss_ablation.md``):
    - ``soft``: cross-entropy H(p, q), forward KL up to a constant (EAGLE, SpecForge);
    - ``hard``: cross-entropy of the target's argmax, what greedy acceptance counts;
    - ``lk``: -log sum_v min(p_v, q_v), the log of the acceptance rate of sampled speculation
      (an LK-style loss: the acceptance itself, not a proxy);
    - ``soft+hard``: their sum."""
    SOFT = "soft"
    HARD = "hard"
    LK = "lk"
    SOFT_HARD = "soft+hard"

    def per_position(self, p: torch.Tensor, logits: torch.Tensor, tid: torch.Tensor) -> torch.Tensor:
        """The loss at each of N positions: ``p`` [N, D] target probabilities, ``logits`` [N, D]
        the head's, ``tid`` [N] the target argmax's draft id."""
        logq = F.log_softmax(logits.float(), dim=-1)
        if self is DraftLoss.LK:
            return -torch.minimum(p, logq.exp()).sum(-1).clamp_min(1e-6).log()
        hard = -logq.gather(-1, tid[:, None])[:, 0]
        if self is DraftLoss.HARD:
            return hard
        soft = -(p * logq).sum(-1)
        return soft + hard if self is DraftLoss.SOFT_HARD else soft


def new_head_config(target_cfg, draft_vocab_size: int, aux_layer_ids: tuple[int, ...] | None = None,
                    fc_norm: bool = False, norm_output: bool = False,
                    intermediate_size: int | None = None) -> EagleHeadConfig:
    """A head shaped like one target layer (SpecForge's default draft config); ``intermediate_size``
    (default: the target's) narrows its MLP, the largest part of a head beside its LM head."""
    if intermediate_size is not None and intermediate_size < 1:
        raise ValueError(f"intermediate_size must be positive, got {intermediate_size}")
    return EagleHeadConfig(
        kind=HeadKind.EAGLE3, hidden_size=target_cfg.hidden_size,
        intermediate_size=intermediate_size or target_cfg.intermediate_size,
        num_heads=target_cfg.num_heads, num_kv_heads=target_cfg.num_kv_heads, head_dim=target_cfg.head_dim,
        vocab_size=target_cfg.vocab_size, draft_vocab_size=draft_vocab_size,
        target_hidden_size=target_cfg.hidden_size, target_num_layers=target_cfg.num_layers,
        aux_layer_ids=aux_layer_ids or EagleHeadConfig.default_aux_layer_ids(target_cfg.num_layers),
        rms_norm_eps=target_cfg.rms_norm_eps, rope_theta=target_cfg.rope_theta,
        rope_scaling=target_cfg.rope_scaling, max_position_embeddings=target_cfg.max_position_embeddings,
        fc_norm=fc_norm, norm_output=norm_output)


class HeadInit(str, enum.Enum):
    """How a new EAGLE-3 head starts (``--head-init``; compared in ``benchmarks/results/head_init.md``):
    ``random`` every weight ~ N(0, 0.02), norms 1; ``target`` (default) the LM head = the target's
    LM-head rows of the draft vocabulary and ``norm`` = its final norm; ``target-layer`` also the
    decoder layer from the target's last one (its o-projection, MLP and norms, and its q/k/v
    weights on the hidden-state half of the 2h-wide input; the token-embedding half and ``fc``
    stay random)."""
    RANDOM = "random"
    TARGET = "target"
    TARGET_LAYER = "target-layer"


def init_eagle3_head(cfg: EagleHeadConfig, target, vocab: DraftVocab, seed: int = 0,
                     init: HeadInit | str = HeadInit.TARGET) -> Eagle3Head:
    """A new head: random weights (seeded), then what ``init`` takes from the target (``HeadInit``);
    ``d2t``/``t2d`` from ``vocab``."""
    init = HeadInit(init)
    if vocab.t2d.numel() != target.cfg.vocab_size or vocab.size != cfg.draft_vocab_size:
        raise ValueError(f"draft vocab maps {vocab.size}/{vocab.t2d.numel()} do not fit the head "
                         f"({cfg.draft_vocab_size} of {target.cfg.vocab_size})")
    head = Eagle3Head(cfg, target.embed.weight.detach().float())
    init_head_weights(head, seed)
    with torch.no_grad():
        if init is not HeadInit.RANDOM:
            head.lm_head.weight.copy_(target.lm_head.weight.detach()[vocab.draft_ids].float())
            head.norm.weight.copy_(target.norm.weight.detach().float())
        if init is HeadInit.TARGET_LAYER:
            if cfg.intermediate_size != target.cfg.intermediate_size:
                raise ValueError(f"--head-init target-layer copies the target's MLP ({target.cfg.intermediate_size} "
                                 f"wide); this head's is {cfg.intermediate_size}: use --head-init target")
            _copy_last_layer(head, target.layers[-1])
        head.d2t.copy_(vocab.d2t)
        head.t2d.copy_(vocab.t2d)
    return head


def _copy_last_layer(head: Eagle3Head, layer) -> None:
    """The target decoder layer's weights where the head's layer has their shape (see ``HeadInit``)."""
    h = head.cfg.hidden_size
    copy = lambda dst, src: dst.copy_(src.detach().float())        # noqa: E731
    for mine, theirs in ((head.attn.wq, layer.attn.wq), (head.attn.wk, layer.attn.wk), (head.attn.wv, layer.attn.wv)):
        copy(mine.weight[:, h:], theirs.weight)                      # input = [embedding, hidden state]
        if mine.bias is not None and theirs.bias is not None:
            copy(mine.bias, theirs.bias)
    copy(head.attn.wo.weight, layer.attn.wo.weight)
    for mine, theirs in ((head.mlp.w_gate, layer.mlp.w_gate), (head.mlp.w_up, layer.mlp.w_up),
                         (head.mlp.w_down, layer.mlp.w_down)):
        copy(mine.weight, theirs.weight)
    for norm in (head.input_layernorm, head.hidden_norm):
        copy(norm.weight, layer.attn_norm.weight)
    copy(head.post_attention_layernorm.weight, layer.mlp_norm.weight)


def ttt_attention(attn, x: torch.Tensor, cos, sin, past: list[tuple[torch.Tensor, torch.Tensor]]):
    """Attention of TTT step i = len(past): causal over step-0 keys, diagonal over steps 1..i."""
    b, t, _ = x.shape
    q = attn.wq(x).reshape(b, t, attn.h, attn.d).transpose(1, 2)
    k = attn.wk(x).reshape(b, t, attn.kvh, attn.d).transpose(1, 2)
    v = attn.wv(x).reshape(b, t, attn.kvh, attn.d).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    steps = past + [(k, v)]
    keys = torch.cat([kv[0] for kv in steps], dim=2)
    vals = torch.cat([kv[1] for kv in steps], dim=2)
    causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
    eye = torch.eye(t, dtype=torch.bool, device=x.device)
    mask = torch.cat([causal] + [eye] * len(past), dim=1)
    out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=attn.kvh != attn.h)
    return attn.wo(out.transpose(1, 2).reshape(b, t, attn.h * attn.d)), (k, v)


def ttt_step(head: Eagle3Head, tokens, positions, hidden, past):
    """One unrolled step; mirrors ``Eagle3Head.forward`` with the TTT attention. Returns the state
    to feed back, the final-normed state (``head.lm_head`` of it gives the logits) and the step's
    K/V."""
    cos, sin = head._rope(positions, hidden.dtype)
    x, residual = head.attention_input(tokens, hidden)
    a, kv = ttt_attention(head.attn, x, cos, sin, past)
    h = residual + a
    h = h + head.mlp(head.post_attention_layernorm(h))
    normed = head.norm(h)
    return (normed if head.cfg.norm_output else h), normed, kv


def _shift(x: torch.Tensor, i: int, fill) -> torch.Tensor:
    """x shifted left by i along dim 1, padded with ``fill``."""
    if i == 0:
        return x
    pad = torch.full_like(x[:, :i], fill)
    return torch.cat([x[:, i:], pad], dim=1)


class Eagle3TTT(nn.Module):
    """The trainable module: ``forward(Eagle3Inputs) -> StepOut`` (loss sum, acc@i stats)."""

    def __init__(self, head: Eagle3Head, ttt_length: int = 7, decay: float = 0.8,
                 loss: DraftLoss | str = DraftLoss.SOFT):
        super().__init__()
        if ttt_length < 1:
            raise ValueError("ttt_length must be >= 1")
        self.head, self.ttt_length, self.decay = head, ttt_length, decay
        self.loss = DraftLoss(loss)

    def states(self, inp: Eagle3Inputs) -> list[torch.Tensor]:
        """Final-normed head states [B, L, h] of every TTT step."""
        hidden = self._fuse(inp.hidden)
        past: list = []
        out = []
        for i in range(self.ttt_length):
            hidden, normed, kv = ttt_step(self.head, _shift(inp.tokens, i, 0), inp.positions + i, hidden, past)
            past.append(kv)
            out.append(normed)
        return out

    def unroll(self, inp: Eagle3Inputs) -> list[torch.Tensor]:
        """Draft-vocabulary logits [B, L, D] of every TTT step."""
        return [self.head.lm_head(n) for n in self.states(inp)]

    def forward(self, inp: Eagle3Inputs) -> StepOut:
        """The LM head (the costliest matmul, over the draft vocabulary) runs only at each step's
        valid positions: nothing else is read from the logits."""
        loss = torch.zeros((), dtype=torch.float32, device=inp.tokens.device)
        stats = {}
        for i, normed in enumerate(self.states(inp)):
            valid = _shift(inp.valid, i, False)
            p = _shift(inp.target_p, i, 0.0)[valid]
            tid = _shift(inp.target_ids, i, -1)[valid]
            logits = self.head.lm_head(normed[valid])                          # [n_valid, D]
            loss = loss + (self.decay ** i) * self.loss.per_position(p, logits, tid).sum()
            n = valid.sum().float()
            stats[f"acc{i}"] = torch.stack([(logits.argmax(-1) == tid).sum().float(), n])
            if not self.training:
                stats.update(topk_hits(logits, tid, torch.ones_like(tid, dtype=torch.bool), i))
        return StepOut(loss, stats)

    def _fuse(self, cat_hidden: torch.Tensor) -> torch.Tensor:
        h = self.head.cfg.target_hidden_size
        parts = {layer: cat_hidden[..., j * h:(j + 1) * h] for j, layer in enumerate(self.head.aux_layers)}
        return self.head.fuse(TargetFeatures(hidden=parts, last_hidden=None))


class Eagle3Task:
    """Couples the frozen target with an ``Eagle3TTT`` module (see ``loop.Task``)."""

    def __init__(self, target, head: Eagle3Head, ttt_length: int = 7, decay: float = 0.8, features=None,
                 loss: DraftLoss | str = DraftLoss.SOFT):
        """``features``: a ``features.FeatureStore`` to read target features from instead of running
        the target forward (its ``lm_head`` still gives the target distribution)."""
        if head.cfg.vocab_size != target.cfg.vocab_size or head.cfg.target_hidden_size != target.cfg.hidden_size:
            raise ValueError(f"head (vocab {head.cfg.vocab_size}, target hidden {head.cfg.target_hidden_size}) "
                             f"does not fit the target (vocab {target.cfg.vocab_size}, hidden {target.cfg.hidden_size})")
        self.target = target.eval().requires_grad_(False)
        self.features = features
        self.module = Eagle3TTT(head, ttt_length, decay, loss).to(module_device(target))   # trained where the target runs
        vocab = DraftVocab(d2t=head.d2t, t2d=head.t2d)
        self.draft_ids = vocab.draft_ids
        self.target_to_draft = vocab.target_to_draft()

    @torch.no_grad()
    def prepare(self, batch: Batch) -> Eagle3Inputs:
        batch = batch.to(module_device(self.target))
        ids = batch.input_ids
        b, t = ids.shape
        if t < 3:
            raise ValueError("sequences need >= 3 tokens")
        pos = torch.arange(t, device=ids.device).expand(b, t)
        aux, last = self._features(batch)
        last = last[:, 1:]                                              # positions 1..T-1
        w = self.target.lm_head.weight
        in_loss = _shift(batch.loss_mask, 2, 0.0)[:, :t - 1] > 0
        # the full-vocabulary argmax only where a loss is taken (it only decides validity there)
        picked = last[in_loss]
        full_argmax = torch.zeros(b, t - 1, dtype=torch.long, device=ids.device)
        if picked.shape[0]:
            full_argmax[in_loss] = torch.cat([F.linear(c, w).argmax(-1) for c in picked.split(256)])
        draft_logits = F.linear(last, w[self.draft_ids])
        target_ids = self.target_to_draft[full_argmax]
        valid = (target_ids >= 0) & in_loss
        return Eagle3Inputs(tokens=ids[:, 1:], positions=pos[:, :-1], hidden=aux[:, :-1].float(),
                            target_p=F.softmax(draft_logits.float(), -1), target_ids=target_ids,
                            valid=valid, count=float(valid.sum()))

    def _features(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Concatenated aux features [B, T, n*h] and the last hidden state [B, T, h]."""
        ids = batch.input_ids
        if self.features is not None:
            return self.features.batch(batch.ids, batch.lengths.tolist(), ids.shape[1], device=ids.device)
        layers = tuple(dict.fromkeys(self.module.head.aux_layers))
        out = self.target(ids, torch.arange(ids.shape[1], device=ids.device).expand(ids.shape), hidden_layers=layers,
                          compute_logits=False)
        return torch.cat([out.hidden[k] for k in self.module.head.aux_layers], dim=-1), out.last_hidden

    def save(self, folder: Path) -> None:
        import copy
        head = copy.deepcopy(self.module.head).to(getattr(self, "save_dtype", torch.bfloat16))
        save_eagle_head(head, folder)
