"""EAGLE draft heads (nn.Modules): the EAGLE-1 feature predictor and the EAGLE-3 (and 3.1) head.

Alignment, stated once: an EAGLE head reads *pairs* (feature at position t, token at position
t+1) and its output at that pair predicts the token at position t+2. The pair sits at RoPE
position t (the feature's position). Target features come from the target forward that computed
position t; for draft depth k > 1 the feature is the head's own output hidden state at the
parent pair (no target feature exists yet). This is the shift EAGLE, SpecForge and vLLM train
and serve with (``input_ids[1:]`` against ``hidden_states[:-1]``).

Heads share one interface, used by ``eagle.EagleDrafter``:
- ``hidden_layers`` / ``needs_last_hidden``: the target features the head reads (distinct layers;
  EAGLE-3's ``aux_layers`` give the fc input order and may repeat a layer on shallow targets);
- ``fuse(features) -> [T, h]``: turn target features at T positions into the head's input state
  (EAGLE-3: per-layer RMSNorm when ``fc_norm``, concatenation, ``fc``; EAGLE-1: the last hidden);
- ``forward(tokens, positions, hidden, cache, ...) -> HeadOutput``: ``hidden`` [B,T,h] is the
  fused target feature or the head's own fed-back state; the output gives the state to feed to
  the children and draft-vocabulary logits;
- ``draft_to_target(ids)``: draft-vocabulary ids to target ids (EAGLE-3 ``d2t``: i + d2t[i]).

Architectures (names as in the official checkpoints, mapped in ``verispec.formats``):
- EAGLE-3: ``x = fc(concat(f_low, f_mid, f_high))``; one Llama layer whose q/k/v read
  ``concat(input_layernorm(embed(token)), hidden_norm(x))`` (2h) with residual ``x`` (or
  ``hidden_norm(x)``: speculators' ``norm_before_residual``);
  logits ``lm_head(norm(out))`` over the draft vocabulary; fed back: ``out`` (EAGLE-3) or
  ``norm(out)`` (EAGLE-3.1 ``norm_output``).
- EAGLE-1: ``x = fc(concat(embed(token), feature))`` (2h -> h, optional bias); one Llama layer
  without input norm (as in the EAGLE repo); ``out`` predicts the next target feature, the
  target's ``lm_head`` turns it into logits; fed back: ``out``.
The head keeps its own one-layer ``KVCache``; draft-tree nodes are written as scratch slots after
the committed ones and never committed (see ``eagle.py``).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..models.config import ModelConfig
from ..models.kv_cache import KVCache
from ..models.transformer import MLP, Attention, RMSNorm, rope_inv_freq
from ..core.features import TargetFeatures


class HeadKind(str, enum.Enum):
    EAGLE1 = "eagle1"
    EAGLE3 = "eagle3"


@dataclass(frozen=True)
class EagleHeadConfig:
    kind: HeadKind
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int                        # target vocabulary
    draft_vocab_size: int                  # rows of the EAGLE-3 lm_head (EAGLE-1: = vocab_size)
    target_hidden_size: int
    target_num_layers: int
    aux_layer_ids: tuple[int, ...] = ()    # EAGLE-3, vLLM convention: id k = output of layer k-1
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    attention_bias: bool = False
    fc_bias: bool = False                  # EAGLE-1 fc bias (the EAGLE repo has one)
    fc_norm: bool = False                  # EAGLE-3.1: RMSNorm per fused feature before fc
    norm_output: bool = False              # EAGLE-3.1: feed back the post-norm hidden state
    norm_before_residual: bool = False     # speculators: the residual is hidden_norm(x), not x
    own_embedding: bool = False            # False: share the target's token embedding

    def __post_init__(self) -> None:
        if self.kind is HeadKind.EAGLE3:
            if not self.aux_layer_ids:
                raise ValueError("an EAGLE-3 head needs aux_layer_ids")
            bad = [k for k in self.aux_layer_ids if not 1 <= k <= self.target_num_layers]
            if bad:
                raise ValueError(f"aux hidden state layer ids {bad} out of range 1..{self.target_num_layers} "
                                 "(id k = output of target layer k-1; 0 would be the embeddings)")
        if not self.own_embedding and self.hidden_size != self.target_hidden_size:
            raise ValueError("a head without its own embed_tokens shares the target's, so its hidden size "
                             f"{self.hidden_size} must equal the target's {self.target_hidden_size}")

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """Our 0-based decoder-layer outputs (``ModelOutput.hidden`` keys), one per aux id."""
        return tuple(k - 1 for k in self.aux_layer_ids)

    def layer_config(self) -> ModelConfig:
        """A one-layer ``ModelConfig`` for RoPE and the head's ``KVCache``."""
        return ModelConfig(arch="llama", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=1, num_heads=self.num_heads,
                           num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           max_position_embeddings=self.max_position_embeddings, rope_theta=self.rope_theta,
                           rope_scaling=self.rope_scaling, rms_norm_eps=self.rms_norm_eps,
                           attention_bias=self.attention_bias)

    @staticmethod
    def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
        """EAGLE / SpecForge / vLLM default: outputs of layers 1, N/2-1, N-4 (ids 2, N/2, N-3)."""
        return (2, num_layers // 2, num_layers - 3)


@dataclass
class HeadOutput:
    hidden: torch.Tensor            # [B, T, h] state to feed to children (EAGLE-3.1: post-norm)
    logits: torch.Tensor | None     # [B, T or K, draft_vocab] at ``logits_at`` (all T if None)


class WideAttention(Attention):
    """Llama attention whose q/k/v read ``in_dim`` features (EAGLE-3: 2h) and write back h."""

    def __init__(self, cfg: ModelConfig, in_dim: int):
        super().__init__(cfg.replace(hidden_size=in_dim), 0)
        self.wo = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)


