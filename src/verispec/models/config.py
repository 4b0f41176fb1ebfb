"""Typed configuration of the transformer we own (Llama family: Llama, SmolLM2, Qwen2, Mistral).

Built from a Hugging Face ``config.json`` (``from_hf``) or from GGUF metadata (see ``gguf_loader``).
Knows nothing about weights, caches or decoding.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


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

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.arch!r} is not supported; verispec runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict."""
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; verispec runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            arch=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_scaling=cfg.get("rope_scaling"),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
