"""A compact decoder-only transformer we own (Llama, SmolLM2, Mistral, Qwen2/3, Phi-3, Gemma 2/3).

One forward serves prefill, decode and draft-tree verification:

    forward(tokens [B,T], positions [B,T], cache, attn_mask=None, ..., kv_len=None) -> ModelOutput

- ``positions`` are RoPE positions (for a tree: cache length + depth, so siblings share one).
- With a ``cache``, the T new keys/values are written to scratch slots ``lengths[row] + 0..T-1``
  (see ``kv_cache``); each query sees every committed slot of its row plus the new tokens allowed
  by ``attn_mask [B,T,T]`` (bool, True = may attend; default causal). Lengths are not changed.
- ``kv_len`` (optional, a host int, e.g. ``KVCache.kv_len``'s bucket): attend that many cache
  slots, masking those past each row's ``length + T``. Same logits, shapes fixed per bucket and no
  device sync: the verify forward can be captured (CUDA graphs, ``torch.compile``).
- Without a cache, the forward is a plain full-sequence forward (causal unless ``attn_mask``).
- ``hidden_layers``: the outputs of these decoder layers (0-based) are returned in
  ``ModelOutput.hidden`` (EAGLE-3 fuses layers 1, N/2-1, N-4); ``ModelOutput.last_hidden`` is the
  final-normed state the LM head reads (EAGLE-1, Medusa).
- Family differences are ``ModelConfig`` fields, never names: scaled embeddings, q/k RMSNorm
  (Gemma 3, Qwen3), sandwich norms, GeGLU, soft-capped attention and logits (Gemma 2), partial
  rotary and LongRoPE (Phi-3), and sliding-window layers (a query at position p sees keys at
  positions > p - window, committed or new), with their own RoPE base (Gemma 3).
Knows nothing about drafters, trees or sampling.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from .attention import attend, attend_paged
from .config import ModelConfig, UnsupportedModelError
from .kv_cache import CacheFullError, KVCache, Rows


@dataclass
class ModelOutput:
    logits: torch.Tensor | None                  # [B, T, V] (or [B, K, V] with logits_index)
    last_hidden: torch.Tensor                    # [B, T, hidden] after the final norm
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)   # layer -> [B, T, hidden]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies [rope_dim/2] with the config's theta and scaling (default, linear,
    llama3), divided by ``rope_freq_factors`` where set (llama.cpp's rope_freqs); LongRoPE: [2,
    rope_dim/2], the short factors' row then the long factors' (``Transformer.rope`` picks per
    position). ``local``: those of the sliding-window layers: ``rope_local_theta`` without scaling
    where it is set (Gemma 3), else the global ones (Mistral, Qwen2, Gemma 2: one RoPE)."""
    dim = cfg.rope_dim
    local = local and cfg.rope_local_theta is not None
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if cfg.rope_freq_factors is not None and not local:
        inv = inv / torch.tensor(cfg.rope_freq_factors, dtype=torch.float64)
    sc = {} if local else (cfg.rope_scaling or {})
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind in ("default", None):
        return inv.float()
    if kind == "linear":
        return (inv / float(sc["factor"])).float()
    if kind == "llama3":
        factor, lo, hi = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen) - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled).float()
    if kind == "longrope":     # as transformers: 1 / (factor * theta^(2i/d)) in fp32
        base = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        return torch.stack([1.0 / (torch.tensor(sc[k], dtype=torch.float32) * base)
                            for k in ("short_factor", "long_factor")])
    raise UnsupportedModelError(f"rope scaling {kind!r} is not supported (default, linear, llama3, longrope are)")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B,H,T,D]; cos/sin [B,1,T,R] (HF half-rotation layout) over the first R <= D dims of
    each head; the rest pass through (partial rotary, Phi-3)."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    half = r // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.h, self.kvh, self.d = layer, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.hidden_size, self.h * self.d, bias=cfg.attention_bias)
        self.wk = nn.Linear(cfg.hidden_size, self.kvh * self.d, bias=cfg.attention_bias)
        self.wv = nn.Linear(cfg.hidden_size, self.kvh * self.d, bias=cfg.attention_bias)
        self.wo = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.query_scale
        self.softcap = cfg.attn_logit_softcapping
        self.fused: nn.Linear | None = None

    def fuse_(self) -> None:
        """Serve q, k, v from one matmul (same numbers, fewer kernel calls). Weights stay shared."""
        w = torch.cat([self.wq.weight, self.wk.weight, self.wv.weight])
        bias = torch.cat([self.wq.bias, self.wk.bias, self.wv.bias]) if self.wq.bias is not None else None
        self.fused = _fused_linear(w, bias)
        sizes = [self.h * self.d, self.kvh * self.d, self.kvh * self.d]
        _share(self.fused.weight, [self.wq, self.wk, self.wv], sizes, "weight")
        if bias is not None:
            _share(self.fused.bias, [self.wq, self.wk, self.wv], sizes, "bias")

    def forward(self, x, cos, sin, mask, cache: KVCache | None, rows, slots, used, select=None):
        """``rows [B]`` (index tensor) and ``slots [B,T]``: where the new K/V go; the first ``used``
        slots of ``select`` (default ``rows``; a slice for consecutive rows) are attended."""
        b, t, _ = x.shape
        if self.fused is not None:
            q, k, v = self.fused(x).split([self.h * self.d, self.kvh * self.d, self.kvh * self.d], dim=-1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = q.reshape(b, t, self.h, self.d).transpose(1, 2)
        k = k.reshape(b, t, self.kvh, self.d).transpose(1, 2)
        v = v.reshape(b, t, self.kvh, self.d).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            cache.write(self.layer, rows, slots, k, v)
            # isinstance, not ``select is None``: dynamo evaluates an identity test on a slice by
            # specialising its symbolic bounds, which recompiled the graph for every batch size
            sel = select if isinstance(select, (slice, torch.Tensor)) else cache.view_rows(rows)
            if cache.paged:                                   # the pool, read in place through the table
                out = attend_paged(q, cache.k[self.layer], cache.v[self.layer], cache.table[sel], used, mask,
                                   self.scale, self.softcap, cache.shift)
            else:
                out = attend(q, *cache.read(self.layer, sel, used), mask, self.scale, self.softcap)
        else:
            out = attend(q, k, v, mask, self.scale, self.softcap)
        return self.wo(out.transpose(1, 2).reshape(b, t, self.h * self.d))


def _fused_linear(w: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(w.detach(), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return lin


def _share(fused: torch.Tensor, parts: list[nn.Linear], sizes: list[int], attr: str) -> None:
    """Point each part's parameter at its slice of the fused tensor (no second copy in memory)."""
    for lin, piece in zip(parts, fused.split(sizes, dim=0)):
        setattr(lin, attr, nn.Parameter(piece, requires_grad=False))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_gate = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.w_up = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.w_down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = F.silu if cfg.hidden_act == "silu" else partial(F.gelu, approximate="tanh")
        self.fused: nn.Linear | None = None

    def fuse_(self) -> None:
        """Gate and up projections from one matmul."""
        self.fused = _fused_linear(torch.cat([self.w_gate.weight, self.w_up.weight]), None)
        n = self.w_gate.weight.shape[0]
        _share(self.fused.weight, [self.w_gate, self.w_up], [n, n], "weight")

    def forward(self, x):
        if self.fused is not None:
            gate, up = self.fused(x).chunk(2, dim=-1)
            return self.w_down(self.act(gate) * up)
        return self.w_down(self.act(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norm else None
        self.post_mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.sandwich_norm else None

    def forward(self, x, cos, sin, mask, cache, rows, slots, used, select=None):
        a = self.attn(self.attn_norm(x), cos, sin, mask, cache, rows, slots, used, select)
        x = x + (a if self.post_attn_norm is None else self.post_attn_norm(a))
        m = self.mlp(self.mlp_norm(x))
        return x + (m if self.post_mlp_norm is None else self.post_mlp_norm(m))


def build_mask(lengths: torch.Tensor, used: int, new_mask: torch.Tensor) -> torch.Tensor:
    """[B,1,T,used] bool: committed slots of the row plus the allowed new tokens."""
    b, t, _ = new_mask.shape
    slot = torch.arange(used, device=lengths.device)[None, None, :]            # [1,1,S]
    rel = slot - lengths[:, None, None]                                        # [B,1,S]
    prefix = rel < 0
    in_new = (rel >= 0) & (rel < t)
    gathered = torch.gather(new_mask, 2, rel.clamp(0, t - 1).expand(b, t, used))
    return (prefix | (in_new & gathered))[:, None]


def window_mask(lengths: torch.Tensor | None, used: int, positions: torch.Tensor, window: int) -> torch.Tensor:
    """[B,1,T,used] bool: key slot within ``window`` positions of the query (its own included).
    A committed slot's position is its index; new slot ``lengths + j`` holds ``positions[:, j]``."""
    b, t = positions.shape
    if lengths is None:
        key_pos = positions
    else:
        slot = torch.arange(used, device=positions.device)[None, :]
        rel = slot - lengths[:, None]
        key_pos = torch.where(rel < 0, slot, torch.gather(positions, 1, rel.clamp(0, t - 1)))
    return (key_pos[:, None, :] > positions[:, :, None] - window)[:, None]


def _cache_shape(cache: KVCache, rows: Rows | None, b: int, t: int, kv_len: int | None):
    """(index [B] long, read selector, lengths [B], attended slots) of a forward on ``cache``.
    The selector is a slice for consecutive rows (``KVCache.select``). Without ``kv_len`` the
    attended slots are ``max(lengths) + t`` read from the device (one sync). With it, the bound is
    checked on the host mirror when the rows are host-known, except under ``torch.compile``."""
    index, select = cache.select(rows, b)
    on_device = isinstance(rows, torch.Tensor) and rows.device.type != "cpu"
    if not torch.compiler.is_compiling():
        cache.reserve(range(b) if rows is None else rows, t)     # a paged cache's blocks for the new slots
    if kv_len is None:
        select = cache.view_rows(select) if on_device else select
        lengths = cache.lengths[select]
        cache.check_room(range(b) if rows is None else rows, t)
        return index, select, lengths, int(lengths.max()) + t
    if torch.compiler.is_compiling():
        # no host checks in a graph: reading the cache's size would specialise the graph on it,
        # recompiling it for every engine (each sizes its cache to its prompts); the caller's
        # KVCache.kv_len already bounded kv_len by the cache
        return index, select, cache.lengths[select], kv_len
    if kv_len > cache.max_len:
        raise CacheFullError(f"KV cache holds {cache.max_len} slots per sequence, kv_len {kv_len} asked")
    if not on_device:
        need = max(cache.lengths_of(range(b) if rows is None else rows)) + t
        if need > kv_len:
            raise ValueError(f"kv_len {kv_len} is below the {need} slots this forward attends")
    return index, select, cache.lengths[select], kv_len


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.register_buffer("inv_freq_local", rope_inv_freq(cfg, local=True), persistent=False)
        self.sliding = frozenset(cfg.sliding_layers)

    def reset_rope_(self, device: str | torch.device | None = None) -> None:
        """Recompute the RoPE buffers (after ``to_empty``: they are not in the state dict) on
        ``device`` (default: where the embedding lives)."""
        device = self.embed.weight.device if device is None else device
        self.inv_freq = rope_inv_freq(self.cfg).to(device)
        self.inv_freq_local = rope_inv_freq(self.cfg, local=True).to(device)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype, local: bool = False):
        """cos, sin [B,1,T,rope_dim] at ``positions``. LongRoPE: the short factors' frequencies
        below ``rope_long_from``, the long ones from there (what transformers computes when a
        cached generation crosses the original context), times the attention factor."""
        inv = self.inv_freq_local if local else self.inv_freq
        pos = positions[..., None].float()
        if inv.dim() == 2:
            freqs = torch.where(pos < self.cfg.rope_long_from, pos * inv[0], pos * inv[1])
        else:
            freqs = pos * inv                                            # [B,T,R/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]                 # [B,1,T,R]
        cos, sin = emb.cos(), emb.sin()
        if self.cfg.rope_attention_factor != 1.0:
            cos, sin = cos * self.cfg.rope_attention_factor, sin * self.cfg.rope_attention_factor
        return cos.to(dtype), sin.to(dtype)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
                attn_mask: torch.Tensor | None = None, rows: Rows | None = None,
                hidden_layers: tuple[int, ...] = (), logits_index: torch.Tensor | None = None,
                compute_logits: bool = True, kv_len: int | None = None) -> ModelOutput:
        """See the module docstring. ``rows``: cache rows of the batch (default 0..B-1; a tensor,
        or host ints). ``logits_index [B,K]``: compute logits only at these positions of T.
        ``kv_len``: attend the first ``kv_len`` cache slots, a host int at least
        ``max(lengths[rows]) + T`` (``KVCache.kv_len`` gives a bucketed one); slots past a row's
        ``length + T`` are masked, so the logits do not depend on it. With ``kv_len`` and host
        ``rows`` (or none) the forward makes no device sync and its shapes depend only on
        (B, T, kv_len, rows): CUDA graphs and ``torch.compile`` can capture it. Without it,
        ``kv_len`` is found from the device lengths (one sync)."""
        b, t = tokens.shape
        dev = tokens.device
        new_mask = attn_mask if attn_mask is not None else \
            torch.ones(t, t, dtype=torch.bool, device=dev).tril().expand(b, t, t)
        if cache is not None:
            index, select, lengths, used = _cache_shape(cache, rows, b, t, kv_len)
            slots = cache.physical(index, lengths[:, None] + torch.arange(t, device=dev))
            mask = build_mask(lengths, used, new_mask)
        else:
            index, select, slots, used, lengths = None, None, None, t, None
            mask = new_mask[:, None]
        x = self.embed(tokens)
        if self.cfg.embed_scale != 1.0:
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        full = (*self.rope(positions, x.dtype), mask)
        local = full
        if self.sliding:
            local = (*self.rope(positions, x.dtype, local=True),
                     mask & window_mask(lengths, used, positions, self.cfg.sliding_window))
        hidden = {}
        for i, layer in enumerate(self.layers):
            cos, sin, m = local if i in self.sliding else full
            x = layer(x, cos, sin, m, cache, index, slots, used, select)
            if i in hidden_layers:
                hidden[i] = x
        x = self.norm(x)
        logits = None
        if compute_logits:
            sel = x if logits_index is None else torch.gather(
                x, 1, logits_index[..., None].expand(-1, -1, x.shape[-1]))
            logits = self.lm_head(sel)
            if self.cfg.final_logit_softcapping:
                cap = self.cfg.final_logit_softcapping
                logits = torch.tanh(logits / cap) * cap
        return ModelOutput(logits=logits, last_hidden=x, hidden=hidden)

    def fuse_(self) -> "Transformer":
        """Fuse q/k/v and gate/up projections for inference (fewer, larger matmuls)."""
        for layer in self.layers:
            layer.attn.fuse_()
            layer.mlp.fuse_()
        return self

    # The pack_*_ methods replace every matmul of the fused forward by a packed module. The decoder
    # layers' fp32 weights are released (``packed.PackedLinear``: a compact copy rebuilds them for
    # prefill and readers), and so are the unfused q/k/v and gate/up parameters that viewed them:
    # a packed model has no ``wq``/``wk``/``wv``/``w_gate``/``w_up``. The LM head keeps its fp32
    # parameter, which it shares with the embedding when tied and which drafters read.
    def pack_fp16_(self) -> "Transformer":
        """fp16-packed weights for every matmul of the fused forward (see ``packed``)."""
        from .packed import pack_fp16_
        pack_fp16_(self, self._release_unfused_(), keep_weight=False)
        return self._packed_head_()

    def pack_int4_(self, head: str = "fp16", int8_activations: bool = False) -> "Transformer":
        """int4 matmuls in every decoder layer, weight-only (bf16 activations) or, with
        ``int8_activations``, W4A8 (``int4-a8``); the LM head ``head``: ``"fp16"`` fp16-packed
        (``int4``: its rows are what drafters read through, and 4 bits there cost the most
        quality), ``"int4"`` (``int4-all``) or ``"int8"`` W8A8 (``int4-head8``, ``int4-a8``). A
        packed head keeps its fp32 parameter (tied to the embedding, read by drafters), which then
        holds the dequantised values."""
        from .int4 import pack_int4_
        if head not in ("fp16", "int4", "int8"):
            raise ValueError(f"the LM head is packed fp16, int4 or int8, not {head!r}")
        pack_int4_(self, self._release_unfused_(), keep_weight=False, int8_activations=int8_activations)
        if head == "int4":
            pack_int4_(self, ("lm_head",))
        elif head == "int8":
            from .int8 import pack_int8_
            pack_int8_(self, ("lm_head",))
        else:
            self._packed_head_()
        return self

    def pack_int8_(self) -> "Transformer":
        """int8 weights with per-token int8 activations in every decoder layer (``int8``), the LM
        head fp16-packed (drafters read through its rows)."""
        from .int8 import pack_int8_
        pack_int8_(self, self._release_unfused_(), keep_weight=False)
        return self._packed_head_()

    def _release_unfused_(self) -> tuple[str, ...]:
        """Drop the unfused parts (before packing, so each fused fp32 weight is freed as soon as
        its packed module replaces it: loading peaks lower); returns ``_layer_matmuls()``."""
        names = self._layer_matmuls()
        for layer in self.layers:
            layer.attn.wq = layer.attn.wk = layer.attn.wv = None
            layer.mlp.w_gate = layer.mlp.w_up = None
        return names

    def _packed_head_(self) -> "Transformer":
        """The LM head fp16-packed (its fp32 parameter kept: tied to the embedding, read by drafters)."""
        from .packed import pack_fp16_
        pack_fp16_(self, ("lm_head",))
        return self

    def _layer_matmuls(self) -> tuple[str, ...]:
        """Dotted names of the fused forward's matmuls in the decoder layers (fusing them first
        where that has not been done)."""
        if any(layer.attn.fused is None or layer.mlp.fused is None for layer in self.layers):
            self.fuse_()
        return tuple(f"layers.{i}.{m}" for i in range(len(self.layers))
                     for m in ("attn.fused", "attn.wo", "mlp.fused", "mlp.w_down"))
