"""Export trained draft heads to the folders other serving stacks load.

``export_checkpoint(src, dst, fmt, target_model=None)`` reads a head folder written by
``verispec.formats`` (``save_eagle_head`` / ``save_medusa_heads``, or any folder those loaders
accept) with the format module the loaders use (``formats.eagle3``, ``eagle1``, ``medusa``),
detects what it holds from its ``config.json`` (``detect_source``) and writes ``dst`` in the
layout a consumer loads. Tensors keep their source dtype (bf16 stays bf16); every source tensor
is written; nothing is written unless the whole export is valid; a non-empty ``dst`` is refused
unless ``overwrite=True`` (which first removes the config and weight files already there, so a
consumer never picks up a stale ``pytorch_model.bin`` beside a new ``model.safetensors``).

What each consumer reads (checked against their loaders):

EAGLE-3 head (``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``,
optional ``embed_tokens.weight``):
- ``sglang`` (``python/sglang/srt/models/llama_eagle3.py``, ``LlamaForCausalLMEagle3``):
  ``config.json`` + ``model.safetensors``. Names must be ``midlayer.*`` (SGLang's module is
  ``model.midlayer``; ``layers.0.*`` names would be skipped silently). ``d2t`` becomes
  ``hot_token_id``, ``t2d`` is ignored, ``tie_word_embeddings`` must be false and
  ``draft_vocab_size`` present (else SGLang takes the target's lm_head). The embedding is always
  replaced by the target's unless ``target_hidden_size != hidden_size``. Aux layers: SGLang adds 1
  to ``eagle_config.eagle_aux_hidden_state_layer_ids`` (an id names the layer whose *output* is
  taken), so this export writes our ids (vLLM's: the layer whose *input* is taken) minus one.
- ``vllm`` (``vllm/model_executor/models/llama_eagle3.py``, ``Eagle3LlamaForCausalLM``): same
  files and names (vLLM maps ``midlayer.`` to ``layers.0.``, ``d2t`` to ``draft_id_to_target_id``,
  skips ``t2d``, shares the target's embedding when the shapes match). Aux ids are written both at
  the top level (``vllm/v1/worker/gpu_model_runner.py`` reads that first) and in ``eagle_config``.
- ``eagle`` (SafeAILab/EAGLE ``EaModel.from_pretrained(use_eagle3=True, ea_model_path=...)``):
  ``config.json`` (EConfig: ``draft_vocab_size``, ``bias`` false, ``pretraining_tp``; rope scaling
  only ``{"type": linear|dynamic, "factor"}``) + ``pytorch_model.bin`` (read first; every EAGLE
  version reads it). ``target_hidden_size`` is written only when it differs from ``hidden_size``:
  with the key present EAGLE does not load the embedding from the base model. The EAGLE repo
  always fuses the inputs of target layers (2, N/2, N-3); other aux ids are refused.

EAGLE-1 head (``fc.weight`` [h, 2h], optional ``fc.bias``, ``layers.0.*`` without
``input_layernorm``):
- ``eagle`` (EAGLE repo ``cnets1.Model``): ``pytorch_model.bin``; config ``bias`` says whether
  ``fc`` has a bias (EAGLE's default is true), ``qkv_bias`` for attention biases.
- ``vllm`` (``vllm/model_executor/models/llama_eagle.py``, ``EagleLlamaForCausalLM``; vLLM maps
  ``LlamaForCausalLM`` to it for method ``eagle``): ``model.safetensors``; vLLM's ``fc`` has no
  bias, so a head with ``fc.bias`` is refused (export to ``eagle`` or ``sglang`` instead).
- ``sglang`` (``python/sglang/srt/models/llama_eagle.py``, ``LlamaForCausalLMEagle``; the
  architecture must say ``Eagle`` or SGLang treats the draft as an MTP layer): SGLang's ``fc``
  always has a bias, so a head without one gets ``fc.bias`` = zeros (the same function).
  SGLang's and vLLM's Llama layers read config ``bias`` as an *attention* bias, so both exports
  write ``bias: false`` (it means the fc bias only in the EAGLE repo).
Both vLLM and SGLang use the target's embedding and lm_head for EAGLE-1.

Medusa heads:
- ``medusa`` (FasterDecoding ``MedusaModel.from_pretrained``): ``medusa_lm_head.safetensors`` with
  ``{i}.{j}.linear.weight`` / ``.bias`` and ``{i}.{K}.weight``, config ``medusa_num_heads``,
  ``medusa_num_layers`` and ``base_model_name_or_path`` (only if given: we do not know the target's
  Hugging Face id; FasterDecoding defaults to vicuna-7b, override with ``base_model=``). Its
  ResBlock always has a bias, so bias-free blocks get zero biases; tied heads get one copy of the
  target's lm_head per head (FasterDecoding has no tie option). FasterDecoding's ``MedusaModel``
  builds ``[ResBlock] * medusa_num_layers`` (one shared block per head), so with more than one
  layer it cannot hold distinct blocks (TGI and TensorRT-LLM read each block): a note says so.
  ``MedusaModel.from_pretrained`` (medusa-llm 0.1 and the repo since) reads only
  ``medusa_lm_head.pt`` (``torch.load``), TGI and the newer training scripts
  ``medusa_lm_head.safetensors``: both files are written, with the same tensors.
- ``vllm`` (``vllm/model_executor/models/medusa.py``): ``model.safetensors`` with
  ``blocks.{i}.layers.{j}.weight`` (``.bias`` with ``medusa_fc_bias``) and ``lm_heads.{i}.weight``,
  config ``num_heads``, ``num_hidden_layers``, ``truncated_vocab_size``. Tied heads are written with
  ``original_lm_head: true`` and one ``lm_heads.0.weight`` (vLLM shares it across heads) copied
  from the target; ``load_medusa_heads`` does not read that variant back.

Not produced anywhere: EAGLE-3.1 heads (``fc_norm`` / ``norm_output``) and attention biases on
EAGLE-3 heads (none of these consumers implements them), more or fewer than three aux layers, and
own embeddings that a consumer would replace by the target's (refused unless equal to it).
Aux ids in a source ``config.json`` are read in vLLM's convention, as ``load_eagle_head`` does.
The EAGLE-3.1 switches ``fc_norm`` / ``norm_output`` are written only when on (see ``formats.eagle3``):
SpecForge 0.2.0 reads ``norm_output: false`` as "no final norm before lm_head".
"""
from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ..formats import eagle1, eagle3, medusa
from ..formats.common import CheckpointError, ExportFormat, read_config, read_tensors, write_config, write_tensors


