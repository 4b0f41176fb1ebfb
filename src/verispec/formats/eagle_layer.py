"""What the EAGLE-1 and EAGLE-3 formats share: one Llama decoder layer and its Llama config.

Both formats store a head as ``config.json`` (a Llama config with ``num_hidden_layers`` 1) and
tensors named as the EAGLE repo / Hugging Face Llama names them (``self_attn.q_proj``, ...,
``mlp.down_proj``, ``post_attention_layernorm``) under a layer prefix (EAGLE-3 ``midlayer.``,
EAGLE-1 ``layers.0.``). This module maps those names to ours, parses and writes the shared config
keys (checked against the target's config), loads and saves a head given the kind's name map,
and holds the consumer rules both kinds need when exported (embedding, RoPE scaling).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from ..drafting.eagle_head import Eagle1Head, Eagle3Head, EagleHead, EagleHeadConfig, HeadKind, new_eagle_head
from .common import (CONSUMER, CheckpointError, ExportFormat, check_names, check_shapes, copy_into, dtype_name,
                     module_shapes, read_config, read_tensors, strip_model_prefix, write_config, write_tensors)

_LAYER = {"self_attn.q_proj": "attn.wq", "self_attn.k_proj": "attn.wk", "self_attn.v_proj": "attn.wv",
          "self_attn.o_proj": "attn.wo", "mlp.gate_proj": "mlp.w_gate", "mlp.up_proj": "mlp.w_up",
          "mlp.down_proj": "mlp.w_down"}


@dataclass
class EagleCheckpoint:
    """A validated head folder: our config, its tensors under the official names (as stored, plus
    what the reader completes: EAGLE-3 ``t2d`` / identity ``d2t``), its config.json, and whether
    the aux layer ids are known (from the config, the caller or the target) or a stand-in."""
    cfg: EagleHeadConfig
    tensors: dict[str, torch.Tensor]
    json: dict
    aux_ids_known: bool = True


# -- names ---------------------------------------------------------------------------------------------
def layer_names(prefix: str, cfg: EagleHeadConfig) -> dict[str, str]:
    """Official name -> ours for the decoder layer's attention, MLP and post-attention norm."""
    out = {f"{prefix}.{theirs}.weight": f"{ours}.weight" for theirs, ours in _LAYER.items()}
    if cfg.attention_bias:
        out.update({f"{prefix}.self_attn.{p}_proj.bias": f"attn.w{p}.bias" for p in ("q", "k", "v")})
    out[f"{prefix}.post_attention_layernorm.weight"] = "post_attention_layernorm.weight"
    out["fc.weight"] = "fc.weight"
    if cfg.own_embedding:
        out["embed_tokens.weight"] = "embed_tokens"
    return out


def plain_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Names without a leading ``model.``; RoPE buffers older exports carry (``rotary_emb.inv_freq``) dropped."""
    return {strip_model_prefix(k): v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}


# -- config ------------------------------------------------------------------------------------------
def llama_fields(cfg: dict, target_cfg) -> dict:
    """``EagleHeadConfig`` keyword arguments from the shared Llama keys of a head's config.json,
    checked against the target's vocabulary (``check_target_hidden`` checks the hidden size)."""
    if cfg.get("model_type", "llama") != "llama":
        raise CheckpointError(f"head model_type {cfg.get('model_type')!r} is not supported (llama is)")
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        raise CheckpointError(f"EAGLE heads have one decoder layer; config says num_hidden_layers="
                              f"{cfg.get('num_hidden_layers')}")
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        inter, vocab = int(cfg["intermediate_size"]), int(cfg["vocab_size"])
    except KeyError as e:
        raise CheckpointError(f"config.json lacks {e.args[0]!r}") from None
    if vocab != target_cfg.vocab_size:
        raise CheckpointError(f"head vocab_size {vocab} differs from the target's {target_cfg.vocab_size}")
    return dict(hidden_size=hidden, intermediate_size=inter, num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads), vocab_size=vocab,
                target_hidden_size=int(cfg.get("target_hidden_size") or hidden),
                target_num_layers=target_cfg.num_layers,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)), rope_theta=float(cfg.get("rope_theta", 10000.0)),
                rope_scaling=cfg.get("rope_scaling"),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
                attention_bias=bool(cfg.get("attention_bias", False)))


def check_target_hidden(fields: dict, target_cfg) -> None:
    """The hidden size the head reads (``target_hidden_size``, default its own) is the target's."""
    if fields["target_hidden_size"] != target_cfg.hidden_size:
        raise CheckpointError(f"head expects target hidden size {fields['target_hidden_size']}, "
                              f"the target has {target_cfg.hidden_size}")