def attention_plan(cache: KVCache | None, rows: torch.Tensor | None, t: int, scratch: int,
                   local_mask: torch.Tensor | None, b: int, device: torch.device | None = None):
    """Slots, used length and the [B,1,T,used] bool mask for T new tokens, on ``device`` (default:
    the cache's, else the CPU).

    With a cache, row r's committed slots ``< lengths[r]`` are visible to every new token; the
    ``scratch`` slots after them (earlier tree levels, never committed) and the T new tokens
    (written at ``lengths[r] + scratch + 0..T-1``) are visible as ``local_mask [B, T, scratch+T]``
    says (default: causal over the new tokens, no scratch)."""
    dev = device if device is not None else (cache.lengths.device if cache is not None else torch.device("cpu"))
    if local_mask is None:
        causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
        none = torch.zeros(t, scratch, dtype=torch.bool, device=dev)
        local_mask = torch.cat([none, causal], 1).expand(b, t, scratch + t)
    if cache is None:
        return None, t, local_mask[:, None, :, scratch:]
    cache.check_room(rows, scratch + t)
    host = cache.lengths_of(rows)                     # the cache's host mirror: no device read
    lengths = torch.tensor(host, dtype=torch.long, device=dev)
    slots = lengths[:, None] + scratch + torch.arange(t, device=dev)
    used = max(host) + scratch + t
    rel = torch.arange(used, device=dev)[None, None, :] - lengths[:, None, None]            # [B,1,used]
    width = scratch + t
    inside = (rel >= 0) & (rel < width)
    local = torch.gather(local_mask, 2, rel.clamp(0, width - 1).expand(b, t, used))
    return slots, used, ((rel < 0) | (inside & local))[:, None]


