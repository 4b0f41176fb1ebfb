"""How a draft head's matmuls are packed beside a packed target (``draft_packing``), and the
packing itself (``pack_linears_``). A draft's numbers need not match the target's: every drafted
token is verified by the target, so the output is the target's whatever the head computes, and a
head may take fewer bits than the target keeps."""
from __future__ import annotations

import enum

import torch
from torch import nn

from .int4 import GROUP, int4_available, pack_int4_
from .int8 import pack_int8_
from .packed import WeightFormat, pack_fp16_


class DraftPacking(str, enum.Enum):
    """How a draft head's matmuls are packed beside a packed target. A draft's numbers need not
    match the target's (every draft token is verified by the target, so the output is the target's
    whatever the head computes), so a head may take fewer bits than the target keeps: its step
    reads a quarter of the fp16 bytes with ``int4``."""
    FP16 = "fp16"
    INT4 = "int4"
    INT8 = "int8"


def pack_linears_(module: nn.Module, packing: DraftPacking = DraftPacking.FP16, skip: tuple[str, ...] = ()) -> int:
    """Pack every ``nn.Linear`` below ``module`` whose dotted name does not end with one of
    ``skip`` (draft heads: small modules where every matmul is on the forward path), as
    ``packing`` says; a matrix whose shape the int4 or int8 kernel does not take is fp16-packed."""
    names = tuple(n for n, m in module.named_modules()
                  if isinstance(m, nn.Linear) and not n.endswith(skip))
    if packing is DraftPacking.FP16:
        return pack_fp16_(module, names)
    fits = {n for n in names if module.get_submodule(n).out_features % 16 == 0
            and module.get_submodule(n).in_features % GROUP == 0}
    quantised = tuple(n for n in names if n in fits)
    count = (pack_int4_ if packing is DraftPacking.INT4 else pack_int8_)(module, quantised)
    return count + pack_fp16_(module, tuple(n for n in names if n not in fits))


def draft_packing(target, module: nn.Module) -> DraftPacking | None:
    """How a draft ``module`` (EAGLE / Medusa head) drafting for the loaded ``target`` is packed:
    None (kept as loaded) unless the target's weights are packed and the module computes in fp32;
    ``int4`` beside int4 decoder layers (the int4 kernel available), ``int8`` beside int8 ones,
    else ``fp16``."""
    if target.weights == WeightFormat.DENSE or next(module.parameters()).dtype != torch.float32:
        return None
    if target.weights.int4_layers:
        return DraftPacking.INT4 if int4_available() else DraftPacking.FP16
    return DraftPacking.INT8 if target.weights is WeightFormat.INT8 else DraftPacking.FP16
