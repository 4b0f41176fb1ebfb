"""The output layer's incremental detokenizer: text equal to a full decode, stop strings split
across tokens and across engine steps, and work that grows linearly with the output."""
from __future__ import annotations

import pytest

from verispec import LLM, SamplingParams
from verispec.core.detokenizer import IncrementalDetokenizer, cut_at_stop

TEXT = ("Hello world! Ünïcödé, emoji 🙂🚀 and 中文字符, code `x = f(y) -> z`, newlines\n\n"
        "and tabs\tand spaces   here. Done.")


@pytest.fixture(scope="module")
def tok(target):
    return target.tokenizer


def _decode(tok):
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


def test_incremental_text_equals_full_decode(tok):
    """Token by token and in uneven chunks, the text and the concatenated deltas equal one full
    decode, also through multi-byte characters split over several byte-level tokens."""
    ids = tok(TEXT, add_special_tokens=False).input_ids
    assert any("\ufffd" in tok.decode(ids[:i]) for i in range(1, len(ids)))   # some prefix splits a character
    for chunk in (1, 2, 3, 7):
        d = IncrementalDetokenizer(_decode(tok))
        deltas = []
        for i in range(0, len(ids), chunk):
            assert d.push(ids[i:i + chunk]) is None
            deltas.append(d.delta())
            assert "\ufffd" not in d.text
        assert d.finish() == tok.decode(ids) == TEXT
        deltas.append(d.delta())
        assert "".join(deltas) == TEXT


def test_stop_string_split_across_tokens_and_steps(tok):
    ids = tok(TEXT, add_special_tokens=False).input_ids
    stop = "emoji 🙂"                                       # spans several tokens, ends mid-character
    want_len = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))
    for chunk in (1, 4, len(ids)):                          # one token per step .. everything in one step
        d = IncrementalDetokenizer(_decode(tok), [stop, "never there"])
        taken, streamed = 0, ""
        for i in range(0, len(ids), chunk):
            k = d.push(ids[i:i + chunk])
            streamed += d.delta()
            if k is not None:
                taken = i + k
                break
        assert taken == want_len, chunk                     # the token that completes the stop string
        assert d.stopped and d.text == cut_at_stop(tok.decode(ids[:taken]), [stop]) == TEXT[:TEXT.index(stop)]
        assert streamed == d.text                           # nothing of the stop string was streamed
    inc = IncrementalDetokenizer(_decode(tok), [stop], include_stop=True)
    inc.push(ids)
    assert inc.text == TEXT[:TEXT.index(stop) + len(stop)]
    with pytest.raises(RuntimeError, match="ended"):
        inc.push(ids[:1])


def test_checking_work_grows_linearly(tok):
    """4,000 output tokens, one per step, with stop strings that never match: the characters
    decoded and searched per token stay bounded (a full decode per token would make the total
    quadratic: about 8 million tokens decoded here)."""
    ids = tok(TEXT, add_special_tokens=False).input_ids
    out = (ids * (4000 // len(ids) + 1))[:4000]
    for n in (1000, 4000):
        decoded = [0]

        def counting(x, _d=_decode(tok)):
            decoded[0] += len(x)
            return _d(x)
        d = IncrementalDetokenizer(counting, ["<never>", "also never"])
        for t in out[:n]:
            assert d.push([t]) is None
        assert d.finish() == tok.decode(out[:n])
        assert decoded[0] <= 12 * n, (n, decoded[0])         # a few tokens per window, two windows a token


def test_engine_stops_at_the_string_not_the_step(target):
    """LLM.generate: with speculation emitting several tokens per step, the output ends at the
    token that completes the stop string; the text is cut before it."""
    llm = LLM(loaded=target, speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    free = llm.generate("Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12", SamplingParams(temperature=0, max_tokens=40))[0]
    text = free.text
    assert len(text) > 12
    stop = text[len(text) // 2:len(text) // 2 + 3]
    out = llm.generate("Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12",
                       SamplingParams(temperature=0, max_tokens=40, stop=[stop]))[0]
    want_k = next(k for k in range(1, len(free.token_ids) + 1) if stop in llm.tokenizer.decode(free.token_ids[:k]))
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:want_k]
    assert out.text == text[:text.index(stop)]


def test_empty_stop_string_is_refused(tok):
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(_decode(tok), [""])


def test_deltas_hold_back_partial_characters_and_stop_prefixes():
    data = "añb→c STOP".encode()
    tokens = [bytes([b]) for b in data]                    # one byte per token

    def decode(ids):
        return b"".join(tokens[i] for i in ids).decode("utf-8", errors="replace")
    d = IncrementalDetokenizer(decode, ["STOP"])
    deltas, hit = [], None
    for i in range(len(tokens)):
        hit = d.push([i])
        deltas.append(d.delta())
        if hit is not None:
            break
    assert hit == 1 and i == len(tokens) - 1
    assert "".join(deltas) == "añb→c " and all("\ufffd" not in x for x in deltas)
    assert not any(x.endswith(("S", "ST", "STO")) for x in deltas)
