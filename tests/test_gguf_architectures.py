"""GGUF files of the architectures users bring, written as llama.cpp's converter writes them (its
tensor names from ``gguf.get_tensor_name_map``, its keys through ``gguf.GGUFWriter``, its
transforms: llama's permuted q/k rows and Llama 3.1's ``rope_freqs`` tensor in place of a scaling
type, Phi-3's fused qkv / gate_up and ``rope_factors_*`` tensors, Gemma's norms stored as 1 + w),
loaded by verispec and compared with transformers on the same tiny random weights. Mixture-of-
experts GGUFs (an ``expert_count``) are refused.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from test_architectures import ARCHS, PROMPT, _hf_logits, _our_logits, _tokens
from verispec.models.config import UnsupportedModelError
from verispec.models.loading import load_model

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.usefixtures("module_single_thread")

GGUF_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen3": gguf.MODEL_ARCH.QWEN3, "phi3": gguf.MODEL_ARCH.PHI3,
             "gemma2": gguf.MODEL_ARCH.GEMMA2}


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute`` (half rotation -> interleaved rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(c) -> np.ndarray:
    """``rope_freqs`` as the converter derives it from llama3 scaling (one divisor per frequency)."""
    rp = c.rope_parameters
    dim = c.head_dim
    freqs = 1.0 / (rp["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, lo, hi, old = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"], \
        rp["original_max_position_embeddings"]
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _write_metadata(w, arch: str, c) -> None:
    rp = c.rope_parameters
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(rp["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if arch == "phi3":
        w.add_rope_dimension_count(int(head_dim * rp["partial_rotary_factor"]))
        original = rp["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(c.max_position_embeddings / original)
                                                  / math.log(original)))
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_sliding_window(c.sliding_window)


def write_gguf(hf, arch: str, path) -> None:
    """``hf`` (a transformers model) as llama.cpp's converter writes it (fp32 tensors)."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[GGUF_ARCH[arch]])
    _write_metadata(w, arch, c)
    names = gguf.get_tensor_name_map(GGUF_ARCH[arch], c.num_hidden_layers)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        t = t.detach().float()
        if arch == "llama" and name.endswith("q_proj.weight"):
            t = _permute(t, c.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            t = _permute(t, c.num_key_value_heads)
        if arch == "gemma2" and name.endswith("norm.weight"):
            t = t + 1
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), t.numpy())
    if arch == "llama":
        w.add_tensor("rope_freqs.weight", _llama3_rope_freqs(c))
    if arch == "phi3":
        w.add_tensor("rope_factors_long.weight", np.array(c.rope_parameters["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(c.rope_parameters["short_factor"], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def gguf_pairs(tmp_path_factory):
    """arch -> (transformers model, verispec's load of its GGUF)."""
    out = {}
    for arch in GGUF_ARCH:
        cls, cfg = ARCHS[arch]()
        if arch == "gemma2":     # llama.cpp fixes 1/sqrt(head_dim) (all but the 27B): a GGUF cannot say 24
            cfg.query_pre_attn_scalar = cfg.head_dim
        torch.manual_seed(0)
        hf = cls(cfg).eval()
        with torch.no_grad():
            for p in hf.parameters():
                p.normal_(0.0, 0.08)
        path = tmp_path_factory.mktemp(arch) / f"{arch}.gguf"
        write_gguf(hf, arch, path)
        out[arch] = hf, load_model(path, with_tokenizer=False)
    return out


@pytest.mark.parametrize("arch", list(GGUF_ARCH))
def test_gguf_logits_match_transformers(arch, gguf_pairs):
    hf, ours = gguf_pairs[arch]
    assert ours.format == "gguf" and ours.config.arch == arch
    tokens = _tokens()
    want, got = _hf_logits(hf, tokens), _our_logits(ours.model, tokens)
    prefill = (got[:PROMPT] - want[:PROMPT]).abs().max().item()
    steps = (got[PROMPT:] - want[PROMPT:]).abs().max().item()
    msg = f"{arch} GGUF: max |logit difference| prefill {prefill:.3e}, cached steps {steps:.3e}"
    print(msg)
    assert max(prefill, steps) <= 1e-5 * want.abs().max().item(), msg


def test_gguf_config_fields(gguf_pairs):
    """What the converter writes becomes our fields: llama3's rope_freqs (no scaling type),
    Phi-3's LongRoPE and partial rotary, Gemma 2's caps and alternating sliding layers, Qwen3's norms."""
    cfg = {a: p[1].config for a, p in gguf_pairs.items()}
    assert cfg["llama"].rope_scaling is None and len(cfg["llama"].rope_freq_factors) == 16
    assert cfg["llama"].rope_freq_factors[-1] == 8.0 and cfg["llama"].rope_freq_factors[0] < 2.0
    assert cfg["phi3"].rotary_dim == 24 and cfg["phi3"].rope_long_from == 16
    assert cfg["gemma2"].sliding_layers == (0, 2) and cfg["gemma2"].attn_logit_softcapping == 3.0
    assert cfg["qwen3"].qk_norm and cfg["qwen3"].head_dim == 32 and cfg["qwen3"].tie_word_embeddings


def test_moe_gguf_is_refused(tmp_path):
    """A Mixtral GGUF is written as ``llama`` with an ``expert_count``: refused, naming what runs."""
    path = tmp_path / "mixtral.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in (("block_count", 1), ("embedding_length", 32), ("feed_forward_length", 64), ("head_count", 4),
                   ("expert_count", 8), ("expert_used_count", 2)):
        getattr(w, f"add_{add}")(v)
    w.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts.*qwen3"):
        load_model(path, with_tokenizer=False)
