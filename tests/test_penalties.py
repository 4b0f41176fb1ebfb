"""Penalties (repetition, frequency, presence) and min-p: per-node target rows of a draft tree, greedy
speculation equal to greedy vanilla with the same penalties, validation. The sampled lossless
test is in test_lossless_engine.py (test_engine_is_lossless_with_penalties_and_min_p)."""
from __future__ import annotations

import pytest
import torch

from verispec import LLM, SamplingParams
from verispec.core.logits import LogitsPipeline
from verispec.core.sampling import target_probs
from verispec.core.tree import DraftTree


def apply_penalties(logits, p, prompt, output, tree=None):
    return LogitsPipeline.build(p).process(logits, prompt, output, tree)


def penalized(p) -> bool:
    return bool(LogitsPipeline.build(p).processors)


def _naive_row(logits, prompt, generated, p: SamplingParams):
    x = logits.clone()
    for t in set(prompt) | set(generated):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(generated):
        x[t] -= p.frequency_penalty * generated.count(t) + p.presence_penalty
    return x


def test_tree_rows_equal_the_penalties_of_each_root_path():
    torch.manual_seed(0)
    v = 12
    tree = DraftTree(torch.tensor([3, 5, 3, 7, 3]), torch.tensor([-1, -1, 0, 2, 1]))
    logits = torch.randn(len(tree) + 1, v) * 3
    p = SamplingParams(repetition_penalty=1.4, frequency_penalty=0.7, presence_penalty=-0.3)
    prompt, output = [1, 2, 3], [4, 4, 9]            # output ends with the root (9)
    got = apply_penalties(logits, p, prompt, output, tree)
    toks, par = tree.tokens.tolist(), tree.parents.tolist()
    for row in range(len(tree) + 1):
        path, i = [], row - 1
        while i >= 0:
            path.insert(0, toks[i])
            i = par[i]
        torch.testing.assert_close(got[row], _naive_row(logits[row], prompt, output + path, p))
    single = apply_penalties(logits[:1], p, prompt, output)
    torch.testing.assert_close(single[0], got[0])
    assert not penalized(SamplingParams()) and penalized(SamplingParams(repetition_penalty=1.1))
    with pytest.raises(ValueError, match="logit rows"):
        apply_penalties(logits[:3], p, prompt, output, tree)


def test_min_p_keeps_tokens_above_a_fraction_of_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))
    probs = target_probs(logits, SamplingParams(temperature=1.0, min_p=0.2))
    torch.testing.assert_close(probs, torch.tensor([[0.5, 0.3, 0.12, 0.0]]) / 0.92)   # 0.08 < 0.2 x 0.5


@pytest.mark.parametrize("field,bad", [("min_p", 1.5), ("min_p", -0.1), ("presence_penalty", 2.5),
                                       ("frequency_penalty", -3.0), ("repetition_penalty", 0.0)])
def test_bad_values_are_refused(field, bad):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: bad})


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 4},
                                  {"method": "draft_model", "model": "self", "self_draft_layers": 6,
                                   "tree": [[0], [1], [0, 0], [1, 0], [0, 0, 0]]}], ids=["ngram", "self_draft_tree"])
def test_greedy_with_penalties_equals_vanilla(target, chat_prompts, spec):
    """Penalties change the output (checked) and speculation reproduces it token for token."""
    prompts = [chat_prompts[10], chat_prompts[16]]            # extraction, translation
    pen = SamplingParams(temperature=0.0, max_tokens=48, repetition_penalty=1.05, frequency_penalty=0.3,
                         presence_penalty=0.2)
    vanilla = LLM(loaded=target, max_num_seqs=2)
    fast = LLM(loaded=target, max_num_seqs=2, speculative_config=spec)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    want, got = vanilla.generate(inputs, pen), fast.generate(inputs, pen)
    plain = vanilla.generate(inputs, SamplingParams(temperature=0.0, max_tokens=48))
    assert any(w.token_ids != q.token_ids for w, q in zip(want, plain)), "penalties changed nothing"
    assert sum(g.metrics.num_accepted_tokens for g in got) > 0
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 4},
                                  {"method": "draft_model", "model": "self", "self_draft_layers": 6,
                                   "tree": [[0], [1], [0, 0], [1, 0], [0, 0, 0]]}], ids=["ngram", "self_draft_tree"])
def test_greedy_min_tokens_equals_vanilla(target, llm, spec):
    """A prompt whose greedy answer ends early: with min_tokens 24 it goes on, and speculation
    reproduces the longer answer token for token (drafts of EOS are rejected where it is masked)."""
    ids = llm.tokenizer(llm.apply_chat_template([{"role": "user", "content": "Reply with one word: yes or no?"}]),
                        add_special_tokens=False).input_ids
    short = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=40))[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 24
    sp = SamplingParams(temperature=0, max_tokens=40, min_tokens=24)
    want = llm.generate({"prompt_token_ids": ids}, sp)[0]
    got = LLM(loaded=target, speculative_config=spec).generate({"prompt_token_ids": ids}, sp)[0]
    assert len(want.token_ids) >= 24 and got.token_ids == want.token_ids
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_logit_bias_steers_target_rows_and_is_checked(target, llm):
    tok = llm.encode_prompt(" banana")[1][-1]
    sp = SamplingParams(temperature=0, max_tokens=6, logit_bias={tok: 100.0})
    fast = LLM(loaded=target, speculative_config={"method": "ngram"})
    for out in (llm.generate("I like", sp)[0], fast.generate("I like", sp)[0]):
        assert out.token_ids == [tok] * 6
    logits = torch.zeros(2, 10)
    biased = apply_penalties(logits, SamplingParams(logit_bias={3: -5.0, 7: 2.5}), [], [1])
    assert biased[:, 3].tolist() == [-5.0, -5.0] and biased[:, 7].tolist() == [2.5, 2.5]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate("I like", SamplingParams(max_tokens=2, logit_bias={10**7: 1.0}))
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 500.0})


def test_allowed_token_ids_restrict_every_row(target, llm):
    allowed = llm.encode_prompt(" yes no maybe")[1][-3:]
    sp = SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=allowed)
    fast = LLM(loaded=target, speculative_config={"method": "draft_model", "model": "self", "self_draft_layers": 6})
    want, got = llm.generate("Answer:", sp)[0], fast.generate("Answer:", sp)[0]
    assert set(want.token_ids) <= set(allowed) and got.token_ids == want.token_ids
    sampled = llm.generate("Answer:", SamplingParams(temperature=1.0, max_tokens=8, seed=1, allowed_token_ids=allowed))[0]
    assert set(sampled.token_ids) <= set(allowed)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate("Answer:", SamplingParams(max_tokens=2, allowed_token_ids=[10**7]))
