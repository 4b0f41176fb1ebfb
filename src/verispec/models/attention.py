"""Attention of the target's forward: row-invariant on the CPU for decode and verify inputs
(``csrc/attention.cpp``, built on first use), torch's ``scaled_dot_product_attention`` otherwise.

Why: speculation is lossless when a verify forward computes, for each accepted token, what a
one-token decode would have computed. Every packed matmul op (fp16, int4, int8) and every per-row
op (norms, RoPE, SiLU) already does; torch's SDPA does not (its CPU kernels block a one-token and a
several-token query differently, and a token's output moves in its last bits). Rounded
activations (int8 codes per token, bf16) amplify those bits into different logits, and greedy
speculation then drifts from greedy decoding on near-ties. The C++ op computes each query row from
the keys its mask shows, in slot order, with the same instructions whatever T, the batch or the
thread count: a verify row's output is bit-identical to the decode's (``tests/test_attention.py``).

Contract of ``attend(q, k, v, mask, scale)`` (q [B,H,T,D], k/v [B,KVH,S,D], bool mask
[B,1,T,S]; returns [B,H,T,D]):
- the C++ op runs when the inputs are float32 CPU tensors without autograd, T is below
  ``packed.DENSE_MIN_ROWS`` (decode, verification: prefill chunks keep SDPA's flash kernel), the
  head size is a multiple of 16 up to 256 and the op is available; SDPA otherwise. Which one runs
  depends on T and the model's shapes only, never on the batch or the drafter.
- ``softcap`` (Gemma 2): scores become ``c * tanh(scores / c)`` before the mask and softmax, as
  transformers' eager attention computes them; this runs in plain torch ops (neither the op nor
  SDPA soft-caps), which are not row-invariant, so ``row_invariant`` is False for such models.
- ``VERISPEC_ATTENTION=sdpa`` turns the op off for the process (comparisons, debugging).
- Numbers: softmax attention within about 1e-6 of SDPA (a polynomial exp, fp32 sums in slot order).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from . import native
from .packed import DENSE_MIN_ROWS, max_threads
from .paged_kv import gather_slots

_OFF = os.environ.get("VERISPEC_ATTENTION", "").strip().lower() == "sdpa"


def _register_fake() -> None:
    @torch.library.register_fake("verispec_attn::attention")
    def _(q, k, v, mask, scale, max_threads):
        b, h, t, d = q.shape
        return q.new_empty((b, t, h, d)).permute(0, 2, 1, 3)

    @torch.library.register_fake("verispec_attn::paged_attention")
    def _(q, k, v, table, mask, scale, shift, max_threads):
        b, h, t, d = q.shape
        return q.new_empty((b, t, h, d)).permute(0, 2, 1, 3)


_OP = native.NativeOp("verispec_attn", "attention.cpp", no_isa="neither AVX2 nor AVX-512",
                      off=lambda: "turned off by VERISPEC_ATTENTION=sdpa" if _OFF else None,
                      fake=_register_fake,
                      fallback="attention falls back to torch's SDPA (speculation on rounded activations "
                               "is then not bit-exact)")


def kernel():
    """The compiled op module (``attention``, ``isa``), or ``None`` where it cannot be had (see
    ``unavailable_reason``). Built once per process."""
    return _OP.module()


def available() -> bool:
    return kernel() is not None


def unavailable_reason() -> str | None:
    return _OP.reason()


def _head_fits(d: int) -> bool:
    """The op's head sizes: a multiple of 16, at most 256."""
    return d % 16 == 0 and d <= 256


def row_invariant(cfg) -> bool:
    """Whether a model of config ``cfg`` (``ModelConfig``) runs its decode and verify forwards
    through the row-invariant op on the CPU (fp32)."""
    return _head_fits(cfg.head_dim) and not cfg.attn_logit_softcapping and available()


def uses_op(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether ``attend`` runs the row-invariant op for these inputs (see the module docstring)."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and q.shape[2] < DENSE_MIN_ROWS
            and mask is not None and mask.dtype == torch.bool and mask.dim() == 4
            and _head_fits(q.shape[-1])
            and not (torch.is_grad_enabled() and q.requires_grad) and available())


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           scale: float | None, softcap: float | None = None) -> torch.Tensor:
    """Softmax attention of ``q`` over ``k``/``v`` under a bool ``mask`` (True: attend); grouped
    query heads when k/v have fewer heads; scores soft-capped at ``softcap`` when given. See the
    module docstring."""
    if softcap:
        return _softcapped(q, k, v, mask, q.shape[-1] ** -0.5 if scale is None else scale, softcap)
    if uses_op(q, mask):
        s = q.shape[-1] ** -0.5 if scale is None else scale
        return torch.ops.verispec_attn.attention(q, k, v, mask, float(s), max_threads(0))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1],
                                          scale=scale)


def attend_paged(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor, used: int,
                 mask: torch.Tensor | None, scale: float | None, softcap: float | None, shift: int) -> torch.Tensor:
    """``attend`` over the first ``used`` slots of a paged cache's rows: pools ``[blocks, KVH,
    block_size, D]``, ``table [B, blocks]`` (slot j at block ``table[b, j >> shift]``). The
    row-invariant op reads the pool in place (bit-identical to ``attend`` on the same K/V in
    static rows); other paths gather the slots, then ``attend``."""
    if not softcap and uses_op(q, mask):
        s = q.shape[-1] ** -0.5 if scale is None else scale
        return torch.ops.verispec_attn.paged_attention(q, k_pool, v_pool, table, mask, float(s), shift,
                                                       max_threads(0))
    return attend(q, gather_slots(k_pool, table, used), gather_slots(v_pool, table, used), mask, scale, softcap)


def _softcapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                scale: float, cap: float) -> torch.Tensor:
    """Eager attention with soft-capped scores (transformers' Gemma 2 order: scale, cap, mask,
    fp32 softmax)."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scale / cap) * cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
