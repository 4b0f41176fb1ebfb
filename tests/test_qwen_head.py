"""The Qwen2.5-Coder-1.5B EAGLE-3 head's path, on a tiny random stand-in of the same config.

The real target and head need the 1.6 GB model wheels, so the default run builds a tiny random
Qwen2 target (q/k/v biases, grouped KV heads, untied LM head) in a folder named like the real
model, and a head made exactly as ``verispec train eagle3 --head-init target --intermediate-size
I --draft-vocab-size D`` makes the shipped one (a narrower MLP than the target's, a reduced draft
vocabulary, the default aux layers), saved under a checkpoint root as ``<model>-eagle3``. Checked:
``LLM(model=..., speculative_config={"method": "eagle3"})`` finds that head by name, its greedy
decoding equals vanilla's token for token, and its speculators-layout export (``verispec train
export --format vllm``) loads back into the same head. The real head runs in the slow test at the
end and in the suite ``specbench-qwen-heads``.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import save_random_hf

from verispec import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("module_single_thread")

NAME = "qwen2.5-coder-1.5b"
VOCAB, LAYERS, DRAFT = 96, 6, 48
# the shipped head found by name, drafting a fixed 3-token chain every step (no cost-driven choice)
PINNED = {"method": "eagle3", "tree": [[0], [0, 0], [0, 0, 0]], "adaptive_drafting": False}


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    """A random tiny Qwen2 saved by transformers, with a word-level tokenizer, in a folder named like
    the real model."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, rope_theta=1_000_000.0, eos_token_id=2, bos_token_id=1)
    return save_random_hf(Qwen2ForCausalLM(cfg), tmp_path_factory.mktemp("models") / NAME, VOCAB)


@pytest.fixture(scope="module")
def target(qwen_dir):
    from verispec.models.loading import load_model
    return load_model(qwen_dir)


