"""The heads shipped in checkpoints/ for the default model: default for their method, small,
bf16, carded, and lossless (greedy output equals vanilla greedy output)."""
from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from helpers import assert_same_or_tie

from verispec import LLM, SamplingParams
from verispec.drafting.shipped import shipped_head

ROOT = Path(__file__).resolve().parents[1] / "checkpoints"
METHODS = ("eagle3", "medusa", "eagle")


def test_shipped_heads_fit_the_budget():
    total = sum(f.stat().st_size for m in METHODS for f in (ROOT / f"smollm2-135m-{m}").iterdir())
    assert total <= 50e6, f"shipped heads take {total / 1e6:.1f} MB (budget 50 MB)"
    for m in METHODS:
        folder = ROOT / f"smollm2-135m-{m}"
        card = (folder / "README.md").read_text()
        for what in ("## Data", "## Training", "acc", "## Measured acceptance", "## Reproduce"):
            assert what in card, (m, what)
        weights = next(f for f in folder.glob("*.safetensors") if f.name != "draft_vocab.safetensors")
        with safe_open(str(weights), "pt") as f:
            dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys()}
        assert "BF16" in dtypes and not {"F32", "F16"} & dtypes, (m, dtypes)


@pytest.mark.parametrize("method", METHODS)
def test_shipped_head_is_the_default_and_lossless(packed_target, chat_prompts, method):
    """On the fp16-packed target (heads follow it; the dense target is covered by test_eagle /
    test_medusa), which halves this test's time."""
    assert shipped_head("smollm2-135m", method) == ROOT / f"smollm2-135m-{method}"
    llm = LLM(loaded=packed_target)
    spec = LLM(loaded=packed_target, speculative_config={"method": method})
    params = SamplingParams(temperature=0, max_tokens=48)
    prompts = [{"prompt_token_ids": ids} for ids in chat_prompts[:3]]
    outs = spec.generate(prompts, params)
    ref = llm.generate(prompts, params)
    for p, o, r in zip(prompts, outs, ref):
        assert_same_or_tie(llm.target.model, p["prompt_token_ids"], o.token_ids, r.token_ids, method)
    drafter = spec.make_engine(1, 64).drafter       # eagle3 and medusa draft over their folder's cut
    if method == "medusa":
        assert drafter.heads.vocab_ids.numel() == 8192
    elif method == "eagle3":
        assert drafter.head.lm_head.out_features == 8192
    else:
        assert drafter.head.vocab_ids.numel() == 8192
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0, "the shipped head never gets a token accepted"
