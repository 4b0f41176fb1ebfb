"""``verispec data regenerate``: continuous batching gives every conversation what answering its
turns one by one with ``LLM.chat`` gives, whatever the batch; shards partition the input; bad
``--shard`` values are refused. The real SmolLM2-135M with dense fp32 weights (the ``llm``
fixture): batched fp16 kernels could round differently."""
from __future__ import annotations

import json

import pytest

from verispec import SamplingParams
from verispec.train.data import Conversation
from verispec.train.regenerate import parse_shard, regenerate, select_shard, shard_output

MAX_TOKENS = 12


def _conversations() -> list[Conversation]:
    """Two-turn and one-turn conversations; one with a system message, one whose second user turn
    is too long for the prompt budget (left out, the third turn still answered)."""
    u = lambda t: {"role": "user", "content": t}           # noqa: E731
    a = {"role": "assistant", "content": "(dataset answer, replaced)"}
    return [Conversation("two", (u("Name a prime number."), a, u("And another one?"))),
            Conversation("sys", ({"role": "system", "content": "Answer in French."}, u("Say hello."))),
            Conversation("gap", (u("Count to three."), a, u("word " * 150), a, u("Now to four."))),
            Conversation("one", (u("What is the capital of Italy?"),)),
            Conversation("three", (u("Say yes."), a, u("Say no."), a, u("Say maybe.")))]


def _reference(llm, conv: Conversation, max_turns: int, max_prompt_tokens: int) -> list[dict]:
    """Today's semantics written plainly: each user turn answered alone with ``LLM.chat``."""
    history = [m for m in conv.messages if m["role"] == "system"]
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    for user in conv.user_turns()[:max_turns]:
        msgs = history + [{"role": "user", "content": user}]
        n = len(llm.tokenizer(llm.apply_chat_template(msgs), add_special_tokens=False).input_ids)
        if n <= max_prompt_tokens:
            history = msgs + [{"role": "assistant", "content": llm.chat(msgs, sp)[0].text}]
    return history


def _regen(llm, tmp_path, name: str, batch: int) -> dict[str, dict]:
    out = tmp_path / f"{name}.jsonl"
    regenerate(llm, _conversations(), out, max_tokens=MAX_TOKENS, max_turns=3, max_prompt_tokens=128,
               batch_size=batch, progress=False)
    return {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}


def test_answers_do_not_depend_on_the_batch_and_match_turn_by_turn_chat(llm, tmp_path):
    b1, b4 = _regen(llm, tmp_path, "b1", 1), _regen(llm, tmp_path, "b4", 4)
    assert set(b1) == set(b4) == {c.id for c in _conversations()}
    for cid in b1:
        assert b1[cid] == b4[cid], cid
    for conv in _conversations():
        assert b4[conv.id]["conversations"] == _reference(llm, conv, 3, 128), conv.id
    gap = b4["gap"]["conversations"]
    assert [m["role"] for m in gap] == ["user", "assistant"] * 2 and gap[2]["content"] == "Now to four."
    assert len(b4["gap"]["meta"]["finish_reasons"]) == 2
    assert b4["sys"]["conversations"][0] == {"role": "system", "content": "Answer in French."}


def test_shards_partition_the_input_and_name_their_files():
    convs = [Conversation(f"c{i}", ({"role": "user", "content": str(i)},)) for i in range(10)]
    parts = [select_shard(convs, i, 3) for i in range(3)]
    ids = [c.id for p in parts for c in p]
    assert sorted(ids) == sorted(c.id for c in convs) and len(ids) == len(set(ids))
    assert [c.id for c in parts[1]] == ["c1", "c4", "c7"]
    assert shard_output("runs/regen.jsonl", 0, 1).name == "regen.jsonl"
    assert shard_output("runs/regen.jsonl", 1, 2).name == "regen.shard1of2.jsonl"
    assert parse_shard("1/2") == (1, 2) and parse_shard("0/1") == (0, 1)


@pytest.mark.parametrize("bad", ["2/2", "-1/2", "1/0", "1", "a/b", "1/2/3", ""])
def test_bad_shard_is_refused_before_any_work(bad, tmp_path):
    from verispec.cli import main
    with pytest.raises(ValueError, match="i/n"):
        parse_shard(bad)
    with pytest.raises(SystemExit, match="--shard wants i/n"):
        main(["data", "regenerate", "--output", str(tmp_path / "x.jsonl"), f"--shard={bad}"])


def test_a_line_separator_inside_a_json_string_stays_one_record(tmp_path):
    """JSONL written with ensure_ascii=False may hold U+2028 / U+0085 inside strings; str.splitlines
    cut such records in two (7 of 5,179 regenerated conversations were dropped as 'malformed', and
    a resume would have answered them again). Both readers split on newlines only."""
    from verispec.train.data import load_conversations
    from verispec.train.regenerate import _repair_and_read_ids
    recs = [{"id": "a", "conversations": [{"from": "human", "value": "x\u2028y"}, {"from": "gpt", "value": "z\x85w"}]},
            {"id": "b", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok"}]}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs), encoding="utf-8")
    convs, report = load_conversations(path)
    assert [c.id for c in convs] == ["a", "b"] and report.kept == 2
    assert convs[0].messages[0]["content"] == "x\u2028y" and convs[0].messages[1]["content"] == "z\x85w"
    assert _repair_and_read_ids(path) == {"a", "b"}
