"""OpenAI's two ``logprobs`` shapes, built from the engine's ``TokenLogprob`` entries.

- Completions (``logprobs: k``): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``,
  ``top_logprobs`` a list of ``{token text: logprob}`` with the ``k`` best and the emitted token
  (so up to ``k + 1`` keys, as OpenAI documents; where two tokens have the same text the more
  likely one is kept). A token that holds only part of a UTF-8 character is named
  ``bytes:\\xNN...`` (OpenAI's spelling) instead of a replacement character. ``text_offset``: the
  character offset in the completion text where the token starts (a token that completes a
  character started by an earlier one points at that character).
- Chat (``logprobs: true, top_logprobs: k``): ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}]}]}`` with ``k`` best entries.
Every output token has an entry, also those after which a stop string cut the text (as vLLM).
A token's text is its own decoding; ``bytes`` are its exact bytes where the tokenizer is
byte-level (a token may hold part of a UTF-8 character) or a ``<0xNN>`` byte-fallback token, and
the UTF-8 of its text otherwise. Streaming sends each chunk the entries of the tokens it covers.
"""
from __future__ import annotations

import codecs
import re
import threading
from typing import Callable

from ..core.logprobs import TokenLogprob

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode   # GPT-2's byte <-> char map
    return {c: b for b, c in bytes_to_unicode().items()}


class TokenTexts:
    """Text and bytes of single token ids, cached; thread-safe through the tokenizer lock."""

    def __init__(self, tokenizer, lock: threading.Lock):
        self.tok, self.lock = tokenizer, lock
        self.cache: dict[int, tuple[str, list[int]]] = {}
        self.byte_map = _byte_decoder()

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self.cache.get(token_id)
        if hit is None:
            with self.lock:
                raw = self.tok.convert_ids_to_tokens(token_id)
                text = self.tok.decode([token_id], skip_special_tokens=False)
            hit = self.cache[token_id] = (text, self._bytes(raw, text))
        return hit

    def _bytes(self, raw: str | None, text: str) -> list[int]:
        if raw:
            m = _BYTE_TOKEN.match(raw)
            if m:
                return [int(m.group(1), 16)]
            if "\ufffd" in text and all(c in self.byte_map for c in raw):
                return [self.byte_map[c] for c in raw]
        return list(text.encode("utf-8"))


class LogprobFormatter:
    """Formats successive groups of entries of one choice (keeps the completion text offset)."""

    def __init__(self, chat: bool, texts: Callable[[int], tuple[str, list[int]]]):
        self.chat, self.texts = chat, texts
        self.offset = 0                                     # characters completed so far
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def format(self, entries: list[TokenLogprob]) -> dict:
        return self._chat(entries) if self.chat else self._completion(entries)

    def _chat(self, entries: list[TokenLogprob]) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            text, raw = self.texts(token_id)
            return {"token": text, "logprob": logprob, "bytes": raw}
        return {"content": [dict(item(e.token_id, e.logprob), top_logprobs=[item(t, lp) for t, lp in e.top])
                            for e in entries]}

    def _name(self, token_id: int) -> str:
        text, raw = self.texts(token_id)
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw) if "\ufffd" in text else text

    def _completion(self, entries: list[TokenLogprob]) -> dict:
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            top: dict[str, float] | None = {}
            for t, lp in e.top:                             # best first: keep the first of a name
                top.setdefault(self._name(t), lp)
            name = self._name(e.token_id)
            if e.logprob is None:                           # an echoed prompt's first token
                top = None
            else:
                top.setdefault(name, e.logprob)
            out["tokens"].append(name)
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(self.utf8.decode(bytes(self.texts(e.token_id)[1])))
        return out
