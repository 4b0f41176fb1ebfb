"""Read a GGUF file into a ``ModelConfig`` and a state dict of the transformer we own.

Architectures, as llama.cpp's converter writes them (names and keys from the ``gguf`` package):
``llama`` (Llama, Mistral, SmolLM2), ``qwen2``, ``qwen3``, ``phi3``, ``gemma2``, ``gemma3``.
Quantized tensors are dequantized with the ``gguf`` package. Per architecture:
- ``llama``: the converter permutes the rows of q and k (interleaved RoPE); that is undone so the
  weights match the half-rotation layout our ``Transformer`` uses. Llama 3.1/3.2 files carry a
  ``rope_freqs`` tensor (the llama3 scaling as one divisor per frequency) and no scaling type: it
  becomes ``ModelConfig.rope_freq_factors``.
- ``phi3``: fused ``attn_qkv`` and ``ffn_up`` (gate and up rows) are split; ``rope_factors_short``
  / ``rope_factors_long`` with the original context and attention factor become LongRoPE;
  ``rope.dimension_count`` the partial rotary.
- ``gemma2`` / ``gemma3``: the converter stores RMSNorm weights as 1 + w, exactly the multiplier
  our ``RMSNorm`` applies; the settings llama.cpp fixes in code are fixed here the same way.
Mixture-of-experts files (an ``expert_count``, or an MoE architecture) and unknown architectures
raise ``UnsupportedModelError`` naming what is supported.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from .config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError


def _names() -> tuple[dict[str, str], dict[str, str]]:
    """(layer tensor name after ``blk.N.`` -> ours, global name -> ours), from gguf's names."""
    from gguf import MODEL_TENSOR as T, TENSOR_NAMES
    layer = {T.ATTN_NORM: "attn_norm", T.ATTN_Q: "attn.wq", T.ATTN_K: "attn.wk", T.ATTN_V: "attn.wv",
             T.ATTN_OUT: "attn.wo", T.FFN_NORM: "mlp_norm", T.FFN_GATE: "mlp.w_gate", T.FFN_UP: "mlp.w_up",
             T.FFN_DOWN: "mlp.w_down", T.ATTN_Q_NORM: "attn.q_norm", T.ATTN_K_NORM: "attn.k_norm",
             T.ATTN_POST_NORM: "post_attn_norm", T.FFN_POST_NORM: "post_mlp_norm"}
    glob = {T.TOKEN_EMBD: "embed", T.OUTPUT_NORM: "norm", T.OUTPUT: "lm_head"}
    out_layer = {}
    for t, ours in layer.items():
        base = TENSOR_NAMES[t].removeprefix("blk.{bid}.")
        out_layer[f"{base}.weight"] = f"{ours}.weight"
        if t in (T.ATTN_Q, T.ATTN_K, T.ATTN_V):
            out_layer[f"{base}.bias"] = f"{ours}.bias"
    return out_layer, {f"{TENSOR_NAMES[t]}.weight": f"{ours}.weight" for t, ours in glob.items()}


class GGUFFormatError(ValueError):
    """The file is not a GGUF model verispec can read."""


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _tensor(reader, name: str) -> np.ndarray | None:
    """A (small) tensor of the file as fp32, or None when absent."""
    import gguf
    t = next((t for t in reader.tensors if t.name == name), None)
    if t is None:
        return None
    return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute`` of q/k rows (interleaved -> half rotation)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _checked_arch(reader) -> str:
    arch = _field(reader, "general.architecture")
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    experts = _field(reader, f"{arch}.expert_count")
    if (experts and int(experts) > 0) or "moe" in str(arch):
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is a mixture-of-experts model "
                                    f"({experts or 'MoE'} experts); verispec runs dense models: {supported}")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported; verispec runs {supported}")
    return arch


def config_from_gguf(reader) -> ModelConfig:
    """The ``ModelConfig`` of a GGUF file's metadata (and its small RoPE tensors)."""
    arch = _checked_arch(reader)
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    names = {t.name for t in reader.tensors}
    eos = [int(x) for x in (_field(reader, "tokenizer.ggml.eos_token_id"),
                            _field(reader, "tokenizer.ggml.eot_token_id")) if x is not None]
    scaling = None
    if g("rope.scaling.type") not in (None, "none"):
        scaling = {"rope_type": g("rope.scaling.type"), "factor": float(g("rope.scaling.factor", 1.0))}
    freqs = _tensor(reader, "rope_freqs.weight")
    fields = dict(
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
        rope_freq_factors=tuple(float(x) for x in freqs) if freqs is not None else None,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6 if arch.startswith("gemma") else 1e-5)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names or "blk.0.attn_qkv.bias" in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        qk_norm="blk.0.attn_q_norm.weight" in names,
    )
    extra = _ARCH_FIELDS.get(arch)
    if extra is not None:
        fields.update(extra(reader, g, fields))
    return ModelConfig(**fields)


