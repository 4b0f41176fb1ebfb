"""fp16-packed weights for CPU inference: FBGEMM's fp16 GEMM (fp16 weights, fp32 activations and
accumulation).

Why: on a CPU the matmuls of a small model's forward are memory-bound at one token and poorly
served by the fp32 BLAS for a few tokens (MKL's skinny-M sgemm on this AMD EPYC runs a forward of
2-8 tokens at 1.5-2x the one-token time). FBGEMM's fp16 kernels read half the bytes and are built
for small M, so a verification forward over a draft tree costs about what a one-token decode
costs: the condition for speculative decoding to pay.

Contract:
- ``WeightFormat.DENSE`` (default): the model as loaded, nothing changes.
- ``WeightFormat.FP16``: every matmul weight of the forward (fused q/k/v, o, fused gate/up, down,
  LM head) is rounded to fp16 *in place* (so every reader of ``.weight`` sees the numbers the
  kernel uses: the model simply *is* the fp16-weight model) and packed once for FBGEMM. Vanilla
  and speculative decoding on such a model share those weights, so speculation stays lossless
  with respect to it; it is not bit-identical to the fp32 model (relative weight error <= 2^-11).
- Which kernel computes a product depends only on the weight's size and the input's sequence
  length T, never on the batch or the drafter: T >= ``DENSE_MIN_ROWS`` (prefill chunks) runs the
  fp32 BLAS over the same rounded weights; shorter inputs (decode, verification) run FBGEMM's fp16
  kernel over all of torch's threads (``fp16_kernel``: the output's column blocks split inside one
  OpenMP region; bit-identical to one thread). Where that op cannot be built, torch's
  single-threaded op runs instead, matrices of ``SPLIT_MIN_BYTES`` or more as two column halves on
  two Python threads (bit-identical too).
- CPU only (``load_model`` refuses ``weights="fp16"`` with any other device before loading: on
  CUDA, dtype bfloat16 / float16 is the fast path). Inference only (no autograd through packed
  weights); fp32 activations only.
- Memory (``PackedLinear``): a module packed with ``keep_weight=True`` (the default; the LM head,
  which the embedding and drafters share) keeps its fp32 tensor, so it grows by half. The
  decoder layers packed by ``Transformer.pack_fp16_`` release it and keep the fp16 values, which
  rebuild the same fp32 weight for prefill and readers: Qwen2.5-Coder-1.5B holds 8.3 GB instead
  of 11.
"""
from __future__ import annotations

import enum
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from . import fp16_kernel


class WeightFormat(str, enum.Enum):
    """How the CPU forward's matmul weights are held: as loaded, fp16-packed (this module), or for
    the decoder layers int4 weight-only (``int4``) or int8 weights with int8 activations per token
    (``int8``), the LM head fp16-packed in both; ``int4-all``: int4 in the LM head too (its rows,
    which a tied embedding and tied draft heads read, become the dequantised int4 values: about
    a third of a 1.5B model's bytes per token less, at a quality cost measured in
    ``benchmarks/results/weights_quality_*.md``); ``int4-head8``: int4 decoder layers and the LM
    head in int8 W8A8 (its rows become the dequantised int8 values: half the fp16 head's bytes,
    at a smaller quality cost than int4-all's); ``int4-a8``: as ``int4-head8``, with the decoder
    layers' activations quantised to int8 per group of 32 columns (W4A8, as llama.cpp's Q4 x Q8
    kernels: exact integer dot products, about 1.1-1.6x the weight-only kernel's speed)."""
    DENSE = "dense"
    FP16 = "fp16"
    INT4 = "int4"
    INT8 = "int8"
    INT4_ALL = "int4-all"
    INT4_HEAD8 = "int4-head8"
    INT4_A8 = "int4-a8"

    @property
    def int8_activations(self) -> bool:
        """Whether some matmul quantises its activations to int8 (per token, or per group of a
        token's columns: W8A8, W4A8): a forward then reproduces a decode's logits in a verify only
        with the row-invariant attention op."""
        return self in (WeightFormat.INT8, WeightFormat.INT4_HEAD8, WeightFormat.INT4_A8)

    @property
    def int4_layers(self) -> bool:
        """Whether the decoder layers hold int4 weights (weight-only, or W4A8 with ``int4-a8``)."""
        return self in (WeightFormat.INT4, WeightFormat.INT4_ALL, WeightFormat.INT4_HEAD8, WeightFormat.INT4_A8)

    @classmethod
    def parse(cls, value: "str | WeightFormat") -> "WeightFormat":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown weight format {value!r}; use one of "
                             f"{[w.value for w in cls]}") from None


