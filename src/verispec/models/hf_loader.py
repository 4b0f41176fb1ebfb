"""Read a Hugging Face model folder (config.json + *.safetensors, one file or shards) into our
config and parameter names.

Names: the Llama layout (Llama, Mistral, Qwen2, Qwen3); Gemma's four norms (``sandwich_norm``
models: its ``post_attention_layernorm`` is an output norm there); Phi-3's fused ``qkv_proj`` and
``gate_up_proj``, split here into q/k/v and gate/up (rows [q; k; v] and [gate; up], as
transformers splits them). RMSNorm weights get ``cfg.norm_weight_offset`` added (Gemma stores w
of a (1 + w) multiplier; our ``RMSNorm`` multiplies by its weight).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from .config import ModelConfig

_HF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn.wq.weight", "self_attn.q_proj.bias": "attn.wq.bias",
    "self_attn.k_proj.weight": "attn.wk.weight", "self_attn.k_proj.bias": "attn.wk.bias",
    "self_attn.v_proj.weight": "attn.wv.weight", "self_attn.v_proj.bias": "attn.wv.bias",
    "self_attn.o_proj.weight": "attn.wo.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "mlp.gate_proj.weight": "mlp.w_gate.weight",
    "mlp.up_proj.weight": "mlp.w_up.weight",
    "mlp.down_proj.weight": "mlp.w_down.weight",
}
_HF_QK_NORM = {"self_attn.q_norm.weight": "attn.q_norm.weight", "self_attn.k_norm.weight": "attn.k_norm.weight"}
# Gemma names its four norms differently ("post_attention_layernorm" is an output norm there).
_HF_GEMMA_LAYER = {**_HF_LAYER,
                   "post_attention_layernorm.weight": "post_attn_norm.weight",
                   "pre_feedforward_layernorm.weight": "mlp_norm.weight",
                   "post_feedforward_layernorm.weight": "post_mlp_norm.weight"}
_HF_GLOBAL = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
              "lm_head.weight": "lm_head.weight"}
# fused tensors (Phi-3) -> the parts they are split into, in row order
_HF_FUSED = {"self_attn.qkv_proj.weight": ("attn.wq.weight", "attn.wk.weight", "attn.wv.weight"),
             "mlp.gate_up_proj.weight": ("mlp.w_gate.weight", "mlp.w_up.weight")}


def _layer_table(cfg: ModelConfig | None) -> dict[str, str]:
    table = _HF_GEMMA_LAYER if cfg is not None and cfg.sandwich_norm else _HF_LAYER
    return {**table, **_HF_QK_NORM} if cfg is not None and cfg.qk_norm else table


def hf_to_ours(name: str, cfg: ModelConfig | None = None) -> str | None:
    """Our name of an (unfused) HF tensor of a model of config ``cfg`` (None: the Llama layout)."""
    if name in _HF_GLOBAL:
        return _HF_GLOBAL[name]
    layer = _layer_table(cfg)
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in layer:
        return f"layers.{m.group(1)}.{layer[m.group(2)]}"
    return None


def split_fused(name: str, t: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our parts of a fused HF tensor (``qkv_proj``, ``gate_up_proj``); {} for any other name."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if not m or m.group(2) not in _HF_FUSED:
        return {}
    parts = _HF_FUSED[m.group(2)]
    if len(parts) == 3:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        sizes = [q, kv, kv]
    else:
        sizes = [cfg.intermediate_size] * 2
    if t.shape[0] != sum(sizes):
        raise ValueError(f"tensor {name}: {t.shape[0]} rows, the config implies {sum(sizes)} ({sizes})")
    return {f"layers.{m.group(1)}.{p}": piece.clone() for p, piece in zip(parts, t.split(sizes))}


def load_hf_folder(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and fp32 state dict (our names) of the HF folder ``path``; every ``*.safetensors``
    file in it is read (a sharded checkpoint's shards included)."""
    from safetensors.torch import load_file
    path = Path(path)
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            ours = hf_to_ours(name, cfg)
            if ours is not None:
                t = t.float()
                state[ours] = t + cfg.norm_weight_offset if cfg.norm_weight_offset and ours.endswith("norm.weight") \
                    else t
            else:
                state.update(split_fused(name, t.float(), cfg))
    return cfg, state
