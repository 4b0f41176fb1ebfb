"""Hybrid drafting (``method: "hybrid"``, ``drafting.hybrid``): the per-step source choice from
measured costs and observed acceptance, and greedy output equal to vanilla on the shipped head,
with both sources used."""
from __future__ import annotations

import pytest

from helpers import assert_same_or_tie
from verispec import LLM, SamplingParams
from verispec.drafting.draft_shape import StepCosts
from verispec.drafting.hybrid import HeadOption, HybridDrafter, SourceChooser
from verispec.drafting.spec_config import SpecConfigError, SpeculativeConfig

pytest.importorskip("arctic_inference.suffix_decoding")

COSTS = StepCosts(verify=((1, 5.0), (2, 5.3), (4, 6.0), (8, 8.0), (16, 12.0)), draft_fixed=1.0,
                  level=((1, 0.4), (2, 0.5)))
HEAD = HeadOption(nodes=2, expected_accepted=0.9, draft_ms=1.4)


def test_chooser_weighs_costs_and_observed_acceptance():
    c = SourceChooser(COSTS, HEAD)
    assert c.choose(0, 0.0, 0) == "head"                  # nothing to copy: the head pays (1.9 / 7.0 > 1 / 5)
    assert c.choose(0, 3.0, 6) == "suffix"                # a long confident match beats it
    assert c.choose(0, 0.2, 1) == "head"                  # a weak match does not
    for _ in range(16):                                   # the head keeps being rejected on this request
        c.observe(0, "head", 0.9, 0)
    assert c.choose(0, 0.0, 0) == "plain"
    assert c.choose(1, 0.0, 0) == "head"                  # another request keeps its own estimate
    for _ in range(16):                                   # suffix scores that overstate this request's
        c.observe(1, "suffix", 3.0, 0)
    assert c.choose(1, 3.0, 6) == "head"
    c.release(0)
    assert c.choose(0, 0.0, 0) == "head"
    assert c.counts == {"suffix": 1, "head": 5, "plain": 1}


def test_config_keys_and_errors():
    cfg = SpeculativeConfig.from_dict({"method": "hybrid", "suffix_decoding_min_token_prob": 0.2})
    assert cfg.suffix_config().suffix_decoding_min_token_prob == 0.2
    assert cfg.head_config().method == "eagle3" and cfg.head_config().adaptive_drafting is False
    with pytest.raises(SpecConfigError, match="adaptive_drafting"):
        SpeculativeConfig.from_dict({"method": "hybrid", "adaptive_drafting": True})
    with pytest.raises(SpecConfigError, match="'tree'"):
        SpeculativeConfig.from_dict({"method": "hybrid", "tree": [[0]]})
    with pytest.raises(SpecConfigError, match="suffix_decoding_min_token_prob"):
        SpeculativeConfig.from_dict({"method": "hybrid", "suffix_decoding_min_token_prob": 2})


def test_hybrid_greedy_equals_vanilla_and_uses_both_sources(packed_target, chat_prompts, monkeypatch):
    chosen = []
    choose = SourceChooser.choose
    monkeypatch.setattr(SourceChooser, "choose", lambda self, *a: chosen.append(choose(self, *a)) or chosen[-1])
    llm = LLM(loaded=packed_target)
    spec = LLM(loaded=packed_target, speculative_config={"method": "hybrid"})
    copy = chat_prompts[0] + chat_prompts[0]              # a repeated passage: something to copy
    prompts = [{"prompt_token_ids": ids} for ids in (chat_prompts[1], copy, chat_prompts[2])]
    params = SamplingParams(temperature=0, max_tokens=48)
    engine = spec.make_engine(1, 1024)
    assert isinstance(engine.drafter, HybridDrafter)
    outs = spec.generate(prompts, params)
    ref = llm.generate(prompts, params)
    for p, o, r in zip(prompts, outs, ref):
        assert_same_or_tie(llm.target.model, p["prompt_token_ids"], o.token_ids, r.token_ids, "hybrid")
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    assert {"suffix", "head"} <= set(chosen), chosen