def make_config(**fields) -> EagleHeadConfig:
    try:
        return EagleHeadConfig(**fields)
    except ValueError as e:
        raise CheckpointError(str(e)) from e


def llama_json(cfg: EagleHeadConfig, dtype: torch.dtype, architecture: str) -> dict:
    """The shared config.json keys (a Hugging Face Llama config of one layer)."""
    return {
        "architectures": [architecture], "model_type": "llama", "hidden_act": "silu", "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling, "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": cfg.attention_bias, "tie_word_embeddings": False,
        "torch_dtype": dtype_name(dtype), "target_hidden_size": cfg.target_hidden_size,
    }


def standin_target(cfg: dict, aux_ids: tuple[int, ...] | None) -> SimpleNamespace:
    """Without a target model, the head's own config is all there is: the vocabulary and hidden size
    it names, and a layer count that only bounds the aux ids."""
    try:
        return SimpleNamespace(vocab_size=int(cfg["vocab_size"]),
                               hidden_size=int(cfg.get("target_hidden_size") or cfg["hidden_size"]),
                               num_layers=max(aux_ids) + 3 if aux_ids else 6)
    except KeyError as e:
        raise CheckpointError(f"config.json lacks {e.args[0]!r}") from None


def head_shapes(cfg: EagleHeadConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter / buffer shapes for ``cfg``, from a head built on the meta device (no memory)."""
    with torch.device("meta"):
        w = torch.empty(cfg.vocab_size, cfg.hidden_size)
        embed = None if cfg.own_embedding else w
        head = Eagle3Head(cfg, embed) if cfg.kind is HeadKind.EAGLE3 else Eagle1Head(cfg, embed, w)
    return module_shapes(head)


# -- read / load / save --------------------------------------------------------------------------------
def read_folder(folder: str | Path, normalise) -> tuple[dict, dict[str, torch.Tensor]]:
    """``folder``'s config.json and its tensors under the official names (``normalise``: the kind's)."""
    return read_config(Path(folder)), normalise(read_tensors(Path(folder)))


def check_tensors(state: dict[str, torch.Tensor], cfg: EagleHeadConfig, names: dict[str, str],
                  optional: set[str] = frozenset()) -> None:
    """``state`` holds exactly the tensors ``names`` lists (``optional`` ones may be absent), each
    of the shape ``cfg`` implies."""
    check_names(state, set(names), optional=optional)
    shapes = head_shapes(cfg)
    check_shapes(state, {k: shapes[v] for k, v in names.items()})


def build_head(ck: EagleCheckpoint, names: dict[str, str], target_model) -> EagleHead:
    """The head of a validated checkpoint for ``target_model``: eval mode, no gradients."""
    head = new_eagle_head(ck.cfg, target_model)
    copy_into(head, {names[k]: v for k, v in ck.tensors.items()})
    return head.eval().requires_grad_(False)


def save_head(head: EagleHead, folder: str | Path, names: dict[str, str], cfg_json: dict, weights: str) -> Path:
    """Write ``head``'s tensors under the official ``names`` and ``cfg_json``."""
    folder = Path(folder)
    own = dict(head.named_parameters()) | dict(head.named_buffers())
    write_tensors(folder, {theirs: own[ours] for theirs, ours in names.items()}, weights)
    write_config(folder, cfg_json)
    return folder


# -- consumer rules both kinds need --------------------------------------------------------------------
def eagle_rope_scaling(rope: dict | None, problems: list[str]) -> dict | None:
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


def check_own_embedding(cfg: EagleHeadConfig, state: dict, fmt: ExportFormat, target_model,
                        problems: list[str]) -> None:
    """vLLM and SGLang replace a draft embedding of the target's shape by the target's."""
    if not cfg.own_embedding or cfg.hidden_size != cfg.target_hidden_size:
        return
    consumer = CONSUMER[fmt]
    if target_model is None:
        problems.append(f"the head has its own embed_tokens.weight, which {consumer} replaces by the target's "
                        "(same shape); pass the target model to check they are equal")
    elif not torch.equal(state["embed_tokens.weight"].to(target_model.embed.weight.dtype),
                         target_model.embed.weight.detach().cpu()):
        problems.append(f"the head's own embed_tokens.weight differs from the target's, and {consumer} always "
                        "uses the target's embedding for a draft of the same hidden size")


def add_target_embedding(cfg: EagleHeadConfig, out: dict, target_model, notes: list[str]) -> None:
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


def refuse(problems: list[str], what: str, fmt: ExportFormat) -> None:
    if problems:
        raise CheckpointError(f"cannot export {what} to {fmt.value!r}: " + "; ".join(problems))

