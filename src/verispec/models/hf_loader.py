"""Read a Hugging Face model folder (config.json + *.safetensors) into our config and names."""
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
# Gemma 3 names its four norms differently ("post_attention_layernorm" is an output norm there).
_HF_GEMMA3_LAYER = {**_HF_LAYER,
                    "post_attention_layernorm.weight": "post_attn_norm.weight",
                    "pre_feedforward_layernorm.weight": "mlp_norm.weight",
                    "post_feedforward_layernorm.weight": "post_mlp_norm.weight",
                    "self_attn.q_norm.weight": "attn.q_norm.weight",
                    "self_attn.k_norm.weight": "attn.k_norm.weight"}
_HF_GLOBAL = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
              "lm_head.weight": "lm_head.weight"}


def hf_to_ours(name: str, arch: str = "llama") -> str | None:
    if name in _HF_GLOBAL:
        return _HF_GLOBAL[name]
    layer = _HF_GEMMA3_LAYER if arch == "gemma3" else _HF_LAYER
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in layer:
        return f"layers.{m.group(1)}.{layer[m.group(2)]}"
    return None


def load_hf_folder(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file
    path = Path(path)
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            ours = hf_to_ours(name, cfg.arch)
            if ours is not None:
                t = t.float()
                # Gemma's RMSNorm multiplies by (1 + w); ours by w
                state[ours] = t + 1 if cfg.arch == "gemma3" and ours.endswith("norm.weight") else t
    return cfg, state
