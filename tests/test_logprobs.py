"""Logprobs of output tokens: the target's raw distribution at each emitting position, equal for
vanilla and speculative decoding, one entry per output token."""
from __future__ import annotations

import json
import math

import pytest
import torch

from verispec import LLM, SamplingParams
from verispec.core.logprobs import token_logprobs

SELF_DRAFT = {"method": "draft_model", "model": "self", "self_draft_layers": 6, "num_speculative_tokens": 3}


def test_token_logprobs_match_log_softmax_ranks_and_top():
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    logits[2, 7] = logits[2, 9] = 100.0                 # a tie at the top: lower id first
    toks = [int(logits[0].argmax()), int(logits[1].argsort(descending=True)[4]), 9]
    out = token_logprobs(logits, toks, 3)
    ref = torch.log_softmax(logits, -1)
    for n, e in enumerate(out):
        assert e.token_id == toks[n]
        assert e.logprob == pytest.approx(float(ref[n, toks[n]]), abs=1e-6)
        assert [t for t, _ in e.top] == ref[n].sort(descending=True, stable=True).indices[:3].tolist()
        assert all(a[1] >= b[1] for a, b in zip(e.top, e.top[1:]))
    assert [e.rank for e in out] == [1, 5, 1]
    assert out[2].top[0][0] == 7 and out[2].top[1][0] == 9
    assert token_logprobs(logits, toks, 0)[1].top == ()
    with pytest.raises(ValueError, match="do not match"):
        token_logprobs(logits, toks[:2], 1)
    with pytest.raises(ValueError, match=r"\[0, 20\]"):
        token_logprobs(logits, toks, 21)


@pytest.mark.parametrize("bad", [-1, 21, 2.0, True, "3"])
def test_sampling_params_reject_bad_logprobs(bad):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=bad)


SELF_TREE = {"method": "draft_model", "model": "self", "self_draft_layers": 4,
             "tree": [[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]]}      # accepted paths leave the first branch


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 4}, SELF_DRAFT, SELF_TREE],
                         ids=["ngram", "self_draft", "self_draft_tree"])
def test_speculative_logprobs_equal_vanilla_logprobs(target, chat_prompts, spec):
    vanilla = LLM(loaded=target, max_num_seqs=2)
    fast = LLM(loaded=target, max_num_seqs=2, speculative_config=spec)
    prompts = [{"prompt_token_ids": ids} for ids in (chat_prompts[8], chat_prompts[10])]   # coding, extraction
    sp = SamplingParams(temperature=0.0, max_tokens=40, logprobs=3)
    want, got = vanilla.generate(prompts, sp), fast.generate(prompts, sp)
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0, "the drafter never helped: nothing tested"
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        assert len(g.logprobs) == len(w.logprobs) == len(w.token_ids)
        for a, b, tok in zip(g.logprobs, w.logprobs, w.token_ids):
            assert a.token_id == b.token_id == tok and a.rank == 1 == b.rank     # greedy: the argmax
            assert a.logprob == pytest.approx(b.logprob, abs=2e-3)
            assert [t for t, _ in a.top] == [t for t, _ in b.top] and a.top[0][0] == tok


def test_logprobs_are_the_raw_distribution_and_follow_stops(target, llm):
    """Sampled at temperature 0.5 with top-k 5: the entries are still the raw (temperature-1)
    log-probabilities of a plain forward, and a stop token ends them with the text."""
    prompt = "The three primary colours are"
    ids = llm.encode_prompt(prompt)[1]
    out = llm.generate(prompt, SamplingParams(temperature=0.5, top_k=5, max_tokens=12, seed=3, logprobs=5))[0]
    assert len(out.logprobs) == len(out.token_ids) > 0
    with torch.no_grad():
        full = ids + out.token_ids
        logits = target.model(torch.tensor([full]), torch.arange(len(full))[None]).logits[0]
    ref = torch.log_softmax(logits.float(), -1)
    for i, e in enumerate(out.logprobs):
        assert e.logprob == pytest.approx(float(ref[len(ids) - 1 + i, e.token_id]), abs=2e-3)
        assert e.rank <= 5                                   # top-k 5 sampling never leaves the top 5
        assert math.isclose(sum(math.exp(lp) for _, lp in e.top), float(ref[len(ids) - 1 + i].exp().topk(5).values.sum()),
                            abs_tol=2e-3)
    stop_tok = out.token_ids[3]
    cut = llm.generate(prompt, SamplingParams(temperature=0.5, top_k=5, max_tokens=12, seed=3, logprobs=0,
                                              stop_token_ids=[stop_tok]))[0]
    assert cut.token_ids == out.token_ids[:out.token_ids.index(stop_tok)]
    assert [e.token_id for e in cut.logprobs] == cut.token_ids and all(e.top == () for e in cut.logprobs)
    assert llm.generate(prompt, SamplingParams(max_tokens=4))[0].logprobs is None