def _gemma_fields(reader, g, base: dict) -> dict:
    """Gemma 2 / 3 settings llama.cpp reads from the file or fixes in code (``llama-model.cpp``):
    Gemma 2 slides on even layers, Gemma 3 on all but every 6th unless a
    ``sliding_window_pattern`` is stored; Gemma 3's local RoPE base is 10000; the query scale is
    1/sqrt(head_dim) except for the 27B models (46 layers Gemma 2, 62 Gemma 3: 1/sqrt(hidden/heads))."""
    gemma3 = base["arch"] == "gemma3"
    n, hidden, heads = base["num_layers"], base["hidden_size"], base["num_heads"]
    pattern = g("attention.sliding_window_pattern")
    if isinstance(pattern, list):      # one flag per layer: True = sliding
        sliding = tuple(i for i, flag in enumerate(pattern) if flag)
    else:
        every = int(pattern) if pattern else (6 if gemma3 else 2)
        sliding = tuple(i for i in range(n) if (i + 1) % every)
    query = hidden // heads if n == (62 if gemma3 else 46) else base["head_dim"]
    return dict(hidden_act="gelu_tanh", embed_scale=float(hidden) ** 0.5, qk_norm=gemma3, sandwich_norm=True,
                query_scale=float(query) ** -0.5, sliding_window=int(g("attention.sliding_window", 4096)),
                sliding_layers=sliding, rope_local_theta=10000.0 if gemma3 else None,
                final_logit_softcapping=g("final_logit_softcapping"),
                attn_logit_softcapping=None if gemma3 else g("attn_logit_softcapping"))


def _phi3_fields(reader, g, base: dict) -> dict:
    """Phi-3: partial rotary, LongRoPE from the factor tensors, a sliding window on every layer."""
    out = dict(rotary_dim=int(g("rope.dimension_count", base["head_dim"])))
    short, long = _tensor(reader, "rope_factors_short.weight"), _tensor(reader, "rope_factors_long.weight")
    if short is not None and long is not None:
        original = int(g("rope.scaling.original_context_length", base["max_position_embeddings"]))
        out["rope_scaling"] = {"rope_type": "longrope", "short_factor": short.tolist(), "long_factor": long.tolist(),
                               "original_max_position_embeddings": original,
                               "attention_factor": float(g("rope.scaling.attn_factor", 1.0))}
    window = g("attention.sliding_window")
    if window:
        out.update(sliding_window=int(window), sliding_layers=tuple(range(base["num_layers"])))
    return out


_ARCH_FIELDS = {"gemma2": _gemma_fields, "gemma3": _gemma_fields, "phi3": _phi3_fields}


def _our_names(name: str, w: np.ndarray, cfg: ModelConfig, layer_names, global_names) -> dict[str, np.ndarray]:
    """Our tensors from one GGUF tensor (fused ones split, llama's q/k rows unpermuted); {} to skip."""
    if name in global_names:
        return {global_names[name]: w}
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if not m:
        return {}
    prefix, rest = f"layers.{m.group(1)}.", m.group(2)
    if rest.startswith("attn_qkv."):
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        kind = rest.split(".")[1]
        return {f"{prefix}attn.w{p}.{kind}": part for p, part in zip("qkv", np.split(w, [q, q + kv]))}
    if rest == "ffn_up.weight" and w.shape[0] == 2 * cfg.intermediate_size:      # phi3: [gate; up]
        gate, up = np.split(w, 2)
        return {f"{prefix}mlp.w_gate.weight": gate, f"{prefix}mlp.w_up.weight": up}
    if rest not in layer_names:
        return {}
    if cfg.arch == "llama" and rest.startswith(("attn_q.", "attn_k.")):
        w = _unpermute(w, cfg.num_heads if rest.startswith("attn_q.") else cfg.num_kv_heads)
    return {prefix + layer_names[rest]: w}


def load_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and fp32 state dict (our parameter names) of a GGUF model file."""
    import gguf
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure is a format error for the user
        raise GGUFFormatError(f"{path}: not a readable GGUF file ({e})") from e
    cfg = config_from_gguf(reader)
    layer_names, global_names = _names()
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if not t.name.startswith("blk.") and t.name not in global_names:
            continue      # rope_freqs / rope_factors_*: read into the config
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        for ours, part in _our_names(t.name, w, cfg, layer_names, global_names).items():
            state[ours] = torch.from_numpy(np.array(part, dtype=np.float32, copy=True))
    return cfg, state