class SourceKind(str, enum.Enum):
    EAGLE3 = "eagle3"
    EAGLE1 = "eagle1"
    MEDUSA = "medusa"


VALID_FORMATS: dict[SourceKind, tuple[ExportFormat, ...]] = {
    SourceKind.EAGLE3: (ExportFormat.EAGLE, ExportFormat.SGLANG, ExportFormat.VLLM),
    SourceKind.EAGLE1: (ExportFormat.EAGLE, ExportFormat.SGLANG, ExportFormat.VLLM),
    SourceKind.MEDUSA: (ExportFormat.MEDUSA, ExportFormat.VLLM),
}
_KIND_NAME = {SourceKind.EAGLE3: "an EAGLE-3 head", SourceKind.EAGLE1: "an EAGLE-1 head",
              SourceKind.MEDUSA: "Medusa heads"}
_STALE_SUFFIXES = (".safetensors", ".bin", ".pt")


class ExportWarning(UserWarning):
    """Something a consumer of the export should know (printed by ``verispec export``)."""


@dataclass
class ExportReport:
    path: Path
    source: SourceKind
    format: ExportFormat
    files: list[tuple[str, int]]                 # (file name, bytes), in writing order
    tensors: int                                 # tensors written (per weight file)
    notes: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(n for _, n in self.files)


# -- detection -----------------------------------------------------------------------------------------
def detect_source(src: str | Path) -> SourceKind:
    """What ``src`` holds, from its ``config.json`` (tensor names only break a plain-Llama tie)."""
    folder = Path(src)
    cfg = read_config(folder)
    archs = set(cfg.get("architectures") or [])
    if "medusa_num_heads" in cfg or cfg.get("model_type") == "medusa" or "MedusaModel" in archs:
        return SourceKind.MEDUSA
    if archs & (set(eagle3.ARCHITECTURES) - {"LlamaForCausalLM"}) or "draft_vocab_size" in cfg \
            or "eagle_config" in cfg or "eagle_aux_hidden_state_layer_ids" in cfg:
        return SourceKind.EAGLE3
    if archs & {"LlamaForCausalLMEagle", "EagleLlamaForCausalLM"}:
        return SourceKind.EAGLE1
    if "hidden_size" in cfg and int(cfg.get("num_hidden_layers", 1)) == 1 \
            and cfg.get("model_type", "llama") == "llama":
        names = read_tensors(folder)                         # plain LlamaForCausalLM: either EAGLE
        if any(n.removeprefix("model.").startswith("midlayer.") or "hidden_norm" in n for n in names):
            return SourceKind.EAGLE3
        return SourceKind.EAGLE1
    raise CheckpointError(f"{folder}/config.json is neither an EAGLE-1/EAGLE-3 head (a one-layer Llama "
                          "config) nor Medusa heads (medusa_num_heads / model_type medusa)")


