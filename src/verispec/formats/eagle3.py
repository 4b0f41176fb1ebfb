"""EAGLE-3 / 3.1 heads: read and write our layout and each consumer's.

Our layout (what SpecForge exports and vLLM / SGLang read): a folder with ``config.json`` (a Llama
config: ``num_hidden_layers`` 1, ``draft_vocab_size``, optional ``target_hidden_size``,
``architectures`` ``LlamaForCausalLMEagle3`` (or ``LlamaForCausalLM`` /
``Eagle3LlamaForCausalLM``), the EAGLE-3.1 switches ``fc_norm`` / ``norm_output`` when on,
speculators' ``norm_before_residual`` when on (vLLM reads it too),
``eagle_config.eagle_aux_hidden_state_layer_ids``) and ``model.safetensors`` (or
``pytorch_model.bin``) with ``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``,
``d2t``, ``t2d``, optional ``embed_tokens.weight`` (absent: the target's is shared) and
``fc_norm.{i}.weight``. Read too: vLLM's ``layers.0.*`` for ``midlayer.*``, a leading ``model.``,
aux ids at the top level of the config, a missing ``t2d`` (rebuilt from ``d2t``) and a missing
``d2t`` for a full draft vocabulary, and the speculators format (RedHatAI ``*speculator.eagle3``:
``speculators_config``, the layer's Llama config under ``transformer_layer_config``, tensors named
``layers.0.*``; see ``from_speculators``). Aux layer ids follow vLLM: id k is the hidden state entering
target layer k (= output of layer k-1); default (2, N/2, N-3).

The EAGLE-3.1 switches are written only when on: SpecForge 0.2.0 reads a present ``norm_output``
as "apply the final norm before lm_head" (absent: yes), vLLM / SGLang as EAGLE-3.1's "feed the
normed state back" (absent: no), so only an absent key means plain EAGLE-3 to all of them.

Consumer layouts (``to_consumer``; see ``train.export`` for the checks against their loaders):
``sglang`` (aux ids minus one: SGLang names the layer whose output is fused), ``vllm`` (aux ids at
the top level and in ``eagle_config``), ``eagle`` (the EAGLE repo: ``pytorch_model.bin``, EConfig
keys, fixed aux layers (2, N/2, N-3), the embedding included when the target is given).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..drafting.draft_vocab import DraftVocab
from ..drafting.eagle_head import Eagle3Head, EagleHeadConfig, HeadKind
from .common import CONSUMER, CheckpointError, ExportFormat, check_names, dtype_of
from .eagle_layer import (EagleCheckpoint, add_target_embedding, build_head, check_own_embedding, check_target_hidden,
                          check_tensors, eagle_rope_scaling, layer_names, llama_fields, llama_json, make_config,
                          plain_names, read_folder, refuse, save_head, standin_target)

ARCHITECTURES = ("LlamaForCausalLMEagle3", "LlamaForCausalLM", "Eagle3LlamaForCausalLM")
SPECULATORS_ARCHITECTURES = ("Eagle3Speculator",)
_WHAT = "an EAGLE-3 head"


# -- names and config ------------------------------------------------------------------------------
def tensor_names(cfg: EagleHeadConfig) -> dict[str, str]:
    """Official tensor name -> our parameter / buffer name, for the tensors this head has."""
    out = layer_names("midlayer", cfg)
    for n in ("input_layernorm", "hidden_norm"):
        out[f"midlayer.{n}.weight"] = f"{n}.weight"
    out.update({"norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight", "d2t": "d2t", "t2d": "t2d"})
    if cfg.fc_norm:
        out.update({f"fc_norm.{i}.weight": f"fc_norm.{i}.weight" for i in range(len(cfg.aux_layer_ids))})
    return out


def normalise(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Official names: vLLM's ``layers.0.`` read as ``midlayer.``; an EAGLE-1 head is refused."""
    out = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
           for k, v in plain_names(state).items()}
    if "fc.weight" in out and "midlayer.hidden_norm.weight" not in out:
        raise CheckpointError("no midlayer.hidden_norm.weight: not an EAGLE-3 head (an EAGLE-1 head? "
                              "use method 'eagle')")
    return out


def from_speculators(cfg_json: dict) -> dict:
    """A speculators-format config (``speculators_config`` / ``transformer_layer_config``, as
    vLLM reads it) as our layout's config: the layer config, plus ``draft_vocab_size``,
    ``target_hidden_size`` and the aux ids of the outer config. Any other config is returned as it
    is. ``norm_before_residual`` (the attention's residual is ``hidden_norm(x)``) is kept. Refused:
    another algorithm."""
    if not ({"speculators_config", "transformer_layer_config"} & set(cfg_json)
            or set(cfg_json.get("architectures") or []) & set(SPECULATORS_ARCHITECTURES)):
        return cfg_json
    algorithm = (cfg_json.get("speculators_config") or {}).get("algorithm") or cfg_json.get("speculators_model_type")
    if algorithm not in (None, "eagle3"):
        raise CheckpointError(f"speculators algorithm {algorithm!r} is not an EAGLE-3 head (eagle3)")
    layer = cfg_json.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise CheckpointError("speculators config.json lacks 'transformer_layer_config'")
    out = {**layer, "architectures": [ARCHITECTURES[0]]}
    for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "norm_before_residual"):
        if cfg_json.get(key) is not None:
            out[key] = cfg_json[key]
    return out


