"""Public EAGLE-3 head layouts load through verispec's EAGLE-3 reader.

Each head is rebuilt from its published ``config.json`` (every key as published; for the
loadable copies the sizes are scaled down) with random tensors of the published names, shapes
and dtypes: yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (``pytorch_model.bin``, ``midlayer.*``, llama3
RoPE, 32k draft vocabulary), AngelSlim/Qwen3-8B_eagle3 (a Qwen3 target: explicit head_dim,
bf16 safetensors), a SpecForge export with its own ``embed_tokens`` and aux ids in
``eagle_config``, and RedHatAI's speculators format (``speculators_config``,
``transformer_layer_config``, ``layers.0.*``). The full-size configs parse against stand-in
targets of the published sizes; the scaled copies load onto tiny targets and speculate exactly as
vanilla decoding. Wrong pairings (hidden size, vocabulary, depth) fail with a clear error.
"""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from verispec.drafting.eagle_head import HeadKind
from verispec.formats import CheckpointError, load_eagle_head, write_config, write_tensors
from verispec.formats import eagle3
from verispec.models.config import ModelConfig
from verispec.models.transformer import Transformer

pytestmark = pytest.mark.usefixtures("module_single_thread")

LLAMA31_ROPE = {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}
# yuhuili/EAGLE3-LLaMA3.1-Instruct-8B config.json
EAGLE3_LLAMA31_8B = {
    "architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 128000, "eos_token_id": 128001,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_hidden_layers": 1, "pad_token_id": 0, "rms_norm_eps": 1e-05, "rope_scaling": LLAMA31_ROPE,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "float16",
    "transformers_version": "4.28.1", "use_cache": True, "vocab_size": 128256, "draft_vocab_size": 32000}
# AngelSlim/Qwen3-8B_eagle3 config.json
EAGLE3_QWEN3_8B = {
    "architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 40960,
    "max_window_layers": 36, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 1,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    "draft_vocab_size": 32000}
# a SpecForge export (Llama 3.1 8B target): its own embedding, aux ids in eagle_config
SPECFORGE_LLAMA31_8B = {**EAGLE3_LLAMA31_8B, "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
                        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 16, 29],
                                         "use_aux_hidden_state": True}}
# RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3 config.json
SPECULATORS_LLAMA31_8B = {
    "architectures": ["Eagle3Speculator"], "auto_map": {"": "eagle3.Eagle3SpeculatorConfig"},
    "draft_vocab_size": 32000, "norm_before_residual": False, "target_hidden_size": None,
    "speculators_model_type": "eagle3", "speculators_version": "0.1.0", "torch_dtype": "bfloat16",
    "transformers_version": "4.54.1",
    "speculators_config": {
        "algorithm": "eagle3", "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5, "accept_tolerance": 0.0,
                              "verifier_accept_k": 1}],
        "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "meta-llama/Llama-3.1-8B-Instruct"}},
    "transformer_layer_config": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": 32, "num_hidden_layers": 1, "num_key_value_heads": 8, "pretraining_tp": 1,
        "rms_norm_eps": 1e-05, "rope_scaling": LLAMA31_ROPE, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": 128256}}

# published head -> (full target: hidden, vocab, layers; weight file; layer prefix; own embedding; dtype)
HEADS = {
    "yuhuili-llama3.1": (EAGLE3_LLAMA31_8B, (4096, 128256, 32), "pytorch_model.bin", "midlayer", False, torch.float16),
    "angelslim-qwen3": (EAGLE3_QWEN3_8B, (4096, 151936, 36), "model.safetensors", "midlayer", False, torch.bfloat16),
    "specforge-llama3.1": (SPECFORGE_LLAMA31_8B, (4096, 128256, 32), "model.safetensors", "midlayer", True,
                           torch.bfloat16),
    "speculators-llama3.1": (SPECULATORS_LLAMA31_8B, (4096, 128256, 32), "model.safetensors", "layers.0", False,
                             torch.bfloat16),
}
SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
             vocab_size=256, draft_vocab_size=64)


def _layer_cfg(cfg: dict) -> dict:
    return cfg["transformer_layer_config"] if "transformer_layer_config" in cfg else cfg


