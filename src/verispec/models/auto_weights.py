"""``weights="auto"``: the fastest weights that stay faithful to the checkpoint.

The rule, decided from the checkpoint and the place it runs, never from timings:
- off the CPU, or with a dtype other than float32: ``dense`` (packing is a CPU path for fp32
  activations; bf16/fp16 on CUDA is the fast path there);
- a GGUF whose decoder matrices are mostly 4-bit blocks (Q4_0, Q4_1, Q4_K: what a Q4_K_M or
  Q4_1 file holds): ``int4``, which keeps those blocks' codes as they are (no second rounding),
  when the int4 kernel is available;
- anything else (HF folders in fp32/bf16/fp16, GGUF in F16/Q8_0...): ``fp16`` packing (FBGEMM),
  when available; otherwise ``dense``.
Faster but lossier formats (``int4-a8``, ``int4-head8``, ``int4-all``, ``int8``) quantise beyond the
checkpoint and stay explicit choices.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .packed import WeightFormat

AUTO = "auto"
_FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")


def decoder_block_types(path: str | Path) -> list[str]:
    """The GGUF block type (``Q4_K``, ``Q5_0``, ``F16``...) of each decoder-layer matrix (``blk.*``
    2-D weights) of the GGUF at ``path``."""
    import gguf
    reader = gguf.GGUFReader(str(path))
    return [t.tensor_type.name for t in reader.tensors
            if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) == 2]


def four_bit_share(path: str | Path) -> float:
    """The share of a GGUF's decoder-layer matrices stored in 4-bit blocks."""
    kinds = decoder_block_types(path)
    return sum(k in _FOUR_BIT for k in kinds) / len(kinds) if kinds else 0.0


def auto_weights(path: str | Path, fmt: str, dtype: torch.dtype, device_kind: str) -> WeightFormat:
    """The format ``weights="auto"`` loads the checkpoint at ``path`` (``fmt``: "gguf" or "hf") with,
    for activations of ``dtype`` on a device of kind ``device_kind`` (module docstring)."""
    from .packed import fp16_packing_available
    if device_kind != "cpu" or dtype != torch.float32:
        return WeightFormat.DENSE
    if fmt == "gguf" and four_bit_share(path) >= 0.5:
        from .int4 import kernel
        if kernel() is not None:
            return WeightFormat.INT4
    return WeightFormat.FP16 if fp16_packing_available() else WeightFormat.DENSE
