"""Typed configuration of the transformer we own: one decoder whose differences between families
are typed fields (never switches on the name). The families and what sets them apart:

- ``llama`` (Llama 2/3/3.1/3.2, SmolLM2; llama3 RoPE scaling, tied or untied head), ``mistral``
  (sliding window on every layer), ``qwen2`` (q/k/v biases, optional sliding window);
- ``qwen3``: RMSNorm over head_dim on q and k (``qk_norm``), ``head_dim`` from the config;
- ``phi3`` (Phi-3/3.5/4): fused qkv / gate_up (split by the loaders), partial rotary
  (``rotary_dim``), LongRoPE (``rope_scaling`` type ``longrope``, formerly ``su``);
- ``gemma2``: scaled embeddings, sandwich norms, GeGLU, alternating sliding layers, attention and
  final logit soft-capping; ``gemma3`` (text): gemma2's, with q/k RMSNorm and a local RoPE base.

Built from a Hugging Face ``config.json`` (``from_hf``) or from GGUF metadata (see ``gguf_loader``).
Mixture-of-experts and multimodal checkpoints are refused with ``UnsupportedModelError`` naming
what is supported. Knows nothing about weights, caches or decoding.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

LLAMA_FAMILY = ("llama", "mistral", "qwen2")
SUPPORTED_ARCHITECTURES = (*LLAMA_FAMILY, "qwen3", "phi3", "gemma2", "gemma3")
# what each architecture covers, and how it is checked (``verispec models`` prints this)
ARCHITECTURE_STATUS = {
    "llama": "Llama 2/3/3.1/3.2, SmolLM2: llama3 / linear RoPE scaling, GGUF rope_freqs; logits checked "
             "against transformers (tests/test_architectures.py)",
    "mistral": "Mistral 7B: sliding-window attention on every layer; checked against transformers",
    "qwen2": "Qwen2 / Qwen2.5: q/k/v biases, optional sliding window; checked against transformers",
    "qwen3": "Qwen3 (dense): q/k RMSNorm, explicit head_dim; checked against transformers",
    "phi3": "Phi-3 / 3.5 / 4: fused qkv and gate_up, partial rotary, LongRoPE (per position: short "
            "factors below original_max_position_embeddings); checked against transformers",
    "gemma2": "Gemma 2: soft-capped attention and logits, alternating sliding layers, sandwich norms; "
              "checked against transformers",
    "gemma3": "Gemma 3 text models (gemma3_text): q/k RMSNorm, local RoPE base; checked against transformers",
}
_HF_MODEL_TYPES = {"gemma3_text": "gemma3"}   # HF model_type -> our arch name
ACTIVATIONS = ("silu", "gelu_tanh")
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
_MULTIMODAL_KEYS = ("vision_config", "text_config", "audio_config", "vision_tower", "mm_projector_type")


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model family verispec's runtime does not implement."""