def _scaled(cfg: dict) -> dict:
    """The published config with its sizes scaled down (every other key as published)."""
    out = copy.deepcopy(cfg)
    layer = _layer_cfg(out)
    for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        layer[k] = SMALL[k]
    if "head_dim" in layer:
        layer["head_dim"] = SMALL["head_dim"]
    out["draft_vocab_size"] = SMALL["draft_vocab_size"]
    if "eagle_config" in out:
        out["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 3, 4]
    return out


def _tensors(cfg: dict, prefix: str, own_embedding: bool, dtype: torch.dtype, seed: int = 0) -> dict:
    """Random tensors of the published names and the shapes ``cfg`` implies."""
    c = _layer_cfg(cfg)
    h, inter, vocab, dv = c["hidden_size"], c["intermediate_size"], c["vocab_size"], cfg["draft_vocab_size"]
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or h // heads
    g = torch.Generator().manual_seed(seed)
    shapes = {f"{prefix}.self_attn.q_proj.weight": (heads * d, 2 * h), f"{prefix}.self_attn.k_proj.weight": (kv * d, 2 * h),
              f"{prefix}.self_attn.v_proj.weight": (kv * d, 2 * h), f"{prefix}.self_attn.o_proj.weight": (h, heads * d),
              f"{prefix}.mlp.gate_proj.weight": (inter, h), f"{prefix}.mlp.up_proj.weight": (inter, h),
              f"{prefix}.mlp.down_proj.weight": (h, inter), "fc.weight": (h, 3 * h), "lm_head.weight": (dv, h)}
    out = {k: (torch.randn(s, generator=g) * 0.3).to(dtype) for k, s in shapes.items()}
    for n in (f"{prefix}.hidden_norm", f"{prefix}.input_layernorm", f"{prefix}.post_attention_layernorm", "norm"):
        out[f"{n}.weight"] = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
    if own_embedding:
        out["embed_tokens.weight"] = torch.randn(vocab, h, generator=g).to(dtype)
    ids = torch.randperm(vocab, generator=g)[:dv].sort().values
    out["d2t"] = ids - torch.arange(dv)
    out["t2d"] = torch.zeros(vocab, dtype=torch.bool)
    out["t2d"][ids] = True
    return out


def _head_folder(tmp_path, name: str, cfg: dict | None = None) -> tuple:
    published, _, weights, prefix, own, dtype = HEADS[name]
    cfg = cfg or _scaled(published)
    folder = tmp_path / name
    write_tensors(folder, _tensors(cfg, prefix, own, dtype), weights)
    write_config(folder, cfg)
    return folder, cfg


def _target(cfg: dict, name: str, layers: int = 6, **changes):
    """A tiny random target of the head's (scaled) hidden size and vocabulary."""
    c = _layer_cfg(cfg)
    arch = "qwen3" if "qwen3" in name else "llama"
    mc = ModelConfig(arch=arch, vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=96,
                     num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=arch == "qwen3",
                     **changes)
    torch.manual_seed(1)
    model = Transformer(mc).eval().requires_grad_(False)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else 0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("name", list(HEADS))
def test_published_config_parses_for_its_target(name):
    """The full-size config.json, as published, against a target of the published sizes."""
    published, (hidden, vocab, layers), *_ = HEADS[name]
    target = SimpleNamespace(hidden_size=hidden, vocab_size=vocab, num_layers=layers)
    cfg = eagle3.config_from_json(published, target, has_embedding=HEADS[name][4])
    assert (cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size) == (4096, vocab, 32000)
    assert cfg.head_dim == 128 and cfg.num_kv_heads == 8 and len(cfg.aux_layer_ids) == 3
    if "llama" in name:
        assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_theta == 500000.0
    if name.startswith("specforge"):
        assert cfg.aux_layer_ids == (2, 16, 29)


@pytest.mark.parametrize("name", list(HEADS))
def test_scaled_head_loads_and_speculates_losslessly(name, tmp_path):
    from verispec.core.engine import Engine, Sequence
    from verispec.core.params import SamplingParams
    from verispec.drafting.dynamic_tree import StaticTreeConfig
    from verispec.drafting.eagle import EagleDrafter
    folder, cfg = _head_folder(tmp_path, name)
    target = _target(cfg, name)
    head = load_eagle_head(folder, target, HeadKind.EAGLE3)
    assert head.cfg.draft_vocab_size == 64 and head.cfg.own_embedding == HEADS[name][4]
    prompt = [5, 6, 7, 8, 9] * 4
    outs = []
    for drafter in (None, EagleDrafter(head, StaticTreeConfig.from_choices([[0], [1], [0, 0]]),
                                       max_batch=1, max_len=96)):
        engine = Engine(target, drafter, max_batch=1, max_len=96)
        seq = Sequence(prompt_ids=prompt, params=SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        with torch.no_grad():
            engine.run([seq])
        outs.append(seq.output_ids)
    assert outs[0] == outs[1] and engine.stats.num_drafts > 0


@pytest.mark.parametrize("wrong,match", [("hidden", "hidden size"), ("vocab", "vocab_size"),
                                         ("layers", "out of range")])
def test_wrong_pairings_fail_clearly(wrong, match, tmp_path):
    """A head for another hidden size, vocabulary or depth (its aux layers past the target's)."""
    folder, cfg = _head_folder(tmp_path, "specforge-llama3.1")
    target = {"hidden": lambda: _target({**cfg, "hidden_size": 96}, "llama"),
              "vocab": lambda: _target({**cfg, "vocab_size": 300}, "llama"),
              "layers": lambda: _target(cfg, "llama", layers=3)}[wrong]()
    with pytest.raises(CheckpointError, match=match):
        load_eagle_head(folder, target, HeadKind.EAGLE3)


def test_speculators_variants(tmp_path):
    """``norm_before_residual`` is read (and reaches the head's config); another algorithm or a
    non-boolean switch is refused clearly."""
    cfg = _scaled(SPECULATORS_LLAMA31_8B)
    target = SimpleNamespace(hidden_size=64, vocab_size=256, num_layers=32)
    for flag in (False, True):
        layer = eagle3.from_speculators({**cfg, "norm_before_residual": flag})
        assert layer["norm_before_residual"] is flag
    with pytest.raises(CheckpointError, match="norm_before_residual"):
        eagle3.config_from_json({**cfg, "norm_before_residual": "yes"}, target, False)
    with pytest.raises(CheckpointError, match="not an EAGLE-3 head"):
        eagle3.from_speculators({**cfg, "speculators_config": {"algorithm": "eagle"}})
