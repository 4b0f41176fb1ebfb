"""The one logits pipeline: built from SamplingParams, in HF's processor order, applied per tree
node; the server's request mapping and the response-cache key are derived from the dataclass, so
no SamplingParams field can be left out of either."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from verispec.core.logits import (AllowedTokens, FrequencyPresencePenalty, LogitBias, LogitsPipeline, MinTokens,
                             RepetitionPenalty, target_probs)
from verispec.core.params import SamplingParams
from verispec.core.structured import StructuredOutputsParams
from verispec.core.tree import DraftTree

# A different valid value for every SamplingParams field (the key test below needs one per field).
OTHER = {"temperature": 0.5, "top_p": 0.9, "top_k": 5, "max_tokens": 17, "seed": 3, "stop": ["x"],
         "stop_token_ids": [2], "ignore_eos": True, "logprobs": 2, "prompt_logprobs": 1, "min_p": 0.1,
         "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2, "n": 2, "min_tokens": 3,
         "include_stop_str_in_output": True, "logit_bias": {1: 2.0}, "allowed_token_ids": [1, 2],
         "structured_outputs": StructuredOutputsParams(regex="a+")}


def test_pipeline_order_and_only_what_applies():
    assert LogitsPipeline.build(SamplingParams()).processors == ()
    p = SamplingParams(repetition_penalty=1.3, presence_penalty=0.2, logit_bias={4: 1.0}, allowed_token_ids=[1, 4],
                       min_tokens=2, max_tokens=8)
    procs = LogitsPipeline.build(p, eos_ids=(0,)).processors
    assert [type(x) for x in procs] == [RepetitionPenalty, FrequencyPresencePenalty, LogitBias, AllowedTokens,
                                        MinTokens]
    assert procs[-1] == MinTokens(2, (0,))
    assert LogitsPipeline.build(dataclasses.replace(p, ignore_eos=True), eos_ids=(0,)).processors[-1:] != (MinTokens(2, (0,)),)


def test_rows_are_processed_per_tree_node():
    """min_tokens counts each node's depth; logit_bias and allowed ids act on every row; the
    pipeline returns its input untouched when nothing applies."""
    tree = DraftTree(torch.tensor([3, 0, 5]), torch.tensor([-1, 0, -1]))     # root -> 3 -> 0 ; root -> 5
    logits = torch.randn(4, 8)
    p = SamplingParams(min_tokens=3, max_tokens=9, logit_bias={5: 2.0}, allowed_token_ids=[0, 3, 5])
    out = LogitsPipeline.build(p, eos_ids=(0,)).process(logits, [1, 2], [7], tree)     # one output token so far
    early = [True, True, False, True]               # output index 1 + depth < 3: root, node 0, node 2
    for row in range(4):
        assert (out[row, 0] == float("-inf")) == early[row]
        assert out[row, 5] == logits[row, 5] + 2.0 and out[row, 3] == logits[row, 3]
        assert torch.isinf(out[row, [1, 2, 4, 6, 7]]).all()
    same = LogitsPipeline.build(SamplingParams()).process(logits, [1], [2], tree)
    assert same is logits
    with pytest.raises(ValueError, match="logit rows"):
        LogitsPipeline.build(p).process(logits[:2], [1], [2], tree)


def test_warpers_are_target_probs():
    logits = torch.randn(3, 11)
    p = SamplingParams(temperature=0.7, top_k=6, top_p=0.8, min_p=0.05)
    torch.testing.assert_close(LogitsPipeline.build(p).probs(logits), target_probs(logits, p))


def test_cache_key_changes_with_every_field():
    base = SamplingParams()
    fields = [f.name for f in dataclasses.fields(SamplingParams)]
    assert sorted(OTHER) == sorted(fields), "give the new SamplingParams field a value in OTHER"
    keys = {base.cache_key()}
    for name in fields:
        changed = dataclasses.replace(base, **{name: OTHER[name]})
        assert changed.cache_key() != base.cache_key(), name
        keys.add(changed.cache_key())
        hash(changed.cache_key())
    assert len(keys) == len(fields) + 1
    assert SamplingParams(logit_bias={1: 2.0, 3: 1.0}).cache_key() == SamplingParams(logit_bias={3: 1.0, 1: 2.0}).cache_key()


def test_request_mapping_covers_every_field():
    """Every SamplingParams field is read from the request under its own name, converted, or set
    elsewhere on purpose; the mapping carries each request value through."""
    pytest.importorskip("fastapi")
    from verispec.serve.protocol import CONVERTED, NOT_FROM_REQUEST, ChatCompletionRequest, CompletionRequest, sampling_params
    for model in (CompletionRequest, ChatCompletionRequest):
        for f in dataclasses.fields(SamplingParams):
            assert f.name in model.model_fields or f.name in CONVERTED or f.name in NOT_FROM_REQUEST, (model, f.name)
    body = {"prompt": "x", "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 3, "stop": "x",
            "stop_token_ids": [2], "ignore_eos": True, "logprobs": 2, "min_p": 0.1, "presence_penalty": 0.5,
            "frequency_penalty": 0.5, "repetition_penalty": 1.2, "min_tokens": 3, "include_stop_str_in_output": True,
            "logit_bias": {"1": 2.0}, "allowed_token_ids": [1, 2], "structured_outputs": {"regex": "a+"}}
    got = sampling_params(CompletionRequest.model_validate(body), 17)
    want = {k: v for k, v in OTHER.items() if k not in NOT_FROM_REQUEST}
    assert {k: getattr(got, k) for k in want} == want and got.max_tokens == 17
    assert sampling_params(CompletionRequest.model_validate({"prompt": "x"}), 5) == SamplingParams(max_tokens=5)
    chat = sampling_params(ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 3}), 4)
    assert chat.logprobs == 3
