"""Foundation: our transformer vs HF transformers, cache consistency, greedy vs HF, ragged batch."""
from __future__ import annotations

import pytest
import torch

from helpers import assert_same_or_tie, dense_module_fixtures
from verispec import LLM, SamplingParams
from verispec.models.kv_cache import KVCache


target, llm = dense_module_fixtures()   # compared with HF transformers


@pytest.fixture(scope="module")
def hf_model(target):
    from transformers import AutoModelForCausalLM
    p = target.path
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def long_prompts(target, spec_bench):
    tok = target.tokenizer
    texts = [q["turns"][0] for q in spec_bench if q["category"] in ("summarization", "rag")][:3]
    out = [tok(t).input_ids for t in texts]
    assert all(len(ids) >= 100 for ids in out)
    return out


def test_logits_match_hf(target, hf_model, long_prompts):
    for ids in long_prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            ours = target.model(x, torch.arange(len(ids))[None]).logits
            ref = hf_model(x).logits
        assert (ours - ref).abs().max().item() <= 1e-3


def test_cached_decoding_equals_full_forward(target, long_prompts):
    ids = long_prompts[0][:60]
    m = target.model
    with torch.no_grad():
        full = m(torch.tensor([ids]), torch.arange(len(ids))[None]).logits[0]
        cache = KVCache.for_model(target.config, 1, 128)
        out = m(torch.tensor([ids[:40]]), torch.arange(40)[None], cache)
        cache.advance(torch.tensor([0]), 40)
        steps = [out.logits[0]]
        for i in range(40, 60):
            o = m(torch.tensor([[ids[i]]]), torch.tensor([[i]]), cache)
            cache.advance(torch.tensor([0]), 1)
            steps.append(o.logits[0])
    assert (torch.cat(steps) - full).abs().max().item() < 1e-4


def test_greedy_matches_hf_generate(target, hf_model, chat_prompts):
    prompts = chat_prompts[::3][:6]
    llm = LLM(loaded=target, max_num_seqs=6)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=48))
    eos = set(llm.eos_token_ids)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([p]), max_new_tokens=48, do_sample=False,
                                    attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
        ref = ref[:next((i for i, t in enumerate(ref) if t in eos), len(ref))]
        assert_same_or_tie(target.model, p, o.token_ids, ref, "verispec vs HF generate")


def test_ragged_batch_equals_each_alone(target, chat_prompts):
    prompts = [chat_prompts[i] for i in (0, 5, 9, 14)]
    assert len({len(p) for p in prompts}) > 1
    llm = LLM(loaded=target, max_num_seqs=4)
    sp = SamplingParams(temperature=0, max_tokens=24)
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    for p, b in zip(prompts, batch):
        alone = llm.generate([{"prompt_token_ids": p}], sp)[0]
        assert_same_or_tie(target.model, p, b.token_ids, alone.token_ids, "batch vs alone")


def test_sampling_is_seeded_and_stream_matches(target):
    llm = LLM(loaded=target)
    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=12, seed=7, ignore_eos=True)
    streamed = []
    a = llm.generate(["Once upon a time"], sp, on_tokens=lambda i, ids: streamed.extend(ids))[0]
    b = llm.generate(["Once upon a time"], sp)[0]
    assert a.token_ids == b.token_ids == streamed and len(a.token_ids) == 12
    assert a.finish_reason == "length" and a.metrics.tokens_per_second > 0


def test_stop_string_cuts_text(target):
    llm = LLM(loaded=target)
    full = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=20))[0]
    word = full.text.split()[1]
    cut = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=20, stop=[word]))[0]
    assert cut.finish_reason == "stop" and word not in cut.text and full.text.startswith(cut.text)


def test_chat_applies_template(target):
    llm = LLM(loaded=target)
    out = llm.chat([[{"role": "user", "content": "Say hi."}]], SamplingParams(temperature=0, max_tokens=8))[0]
    assert "<|im_start|>" in target.tokenizer.decode(out.prompt_token_ids) and out.token_ids