def aux_ids_in_json(cfg_json: dict) -> tuple[int, ...] | None:
    """Aux ids from ``eagle_config`` (SpecForge, ours) or the top level (vLLM), vLLM's convention."""
    ids = (cfg_json.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
        or cfg_json.get("eagle_aux_hidden_state_layer_ids")
    return tuple(int(i) for i in ids) if ids else None


def config_from_json(cfg: dict, target_cfg, has_embedding: bool,
                     aux_layer_ids: tuple[int, ...] | None = None) -> EagleHeadConfig:
    """Our ``EagleHeadConfig`` from a head's config.json, checked against the target's config;
    ``aux_layer_ids`` (else the config's, else the default for the target's depth)."""
    cfg = from_speculators(cfg)
    archs = cfg.get("architectures") or []
    if archs and not set(archs) & set(ARCHITECTURES):
        raise CheckpointError(f"architectures {archs} is not an EAGLE-3 head ({list(ARCHITECTURES)})")
    fields = llama_fields(cfg, target_cfg)
    check_target_hidden(fields, target_cfg)
    ids = aux_layer_ids or aux_ids_in_json(cfg) or EagleHeadConfig.default_aux_layer_ids(target_cfg.num_layers)
    return make_config(kind=HeadKind.EAGLE3, **fields, draft_vocab_size=int(cfg.get("draft_vocab_size")
                                                                            or fields["vocab_size"]),
                       aux_layer_ids=tuple(int(i) for i in ids), fc_norm=bool(cfg.get("fc_norm", False)),
                       norm_output=bool(cfg.get("norm_output", False)), own_embedding=has_embedding,
                       norm_before_residual=_flag(cfg, "norm_before_residual"))


def _flag(cfg: dict, key: str) -> bool:
    """A boolean config switch; anything but true / false / absent is a ``CheckpointError``."""
    value = cfg.get(key, False)
    if value not in (True, False, None):
        raise CheckpointError(f"config.json {key!r} must be true or false, got {value!r}")
    return bool(value)


def config_to_json(cfg: EagleHeadConfig, dtype: torch.dtype) -> dict:
    out = llama_json(cfg, dtype, "LlamaForCausalLMEagle3")
    out["draft_vocab_size"] = cfg.draft_vocab_size
    out.update({k: True for k in ("fc_norm", "norm_output", "norm_before_residual")   # see the module docstring
                if getattr(cfg, k)})
    out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids), "use_aux_hidden_state": True}
    return out


def check_vocab_maps(state: dict, cfg: EagleHeadConfig) -> None:
    """``d2t`` [draft_vocab] int offsets onto distinct target ids; ``t2d`` [vocab] bool agrees (added if absent)."""
    d2t = state["d2t"]
    if tuple(d2t.shape) != (cfg.draft_vocab_size,) or d2t.dtype.is_floating_point:
        raise CheckpointError(f"d2t must be an integer tensor [{cfg.draft_vocab_size}] (draft_vocab_size), "
                              f"got {d2t.dtype} {tuple(d2t.shape)}")
    try:
        t2d = DraftVocab.from_ids(torch.arange(cfg.draft_vocab_size) + d2t.long(), cfg.vocab_size).t2d
    except ValueError:
        raise CheckpointError("d2t maps draft ids outside the target vocabulary or onto repeated ids") from None
    if "t2d" in state:
        given = state["t2d"]
        if tuple(given.shape) != (cfg.vocab_size,) or not torch.equal(given.bool(), t2d):
            raise CheckpointError("t2d does not mark exactly the target ids that d2t maps to")
    state["t2d"] = t2d


