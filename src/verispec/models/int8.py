"""int8 weights with int8 activations per token (W8A8) for CPU decode and verify forwards
(``csrc/int8_gemm.cpp``, built on first use).

Why: a one-token decode streams every weight once, and int8 codes are half the bytes of fp16; the
integer dot products (AVX-512 VNNI: 64 multiply-adds an instruction) also keep a verify over a few
tokens cheaper than the fp16 kernel's float ones. Measured on SmolLM2-135M's shapes (2 threads,
all matmuls of one forward): 6.6 ms against fp16-packed's 9.1 at T = 1, 12.9 against 14.9 at T = 8
(``benchmarks/results/weight_kernels.md``). Its quality cost is larger than int4's (perplexity
+1.55% against fp32, ``weights_quality_smollm2-135m.md``): 8-bit codes per whole activation row.

Contract:
- ``quantize_int8(w)``: symmetric codes in -127..127 with one fp32 scale per output channel
  (``max |w_row| / 127``). ``PackedInt8Linear`` overwrites the ``nn.Linear``'s weight *in place*
  with ``codes * scale``, so every reader of ``.weight`` (EAGLE/Medusa heads, the prefill path)
  sees the weights the kernel uses.
- Inputs shorter than ``packed.DENSE_MIN_ROWS`` tokens (decode, verification) run the kernel: each
  row (token) of the input is quantised on its own to uint8 (asymmetric, its own scale and zero
  point; ``qmax`` 255 with AVX-512 VNNI, 127 with AVX2, where the kernel's int16 pair sums would
  otherwise saturate), the dot products are exact int32 sums, and the float epilogue reads only
  that row's numbers. So a row's product never depends on the other rows of the input (T, batch)
  or on the thread count (checked by ``tests/test_int8.py``). With the row-invariant attention
  (``models.attention``) the whole small-T forward is too, so speculation on int8 weights
  reproduces int8 vanilla token for token and a batch equals each prompt alone. Without that op,
  SDPA's last-bit differences between a one-token decode and a verify (or a padded batch) move
  activation codes (logits by up to ~2), and ``LLM`` refuses speculation on int8 weights. Longer
  inputs (prefill) run the fp32 BLAS over the same dequantised weights.
- ``Transformer.pack_int8_`` packs every decoder matmul; the LM head stays fp16-packed (drafters
  read tokens through its rows, ``packed.shared_reader``).
- CPU only, fp32 models, inference only. The fp32 weight is kept (readers, prefill), so memory
  grows by a quarter, unless packed with ``keep_weight=False`` (``Transformer.pack_int8_``'s
  decoder layers): then the codes stay, one byte per weight (``packed.PackedLinear``). ``VERISPEC_INT8_ISA=avx2`` runs the AVX2 path on an AVX-512 machine (tests).
"""
from __future__ import annotations


import torch
from torch import nn

from . import native
from .packed import DENSE_MIN_ROWS, PackedLinear, max_threads

def _register_fake() -> None:
    @torch.library.register_fake("verispec_int8::linear")
    def _(x, buf, meta, colsum, wscale, bias, qmax, max_threads, out_features):
        return x.new_empty((*x.shape[:-1], out_features))


_OP = native.NativeOp("verispec_int8_gemm", "int8_gemm.cpp", no_isa="neither AVX2 nor AVX-512 VNNI",
                      fake=_register_fake, fallback="int8 weights are not available")


def kernel():
    """The compiled op module (``pack``, ``linear``, ``isa``, ``qmax``), or ``None`` where it cannot
    be had (see ``unavailable_reason``). Built once per process."""
    return _OP.module()


def int8_available() -> bool:
    return kernel() is not None


def unavailable_reason() -> str | None:
    return _OP.reason()


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [N, K] int8 in -127..127, scale [N] fp32, dequantised [N, K] fp32) of ``w [N, K]``."""
    w = w.detach().float()
    scale = w.abs().amax(1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(w / scale[:, None]).clamp(-127, 127)
    return codes.to(torch.int8), scale, codes * scale[:, None]


def _padded(t: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(n - t.numel())]).contiguous()


class PackedInt8Linear(PackedLinear):
    """``y = x @ W.T + b`` with ``W`` as int8 codes and the input quantised per row (see the
    module docstring)."""

    def __init__(self, linear: nn.Linear, keep_weight: bool = True):
        super().__init__()
        if linear.weight.dtype != torch.float32 or linear.weight.device.type != "cpu":
            raise ValueError("int8 packing needs fp32 weights on the CPU "
                             f"(got {linear.weight.dtype} on {linear.weight.device})")
        ext = kernel()
        if ext is None:
            raise RuntimeError(f"the int8 kernel is unavailable: {unavailable_reason()}")
        codes, scale, deq = quantize_int8(linear.weight)
        self._hold(linear, deq, keep_weight, (codes, scale))
        del deq
        self._buf, self._meta, self._colsum = ext.pack(codes)
        padded = int(self._meta[3])
        self._scale = _padded(scale, padded)
        self._bias = _padded(linear.bias.detach().float(), padded) if linear.bias is not None else None
        self._qmax = int(ext.qmax())
        self._max_threads = max_threads(codes.numel())
        self._linear = ext.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise TypeError(f"int8-packed linear takes fp32 activations, got {x.dtype}")
        if x.dim() >= 2 and x.shape[-2] >= DENSE_MIN_ROWS:
            return self._prefill(x)
        x = x.contiguous()
        if torch.compiler.is_compiling():
            return torch.ops.verispec_int8.linear(x, self._buf, self._meta, self._colsum, self._scale,
                                                  self._bias, self._qmax, self._max_threads, self.out_features)
        return self._linear(x, self._buf, self._meta, self._colsum, self._scale, self._bias,
                            self._qmax, self._max_threads)

    def _expand(self, out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.mul(codes, scale[:, None], out=out)   # quantize_int8's dequantised weight, bit for bit

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int8 W8A8 (activations per token, qmax {self._qmax})")


def pack_int8_(model: nn.Module, names: tuple[str, ...], keep_weight: bool = True) -> int:
    """Replace the ``nn.Linear`` submodules at dotted ``names`` by ``PackedInt8Linear``
    (``keep_weight``: see ``packed.PackedLinear``); returns how many were packed. Raises where the
    kernel is unavailable."""
    if not int8_available():
        raise RuntimeError(f"int8 weight packing needs the int8 kernel: {unavailable_reason()}")
    from .packed import replace_linears_
    return replace_linears_(model, names, PackedInt8Linear,
                            lambda lin: PackedInt8Linear(lin, keep_weight))
