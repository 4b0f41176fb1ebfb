"""Read a GGUF file into a ``ModelConfig`` and a state dict of the transformer we own.

Quantized tensors are dequantized with the ``gguf`` package. llama.cpp's converter permutes the
rows of q and k for the ``llama`` architecture (interleaved RoPE); that permutation is undone so
the weights match the Hugging Face half-rotation layout our ``Transformer`` uses. For Gemma 3 the
converter stores RMSNorm weights as 1 + w, which is exactly the multiplier our ``RMSNorm`` applies.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from .config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError

_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm.weight",
    "attn_q.weight": "attn.wq.weight", "attn_q.bias": "attn.wq.bias",
    "attn_k.weight": "attn.wk.weight", "attn_k.bias": "attn.wk.bias",
    "attn_v.weight": "attn.wv.weight", "attn_v.bias": "attn.wv.bias",
    "attn_output.weight": "attn.wo.weight",
    "ffn_norm.weight": "mlp_norm.weight",
    "ffn_gate.weight": "mlp.w_gate.weight",
    "ffn_up.weight": "mlp.w_up.weight",
    "ffn_down.weight": "mlp.w_down.weight",
    # Gemma 3
    "attn_q_norm.weight": "attn.q_norm.weight", "attn_k_norm.weight": "attn.k_norm.weight",
    "post_attention_norm.weight": "post_attn_norm.weight", "post_ffw_norm.weight": "post_mlp_norm.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight",
                 "output.weight": "lm_head.weight"}


class GGUFFormatError(ValueError):
    """The file is not a GGUF model verispec can read."""


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute`` of q/k rows (interleaved -> half rotation)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def config_from_gguf(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; verispec runs {', '.join(SUPPORTED_ARCHITECTURES)}")
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    names = {t.name for t in reader.tensors}
    eos = [int(x) for x in (_field(reader, "tokenizer.ggml.eos_token_id"),
                            _field(reader, "tokenizer.ggml.eot_token_id")) if x is not None]
    scaling = None
    if _field(reader, f"{arch}.rope.scaling.type") not in (None, "none"):
        scaling = {"rope_type": _field(reader, f"{arch}.rope.scaling.type"),
                   "factor": float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))}
    gemma = _gemma3_fields(reader, g, hidden, heads) if arch == "gemma3" else {}
    return ModelConfig(
        arch=arch,
        vocab_size=int(embd.shape[1]),
        hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")),
        num_layers=int(g("block_count")),
        num_heads=heads,
        num_kv_heads=int(g("attention.head_count_kv", heads)),
        head_dim=int(g("attention.key_length", hidden // heads)),
        max_position_embeddings=int(g("context_length", 8192)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6 if gemma else 1e-5)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        **gemma,
    )


def _gemma3_fields(reader, g, hidden: int, heads: int) -> dict:
    """Gemma 3 settings llama.cpp reads from the file or fixes in code (``llama-model.cpp``): every
    6th layer global unless a ``sliding_window_pattern`` is stored, local RoPE base 10000, query
    scale 1/sqrt(head_dim) except for the 62-layer 27B model (1/sqrt(hidden/heads))."""
    n = int(g("block_count"))
    pattern = g("attention.sliding_window_pattern")
    if isinstance(pattern, list):      # one flag per layer: True = sliding
        sliding = tuple(i for i, flag in enumerate(pattern) if flag)
    else:
        every = int(pattern) if pattern else 6
        sliding = tuple(i for i in range(n) if (i + 1) % every)
    head_dim = int(g("attention.key_length", hidden // heads))
    query = hidden // heads if n == 62 else head_dim
    return dict(hidden_act="gelu_tanh", embed_scale=float(hidden) ** 0.5, qk_norm=True, sandwich_norm=True,
                query_scale=float(query) ** -0.5, sliding_window=int(g("attention.sliding_window", 4096)),
                sliding_layers=sliding, rope_local_theta=10000.0,
                final_logit_softcapping=g("final_logit_softcapping"))


def _our_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def load_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and fp32 state dict (our parameter names) of a GGUF model file."""
    import gguf
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure is a format error for the user
        raise GGUFFormatError(f"{path}: not a readable GGUF file ({e})") from e
    cfg = config_from_gguf(reader)
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        ours = _our_name(t.name)
        if ours is None:
            continue   # e.g. rope_freqs: recomputed from the config
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if cfg.arch == "llama" and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            w = _unpermute(w, cfg.num_heads)
        elif cfg.arch == "llama" and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            w = _unpermute(w, cfg.num_kv_heads)
        state[ours] = torch.from_numpy(np.array(w, dtype=np.float32, copy=True))
    return cfg, state
