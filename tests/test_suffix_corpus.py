"""Suffix corpora (``verispec.drafting.suffix_corpus``): the target's own answers preloaded into
suffix decoding's global tree.

1. The file: answers round-trip; a missing, corrupt or inconsistent file and another vocabulary's
   corpus are ``SpecConfigError``s that say what is wrong; the config key takes "auto", null or a
   path and nothing else; "auto" finds ``<root>/<model>-suffix-corpus`` and is silent without one.
2. The tree: a preloaded answer is drafted for a fresh request whose context reaches it; the cap
   keeps the last answers, and they are the first evicted.
3. The engine (SmolLM2-135M): with a corpus of an answer the target wrote earlier, a fresh
   ``LLM``'s first request drafts that answer (far more tokens per step than without the corpus)
   and its greedy output is vanilla's, for ``suffix`` and ``hybrid``.
"""
from __future__ import annotations

import pytest

from helpers import assert_same_or_tie
from verispec import LLM, SamplingParams
from verispec.drafting.spec_config import SpecConfigError, SpeculativeConfig
from verispec.drafting.suffix_corpus import (CORPUS_FILE, answer_spans, load_corpus, resolve_corpus, save_corpus,
                                             shipped_corpus)

arctic = pytest.importorskip("arctic_inference.suffix_decoding")
GREEDY = SamplingParams(temperature=0, max_tokens=48)


# ----------------------------------------------------------------------------- 1. the file
def test_answers_round_trip_through_a_folder_and_a_file(tmp_path):
    answers = [[5, 6, 7], [8], [9, 10, 11, 12]]
    info = save_corpus(answers + [[]], tmp_path / "c", model="m", vocab_size=16, info={"data": "x"})
    assert info["answers"] == 3 and info["tokens"] == 8 and info["data"] == "x"
    assert (tmp_path / "c" / CORPUS_FILE).is_file()
    assert load_corpus(tmp_path / "c", 16) == answers
    save_corpus(answers, tmp_path / "one.safetensors", model="m", vocab_size=16)
    assert load_corpus(tmp_path / "one.safetensors") == answers
    with pytest.raises(ValueError, match="outside the vocabulary of 16"):
        save_corpus([[3, 16]], tmp_path / "bad", model="m", vocab_size=16)
    with pytest.raises(ValueError, match="at least one"):
        save_corpus([[]], tmp_path / "empty", model="m", vocab_size=16)


def test_answer_spans_are_the_runs_under_the_loss_mask():
    assert answer_spans([1, 2, 3, 4, 5, 6, 7], [0, 1, 1, 0, 0, 1, 1]) == [[2, 3], [6, 7]]
    assert answer_spans([1, 2], [0, 0]) == []


def test_bad_corpus_files_are_clear_errors(tmp_path):
    from safetensors.torch import save_file
    import torch
    with pytest.raises(SpecConfigError, match="no such file.*suffix-corpus"):
        load_corpus(tmp_path / "nothing")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00\x01 not a safetensors file")
    with pytest.raises(SpecConfigError, match="not a readable corpus file"):
        load_corpus(tmp_path / "junk.safetensors")
    save_file({"tokens": torch.arange(5, dtype=torch.int32), "offsets": torch.tensor([0, 3, 9])},
              str(tmp_path / "cut.safetensors"))
    with pytest.raises(SpecConfigError, match="'offsets' do not cut"):
        load_corpus(tmp_path / "cut.safetensors")
    save_file({"tokens": torch.arange(5, dtype=torch.int32)}, str(tmp_path / "half.safetensors"))
    with pytest.raises(SpecConfigError, match="not a readable corpus file"):
        load_corpus(tmp_path / "half.safetensors")
    save_corpus([[1, 40000]], tmp_path / "big", model="qwen", vocab_size=151936)
    with pytest.raises(SpecConfigError, match="vocabulary of 151936 .*target has 49152"):
        load_corpus(tmp_path / "big", 49152)


@pytest.mark.parametrize("value", ["", 3, ["a"], True])
def test_config_key_takes_auto_null_or_a_path(value):
    assert SpeculativeConfig.from_dict({"method": "suffix"}).suffix_decoding_corpus is None      # off by default
    assert SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_corpus": "auto"}).suffix_decoding_corpus == "auto"
    hyb = SpeculativeConfig.from_dict({"method": "hybrid", "suffix_decoding_corpus": "/x"})
    assert hyb.suffix_config().suffix_decoding_corpus == "/x"
    for method in ("suffix", "hybrid"):
        with pytest.raises(SpecConfigError, match="'suffix_decoding_corpus'"):
            SpeculativeConfig.from_dict({"method": method, "suffix_decoding_corpus": value})


