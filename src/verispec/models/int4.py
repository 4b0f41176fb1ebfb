"""int4 weight-only matmuls for CPU inference: 4-bit codes in groups of 32 input columns, bf16
activations, fp32 accumulation and output (``csrc/int4_gemm.cpp``, built on first use; torch's
``aten._weight_int4pack_mm_for_cpu`` where it cannot be built).

Why: a one-token decode streams every weight once, so fewer bytes per weight is the lever where
matrices are large (Qwen2.5-Coder-1.5B). Our kernel decodes each block of codes into registers
once per pass of up to 8 rows and multiplies pairs of columns with AVX-512 BF16 dot products, so a
verify over a few tokens costs little more than a decode: Qwen-1.5B's decoder matmuls (2 threads,
``benchmarks/results/weight_kernels.md``) take about what torch's kernel takes at T = 1 and less at
T = 2-16. torch's kernel also rounds its output to bf16; ours keeps fp32.

Contract:
- ``quantize_int4(w, group)``: asymmetric 4-bit codes per group of ``group`` input columns, with a
  scale and zero point per (row, group) stored in bf16. The dequantised weight is
  ``(q - 8) * scale + zero``. A group whose values already sit on a grid of at most 16 levels (a
  GGUF Q4_0 / Q4_1 / Q4_K block of 32, including Q4_K blocks whose fitted scale leaves the end
  codes unused) keeps its codes: the GGUF's own 4-bit weights are used, moved only by the bf16
  rounding of the scale and zero point (at most 2^-9 of each), not quantised a second time.
- ``PackedInt4Linear``: ``y = bf16(x) @ W.T + b``, W the dequantised weight, fp32 sums. The
  ``nn.Linear``'s weight is overwritten *in place* with W (every reader of ``.weight`` sees the
  numbers the kernel uses: the model simply *is* the int4-weight model). Every input, prefill
  included, runs the same kernel. A row's result never depends on the other rows of the input,
  on T or on the thread count (bit-identical; ``tests/test_int4.py``), so with the row-invariant
  attention (``models.attention``) a verify forward computes, per token, what a decode computes:
  speculation on an int4 target reproduces its vanilla decoding exactly.
- ``PackedInt4Linear(..., int8_activations=True)`` (W4A8, ``weights="int4-a8"``): the same
  codes times each row's activations quantised to int8 per group of 32 columns (symmetric,
  max|x| / 127, round to nearest even), exact int32 dot products (AVX-512 VNNI, or AVX2 with the
  same bits), fp32 epilogue: ``y = q8(x) @ W.T + b``. Row-invariant as above; faster where the
  bf16 dot products bound the kernel (verify, prefill); our kernel only.
- ``VERISPEC_INT4_KERNEL=torch`` uses torch's kernel instead (bf16 output; not row-invariant in
  its last bits across T). ``VERISPEC_INT4_ISA=avx2`` runs our AVX2 path on an AVX-512 machine.
- CPU only, fp32 models, inference only. The fp32 weight is kept for readers, so memory grows by
  a fifth, unless packed with ``keep_weight=False`` (``Transformer.pack_int4_``'s decoder
  layers): then one byte of code per weight stays (``packed.PackedLinear``).
"""
from __future__ import annotations

import os

import torch
from torch import nn

from . import native
from .packed import PackedLinear, max_threads

GROUP = 32          # input columns per scale/zero pair: the finest the kernel takes, GGUF's block size


def _register_fake() -> None:
    for name in ("verispec_int4::linear", "verispec_int4::linear_a8"):
        @torch.library.register_fake(name)
        def _(x, buf, meta, bias, max_threads, out_features):
            return x.new_empty((*x.shape[:-1], out_features))


_OP = native.NativeOp(
    "verispec_int4_gemm", "int4_gemm.cpp", no_isa="neither AVX2 nor AVX-512", fake=_register_fake,
    fallback="int4 uses torch's kernel",
    off=lambda: "VERISPEC_INT4_KERNEL=torch" if os.environ.get("VERISPEC_INT4_KERNEL", "").strip().lower() == "torch"
    else None)


def kernel():
    """Our compiled op module (``pack``, ``linear``, ``isa``), or ``None`` where it cannot be had
    or ``VERISPEC_INT4_KERNEL=torch`` asks for torch's (``unavailable_reason`` says which). Built
    once per process."""
    return _OP.module()


def unavailable_reason() -> str | None:
    return _OP.reason()


def _torch_kernel() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and \
        torch.backends.cpu.get_cpu_capability() != "DEFAULT"


def int4_available() -> bool:
    return kernel() is not None or _torch_kernel()