def fp16_packing_available() -> bool:
    return hasattr(torch, "fbgemm_pack_gemm_matrix_fp16") and torch.backends.cpu.get_cpu_capability() != "DEFAULT"


# Under OMP_WAIT_POLICY=PASSIVE, OpenMP's threads sleep between parallel regions and waking one
# costs ~50 us (measured: a 576x576 product 15 us on one thread, 64 us on two): the threaded op
# then splits only matrices of SPLIT_MIN_BYTES or more. With the default (spin a while) policy a
# region costs a few microseconds and every matrix is split (576x576: 15 -> 9 us; 3072x576:
# 73 -> 39 us; the 49152x576 LM head 1.47 -> 0.92 ms at T = 1).
_OMP_PASSIVE = os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"

# torch's FBGEMM fp16 GEMM (the fallback) runs on one thread. A large matrix is packed as two
# halves of its output columns, computed on two threads when torch may use two or more: every
# output element is the same kernel over the same inputs, so the result is bit-identical to the
# unsplit product.
# Measured on the 2-core AMD EPYC (benchmarks/results/spec_core.analysis.md): with 12 MB the Qwen
# 1.5B one-token forward went 258 -> 172 ms and the 0.5B one 88 -> 68 ms; at 24 MB 186 / 73 ms, at
# 6 MB the hand-off (~0.15 ms) ate the gain on the smaller matrices.
SPLIT_MIN_BYTES = 12 << 20          # fp16 bytes; below it the thread hand-off costs more than it saves


def max_threads(numel: int) -> int:
    """``max_threads`` for a threaded C++ op over a matrix of ``numel`` weights: all of torch's
    threads, except one under PASSIVE for matrices under ``SPLIT_MIN_BYTES`` (as fp16)."""
    return 1 if (_OMP_PASSIVE and numel * 2 < SPLIT_MIN_BYTES) else 1 << 16     # capped by torch's


_SPLIT_ALIGN = 64                   # split at a multiple of FBGEMM's column blocking
_pool: tuple[int, ThreadPoolExecutor] | None = None


def _worker() -> ThreadPoolExecutor:
    """One helper thread per process (re-made after a fork)."""
    global _pool
    if _pool is None or _pool[0] != os.getpid():
        _pool = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="verispec-gemm"))
    return _pool[1]


# "fbgemm_... is deprecated": we pin torch (see pyproject). One process-wide filter, because
# catch_warnings() is not safe with the helper thread.
warnings.filterwarnings("ignore", message=r"fbgemm_\w+ is deprecated")


# Long inputs (prefill chunks) are compute-bound: there the fp32 BLAS on every thread beats the
# single-threaded fp16 kernel (SmolLM2 MLP at 512 rows: 16.8 vs 21.3 ms; Qwen 1.5B MLP: 222 vs
# 455 ms). Same (fp16-rounded) weights, another fp32 summation order. Decided by the sequence
# length T alone, never by the batch, so decoding and verification (T <= 1 + tree nodes) always
# use the fp16 kernel and a batch cannot change which kernel a row gets.
DENSE_MIN_ROWS = 128


def _pack(weight: torch.Tensor):
    return torch.fbgemm_pack_gemm_matrix_fp16(weight.detach().contiguous())


def _gemm(x: torch.Tensor, packed, bias: torch.Tensor) -> torch.Tensor:
    return torch.fbgemm_linear_fp16_weight(x, packed, bias)


