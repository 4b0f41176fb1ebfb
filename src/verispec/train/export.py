"""Export trained draft heads to the folders other serving stacks load.

``export_checkpoint(src, dst, fmt, target_model=None)`` reads a head folder written by
``verispec.checkpoints`` (``save_eagle_head`` / ``save_medusa_heads``, or any folder those loaders
accept), detects what it holds from its ``config.json`` (``detect_source``) and writes ``dst`` in
the layout a consumer loads. Tensors keep their source dtype (bf16 stays bf16); every source tensor
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
  Older FasterDecoding code reads only ``medusa_lm_head.pt``; this export writes safetensors.
- ``vllm`` (``vllm/model_executor/models/medusa.py``): ``model.safetensors`` with
  ``blocks.{i}.layers.{j}.weight`` (``.bias`` with ``medusa_fc_bias``) and ``lm_heads.{i}.weight``,
  config ``num_heads``, ``num_hidden_layers``, ``truncated_vocab_size``. Tied heads are written with
  ``original_lm_head: true`` and one ``lm_heads.0.weight`` (vLLM shares it across heads) copied
  from the target; ``load_medusa_heads`` does not read that variant back.

Not produced anywhere: EAGLE-3.1 heads (``fc_norm`` / ``norm_output``) and attention biases on
EAGLE-3 heads (none of these consumers implements them), more or fewer than three aux layers, and
own embeddings that a consumer would replace by the target's (refused unless equal to it).
Aux ids in a source ``config.json`` are read in vLLM's convention, as ``load_eagle_head`` does.
"""
from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from ..checkpoints import (EAGLE3_ARCHITECTURES, MEDUSA_FILES, CheckpointError, _check_names,
                           _check_vocab_maps, _eagle_names, _medusa_config, _medusa_to_ours,
                           _normalise_names, eagle_config_from_json, eagle_config_to_json, read_config,
                           read_tensors, write_config, write_tensors)
from ..drafters.eagle_head import Eagle1Head, Eagle3Head, EagleHeadConfig, HeadKind
from ..drafters.medusa import MedusaConfig, MedusaHeads


class ExportFormat(str, enum.Enum):
    EAGLE = "eagle"       # SafeAILab/EAGLE EaModel (EAGLE-1 and EAGLE-3 heads)
    SGLANG = "sglang"     # SGLang LlamaForCausalLMEagle / LlamaForCausalLMEagle3
    VLLM = "vllm"         # vLLM EagleLlamaForCausalLM / Eagle3LlamaForCausalLM / MedusaModel
    MEDUSA = "medusa"     # FasterDecoding Medusa (medusa_lm_head.safetensors)


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
_CONSUMER = {ExportFormat.EAGLE: "the EAGLE repo", ExportFormat.SGLANG: "SGLang", ExportFormat.VLLM: "vLLM",
             ExportFormat.MEDUSA: "FasterDecoding Medusa"}
_STALE_SUFFIXES = (".safetensors", ".bin", ".pt")


class ExportWarning(UserWarning):
    """Something a consumer of the export should know (printed by ``verispec export``)."""


@dataclass
class ExportReport:
    path: Path
    source: SourceKind
    format: ExportFormat
    files: list[tuple[str, int]]                 # (file name, bytes), in writing order
    tensors: int                                 # tensors written
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
    if archs & (set(EAGLE3_ARCHITECTURES) - {"LlamaForCausalLM"}) or "draft_vocab_size" in cfg \
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
    if kind is SourceKind.MEDUSA:
        cfg_json, tensors, weights = _export_medusa(src, fmt, target_model, base_model_name_or_path, notes)
    else:
        cfg_json, tensors, weights = _export_eagle(src, kind, fmt, target_model, notes)
    _clear_destination(dst)
    write_tensors(dst, tensors, weights)
    write_config(dst, cfg_json)
    files = [(weights, (dst / weights).stat().st_size), ("config.json", (dst / "config.json").stat().st_size)]
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