def quantize_int4(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [N, K] int32 in 0..15, scale_zero [K/group, N, 2] bf16, dequantised [N, K] fp32) of
    an fp32 weight ``w [N, K]``. Raises unless ``group`` divides K."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 weights need the input size ({k}) to be a multiple of {group}")
    g = w.detach().float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / _grid_steps(g, lo, hi)).clamp(min=1e-10).bfloat16().float()
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15)
    zero = (lo + 8 * scale).bfloat16().float()       # the kernel's zero point: the value of code 8
    deq = ((q - 8) * scale[..., None] + zero[..., None]).reshape(n, k)
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().bfloat16()
    return q.to(torch.int32).reshape(n, k), sz, deq


def _grid_steps(g: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, tol: float = 1e-3) -> torch.Tensor:
    """Per group of ``g [N, G, group]``, the number of grid steps between its min ``lo`` and max
    ``hi``: the largest m in 8..15 for which every value sits on ``lo + i (hi - lo) / m`` (within
    ``tol`` of a step), else 15. A 4-bit block whose codes do not reach both 0 and 15 (GGUF Q4_K's
    fitted scales and mins often leave the end codes unused) spans m < 15 steps of its own grid;
    min/max rescaling to 15 steps would move every value. Its grid, or one twice as fine (every
    m >= 1 has a multiple in 8..15), keeps each value where the file put it."""
    steps = torch.full_like(lo, 15.0)
    span = (hi - lo)[..., None]
    srt = g.sort(-1).values
    todo = (srt[..., 1:] != srt[..., :-1]).sum(-1) < 16      # at most 16 distinct values: a candidate
    for m in range(15, 7, -1):
        idx = todo.nonzero(as_tuple=True)
        if idx[0].numel() == 0:
            break
        r = (g[idx] - lo[idx][:, None]) * (m / span[idx].clamp(min=1e-30))
        fits = ((r - torch.round(r)).abs() <= tol).all(-1) & (span[idx][:, 0] > 0)
        hit = tuple(i[fits] for i in idx)
        steps[hit] = float(m)
        todo[hit] = False
    return steps


class PackedInt4Linear(PackedLinear):
    """``y = x @ W.T + b`` with ``W`` as packed int4 codes (see the module docstring)."""

    def __init__(self, linear: nn.Linear, group: int = GROUP, keep_weight: bool = True,
                 int8_activations: bool = False):
        super().__init__()
        if int8_activations and (group != GROUP or kernel() is None):
            raise RuntimeError("int4 weights with int8 activations need verispec's int4 kernel with groups of "
                               f"{GROUP} ({unavailable_reason() or f'group {group}'})")
        self.int8_activations = int8_activations
        if linear.weight.dtype != torch.float32 or linear.weight.device.type != "cpu":
            raise ValueError("int4 packing needs fp32 weights on the CPU "
                             f"(got {linear.weight.dtype} on {linear.weight.device})")
        if linear.out_features % 16:
            raise ValueError(f"int4 weights need the output size ({linear.out_features}) to be a multiple of 16")
        codes, self._sz, deq = quantize_int4(linear.weight, group)
        self.group = group
        codes8 = codes.to(torch.uint8)
        self._hold(linear, deq, keep_weight, (codes8,))
        del deq
        ext = kernel() if group == GROUP else None
        self.backend = "verispec" if ext is not None else "torch"
        if ext is not None:
            scale, zero = self._sz.transpose(0, 1).unbind(-1)                # [N, K/group] bf16 each
            self._buf, self._meta = ext.pack(codes8, scale.contiguous(), zero.contiguous())
            self._bias = linear.bias.detach().float().contiguous() if linear.bias is not None else None
            self._max_threads = max_threads(codes.numel())
            self._linear = ext.linear_a8 if int8_activations else ext.linear   # pybind: the cheapest eager call
        else:
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
        if self.backend == "verispec":
            x = x.contiguous()
            if torch.compiler.is_compiling():
                op = torch.ops.verispec_int4.linear_a8 if self.int8_activations else torch.ops.verispec_int4.linear
                return op(x, self._buf, self._meta, self._bias, self._max_threads, self.out_features)
            return self._linear(x, self._buf, self._meta, self._bias, self._max_threads)
        flat = x.reshape(-1, self.in_features).bfloat16()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self._packed, self.group, self._sz).float()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        acts = ", int8 activations" if self.int8_activations else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int4 packed (group {self.group}{acts}, {self.backend} kernel)")


def pack_int4_(model: nn.Module, names: tuple[str, ...], group: int = GROUP, keep_weight: bool = True,
               int8_activations: bool = False) -> int:
    """Replace the ``nn.Linear`` submodules at dotted ``names`` by ``PackedInt4Linear``
    (``keep_weight``: see ``packed.PackedLinear``; ``int8_activations``: W4A8); returns how many
    were packed. Raises where the kernel is unavailable."""
    if not int4_available():
        raise RuntimeError("int4 weight packing needs a PyTorch CPU build with the int4pack kernel (AVX2 or better)")
    from .packed import replace_linears_
    return replace_linears_(model, names, PackedInt4Linear,
                            lambda lin: PackedInt4Linear(lin, group, keep_weight, int8_activations))
