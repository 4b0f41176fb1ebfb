"""EAGLE-1 heads: read and write our layout (the EAGLE repo's) and each consumer's.

Our layout: ``config.json`` (a Llama config, ``num_hidden_layers`` 1, ``bias``: whether ``fc`` has
a bias, ``architectures`` ``LlamaForCausalLM``) and ``model.safetensors`` (or
``pytorch_model.bin``) with ``fc.weight`` [h, 2h] (+ ``fc.bias``), ``layers.0.*`` without
``input_layernorm`` (as in the EAGLE repo) and an optional ``embed_tokens.weight``; tokens are
read through the target's lm_head. A leading ``model.`` is accepted on load.

Consumer layouts (``to_consumer``): ``eagle`` (EAGLE repo ``cnets1.Model``: ``pytorch_model.bin``,
config ``bias`` for the fc bias, ``qkv_bias`` for attention biases, the embedding included when the
target is given), ``vllm`` (``EagleLlamaForCausalLM``: no fc bias, config ``bias`` false), ``sglang``
(``LlamaForCausalLMEagle``: always an fc bias, zeros when the head has none).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..drafting.eagle_head import Eagle1Head, EagleHeadConfig, HeadKind
from .common import CONSUMER, CheckpointError, ExportFormat, dtype_of
from .eagle_layer import (EagleCheckpoint, add_target_embedding, build_head, check_own_embedding, check_target_hidden,
                          check_tensors, eagle_rope_scaling, layer_names, llama_fields, llama_json, make_config,
                          plain_names, read_folder, refuse, save_head, standin_target)

_WHAT = "an EAGLE-1 head"


def tensor_names(cfg: EagleHeadConfig) -> dict[str, str]:
    """Official tensor name -> our parameter name, for the tensors this head has."""
    out = layer_names("layers.0", cfg)
    if cfg.fc_bias:
        out["fc.bias"] = "fc.bias"
    return out


def normalise(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Official names; an EAGLE-3 head (``midlayer.*``) is refused."""
    out = plain_names(state)
    if any(n.startswith("midlayer.") for n in out):
        raise CheckpointError("this is an EAGLE-3 checkpoint (midlayer.* tensors); use method 'eagle3'")
    return out


def config_from_json(cfg: dict, target_cfg, has_embedding: bool, has_fc_bias: bool) -> EagleHeadConfig:
    """Our ``EagleHeadConfig`` from a head's config.json, checked against the target's config."""
    fields = llama_fields(cfg, target_cfg)
    if fields["hidden_size"] != target_cfg.hidden_size:
        raise CheckpointError(f"EAGLE-1 head hidden size {fields['hidden_size']} differs from the target's "
                              f"{target_cfg.hidden_size}")
    check_target_hidden(fields, target_cfg)
    return make_config(kind=HeadKind.EAGLE1, **fields, draft_vocab_size=fields["vocab_size"], fc_bias=has_fc_bias,
                       own_embedding=has_embedding)


def config_to_json(cfg: EagleHeadConfig, dtype: torch.dtype) -> dict:
    return llama_json(cfg, dtype, "LlamaForCausalLM") | {"bias": cfg.fc_bias}


def read(folder: str | Path, target_cfg=None) -> EagleCheckpoint:
    """The validated checkpoint in ``folder`` for a target with config ``target_cfg`` (None: the
    head's own config stands in for it)."""
    cfg_json, state = read_folder(folder, normalise)
    cfg = config_from_json(cfg_json, target_cfg or standin_target(cfg_json, None), "embed_tokens.weight" in state,
                           "fc.bias" in state)
    check_tensors(state, cfg, tensor_names(cfg))
    return EagleCheckpoint(cfg, state, cfg_json)


def load(folder: str | Path, target_model) -> Eagle1Head:
    """The EAGLE-1 head in ``folder`` for ``target_model`` (our ``Transformer``), eval, no gradients."""
    ck = read(folder, target_model.cfg)
    return build_head(ck, tensor_names(ck.cfg), target_model)


def save(head: Eagle1Head, folder: str | Path, weights: str = "model.safetensors") -> Path:
    """Write ``head`` in our layout (official names, ``weights`` file)."""
    return save_head(head, folder, tensor_names(head.cfg), config_to_json(head.cfg, head.fc.weight.dtype), weights)


def to_consumer(ck: EagleCheckpoint, fmt: ExportFormat, target_model, notes: list[str]):
    """``(config.json, tensors, weight file names)`` of ``ck`` for consumer ``fmt`` (eagle, vllm,
    sglang); a head the consumer cannot express raises ``CheckpointError`` with every reason."""
    cfg, state = ck.cfg, ck.tensors
    out_cfg, out = config_to_json(cfg, dtype_of(state, "fc.weight")), dict(state)
    problems: list[str] = []
    if cfg.attention_bias and fmt is not ExportFormat.EAGLE:
        problems.append(f"attention biases ({CONSUMER[fmt]}'s EAGLE-1 layer is loaded without them)")
    if fmt is ExportFormat.VLLM:
        if cfg.fc_bias:
            problems.append("fc.bias (vLLM's EAGLE-1 fc has no bias; export to 'eagle' or 'sglang')")
        check_own_embedding(cfg, state, fmt, target_model, problems)
        out_cfg["bias"] = False
    elif fmt is ExportFormat.SGLANG:
        check_own_embedding(cfg, state, fmt, target_model, problems)
        out_cfg["architectures"] = ["LlamaForCausalLMEagle"]
        if "fc.bias" not in out:
            out["fc.bias"] = torch.zeros(cfg.hidden_size, dtype=state["fc.weight"].dtype)
            notes.append("SGLang's EAGLE-1 fc always has a bias: wrote fc.bias = 0 (same function)")
        out_cfg["bias"] = False     # SGLang's Llama layer reads `bias` as *attention* bias
    else:
        _eagle_repo(cfg, out_cfg, out, target_model, problems, notes)
    refuse(problems, _WHAT, fmt)
    return out_cfg, out, ("pytorch_model.bin",) if fmt is ExportFormat.EAGLE else ("model.safetensors",)


def _eagle_repo(cfg: EagleHeadConfig, out_cfg: dict, out: dict, target_model, problems: list[str],
                notes: list[str]) -> None:
    """EAGLE repo specifics: head_dim from hidden_size, EConfig keys, the embedding in the folder."""
    if cfg.head_dim * cfg.num_heads != cfg.hidden_size:
        problems.append(f"head_dim {cfg.head_dim} x {cfg.num_heads} heads != hidden_size {cfg.hidden_size} "
                        "(the EAGLE repo's EAGLE-1 layer derives head_dim from hidden_size)")
    out_cfg["rope_scaling"] = eagle_rope_scaling(cfg.rope_scaling, problems)
    out_cfg["pretraining_tp"] = 1
    if cfg.attention_bias:
        out_cfg["qkv_bias"] = True
        notes.append("attention biases: the EAGLE repo reads them (config qkv_bias) since cnets1.py; "
                     "eagle-llm 1.2.1's EAGLE-1 layer has none and refuses the extra tensors")
    if cfg.rope_theta != 10000.0:
        notes.append(f"rope_theta {cfg.rope_theta}: the EAGLE repo reads it since cnets1.py; eagle-llm 1.2.1's "
                     "EAGLE-1 layer always uses 10000 and would draft with the wrong rotary frequencies")
    add_target_embedding(cfg, out, target_model, notes)