def _supported() -> str:
    return ", ".join(SUPPORTED_ARCHITECTURES)


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
    # HF-style: {"rope_type": "linear"|"llama3"|"longrope", "factor": ...}; longrope carries
    # short_factor, long_factor, original_max_position_embeddings and attention_factor
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False       # q/k/v biases (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Gemma, Qwen3, Phi-3 (defaults = Llama family):
    hidden_act: str = "silu"           # MLP gate activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: float = 1.0           # embeddings are multiplied by this (Gemma: sqrt(hidden_size))
    qk_norm: bool = False              # RMSNorm over head_dim on q and k before RoPE (Gemma 3, Qwen3)
    sandwich_norm: bool = False        # extra RMSNorm on the attention and MLP outputs (before the residual)
    query_scale: float | None = None   # attention score scale; None = head_dim ** -0.5
    sliding_window: int | None = None  # window (in positions, the query's own included) of sliding layers
    sliding_layers: tuple[int, ...] = ()   # 0-based layers with sliding-window attention
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (default: rope_theta)
    final_logit_softcapping: float | None = None   # logits = c * tanh(logits / c)
    attn_logit_softcapping: float | None = None    # attention scores = c * tanh(scores / c) (Gemma 2)
    rotary_dim: int | None = None      # leading dims of each head that RoPE rotates; None = head_dim (Phi-3)
    rope_freq_factors: tuple[float, ...] | None = None   # divide the inverse frequencies (GGUF rope_freqs)
    norm_weight_offset: float = 0.0    # HF checkpoints store RMSNorm weights minus this (Gemma: 1)

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(f"architecture {self.arch!r} is not supported; verispec runs {_supported()}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(f"activation {self.hidden_act!r} is not supported; verispec runs {ACTIVATIONS}")
        if self.sliding_layers and not self.sliding_window:
            raise ValueError("sliding_layers need a sliding_window")
        if any(not 0 <= i < self.num_layers for i in self.sliding_layers):
            raise ValueError(f"sliding_layers {self.sliding_layers} outside 0..{self.num_layers - 1}")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and in 1..head_dim={self.head_dim}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.rope_dim // 2:
            raise ValueError(f"{len(self.rope_freq_factors)} rope_freq_factors for {self.rope_dim // 2} frequencies")

    @property
    def rope_dim(self) -> int:
        """The dims of a head RoPE rotates (the first ones; the rest pass through)."""
        return self.rotary_dim or self.head_dim

    @property
    def rope_long_from(self) -> int | None:
        """LongRoPE: the first position rotated with the long factors (the original context); else None."""
        sc = self.rope_scaling or {}
        return int(sc["original_max_position_embeddings"]) if sc.get("rope_type") == "longrope" else None

    @property
    def rope_attention_factor(self) -> float:
        """cos and sin are multiplied by this (LongRoPE's attention factor; 1 otherwise)."""
        sc = self.rope_scaling or {}
        return float(sc.get("attention_factor", 1.0)) if sc.get("rope_type") == "longrope" else 1.0

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict; ``UnsupportedModelError`` for families
        verispec does not run (mixture-of-experts, multimodal, unknown model types)."""
        model_type = _checked_model_type(cfg)
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
        fields.update(_ARCH_FROM_HF[model_type](cfg, model_type))
        return cls(**fields)


def _checked_model_type(cfg: dict) -> str:
    """Our arch name for a config.json, or ``UnsupportedModelError`` saying why not."""
    model_type = cfg.get("model_type", "llama")
    archs = cfg.get("architectures") or []
    if model_type == "gemma3" and "text_config" in cfg:
        raise UnsupportedModelError("this is a Gemma 3 vision-language checkpoint (model_type 'gemma3'); "
                                    "verispec runs the text-only Gemma 3 models (model_type 'gemma3_text')")
    moe = [k for k in _MOE_KEYS if cfg.get(k)]
    if moe or "moe" in model_type:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is a mixture-of-experts model ({', '.join(moe) or model_type}); verispec "
            f"runs dense decoder-only models: {_supported()}")
    multimodal = [k for k in _MULTIMODAL_KEYS if k in cfg] + [a for a in archs if "ConditionalGeneration" in a]
    if multimodal:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is a multimodal model ({', '.join(multimodal)}); verispec runs "
            f"text-only decoder models: {_supported()}")
    model_type = _HF_MODEL_TYPES.get(model_type, model_type)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported; verispec runs {_supported()}")
    return model_type


def _llama_from_hf(cfg: dict, model_type: str) -> dict:
    """Llama, Mistral, Qwen2 and Qwen3: RoPE, sliding window, and Qwen3's q/k norms."""
    return dict(**_rope_from_hf(cfg), **_sliding_from_hf(cfg, model_type), qk_norm=model_type == "qwen3")


def _phi3_from_hf(cfg: dict, model_type: str) -> dict:
    """Phi-3 / 3.5 / 4: partial rotary and LongRoPE (``su`` / ``yarn`` read as longrope, as
    transformers does), with its attention factor resolved here (transformers' rule: given, else
    sqrt(1 + ln(s) / ln(original)) for s = max_position_embeddings / original > 1, else 1)."""
    rope = _rope_from_hf(cfg)
    params = cfg.get("rope_parameters") or {}
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    sc = rope["rope_scaling"]
    if sc is not None:
        sc.pop("partial_rotary_factor", None)
        if sc.get("rope_type", sc.get("type")) in ("su", "yarn", "longrope"):
            sc = _longrope(sc, cfg)
        if not sc:
            sc = None
    return dict(rope_theta=rope["rope_theta"], rope_scaling=sc, rotary_dim=int(head_dim * partial),
                **_sliding_from_hf(cfg, model_type))


def _longrope(sc: dict, cfg: dict) -> dict:
    original = int(sc.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
                   or cfg.get("max_position_embeddings", 4096))
    factor = sc.get("factor") or cfg.get("max_position_embeddings", original) / original
    attention = sc.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"rope_type": "longrope", "short_factor": [float(x) for x in sc["short_factor"]],
            "long_factor": [float(x) for x in sc["long_factor"]], "original_max_position_embeddings": original,
            "attention_factor": float(attention)}


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
    layer when it is set (so does Phi-3); Qwen2 and Qwen3 only with ``use_sliding_window`` and from layer ``max_window_layers``
    on (transformers' rule). The window counts the query's own position, as transformers masks."""
    window = cfg.get("sliding_window")
    if not window:
        return {}
    n = cfg["num_hidden_layers"]
    if model_type in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window", False):
            return {}
        types = cfg.get("layer_types") or [
            "sliding_attention" if i >= cfg.get("max_window_layers", n) else "full_attention" for i in range(n)]
    else:
        types = cfg.get("layer_types") or ["sliding_attention"] * n
    layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return dict(sliding_window=int(window), sliding_layers=layers) if layers else {}


def _gemma_from_hf(cfg: dict, model_type: str) -> dict:
    """The Gemma 2 / Gemma 3 fields of a ``gemma2`` / ``gemma3_text`` config.json (transformers
    4.5x and 5.x spellings). Gemma 2 alternates sliding and global layers (even layers slide) and
    has one RoPE; Gemma 3 makes every ``sliding_window_pattern``-th layer global, adds q/k RMSNorm
    and a local RoPE base. Both store RMSNorm weights w of a (1 + w) multiplier."""
    gemma3 = model_type == "gemma3"
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:   # older configs
        pattern = int(cfg.get("sliding_window_pattern", 6)) if gemma3 else 2
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    if gemma3:
        rope = cfg.get("rope_parameters") or {}
        full, local = rope.get("full_attention", {}), rope.get("sliding_attention", {})
        scaling = full if full.get("rope_type", "default") != "default" else cfg.get("rope_scaling")
        rope_fields = dict(rope_theta=float(full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))),
                           rope_local_theta=float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))),
                           rope_scaling=dict(scaling) if scaling else None)
    else:
        rope_fields = _rope_from_hf(cfg)
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    return dict(
        **rope_fields,
        hidden_act={"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}.get(act, act),
        embed_scale=float(cfg["hidden_size"]) ** 0.5, qk_norm=gemma3, sandwich_norm=True,
        query_scale=float(cfg.get("query_pre_attn_scalar", cfg.get("head_dim", 256))) ** -0.5,
        sliding_window=cfg.get("sliding_window"),
        sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
        norm_weight_offset=1.0,
    )


# our arch name -> its fields from a config.json (beyond the shared ones ``from_hf`` reads)
_ARCH_FROM_HF = {"llama": _llama_from_hf, "mistral": _llama_from_hf, "qwen2": _llama_from_hf,
                 "qwen3": _llama_from_hf, "phi3": _phi3_from_hf, "gemma2": _gemma_from_hf, "gemma3": _gemma_from_hf}