def parse_format(fmt: ExportFormat | str) -> ExportFormat:
    try:
        return ExportFormat(fmt)
    except ValueError:
        raise CheckpointError(f"unknown export format {fmt!r}; formats: "
                              f"{', '.join(f.value for f in ExportFormat)}") from None


# -- public entry points -------------------------------------------------------------------------------
def export_checkpoint(src: str | Path, dst: str | Path, fmt: ExportFormat | str, target_model=None, *,
                      overwrite: bool = False, base_model_name_or_path: str | None = None) -> Path:
    """Write the head folder ``src`` to ``dst`` in format ``fmt``; return ``dst``.

    ``target_model`` (our ``Transformer``) is needed to materialise tied Medusa lm_heads and to
    check own embeddings a consumer would replace; with the ``eagle`` format it also lets the
    export include ``embed_tokens.weight`` (otherwise the EAGLE repo loads it from the base model's
    ``*.index.json``, which only sharded base checkpoints have). Notes are issued as
    ``ExportWarning``; ``export`` returns them in an ``ExportReport`` instead."""
    report = export(src, dst, fmt, target_model, overwrite=overwrite,
                    base_model_name_or_path=base_model_name_or_path)
    for note in report.notes:
        warnings.warn(note, ExportWarning, stacklevel=2)
    return report.path


def export(src: str | Path, dst: str | Path, fmt: ExportFormat | str, target_model=None, *,
           overwrite: bool = False, base_model_name_or_path: str | None = None) -> ExportReport:
    """``export_checkpoint`` returning what was written (files, sizes, tensor count, notes)."""
    src, dst = Path(src), Path(dst)
    fmt = parse_format(fmt)
    kind = detect_source(src)
    if fmt not in VALID_FORMATS[kind]:
        raise CheckpointError(f"format {fmt.value!r} does not fit {_KIND_NAME[kind]} ({src}); valid formats: "
                              f"{', '.join(f.value for f in VALID_FORMATS[kind])}")
    _check_destination(src, dst, overwrite)
    notes: list[str] = []
    target_cfg = target_model.cfg if target_model is not None else None
    if kind is SourceKind.MEDUSA:
        cfg_json, tensors, weights = medusa.to_consumer(medusa.read(src, target_cfg), fmt, target_model,
                                                        base_model_name_or_path, notes)
    else:
        module = eagle3 if kind is SourceKind.EAGLE3 else eagle1
        cfg_json, tensors, weights = module.to_consumer(module.read(src, target_cfg), fmt, target_model, notes)
    _clear_destination(dst)
    for name in weights:
        write_tensors(dst, tensors, name)
    write_config(dst, cfg_json)
    files = [(name, (dst / name).stat().st_size) for name in (*weights, "config.json")]
    return ExportReport(dst, kind, fmt, files, len(tensors), notes)


# -- destination -------------------------------------------------------------------------------------
def _check_destination(src: Path, dst: Path, overwrite: bool) -> None:
    if dst.exists() and not dst.is_dir():
        raise CheckpointError(f"{dst} exists and is not a folder")
    if dst.exists() and dst.resolve() == src.resolve():
        raise CheckpointError(f"destination {dst} is the source folder; export to a new folder")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise CheckpointError(f"{dst} is not empty; pass overwrite=True (--overwrite) to replace the "
                              "checkpoint files in it")


def _clear_destination(dst: Path) -> None:
    """Remove config and weight files a consumer could read instead of the new ones."""
    if not dst.is_dir():
        return
    for p in dst.iterdir():
        if p.is_file() and (p.name == "config.json" or p.suffix in _STALE_SUFFIXES
                            or p.name.endswith(".index.json")):
            p.unlink()


__all__ = ["ExportFormat", "ExportReport", "ExportWarning", "SourceKind", "VALID_FORMATS", "detect_source",
           "export", "export_checkpoint", "parse_format"]