# -- EAGLE ---------------------------------------------------------------------------------------------
def _aux_ids_in_json(cfg_json: dict) -> tuple[int, ...] | None:
    ids = (cfg_json.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
        or cfg_json.get("eagle_aux_hidden_state_layer_ids")
    return tuple(int(i) for i in ids) if ids else None


def _read_eagle(src: Path, kind: SourceKind, target_model):
    """Validated source: (our config, official-name tensors as stored, config.json, ids known?)."""
    head_kind = HeadKind.EAGLE3 if kind is SourceKind.EAGLE3 else HeadKind.EAGLE1
    cfg_json = read_config(src)
    state = _normalise_names(read_tensors(src), head_kind)
    ids = _aux_ids_in_json(cfg_json) if head_kind is HeadKind.EAGLE3 else None
    if target_model is not None:
        target_cfg = target_model.cfg
    else:   # no target: the head's own config is all there is; layer count only bounds the ids
        try:
            target_cfg = SimpleNamespace(vocab_size=int(cfg_json["vocab_size"]),
                                         hidden_size=int(cfg_json.get("target_hidden_size")
                                                         or cfg_json["hidden_size"]),
                                         num_layers=max(ids) + 3 if ids else 6)
        except KeyError as e:
            raise CheckpointError(f"config.json lacks {e.args[0]!r}") from None
    placeholder = head_kind is HeadKind.EAGLE3 and ids is None and target_model is None
    cfg = eagle_config_from_json(cfg_json, target_cfg, head_kind, "embed_tokens.weight" in state,
                                 "fc.bias" in state, (2, 3, 3) if placeholder else ids)
    names = _eagle_names(cfg)
    if head_kind is HeadKind.EAGLE3 and "d2t" not in state and cfg.draft_vocab_size == cfg.vocab_size:
        state["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.long)       # full vocabulary: identity
    _check_names(state, names)
    if head_kind is HeadKind.EAGLE3:
        _check_vocab_maps(state, cfg)                                       # adds t2d when absent
    _check_eagle_shapes(state, names, cfg)
    return cfg, state, cfg_json, not placeholder


def _check_eagle_shapes(state: dict, names: dict[str, str], cfg: EagleHeadConfig) -> None:
    """Shapes the config implies, from a head built on the meta device (no memory)."""
    with torch.device("meta"):
        embed = None if cfg.own_embedding else torch.empty(cfg.vocab_size, cfg.hidden_size)
        head = Eagle3Head(cfg, embed) if cfg.kind is HeadKind.EAGLE3 else \
            Eagle1Head(cfg, embed, torch.empty(cfg.vocab_size, cfg.hidden_size))
    own = dict(head.named_parameters()) | dict(head.named_buffers())
    for theirs, ours in names.items():
        got, want = tuple(state[theirs].shape), tuple(own[ours].shape)
        if got != want:
            raise CheckpointError(f"tensor {theirs}: checkpoint shape {got}, config.json implies {want}")


def _dtype_of(tensors: dict[str, torch.Tensor], first: str) -> torch.dtype:
    if first in tensors and tensors[first].is_floating_point():
        return tensors[first].dtype
    return next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)


def _eagle_rope_scaling(rope: dict | None, problems: list[str]) -> dict | None:
    """EAGLE's EConfig accepts only ``{"type": "linear"|"dynamic", "factor": float > 1}``."""
    if rope is None:
        return None
    kind = rope.get("rope_type", rope.get("type"))
    if kind in ("default", None):
        return None
    if kind == "linear" and float(rope.get("factor", 1.0)) > 1.0:
        return {"type": "linear", "factor": float(rope["factor"])}
    problems.append(f"rope_scaling {rope} (the EAGLE repo implements only linear and dynamic scaling)")
    return None


def _check_own_embedding(cfg: EagleHeadConfig, state: dict, fmt: ExportFormat, target_model,
                         problems: list[str]) -> None:
    """vLLM and SGLang replace a draft embedding of the target's shape by the target's."""
    if not cfg.own_embedding or cfg.hidden_size != cfg.target_hidden_size:
        return
    consumer = _CONSUMER[fmt]
    if target_model is None:
        problems.append(f"the head has its own embed_tokens.weight, which {consumer} replaces by the target's "
                        "(same shape); pass the target model to check they are equal")
    elif not torch.equal(state["embed_tokens.weight"].to(target_model.embed.weight.dtype),
                         target_model.embed.weight.detach().cpu()):
        problems.append(f"the head's own embed_tokens.weight differs from the target's, and {consumer} always "
                        "uses the target's embedding for a draft of the same hidden size")


def _export_eagle(src: Path, kind: SourceKind, fmt: ExportFormat, target_model, notes: list[str]):
    cfg, state, src_json, ids_known = _read_eagle(src, kind, target_model)
    dtype = _dtype_of(state, "fc.weight")
    out_cfg = eagle_config_to_json(cfg, dtype)
    out = dict(state)
    problems: list[str] = []
    consumer = _CONSUMER[fmt]
    if kind is SourceKind.EAGLE3:
        if cfg.fc_norm or cfg.norm_output:
            problems.append(f"EAGLE-3.1 switches fc_norm={cfg.fc_norm} / norm_output={cfg.norm_output} "
                            f"({consumer} implements neither)")
        if cfg.attention_bias:
            problems.append(f"attention biases ({consumer}'s EAGLE-3 layer has none)")
        if len(cfg.aux_layer_ids) != 3:
            problems.append(f"{len(cfg.aux_layer_ids)} aux layers ({consumer} fuses exactly three)")
        ids = list(cfg.aux_layer_ids)
        out_cfg.pop("eagle_config", None)
        if fmt is ExportFormat.SGLANG:
            _check_own_embedding(cfg, state, fmt, target_model, problems)
            if ids_known:      # SGLang captures layer id+1's input: write the id of the layer whose output
                out_cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in ids],
                                           "use_aux_hidden_state": True}
        elif fmt is ExportFormat.VLLM:
            _check_own_embedding(cfg, state, fmt, target_model, problems)
            if ids_known:
                out_cfg["eagle_aux_hidden_state_layer_ids"] = ids
                out_cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
        else:
            _eagle_repo_eagle3(cfg, state, out_cfg, out, ids, ids_known, target_model, problems, notes)
        if not ids_known:
            notes.append("the source config names no aux layers and no target was given: the export names none "
                         "either, so the consumer uses its default layers (2, N/2, N-3)")
    else:
        if cfg.attention_bias and fmt is not ExportFormat.EAGLE:
            problems.append(f"attention biases ({consumer}'s EAGLE-1 layer is loaded without them)")
        if fmt is ExportFormat.VLLM:
            if cfg.fc_bias:
                problems.append("fc.bias (vLLM's EAGLE-1 fc has no bias; export to 'eagle' or 'sglang')")
            _check_own_embedding(cfg, state, fmt, target_model, problems)
            out_cfg["bias"] = False
        elif fmt is ExportFormat.SGLANG:
            _check_own_embedding(cfg, state, fmt, target_model, problems)
            out_cfg["architectures"] = ["LlamaForCausalLMEagle"]
            if "fc.bias" not in out:
                out["fc.bias"] = torch.zeros(cfg.hidden_size, dtype=state["fc.weight"].dtype)
                notes.append("SGLang's EAGLE-1 fc always has a bias: wrote fc.bias = 0 (same function)")
            out_cfg["bias"] = False     # SGLang's Llama layer reads `bias` as *attention* bias
        else:
            if cfg.head_dim * cfg.num_heads != cfg.hidden_size:
                problems.append(f"head_dim {cfg.head_dim} x {cfg.num_heads} heads != hidden_size {cfg.hidden_size} "
                                "(the EAGLE repo's EAGLE-1 layer derives head_dim from hidden_size)")
            out_cfg["rope_scaling"] = _eagle_rope_scaling(cfg.rope_scaling, problems)
            out_cfg["pretraining_tp"] = 1
            if cfg.attention_bias:
                out_cfg["qkv_bias"] = True
            _add_target_embedding(cfg, out, target_model, notes)
    if problems:
        raise CheckpointError(f"cannot export {_KIND_NAME[kind]} to {fmt.value!r}: " + "; ".join(problems))
    weights = "pytorch_model.bin" if fmt is ExportFormat.EAGLE else "model.safetensors"
    return out_cfg, out, weights