def _parts_gemm(x: torch.Tensor, packs: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.Tensor:
    """The product over one or two column parts (the second on the helper thread when torch may
    use two threads)."""
    if len(packs) == 1:
        return _gemm(x, packs[0], biases[0])
    if torch.get_num_threads() < 2:
        return torch.cat([_gemm(x, packs[0], biases[0]), _gemm(x, packs[1], biases[1])], dim=-1)
    second = _worker().submit(_gemm, x, packs[1], biases[1])
    return torch.cat([_gemm(x, packs[0], biases[0]), second.result()], dim=-1)


# FBGEMM's fp16 ops are composite (they read the packed matrix's pointer), so ``torch.compile``
# cannot trace them: under compilation the product is this opaque op, with its output shape given.
@torch.library.custom_op("verispec::fp16_linear", mutates_args=())
def fp16_linear_op(x: torch.Tensor, packs: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.Tensor:
    return _parts_gemm(x, packs, biases)


@fp16_linear_op.register_fake
def _(x, packs, biases):
    return x.new_empty((*x.shape[:-1], sum(b.shape[0] for b in biases)))


class PackedLinear(nn.Module):
    """Base of the packed linears (fp16, int4, int8): ``y = x @ W.T + b`` with ``W`` the weight
    the kernel computes with (the fp16-rounded or dequantised values of the original).

    ``W`` is held one of two ways, chosen at packing (``keep_weight``):
    - kept (the default): the ``nn.Linear``'s fp32 parameter, overwritten in place with ``W``,
      stays as ``self.weight``, so readers that share its storage see ``W`` (the LM head, which
      drafters read tokens through: ``shared_reader``);
    - released: only a compact copy stays (fp16 values, or the integer codes beside the scales the
      kernel already holds). ``dense_weight()``, and reading ``.weight``, rebuild the same fp32
      ``W`` (bit for bit) on each call. ``Transformer.pack_*_`` packs the decoder layers' matmuls
      so: the 1.5B Qwen then holds 8.3 GB with fp16 weights and 5.2 GB with int4, not 11.05 and 9.0.
    ``_prefill(x)``: the fp32 BLAS over ``W``, for subclasses that send long inputs (prefill) there
    (fp16, int8; int4 runs its own kernel at every length)."""

    def _hold(self, linear: nn.Linear, dense: torch.Tensor, keep: bool, compact: tuple) -> None:
        """Keep ``linear``'s parameter overwritten with ``dense``, or only ``compact`` (the
        arguments of ``_expand``)."""
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._compact = None if keep else compact
        if keep:
            with torch.no_grad():
                linear.weight.copy_(dense)
            self.weight = linear.weight

    def _expand(self, out: torch.Tensor, *compact: torch.Tensor) -> torch.Tensor:
        """Write ``W`` (fp32, [out_features, in_features]) into ``out`` from the compact copy."""
        raise NotImplementedError

    def dense_weight(self) -> torch.Tensor:
        """``W`` in fp32: the kept parameter, or rebuilt from the compact copy (a new tensor)."""
        if self._compact is None:
            return self.weight
        return self._expand(torch.empty(self.out_features, self.in_features), *self._compact)

    def __getattr__(self, name: str):
        if name == "weight" and self.__dict__.get("_compact") is not None:
            return self.dense_weight()
        return super().__getattr__(name)

    def _prefill(self, x: torch.Tensor) -> torch.Tensor:
        """The fp32 BLAS over ``W``; a released ``W`` is rebuilt in a scratch buffer this thread
        reuses (a fresh 110 MB tensor per call cost 46 ms of page faults on a Qwen-1.5B gate/up
        matrix; the copy into warm memory 8 ms, against 320 ms for the product at 512 tokens)."""
        if self._compact is None:
            return nn.functional.linear(x, self.weight, self.bias)
        w = self._expand(_scratch(self.out_features * self.in_features).view(self.out_features, self.in_features),
                         *self._compact)
        return nn.functional.linear(x, w, self.bias)


_scratch_local = threading.local()


def _scratch(numel: int) -> torch.Tensor:
    """This thread's fp32 scratch buffer of at least ``numel`` elements (grown, never shrunk)."""
    buf = getattr(_scratch_local, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _scratch_local.buf = torch.empty(numel)
    return buf[:numel]


class PackedFP16Linear(PackedLinear):
    """``y = x @ W.T + b`` with ``W`` packed as fp16 for FBGEMM. ``weight``/``bias`` are the
    original parameters (rounded to fp16 values in place), kept for readers. The product runs on
    all of torch's threads through ``fp16_kernel`` (``backend="threaded"``, the default where it
    builds) or torch's single-threaded op (``backend="torch"``; matrices of at least
    ``SPLIT_MIN_BYTES`` as two column halves on two Python threads). An input whose sequence
    length (``x.shape[-2]``) is at least ``DENSE_MIN_ROWS`` goes to the fp32 BLAS with the same
    rounded weights (prefill)."""

    def __init__(self, linear: nn.Linear, backend: str | None = None, keep_weight: bool = True):
        super().__init__()
        if linear.weight.dtype != torch.float32 or linear.weight.device.type != "cpu":
            raise ValueError("fp16 packing needs fp32 weights on the CPU "
                             f"(got {linear.weight.dtype} on {linear.weight.device}); on CUDA use dtype "
                             "bfloat16 or float16 with dense weights instead")
        if backend not in (None, "threaded", "torch"):
            raise ValueError(f"unknown fp16 backend {backend!r}; use 'threaded' or 'torch'")
        w16 = linear.weight.detach().half()
        w = w16.float()                       # the rounded weight: what every path computes with
        self._hold(linear, w, keep_weight, (w16,))
        ext = fp16_kernel.kernel() if backend != "torch" else None
        if backend == "threaded" and ext is None:
            raise RuntimeError(f"the threaded fp16 kernel is unavailable: {fp16_kernel.unavailable_reason()}")
        self.backend = "threaded" if ext is not None else "torch"
        self._packs: list[torch.Tensor] = []
        self._biases: list[torch.Tensor] = []
        big = w.numel() * 2 >= SPLIT_MIN_BYTES           # fp16 bytes: worth a second thread anywhere
        if ext is not None:
            self._buf, self._meta = ext.pack(w.contiguous())
            self._linear = ext.linear                    # the pybind entry: the cheapest eager call
            self._bias = linear.bias.detach().contiguous() if linear.bias is not None else None
            self._max_threads = max_threads(w.numel())
            return
        bias = (linear.bias.detach() if linear.bias is not None else torch.zeros(linear.out_features, device="cpu"))
        half = (self.out_features // 2) // _SPLIT_ALIGN * _SPLIT_ALIGN
        if big and half > 0:
            parts = [(_pack(w[:half]), bias[:half].contiguous()), (_pack(w[half:]), bias[half:].contiguous())]
        else:
            parts = [(_pack(w), bias)]
        # the kernel's arguments as lists, made once (every decode step calls this module ~120 times)
        self._packs, self._biases = [p for p, _ in parts], [b for _, b in parts]

    @property
    def _parts(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(packed matrix, bias) per column part of the ``torch`` backend (empty for ``threaded``)."""
        return list(zip(self._packs, self._biases))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise TypeError(f"fp16-packed linear takes fp32 activations, got {x.dtype}")
        if x.dim() >= 2 and x.shape[-2] >= DENSE_MIN_ROWS:
            return self._prefill(x)
        x = x.contiguous()
        if self.backend == "threaded":
            if torch.compiler.is_compiling():
                return torch.ops.verispec_fp16.linear(x, self._buf, self._meta, self._bias,
                                                      self._max_threads, self.out_features)
            return self._linear(x, self._buf, self._meta, self._bias, self._max_threads)
        if torch.compiler.is_compiling():
            return fp16_linear_op(x, self._packs, self._biases)
        return _parts_gemm(x, self._packs, self._biases)

    def _expand(self, out: torch.Tensor, half: torch.Tensor) -> torch.Tensor:
        return out.copy_(half)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp16 packed ({self.backend})"


def pack_fp16_(model: nn.Module, names: tuple[str, ...], keep_weight: bool = True) -> int:
    """Replace the ``nn.Linear`` submodules at dotted ``names`` (those the forward calls) by
    ``PackedFP16Linear`` (``keep_weight``: see ``PackedLinear``); returns how many were packed.
    Raises where FBGEMM is unavailable."""
    if not fp16_packing_available():
        raise RuntimeError("fp16 weight packing needs a PyTorch CPU build with FBGEMM and AVX2")
    return replace_linears_(model, names, PackedFP16Linear,
                            lambda lin: PackedFP16Linear(lin, keep_weight=keep_weight))


def replace_linears_(model: nn.Module, names: tuple[str, ...], kind: type, make=None) -> int:
    """Replace the ``nn.Linear`` at each dotted name by ``make(linear)`` (default ``kind(linear)``),
    skipping those already of type ``kind``; returns how many were replaced."""
    count = 0
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        lin = getattr(parent, attr)
        if isinstance(lin, kind):
            continue
        if not isinstance(lin, nn.Linear):
            raise TypeError(f"{name} is a {type(lin).__name__}, not an nn.Linear")
        setattr(parent, attr, (make or kind)(lin))
        count += 1
    return count


def shared_reader(weight: torch.Tensor, owner: nn.Module) -> PackedLinear:
    """The target's packed module ``owner`` as the reader of ``weight`` (a head that reads tokens
    through the target's LM head): it is already rounded and packed (fp16, or int4 with
    ``int4-all``, int8 with ``int4-head8``), so nothing is packed twice. Raises unless ``owner`` is packed over the very
    storage of ``weight``."""
    kept = isinstance(owner, PackedLinear) and owner.__dict__.get("_compact") is None
    if not (kept and owner.weight.shape == weight.shape and owner.weight.data_ptr() == weight.data_ptr()):
        raise ValueError("the head's LM-head weight is not the packed target's: pack the target first")
    return owner