class _HeadBase(nn.Module):
    """Shared parts: token embedding (own or the target's), RoPE, cache, vocabulary map."""

    def __init__(self, cfg: EagleHeadConfig, target_embed: torch.Tensor | None):
        super().__init__()
        self.cfg = cfg
        if cfg.own_embedding:
            self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size).normal_(0, 0.02))
        else:
            if target_embed is None:
                raise ValueError("a head without its own embedding needs the target's embedding weight")
            self.register_buffer("embed_tokens", target_embed, persistent=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.layer_config()), persistent=False)

    def new_cache(self, max_batch: int, max_len: int) -> KVCache:
        """The head's one-layer cache, in its dtype on its device."""
        return KVCache.for_model(self.cfg.layer_config(), max_batch, max_len, self.embed_tokens.dtype,
                                 device=self.embed_tokens.device)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _plan(self, tokens: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, cache: KVCache | None,
              rows: torch.Tensor | None, scratch: int, local_mask: torch.Tensor | None):
        """A forward's rows (default: 0..B-1 with a cache), ``attention_plan`` and RoPE tables."""
        b, t = tokens.shape
        rows = torch.arange(b, device=tokens.device) if rows is None and cache is not None else rows
        slots, used, mask = attention_plan(cache, rows, t, scratch, local_mask, b, tokens.device)
        return rows, slots, used, mask, self._rope(positions, dtype)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.embed_tokens)

    def pack_(self, packing: "DraftPacking | str" = "fp16", target_lm_head: nn.Module | None = None) -> "_HeadBase":
        """Packed matmuls (``models.draft_packing.pack_linears_``: fp16, int4 or int8), for a head drafting
        beside a packed target (``target_lm_head``: the target's packed LM head, for heads that
        read tokens through it)."""
        from ..models.draft_packing import DraftPacking, pack_linears_
        self.attn.fuse_()
        self.mlp.fuse_()
        pack_linears_(self, DraftPacking(packing), skip=("attn.wq", "attn.wk", "attn.wv", "mlp.w_gate", "mlp.w_up"))
        return self

    @staticmethod
    def _select(x: torch.Tensor, logits_at: torch.Tensor | None) -> torch.Tensor:
        if logits_at is None:
            return x
        return torch.gather(x, 1, logits_at[..., None].expand(-1, -1, x.shape[-1]))


