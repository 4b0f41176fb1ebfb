"""The multi-threaded fp16-weight GEMM (``csrc/fp16_gemm.cpp``), built on first use.

Why: torch's ``fbgemm_linear_fp16_weight`` runs FBGEMM's fp16 kernel on one thread, so a decode
or verify forward used one core for its matmuls (half the step on SmolLM2-135M). FBGEMM's kernel
can split its output column blocks over threads; the C++ op does that inside one OpenMP region
(one parallel region per product, no Python hand-off). Every output element is the same kernel
over the same inputs, so products are bit-identical whatever the thread count, and to torch's op.

Contract
- ``kernel()`` returns the compiled module (``pack(weight) -> (buffer, meta)``,
  ``linear(x, buffer, meta, bias, max_threads)``; the same product is the dispatcher op
  ``torch.ops.verispec_fp16.linear(x, buffer, meta, bias, max_threads, out_features)``, which a
  compiled graph calls) or ``None`` where it cannot be had (no C++
  compiler, no FBGEMM, ``VERISPEC_FP16_KERNEL=torch``); ``unavailable_reason()`` says why. The
  first call compiles it (``native.build``: about 25 s, once per machine).
"""
from __future__ import annotations

import contextlib
import os

import torch

from . import native

ENV = "VERISPEC_FP16_KERNEL"          # "torch": use torch's single-threaded op instead
_state: dict = {}


def _register_fake() -> None:
    """Output shape of ``torch.ops.verispec_fp16.linear`` for torch.compile's tracing."""
    @torch.library.register_fake("verispec_fp16::linear")
    def _(x, buf, meta, bias, max_threads, out_features):
        return x.new_empty((*x.shape[:-1], out_features))


_OP = native.NativeOp(
    "verispec_fp16_gemm", "fp16_gemm.cpp", fake=_register_fake, fallback="fp16-packed matmuls run torch's "
    "single-threaded op", off=lambda: f"{ENV}=torch" if os.environ.get(ENV, "").lower() == "torch" else None,
    precondition=lambda: None if hasattr(torch, "fbgemm_pack_gemm_matrix_fp16")
    else "no FBGEMM fp16 kernels in this torch build / CPU")


def kernel():
    """The compiled op module, or ``None`` (see ``unavailable_reason``). Built once per process."""
    if _state.get("off"):
        return None
    return _OP.module()


def unavailable_reason() -> str | None:
    if _state.get("off"):
        return "inside torch_op_only()"
    return _OP.reason()


@contextlib.contextmanager
def torch_op_only():
    """Within it, newly packed matrices use torch's single-threaded op (benchmarks' baseline)."""
    _state["off"] = True
    try:
        yield
    finally:
        _state["off"] = False
