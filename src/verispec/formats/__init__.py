"""Draft-head checkpoint formats: one module per format, each reading and writing our layout and
the layouts its consumers load.

- ``eagle3``: EAGLE-3 / 3.1 heads (SpecForge / vLLM / SGLang names; the EAGLE repo's export);
- ``eagle1``: EAGLE-1 heads (the EAGLE repo's names; vLLM's and SGLang's exports);
- ``medusa``: Medusa heads (FasterDecoding's and vLLM's names);
- ``eagle_layer``: the one-layer Llama both EAGLE formats share;
- ``common``: ``CheckpointError``, ``ExportFormat``, config.json and weight-file IO, name / shape checks.

The drafters (``drafters.eagle``, ``drafters.medusa``), the trainers and ``verispec export``
(``train.export``) all read and write through these modules; the entry points are re-exported here.
"""
from __future__ import annotations

from pathlib import Path

from ..drafting.eagle_head import EagleHead, HeadKind, new_eagle_head
from . import eagle1, eagle3
from .common import CheckpointError, ExportFormat, read_config, read_tensors, write_config, write_tensors
from .medusa import MedusaLayout, load_medusa_heads, save_medusa_heads


def load_eagle_head(path: str | Path, target_model, kind: HeadKind,
                    aux_layer_ids: tuple[int, ...] | None = None) -> EagleHead:
    """The EAGLE-1 or EAGLE-3 head in ``path`` for ``target_model`` (our ``Transformer``), eval, no
    gradients; ``aux_layer_ids`` (EAGLE-3 only) override the checkpoint's."""
    if HeadKind(kind) is HeadKind.EAGLE3:
        return eagle3.load(path, target_model, aux_layer_ids)
    if aux_layer_ids:
        raise CheckpointError("aux layer ids apply to EAGLE-3 heads; EAGLE-1 reads the target's last hidden state")
    return eagle1.load(path, target_model)


def save_eagle_head(head: EagleHead, path: str | Path, weights: str = "model.safetensors") -> Path:
    """Write ``head`` with the official names (what SpecForge exports and vLLM / SGLang read)."""
    return (eagle3 if head.cfg.kind is HeadKind.EAGLE3 else eagle1).save(head, path, weights)


__all__ = ["CheckpointError", "ExportFormat", "MedusaLayout", "load_eagle_head", "load_medusa_heads",
           "new_eagle_head", "read_config", "read_tensors", "save_eagle_head", "save_medusa_heads",
           "write_config", "write_tensors"]