def test_auto_finds_the_shipped_corpus_of_the_model(tmp_path, monkeypatch):
    class Target:
        name = "tiny-model"

        class config:
            vocab_size = 32
    monkeypatch.setenv("VERISPEC_CHECKPOINTS", str(tmp_path))
    assert shipped_corpus("tiny-model") is None and resolve_corpus("auto", Target) is None
    save_corpus([[1, 2, 3]], tmp_path / "tiny-model-suffix-corpus", model="tiny-model", vocab_size=32)
    assert shipped_corpus("/some/dir/tiny-model.gguf") == tmp_path / "tiny-model-suffix-corpus" / CORPUS_FILE
    assert resolve_corpus("auto", Target) == [[1, 2, 3]]
    assert resolve_corpus(None, Target) is None
    Target.config.vocab_size = 2
    with pytest.raises(SpecConfigError, match="target has 2"):
        resolve_corpus("auto", Target)


def test_cli_writes_the_assistant_turns_of_regenerated_conversations(tmp_path, capsys):
    """``verispec data suffix-corpus``: each assistant turn of the JSONL, chat-templated and
    tokenized with the target's tokenizer, is one answer; an input without any is exit code 2."""
    import json

    from verispec.cli import main
    from verispec.models.loading import load_tokenizer
    from verispec.models.sources import resolve_model
    conv = lambda i, *turns: {"id": f"c{i}", "conversations": [  # noqa: E731
        {"role": r, "content": t} for r, t in zip(["user", "assistant"] * 2, turns)]}
    data = tmp_path / "regen.jsonl"
    data.write_text("\n".join(json.dumps(c) for c in (
        conv(0, "Name a colour.", "Blue is a colour."),
        conv(1, "Count to three.", "One, two, three.", "And back?", "Three, two, one."),
        {"id": "c2", "skipped": "prompt over 384 tokens"})) + "\n")
    assert main(["data", "suffix-corpus", "--model", "smollm2-135m", "--data", str(data),
                 "--out", str(tmp_path / "c")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    src = resolve_model("smollm2-135m")
    tok = load_tokenizer(src.path, src.format)
    answers = load_corpus(tmp_path / "c", 49152)
    assert summary["answers"] == len(answers) == 3 and summary["model"] == "smollm2-135m"
    for got, text in zip(answers, ["Blue is a colour.", "One, two, three.", "Three, two, one."]):
        assert tok.decode(got).startswith(text)
    (tmp_path / "none.jsonl").write_text(json.dumps({"id": "x", "skipped": "prompt over 384 tokens"}) + "\n")
    assert main(["data", "suffix-corpus", "--model", "smollm2-135m", "--data", str(tmp_path / "none.jsonl"),
                 "--out", str(tmp_path / "d")]) == 2


# ----------------------------------------------------------------------------- 2. the tree
def test_a_preloaded_answer_is_drafted_for_a_fresh_request():
    from verispec.drafting.suffix import SuffixCache
    answer = [11, 12, 13, 14, 15, 16]
    plain, loaded = SuffixCache(8, 100), SuffixCache(8, 100)
    assert loaded.preload([[1, 2], answer]) == 2 and loaded.cached_requests == 2
    for cache, want in ((plain, []), (loaded, [14, 15, 16])):
        rid = cache.start([7, 7, 11, 12, 13])
        assert cache.speculate(rid, [7, 7, 11, 12, 13], max_nodes=3).tokens == want
    capped = SuffixCache(8, 3)          # keeps the last 3; a new request then evicts the oldest of them
    assert capped.preload([answer, [1, 2, 3], [4, 5, 6], [20, 21, 22]]) == 3
    rid = capped.start([9])
    for ctx, want in (([9, 11, 12, 13], []), ([9, 1, 2], []), ([9, 4, 5], [6]), ([9, 20, 21], [22])):
        assert capped.speculate(rid, ctx, max_nodes=3).tokens == want, ctx
    assert SuffixCache(8, 0).preload([answer]) == 0


# ----------------------------------------------------------------------------- 3. the engine
@pytest.mark.parametrize("method", ["suffix", "hybrid"])
def test_a_fresh_llm_drafts_the_corpus_and_stays_lossless(target, chat_prompts, tmp_path, method):
    seen, new = chat_prompts[8], chat_prompts[0]
    plain = LLM(loaded=target, max_num_seqs=1)
    earlier = plain.generate([{"prompt_token_ids": seen}], GREEDY)[0].token_ids
    want = plain.generate([{"prompt_token_ids": new}], GREEDY)[0].token_ids
    save_corpus([earlier], tmp_path / "corpus", model="smollm2-135m", vocab_size=target.config.vocab_size)
    runs = {}
    for corpus in (None, str(tmp_path / "corpus")):
        llm = LLM(loaded=target, max_num_seqs=1,
                  speculative_config={"method": method, "suffix_decoding_corpus": corpus})
        again, other = llm.generate([{"prompt_token_ids": seen}], GREEDY)[0], \
            llm.generate([{"prompt_token_ids": new}], GREEDY)[0]
        assert again.token_ids == earlier
        assert_same_or_tie(target.model, new, other.token_ids, want, f"{method}, corpus {corpus}")
        runs[corpus] = again.metrics.mean_acceptance_length
    assert runs[str(tmp_path / "corpus")] > runs[None] + 1.0, runs