@pytest.fixture(scope="module")
def head_root(tmp_path_factory, target) -> Path:
    """A checkpoint root holding ``<model>-eagle3``: the trainer's head (target init, half-width
    MLP, the DRAFT most frequent ids of some on-policy-like counts), with its draft vocabulary."""
    from verispec.drafting.draft_vocab import save_draft_vocab
    from verispec.formats import save_eagle_head
    from verispec.train.eagle3 import init_eagle3_head, new_head_config
    from verispec.train.vocab import build_draft_vocab
    model = target.model
    counts = torch.randint(0, 50, (VOCAB,), generator=torch.Generator().manual_seed(4))
    vocab = build_draft_vocab(counts, DRAFT, always=[2])
    cfg = new_head_config(model.cfg, vocab.size, intermediate_size=model.cfg.intermediate_size // 2)
    head = init_eagle3_head(cfg, model, vocab, seed=5)
    root = tmp_path_factory.mktemp("checkpoints")
    save_eagle_head(head, root / f"{NAME}-eagle3")
    save_draft_vocab(vocab, root / f"{NAME}-eagle3" / "draft_vocab.safetensors")
    return root


def test_the_head_is_found_by_name_and_decodes_losslessly(qwen_dir, target, head_root, monkeypatch):
    from verispec.drafting.shipped import shipped_head
    monkeypatch.setenv("VERISPEC_CHECKPOINTS", str(head_root))
    assert shipped_head(str(qwen_dir), "eagle3") == (head_root / f"{NAME}-eagle3").resolve()
    cfg = json.loads((head_root / f"{NAME}-eagle3" / "config.json").read_text())
    assert cfg["intermediate_size"] == target.model.cfg.intermediate_size // 2
    assert cfg["draft_vocab_size"] == DRAFT
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, LAYERS // 2, LAYERS - 3]
    g = torch.Generator().manual_seed(6)
    prompts = [{"prompt_token_ids": torch.randint(3, VOCAB, (n,), generator=g).tolist()} for n in (5, 11, 17)]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    want = LLM(loaded=target).generate(prompts, greedy)
    found = LLM(loaded=target, speculative_config={"method": "eagle3"})
    assert found.make_engine(1, 64).drafter.head.lm_head.out_features == DRAFT
    # a pinned shape, the head still found by name: the default shape and gate follow this
    # machine's measured costs, and a test must not
    spec = LLM(loaded=target, speculative_config=PINNED)
    got = spec.generate(prompts, greedy)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(o.metrics.num_drafts for o in got) > 0


def test_the_speculators_export_loads_back(tmp_path, target, head_root):
    """The ``vllm`` export (speculators' layout, what vLLM reads) of the Qwen-shaped head loads into
    a head with the same tensors and the same aux layers."""
    from verispec.drafting.eagle_head import HeadKind
    from verispec.formats import load_eagle_head, read_tensors
    from verispec.train.export import export
    src = head_root / f"{NAME}-eagle3"
    report = export(src, tmp_path / "vllm", "vllm", target.model)
    cfg = json.loads((report.path / "config.json").read_text())
    assert cfg["draft_vocab_size"] == DRAFT
    mine = load_eagle_head(src, target.model, HeadKind.EAGLE3)
    theirs = load_eagle_head(report.path, target.model, HeadKind.EAGLE3)
    assert mine.cfg.aux_layer_ids == theirs.cfg.aux_layer_ids
    assert mine.cfg.intermediate_size == theirs.cfg.intermediate_size
    a, b = mine.state_dict(), theirs.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert read_tensors(report.path)


def test_the_shipped_qwen_head_fits_its_budget_and_has_its_card():
    """``checkpoints/qwen2.5-coder-1.5b-eagle3``: at most 150 MB, bf16 weights, the config shape
    the trainer writes for this target (read without loading the 1.5B model), and a card."""
    from safetensors import safe_open
    folder = Path(__file__).resolve().parents[1] / "checkpoints" / f"{NAME}-eagle3"
    total = sum(f.stat().st_size for f in folder.iterdir())
    assert total <= 150e6, f"the Qwen head takes {total / 1e6:.1f} MB (budget 150 MB)"
    cfg = json.loads((folder / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["vocab_size"], cfg["num_key_value_heads"]) == (1536, 151936, 2)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 14, 25]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys()}
    assert "BF16" in dtypes and not {"F32", "F16"} & dtypes, dtypes
    card = (folder / "README.md").read_text()
    for what in ("## Data", "## Training", "acc", "## Measured acceptance", "## Reproduce"):
        assert what in card, what
    assert "nan" not in card.lower()
    profile = json.loads((folder / "acceptance.json").read_text())
    assert len(profile["rank_probs"]) == 7


@pytest.mark.slow
def test_the_shipped_qwen_head_is_lossless_and_accepted():
    """The real head beside the real target (int4-a8, the weights it was trained beside): greedy
    output equals vanilla on chat prompts, and the head gets tokens accepted."""
    from verispec.drafting.shipped import shipped_head
    if shipped_head(NAME, "eagle3") is None:
        pytest.skip(f"no {NAME}-eagle3 head in the checkpoint roots")
    llm = LLM(model=NAME, weights="int4-a8")
    spec = LLM(loaded=llm.target, speculative_config=PINNED)
    questions = ["Write a Python function that checks whether a string is a palindrome.",
                 "Explain what a hash map is in two sentences.",
                 "How do I reverse a linked list in C?"]
    prompts = [{"prompt_token_ids": llm.tokenizer(llm.apply_chat_template([{"role": "user", "content": q}]),
                                                  add_special_tokens=False).input_ids} for q in questions]
    greedy = SamplingParams(temperature=0, max_tokens=64)
    want = llm.generate(prompts, greedy)
    got = spec.generate(prompts, greedy)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    tau = sum(o.metrics.num_output_tokens for o in got) / max(sum(o.metrics.num_steps for o in got), 1)
    assert tau > 1.5, f"tokens per step {tau:.2f}: the head is hardly accepted"
