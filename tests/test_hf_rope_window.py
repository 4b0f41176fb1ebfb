"""Hugging Face folders as transformers 5 saves them: RoPE read from ``rope_parameters`` (theta and
llama3 scaling), and Mistral's ``sliding_window`` applied rather than decoded as full attention.
Each model is a tiny random one built with transformers' own config class, saved to a temp folder
and loaded by verispec; logits are compared with transformers' on the same weights."""
from __future__ import annotations

import pytest
import torch

from verispec.models.config import ModelConfig, UnsupportedModelError
from verispec.models.loading import load_model

VOCAB = 128


def _save(hf, tmp_path_factory, name):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.08)
    folder = tmp_path_factory.mktemp(name)
    hf.save_pretrained(folder)
    return load_model(folder, with_tokenizer=False), hf


@pytest.fixture(scope="module")
def tiny_llama3(tmp_path_factory):
    """A Llama with rope_theta 500000 and llama3 scaling (Llama 3.1's), untied head, GQA."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 16},
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    return _save(LlamaForCausalLM(cfg).eval(), tmp_path_factory, "llama3")


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory):
    """A Mistral whose 5-position window is far shorter than the prompts."""
    from transformers import MistralConfig, MistralForCausalLM
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=1, sliding_window=5,
                        max_position_embeddings=512, rope_theta=20000.0, bos_token_id=1, eos_token_id=2)
    return _save(MistralForCausalLM(cfg).eval(), tmp_path_factory, "mistral")


def _max_diff(ours, hf, length=48):
    tokens = torch.randint(3, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = ours.model(tokens, torch.arange(length).expand(2, length)).logits
        want = hf(tokens).logits
    return (got - want).abs().max().item(), want.abs().max().item()


def _greedy_hf(hf, prompt, n):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def _greedy_ours(ours, prompt, n, drafter=None):
    from verispec.core.engine import Engine, Sequence
    from verispec.core.params import SamplingParams
    engine = Engine(ours.model, drafter, max_batch=1, max_len=len(prompt) + n + 16)
    seq = Sequence(prompt_ids=prompt, params=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    with torch.no_grad():
        engine.run([seq])
    return seq.output_ids, engine.stats


def test_rope_parameters_are_read(tiny_llama3):
    cfg = tiny_llama3[0].config
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_scaling["factor"] == 8.0
    # the 4.x spelling still reads, and a flat default rope_parameters carries only theta
    old = ModelConfig.from_hf({"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
                               "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 1e6,
                               "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert old.rope_theta == 1e6 and old.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    new = ModelConfig.from_hf({"model_type": "qwen2", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
                               "num_hidden_layers": 1, "num_attention_heads": 2,
                               "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert new.rope_theta == 1e6 and new.rope_scaling is None


@pytest.mark.parametrize("which", ["tiny_llama3", "tiny_mistral"])
def test_logits_match_transformers(which, request):
    ours, hf = request.getfixturevalue(which)
    diff, scale = _max_diff(ours, hf)
    assert diff < 1e-4 * scale, f"{which}: max |logit difference| {diff:.2e} (scale {scale:.2f})"


@pytest.mark.parametrize("which", ["tiny_llama3", "tiny_mistral"])
def test_greedy_equals_transformers(which, request):
    ours, hf = request.getfixturevalue(which)
    prompt = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    assert _greedy_ours(ours, prompt, 24)[0] == _greedy_hf(hf, prompt, 24)


@pytest.mark.parametrize("which", ["tiny_llama3", "tiny_mistral"])
def test_ngram_speculation_equals_vanilla(which, request):
    from verispec.drafting.ngram import NgramDrafter
    ours = request.getfixturevalue(which)[0]
    prompt = [5, 6, 7, 8, 9, 10] * 4
    want, _ = _greedy_ours(ours, prompt, 32)
    got, stats = _greedy_ours(ours, prompt, 32, NgramDrafter(num_speculative_tokens=4))
    assert got == want and stats.num_drafts > 0


def test_mistral_window_is_applied(tiny_mistral):
    cfg = tiny_mistral[0].config
    assert cfg.sliding_window == 5 and cfg.sliding_layers == (0, 1)
    full = ModelConfig.from_hf({"model_type": "mistral", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
                                "num_hidden_layers": 2, "num_attention_heads": 2, "sliding_window": None})
    assert full.sliding_layers == ()
    qwen = ModelConfig.from_hf({"model_type": "qwen2", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
                                "num_hidden_layers": 2, "num_attention_heads": 2, "sliding_window": 4096,
                                "use_sliding_window": False})
    assert qwen.sliding_layers == ()          # Qwen2 configs carry a window they do not use


def test_unknown_rope_layout_is_refused():
    with pytest.raises(UnsupportedModelError, match="rope_parameters"):
        ModelConfig.from_hf({"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
                             "num_hidden_layers": 1, "num_attention_heads": 2,
                             "rope_parameters": {"full_attention": {"rope_theta": 1e6}}})
