"""int4 weight-only matmuls for CPU inference: PyTorch's packed int4 kernel
(``aten._weight_int4pack_mm_for_cpu``), groups of 32 input columns, bf16 activations.

Why: a one-token decode streams every weight once, so fewer bytes per weight is the lever where
matrices are large (Qwen2.5-Coder-1.5B: a forward's matmuls 1.63x faster than fp16-packed on the
AVX-512 EPYC, ``benchmarks/results/weight_kernels.md``). On SmolLM2-135M's small matrices it ties
fp16-packed.

Contract:
- ``quantize_int4(w, group)``: asymmetric 4-bit codes per group of ``group`` input columns, with a
  scale and zero point per (row, group) stored in bf16 (the kernel's dtype). The dequantised
  weight is ``(q - 8) * scale + zero``. A group whose values already sit on a 16-level grid (a
  GGUF Q4_0 / Q4_1 / Q4_K block of 32) keeps its codes: the GGUF's own 4-bit weights are used, moved
  only by the bf16 rounding of the zero point (at most 2^-9 of it), not quantised a second time.
- ``PackedInt4Linear``: the ``nn.Linear``'s weight is overwritten *in place* with its dequantised
  values (every reader of ``.weight`` sees the numbers the kernel uses: the model simply *is* the
  int4-weight model). Every input, prefill included, runs the int4 kernel on activations
  rounded to bf16 (fp32 accumulation; the bias, if any, added in fp32): at 256 tokens it costs
  what the fp32 BLAS does over the dequantised weight (103 ms on a Qwen-1.5B gate/up matrix), and
  needs no fp32 copy. A row's result never depends on
  the other rows of the input (checked by ``tests/test_int4.py``), so speculation stays lossless
  with respect to the int4 model and a batch cannot change a row.
- CPU only, fp32 models, inference only. The fp32 weight is kept for readers, so memory grows by
  an eighth, unless packed with ``keep_weight=False`` (``Transformer.pack_int4_``'s decoder
  layers): then one byte of code per weight stays (``packed.PackedLinear``).
"""
from __future__ import annotations

import torch
from torch import nn

from .packed import PackedLinear

GROUP = 32          # input columns per scale/zero pair: the finest the kernel takes, GGUF's block size


def int4_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and \
        torch.backends.cpu.get_cpu_capability() != "DEFAULT"


def quantize_int4(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [N, K] int32 in 0..15, scale_zero [K/group, N, 2] bf16, dequantised [N, K] fp32) of
    an fp32 weight ``w [N, K]``. Raises unless ``group`` divides K."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 weights need the input size ({k}) to be a multiple of {group}")
    g = w.detach().float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-10).bfloat16().float()
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15)
    zero = (lo + 8 * scale).bfloat16().float()       # the kernel's zero point: the value of code 8
    deq = ((q - 8) * scale[..., None] + zero[..., None]).reshape(n, k)
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().bfloat16()
    return q.to(torch.int32).reshape(n, k), sz, deq


class PackedInt4Linear(PackedLinear):
    """``y = x @ W.T + b`` with ``W`` as packed int4 codes (see the module docstring)."""

    def __init__(self, linear: nn.Linear, group: int = GROUP, keep_weight: bool = True):
        super().__init__()
        if linear.weight.dtype != torch.float32 or linear.weight.device.type != "cpu":
            raise ValueError("int4 packing needs fp32 weights on the CPU "
                             f"(got {linear.weight.dtype} on {linear.weight.device})")
        if linear.out_features % 16:
            raise ValueError(f"int4 weights need the output size ({linear.out_features}) to be a multiple of 16")
        codes, self._sz, deq = quantize_int4(linear.weight, group)
        self.group = group
        self._hold(linear, deq, keep_weight, (codes.to(torch.uint8),))
        self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)

    def _expand(self, out: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """``quantize_int4``'s dequantised weight, from the codes and the kernel's scale/zero pairs
        (bf16 values, exact in fp32): the same operations, so the same bits."""
        n, k = codes.shape
        scale, zero = self._sz.transpose(0, 1).float().unbind(-1)          # [N, K/group] each
        w = out.view(n, k // self.group, self.group).copy_(codes.view(n, k // self.group, self.group))
        w.sub_(8).mul_(scale[..., None]).add_(zero[..., None])            # (q - 8) * scale + zero, in place
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise TypeError(f"int4-packed linear takes fp32 activations, got {x.dtype}")
        flat = x.reshape(-1, self.in_features).bfloat16()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self._packed, self.group, self._sz).float()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 packed (group {self.group})"


def pack_int4_(model: nn.Module, names: tuple[str, ...], group: int = GROUP, keep_weight: bool = True) -> int:
    """Replace the ``nn.Linear`` submodules at dotted ``names`` by ``PackedInt4Linear``
    (``keep_weight``: see ``packed.PackedLinear``); returns how many were packed. Raises where the
    kernel is unavailable."""
    if not int4_available():
        raise RuntimeError("int4 weight packing needs a PyTorch CPU build with the int4pack kernel (AVX2 or better)")
    from .packed import replace_linears_
    return replace_linears_(model, names, PackedInt4Linear,
                            lambda lin: PackedInt4Linear(lin, group, keep_weight))