class Eagle3Head(_HeadBase):
    hidden_layers: tuple[int, ...]
    needs_last_hidden = False

    def __init__(self, cfg: EagleHeadConfig, target_embed: torch.Tensor | None = None):
        super().__init__(cfg, target_embed)
        lc = cfg.layer_config()
        h, n_aux = cfg.hidden_size, len(cfg.aux_layer_ids)
        self.aux_layers = cfg.aux_layers                            # fc input order (may repeat)
        self.hidden_layers = tuple(dict.fromkeys(self.aux_layers))   # what the engine captures
        self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(n_aux)) \
            if cfg.fc_norm else None
        self.fc = nn.Linear(n_aux * cfg.target_hidden_size, h, bias=False)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.attn = WideAttention(lc, 2 * h)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(lc)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        full = cfg.draft_vocab_size == cfg.vocab_size          # identity map unless a checkpoint says otherwise
        self.register_buffer("t2d", torch.full((cfg.vocab_size,), full, dtype=torch.bool))

    def fuse(self, features: TargetFeatures) -> torch.Tensor:
        """[T, h] from the aux target features at T positions."""
        return self.fuse_parts(self.feature_parts(features))

    def feature_parts(self, features: TargetFeatures) -> tuple[torch.Tensor, ...]:
        """The target features ``fuse_parts`` takes: the aux layers' hidden states, in fc order."""
        return tuple(features.hidden[i] for i in self.aux_layers)

    def fuse_parts(self, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """[..., h] from ``feature_parts`` [..., target h] each: per-layer norm (EAGLE-3.1),
        concatenation, ``fc``. Traceable: the chain program fuses inside its compiled catch-up."""
        if self.fc_norm is not None:
            parts = tuple(norm(p) for norm, p in zip(self.fc_norm, parts))
        return self.fc(torch.cat(parts, dim=-1).to(self.fc.weight.dtype))

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids]

    def restrict_vocab_(self, ids: torch.Tensor) -> "Eagle3Head":
        """Draft over the target ids ``ids`` only (a subset of the head's draft vocabulary: its
        other ids are dropped): the LM head keeps those rows and ``d2t``/``t2d`` map the new
        columns. A runtime cut for cheaper levels (the LM head is most of a level's bytes); call
        before ``pack_``. Raises when no id of ``ids`` is in the draft vocabulary."""
        v = self.cfg.vocab_size
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= v:
            raise ValueError(f"a draft vocabulary must be target ids in 0..{v - 1}")
        dev = self.lm_head.weight.device
        wanted = torch.zeros(v, dtype=torch.bool, device=dev)
        wanted[ids.to(dev)] = True
        current = torch.arange(self.d2t.numel(), device=dev) + self.d2t       # target id of each column
        cols = wanted[current].nonzero()[:, 0]
        if cols.numel() == 0:
            raise ValueError("no id of the draft vocabulary is in the head's own draft vocabulary")
        kept = current[cols]
        with torch.no_grad():
            self.lm_head.weight = nn.Parameter(self.lm_head.weight[cols].contiguous(), requires_grad=False)
        self.lm_head.out_features = cols.numel()
        self.d2t = kept - torch.arange(cols.numel(), device=dev)
        self.t2d = torch.zeros(v, dtype=torch.bool, device=dev).index_fill_(0, kept, True)
        return self

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                cache: KVCache | None = None, rows: torch.Tensor | None = None, scratch: int = 0,
                local_mask: torch.Tensor | None = None, logits_at: torch.Tensor | None = None,
                compute_logits: bool = True) -> HeadOutput:
        """``tokens``/``positions`` [B,T] (target ids), ``hidden`` [B,T,h]; see ``attention_plan``."""
        rows, slots, used, mask, (cos, sin) = self._plan(tokens, positions, hidden.dtype, cache, rows, scratch,
                                                         local_mask)
        state, out = self.layer(tokens, hidden, cos, sin, mask, cache, rows, slots, used)
        logits = self.logits_of(self._select(out, logits_at)) if compute_logits else None
        return HeadOutput(state, logits)

    def layer(self, tokens, hidden, cos, sin, mask, cache, rows, slots, used, select=None):
        """The decoder layer on planned inputs (``attention_plan``'s slots, used and mask): (state
        to feed back [B,T,h], what ``logits_of`` reads [B,T,h])."""
        x, residual = self.attention_input(tokens, hidden)
        h = residual + self.attn(x, cos, sin, mask, cache, rows, slots, used, select)
        h = h + self.mlp(self.post_attention_layernorm(h))
        normed = self.norm(h)
        return (normed if self.cfg.norm_output else h), normed

    def attention_input(self, tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q/k/v input ``concat(input_layernorm(embed(tokens)), hidden_norm(hidden))`` [B,T,2h],
        the attention's residual: ``hidden``, or ``hidden_norm(hidden)`` when ``norm_before_residual``)."""
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(self._embed(tokens)), normed], dim=-1)
        return x, (normed if self.cfg.norm_before_residual else hidden)

    def logits_of(self, x: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of ``layer``'s second output."""
        return self.lm_head(x)


class Eagle1Head(_HeadBase):
    hidden_layers: tuple[int, ...] = ()
    needs_last_hidden = True

    def __init__(self, cfg: EagleHeadConfig, target_embed: torch.Tensor | None = None,
                 target_lm_head: torch.Tensor | None = None):
        super().__init__(cfg, target_embed)
        if target_lm_head is None:
            raise ValueError("an EAGLE-1 head reads tokens through the target's lm_head weight")
        lc = cfg.layer_config()
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=cfg.fc_bias)
        self.attn = Attention(lc, 0)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(lc)
        self.register_buffer("target_lm_head", target_lm_head, persistent=False)
        self.vocab_head: nn.Linear | None = None          # a cut of the target's LM head (restrict_vocab_)
        self.register_buffer("vocab_ids", None, persistent=False)

    def restrict_vocab_(self, ids: torch.Tensor) -> "Eagle1Head":
        """Read tokens over the target ids ``ids`` only (distinct, in range): a copy of those rows of
        the target's LM head (the target's own head is untouched); draft id j is target id
        ``ids[j]``. Call before ``pack_``; once only."""
        from .draft_vocab import check_ids, rows_linear
        if self.vocab_ids is not None:
            raise ValueError("the head's vocabulary is already restricted")
        ids = check_ids(ids, self.cfg.vocab_size).to(self.target_lm_head.device)
        self.vocab_head = rows_linear(self.target_lm_head, ids)
        self.vocab_ids = ids
        return self

    def pack_(self, packing: "DraftPacking | str" = "fp16", target_lm_head: nn.Module | None = None) -> "Eagle1Head":
        from ..models.packed import shared_reader
        super().pack_(packing)          # the cut's own rows (vocab_head) too
        if self.vocab_head is None:
            self.__dict__["_lm_reader"] = shared_reader(self.target_lm_head, target_lm_head)   # not a submodule
        return self

    def _read_tokens(self, x: torch.Tensor) -> torch.Tensor:
        if self.vocab_head is not None:
            return self.vocab_head(x)
        reader = self.__dict__.get("_lm_reader")
        return reader(x) if reader is not None else F.linear(x, self.target_lm_head)

    def fuse(self, features: TargetFeatures) -> torch.Tensor:
        return self.fuse_parts(self.feature_parts(features))

    def feature_parts(self, features: TargetFeatures) -> tuple[torch.Tensor, ...]:
        """The target's last hidden state (after its final norm), alone."""
        return (features.last_hidden,)

    def fuse_parts(self, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return parts[0].to(self.fc.weight.dtype)

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return self.vocab_ids[ids] if self.vocab_ids is not None else ids

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                cache: KVCache | None = None, rows: torch.Tensor | None = None, scratch: int = 0,
                local_mask: torch.Tensor | None = None, logits_at: torch.Tensor | None = None,
                compute_logits: bool = True) -> HeadOutput:
        """Same contract as ``Eagle3Head.forward``; ``out`` is the predicted next target feature."""
        rows, slots, used, mask, (cos, sin) = self._plan(tokens, positions, hidden.dtype, cache, rows, scratch,
                                                         local_mask)
        x, _ = self.layer(tokens, hidden, cos, sin, mask, cache, rows, slots, used)
        logits = self.logits_of(self._select(x, logits_at)) if compute_logits else None
        return HeadOutput(x, logits)

    def layer(self, tokens, hidden, cos, sin, mask, cache, rows, slots, used, select=None):
        """The layer on planned inputs: (predicted next feature, the same for ``logits_of``)."""
        x = self.fc(torch.cat([self._embed(tokens), hidden], dim=-1))
        x = x + self.attn(x, cos, sin, mask, cache, rows, slots, used, select)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, x

    def logits_of(self, x: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of a predicted feature (through the target's LM head or its cut)."""
        return self._read_tokens(x)


EagleHead = Eagle1Head | Eagle3Head


def new_eagle_head(cfg: EagleHeadConfig, target_model) -> EagleHead:
    """A freshly initialised head for ``target_model`` (our ``Transformer``) in the target's dtype
    on its device,
    sharing the target's embedding unless ``cfg.own_embedding`` (EAGLE-1: and its lm_head)."""
    first = next(target_model.parameters())
    embed = None if cfg.own_embedding else target_model.embed.weight.detach()
    if cfg.kind is HeadKind.EAGLE3:
        head = Eagle3Head(cfg, embed)
    else:
        head = Eagle1Head(cfg, embed, target_model.lm_head.weight.detach())
    return head.to(first.device, first.dtype)


def init_head_weights(head: nn.Module, seed: int = 0, std: float = 0.02) -> nn.Module:
    """Deterministic random init (tests, training start): linears ~ N(0, std), norms = 1."""
    g = torch.Generator(device="cpu").manual_seed(seed)      # on the CPU: the same numbers on any device
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g, device="cpu") * std)
            else:
                p.zero_()
    return head