# -- read / load / save ------------------------------------------------------------------------------
def read(folder: str | Path, target_cfg=None, aux_layer_ids: tuple[int, ...] | None = None) -> EagleCheckpoint:
    """The validated checkpoint in ``folder`` for a target with config ``target_cfg`` (None: the
    head's own config stands in for it; aux ids it does not name are then a stand-in)."""
    cfg_json, state = read_folder(folder, normalise)
    cfg_json = from_speculators(cfg_json)
    ids = aux_layer_ids or aux_ids_in_json(cfg_json)
    standin = target_cfg is None and ids is None
    cfg = config_from_json(cfg_json, target_cfg or standin_target(cfg_json, ids), "embed_tokens.weight" in state,
                           (2, 3, 3) if standin else ids)
    if "d2t" not in state and cfg.draft_vocab_size == cfg.vocab_size:
        state["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.long)      # full vocabulary: identity
    names = tensor_names(cfg)
    check_names(state, set(names), optional={"t2d"})
    check_vocab_maps(state, cfg)                                          # its message names the vocabulary maps
    check_tensors(state, cfg, names)
    return EagleCheckpoint(cfg, state, cfg_json, not standin)


def load(folder: str | Path, target_model, aux_layer_ids: tuple[int, ...] | None = None) -> Eagle3Head:
    """The EAGLE-3 head in ``folder`` for ``target_model`` (our ``Transformer``), eval, no gradients."""
    ck = read(folder, target_model.cfg, aux_layer_ids)
    return build_head(ck, tensor_names(ck.cfg), target_model)


def save(head: Eagle3Head, folder: str | Path, weights: str = "model.safetensors") -> Path:
    """Write ``head`` in our layout (official names, ``weights`` file)."""
    return save_head(head, folder, tensor_names(head.cfg), config_to_json(head.cfg, head.fc.weight.dtype), weights)


# -- consumers ---------------------------------------------------------------------------------------
def to_consumer(ck: EagleCheckpoint, fmt: ExportFormat, target_model, notes: list[str]):
    """``(config.json, tensors, weight file names)`` of ``ck`` for consumer ``fmt`` (sglang, vllm,
    eagle); a head the consumer cannot express raises ``CheckpointError`` with every reason."""
    cfg, state = ck.cfg, ck.tensors
    out_cfg, out = config_to_json(cfg, dtype_of(state, "fc.weight")), dict(state)
    out_cfg.pop("eagle_config")
    consumer, problems = CONSUMER[fmt], []
    if cfg.fc_norm or cfg.norm_output:
        problems.append(f"EAGLE-3.1 switches fc_norm={cfg.fc_norm} / norm_output={cfg.norm_output} "
                        f"({consumer} implements neither)")
    if cfg.attention_bias:
        problems.append(f"attention biases ({consumer}'s EAGLE-3 layer has none)")
    if cfg.norm_before_residual and fmt is not ExportFormat.VLLM:
        problems.append(f"norm_before_residual (the residual taken after hidden_norm; {consumer} does not read it, "
                        "vLLM does)")
    if len(cfg.aux_layer_ids) != 3:
        problems.append(f"{len(cfg.aux_layer_ids)} aux layers ({consumer} fuses exactly three)")
    ids = list(cfg.aux_layer_ids)
    if fmt is ExportFormat.SGLANG:
        check_own_embedding(cfg, state, fmt, target_model, problems)
        if ck.aux_ids_known:      # SGLang captures layer id+1's input: write the id of the layer whose output
            out_cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in ids],
                                       "use_aux_hidden_state": True}
    elif fmt is ExportFormat.VLLM:
        check_own_embedding(cfg, state, fmt, target_model, problems)
        if ck.aux_ids_known:
            out_cfg["eagle_aux_hidden_state_layer_ids"] = ids
            out_cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    else:
        _eagle_repo(ck, out_cfg, out, target_model, problems, notes)
    if not ck.aux_ids_known:
        notes.append("the source config names no aux layers and no target was given: the export names none "
                     "either, so the consumer uses its default layers (2, N/2, N-3)")
    refuse(problems, _WHAT, fmt)
    return out_cfg, out, ("pytorch_model.bin",) if fmt is ExportFormat.EAGLE else ("model.safetensors",)


def _eagle_repo(ck: EagleCheckpoint, out_cfg: dict, out: dict, target_model, problems: list[str],
                notes: list[str]) -> None:
    """EAGLE repo specifics: fixed aux layers, EConfig keys, embedding source."""
    cfg, ids = ck.cfg, list(ck.cfg.aux_layer_ids)
    if ck.aux_ids_known:
        n = target_model.cfg.num_layers if target_model is not None else ids[-1] + 3
        fixed = [2, n // 2, n - 3]
        if ids != fixed or len(set(fixed)) != 3:
            problems.append(f"aux layer ids {ids}: the EAGLE repo always fuses the inputs of target layers "
                            f"{fixed} (distinct, in order) and cannot be told other layers")
        elif target_model is None:
            notes.append(f"no target given: assuming it has {n} layers, the only depth for which aux ids {ids} "
                         "are the EAGLE repo's fixed layers (2, N/2, N-3)")
        out_cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    out_cfg["rope_scaling"] = eagle_rope_scaling(cfg.rope_scaling, problems)
    out_cfg["pretraining_tp"] = 1
    out_cfg["bias"] = False
    if cfg.target_hidden_size == cfg.hidden_size:
        out_cfg.pop("target_hidden_size")     # present, EAGLE would not load the base embedding
    add_target_embedding(cfg, out, target_model, notes)