@pytest.mark.parametrize("chunk", [512, 7])
def test_prompt_logprobs_equal_a_full_forward(target, monkeypatch, chunk):
    """Entries for prompt tokens 1..n-1 from the prefill (also across prefill chunks), in a batch
    with a request that does not ask for them."""
    import verispec.core.engine as eng
    monkeypatch.setattr(eng, "PREFILL_CHUNK", chunk)
    llm = LLM(loaded=target, max_num_seqs=2, speculative_config={"method": "ngram"})
    ids = llm.encode_prompt("Speculative decoding drafts tokens cheaply and verifies them at once.")[1]
    outs = llm.generate([{"prompt_token_ids": ids}, {"prompt_token_ids": ids[:5]}],
                        [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2), SamplingParams(max_tokens=3)])
    assert outs[1].prompt_logprobs is None
    got = outs[0].prompt_logprobs
    assert [e.token_id for e in got] == ids[1:]
    with torch.no_grad():
        ref = torch.log_softmax(target.model(torch.tensor([ids]), torch.arange(len(ids))[None]).logits[0].float(), -1)
    for i, e in enumerate(got):
        assert e.logprob == pytest.approx(float(ref[i, ids[i + 1]]), abs=1e-3)
        assert [t for t, _ in e.top] == ref[i].sort(descending=True, stable=True).indices[:2].tolist()
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


def test_n_outputs_per_prompt_like_vllm(target):
    """``SamplingParams(n=3)``: ``outputs`` holds three outputs, output j sampled with seed + j
    (so it equals a one-output run with that seed); output 0 is also the flat fields."""
    llm = LLM(loaded=target, max_num_seqs=4, speculative_config={"method": "ngram"})
    sp = SamplingParams(temperature=1.0, max_tokens=10, seed=7, n=3, logprobs=1)
    out, other = llm.generate(["Once upon a time", "The sea is"], sp)
    assert [o.index for o in out.outputs] == [0, 1, 2] and len(other.outputs) == 3
    assert out.text == out.outputs[0].text and out.token_ids == out.outputs[0].token_ids
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3
    solo = llm.generate("Once upon a time", SamplingParams(temperature=1.0, max_tokens=10, seed=9, logprobs=1))[0]
    assert out.outputs[2].token_ids == solo.token_ids and out.outputs[2].text == solo.text
    assert [e.token_id for e in out.outputs[2].logprobs] == solo.token_ids
    greedy = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=10, n=2))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)


def test_cli_generate_json_with_logprobs_and_penalties(capsys, dense_llm):
    from verispec.cli import main
    argv = ["generate", "--prompt", "The sky is", "--max-tokens", "6", "--json", "--logprobs", "2",
            "--repetition-penalty", "1.2", "--speculative-config", '{"method": "ngram"}',
            "--weights", "dense"]                  # the reference is dense (the CLI's default is auto)
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    want = dense_llm.generate("The sky is", SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.2,
                                                       logprobs=2))[0]
    assert out["token_ids"] == want.token_ids
    assert [e["token_id"] for e in out["logprobs"]] == want.token_ids and all(len(e["top"]) == 2 for e in out["logprobs"])
    assert main(["generate", "--prompt", "x", "--min-p", "3"]) == 2
    assert "min_p must be in [0, 1]" in capsys.readouterr().err