def _eagle_repo_eagle3(cfg, state, out_cfg, out, ids, ids_known, target_model, problems, notes) -> None:
    """EAGLE repo specifics: fixed aux layers, EConfig keys, embedding source."""
    if ids_known:
        n = target_model.cfg.num_layers if target_model is not None else ids[-1] + 3
        fixed = [2, n // 2, n - 3]
        if ids != fixed or len(set(fixed)) != 3:
            problems.append(f"aux layer ids {ids}: the EAGLE repo always fuses the inputs of target layers "
                            f"{fixed} (distinct, in order) and cannot be told other layers")
        elif target_model is None:
            notes.append(f"no target given: assuming it has {n} layers, the only depth for which aux ids {ids} "
                         "are the EAGLE repo's fixed layers (2, N/2, N-3)")
        out_cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    if cfg.attention_bias:
        problems.append("attention biases (the EAGLE repo's EAGLE-3 layer has none)")
    out_cfg["rope_scaling"] = _eagle_rope_scaling(cfg.rope_scaling, problems)
    out_cfg["pretraining_tp"] = 1
    out_cfg["bias"] = False
    if cfg.target_hidden_size == cfg.hidden_size:
        out_cfg.pop("target_hidden_size")     # present, EAGLE would not load the base embedding
    _add_target_embedding(cfg, out, target_model, notes)


def _add_target_embedding(cfg: EagleHeadConfig, out: dict, target_model, notes: list[str]) -> None:
    """EAGLE repo: include the embedding so the folder is self-contained."""
    if cfg.own_embedding:
        return
    if target_model is None:
        notes.append("embed_tokens.weight not written (the head shares the target's): the EAGLE repo loads it "
                     "from the base model's model.safetensors.index.json / pytorch_model.bin.index.json, which "
                     "single-file base checkpoints lack; pass the target to include it")
        return
    out["embed_tokens.weight"] = target_model.embed.weight.detach().to(out["fc.weight"].dtype).cpu().clone()
    notes.append("wrote the target's embedding as embed_tokens.weight (the EAGLE repo reads it from the head)")


# -- Medusa -------------------------------------------------------------------------------------------
def _read_medusa(src: Path, target_model):
    cfg_json = read_config(src)
    layers = int(cfg_json.get("medusa_num_layers", cfg_json.get("num_hidden_layers", 1)))
    state = _medusa_to_ours(read_tensors(src, MEDUSA_FILES), layers)
    tied = bool(cfg_json.get("tie_lm_head", False))
    bias = any(n.endswith(".bias") for n in state)
    if target_model is not None:
        target_cfg = target_model.cfg
    else:
        w = state.get("blocks.0.layers.0.weight", state.get("lm_heads.0.weight"))
        hidden = cfg_json.get("hidden_size") or (w.shape[-1] if w is not None else None)
        vocab = cfg_json.get("vocab_size") or (state["lm_heads.0.weight"].shape[0]
                                               if "lm_heads.0.weight" in state else None)
        if hidden is None or vocab is None:
            raise CheckpointError("cannot tell the Medusa heads' hidden / vocabulary size; pass the target model")
        target_cfg = SimpleNamespace(hidden_size=int(hidden), vocab_size=int(vocab))
    cfg = _medusa_config(cfg_json, target_cfg, tied, bias)
    with torch.device("meta"):
        heads = MedusaHeads(cfg, torch.empty(cfg.vocab_size, cfg.hidden_size) if tied else None)
    expected = {k: tuple(v.shape) for k, v in heads.state_dict().items()}
    missing, unknown = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if unknown:
        raise CheckpointError(f"tensors beyond the config's {cfg.num_heads} heads x {cfg.num_layers} layers"
                              f"{' (tied lm_head)' if tied else ''}: {unknown[:6]}")
    if missing:
        raise CheckpointError(f"Medusa checkpoint is missing tensors: {missing[:6]}")
    for name, want in expected.items():
        if tuple(state[name].shape) != want:
            raise CheckpointError(f"tensor {name}: checkpoint shape {tuple(state[name].shape)}, "
                                  f"config.json implies {want}")
    return cfg, state


def _target_lm_head(cfg: MedusaConfig, target_model, dtype: torch.dtype, fmt: ExportFormat) -> torch.Tensor:
    if target_model is None:
        raise CheckpointError(f"the Medusa heads are tied to the target's lm_head and {_CONSUMER[fmt]} has no "
                              "such tie: pass the target model (--target) so its lm_head can be copied in")
    w = target_model.lm_head.weight.detach()
    if tuple(w.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise CheckpointError(f"target lm_head shape {tuple(w.shape)} does not fit the heads "
                              f"({cfg.vocab_size}, {cfg.hidden_size})")
    return w.to(dtype).cpu()


def _export_medusa(src: Path, fmt: ExportFormat, target_model, base_model: str | None, notes: list[str]):
    cfg, state = _read_medusa(src, target_model)
    dtype = _dtype_of(state, "blocks.0.layers.0.weight")
    k_heads, k_layers = cfg.num_heads, cfg.num_layers
    dtype_name = str(dtype).removeprefix("torch.")
    if fmt is ExportFormat.VLLM:
        out = dict(state)
        out_cfg = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": cfg.hidden_size,
                   "vocab_size": cfg.vocab_size, "truncated_vocab_size": cfg.vocab_size, "num_heads": k_heads,
                   "num_hidden_layers": k_layers, "medusa_fc_bias": cfg.block_bias, "torch_dtype": dtype_name}
        if cfg.tied_lm_head:
            out["lm_heads.0.weight"] = _target_lm_head(cfg, target_model, dtype, fmt).clone()
            out_cfg["original_lm_head"] = True
            notes.append("tied heads: wrote the target's lm_head once as lm_heads.0.weight with "
                         "original_lm_head: true (vLLM shares it across heads)")
        return out_cfg, out, "model.safetensors"
    out = {}
    for i in range(k_heads):
        for j in range(k_layers):
            w = state[f"blocks.{i}.layers.{j}.weight"]
            out[f"{i}.{j}.linear.weight"] = w
            out[f"{i}.{j}.linear.bias"] = state[f"blocks.{i}.layers.{j}.bias"] if cfg.block_bias \
                else torch.zeros(cfg.hidden_size, dtype=w.dtype)
        out[f"{i}.{k_layers}.weight"] = state[f"lm_heads.{i}.weight"] if not cfg.tied_lm_head \
            else _target_lm_head(cfg, target_model, dtype, fmt).clone()
    if not cfg.block_bias and k_layers:
        notes.append("FasterDecoding's ResBlock always has a bias: wrote zero biases (same function)")
    if cfg.tied_lm_head:
        notes.append(f"tied heads: wrote one copy of the target's lm_head per head ({k_heads} copies)")
    if k_layers > 1 and any(not torch.equal(state[f"blocks.{i}.layers.0.weight"], state[f"blocks.{i}.layers.{j}.weight"])
                            for i in range(k_heads) for j in range(1, k_layers)):
        notes.append(f"{k_layers} distinct blocks per head: FasterDecoding's MedusaModel builds "
                     "[ResBlock] * medusa_num_layers (one shared block per head) and keeps only one of them; "
                     "TGI / TensorRT-LLM read every block")
    out_cfg = {"medusa_num_heads": k_heads, "medusa_num_layers": k_layers, "hidden_size": cfg.hidden_size,
               "vocab_size": cfg.vocab_size, "tie_lm_head": False, "torch_dtype": dtype_name}
    if base_model:
        out_cfg["base_model_name_or_path"] = base_model
    else:
        notes.append("base_model_name_or_path not written (pass base_model / --base-model): FasterDecoding "
                     "then defaults to lmsys/vicuna-7b-v1.3 unless from_pretrained gets base_model=")
    return out_cfg, out, "medusa_lm_head.safetensors"


__all__ = ["ExportFormat", "ExportReport", "ExportWarning", "SourceKind", "VALID_FORMATS", "detect_source",
           "export", "export_checkpoint", "parse_format"]
