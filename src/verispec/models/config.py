"""Typed configuration of the transformer we own (Llama family: Llama, SmolLM2, Qwen2, Mistral;
and Gemma 3 text models, whose differences are the fields after ``eos_token_ids``).

Built from a Hugging Face ``config.json`` (``from_hf``) or from GGUF metadata (see ``gguf_loader``).
Knows nothing about weights, caches or decoding.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

LLAMA_FAMILY = ("llama", "mistral", "qwen2")
SUPPORTED_ARCHITECTURES = (*LLAMA_FAMILY, "gemma3")
_HF_MODEL_TYPES = {"gemma3_text": "gemma3"}   # HF model_type -> our arch name
ACTIVATIONS = ("silu", "gelu_tanh")


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model family verispec's runtime does not implement."""


@dataclass(frozen=True)
class ModelConfig:
    arch: str                      # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 8192
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None   # HF-style: {"rope_type": "linear"|"llama3"|..., "factor": ...}
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False       # q/k/v biases (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Gemma 3 (defaults = Llama family):
    hidden_act: str = "silu"           # MLP gate activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: float = 1.0           # embeddings are multiplied by this (Gemma: sqrt(hidden_size))
    qk_norm: bool = False              # RMSNorm over head_dim on q and k before RoPE
    sandwich_norm: bool = False        # extra RMSNorm on the attention and MLP outputs (before the residual)
    query_scale: float | None = None   # attention score scale; None = head_dim ** -0.5
    sliding_window: int | None = None  # window (in positions, the query's own included) of sliding layers
    sliding_layers: tuple[int, ...] = ()   # 0-based layers with sliding-window attention
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (default: rope_theta)
    final_logit_softcapping: float | None = None   # logits = c * tanh(logits / c)

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.arch!r} is not supported; verispec runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(f"activation {self.hidden_act!r} is not supported; verispec runs {ACTIVATIONS}")
        if self.sliding_layers and not self.sliding_window:
            raise ValueError("sliding_layers need a sliding_window")
        if any(not 0 <= i < self.num_layers for i in self.sliding_layers):
            raise ValueError(f"sliding_layers {self.sliding_layers} outside 0..{self.num_layers - 1}")

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict."""
        model_type = cfg.get("model_type", "llama")
        if model_type == "gemma3" and "text_config" in cfg:
            raise UnsupportedModelError("this is a Gemma 3 vision-language checkpoint (model_type 'gemma3'); "
                                        "verispec runs the text-only Gemma 3 models (model_type 'gemma3_text')")
        model_type = _HF_MODEL_TYPES.get(model_type, model_type)
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; verispec runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        fields = dict(
            arch=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
        if model_type == "gemma3":
            fields.update(_gemma3_from_hf(cfg))
        else:
            fields.update(_rope_from_hf(cfg), **_sliding_from_hf(cfg, model_type))
        return cls(**fields)


def _rope_from_hf(cfg: dict) -> dict:
    """``rope_theta`` and ``rope_scaling`` of a Llama-family config.json. transformers 5 writes both
    under ``rope_parameters`` ({"rope_type", "rope_theta", "factor", ...}); 4.x wrote ``rope_theta``
    and ``rope_scaling`` at the top level. Either spelling is read, ``rope_parameters`` first."""
    rope = cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        raise UnsupportedModelError(f"rope_parameters {rope!r}: per-layer-type RoPE is only read for Gemma 3")
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else cfg.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta"} if scaling else None
    return dict(rope_theta=float(theta), rope_scaling=scaling)


def _sliding_from_hf(cfg: dict, model_type: str) -> dict:
    """Sliding-window attention of a Llama-family config: Mistral applies ``sliding_window`` to every
    layer when it is set; Qwen2 only with ``use_sliding_window`` and from layer ``max_window_layers``
    on (transformers' rule). The window counts the query's own position, as transformers masks."""
    window = cfg.get("sliding_window")
    if not window:
        return {}
    n = cfg["num_hidden_layers"]
    if model_type == "qwen2":
        if not cfg.get("use_sliding_window", False):
            return {}
        types = cfg.get("layer_types") or [
            "sliding_attention" if i >= cfg.get("max_window_layers", n) else "full_attention" for i in range(n)]
    else:
        types = cfg.get("layer_types") or ["sliding_attention"] * n
    layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return dict(sliding_window=int(window), sliding_layers=layers) if layers else {}


def _gemma3_from_hf(cfg: dict) -> dict:
    """The Gemma 3 fields of a ``gemma3_text`` config.json (transformers 4.5x and 5.x spellings)."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelError("attention logit soft-capping is not supported")
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:   # older configs: every ``sliding_window_pattern``-th layer is global
        pattern = int(cfg.get("sliding_window_pattern", 6))
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention", {})
    local = rope.get("sliding_attention", {})
    scaling = full if full.get("rope_type", "default") != "default" else cfg.get("rope_scaling")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    return dict(
        hidden_act={"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}.get(act, act),
        embed_scale=float(cfg["hidden_size"]) ** 0.5, qk_norm=True, sandwich_norm=True,
        query_scale=float(cfg.get("query_pre_attn_scalar", cfg.get("head_dim", 256))) ** -0.5,
        sliding_window=cfg.get("sliding_window"),
        sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
        rope_theta=float(full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))),
        rope_local_theta=float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))),
        rope_scaling=dict(scaling) if scaling else None,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
    )
