"""The output layer's text: incremental detokenization and stop strings.

``IncrementalDetokenizer`` turns a growing list of output token ids into text at a cost linear in
the output, as vLLM's detokenizer does. Each new token decodes a short window that starts at the
last character boundary (the "prefix" and "read" offsets); the window's new text is appended once
it no longer ends in an incomplete UTF-8 character (U+FFFD). Stop strings are searched only in
the new text plus the ``longest stop - 1`` characters before it, so a stop string split across
tokens, or across engine steps, is found at the token that completes it.

The engine knows nothing of text: it calls ``push`` as its per-sequence stop hook
(``Sequence.stop_hook``) and ends the sequence with reason "stop" after the token ``push``
names. ``text`` is the output cut at the stop string (``cut_at_stop``), as ``LLM.generate``
returns it; ``delta`` gives streaming increments whose concatenation is ``text``.
"""
from __future__ import annotations

from typing import Callable, Sequence


def cut_at_stop(text: str, stop: Sequence[str], include: bool = False) -> str:
    """The output text: cut at each stop string in turn (before it, or after it with ``include``)."""
    for s in stop:
        i = text.find(s)
        if i >= 0:
            text = text[:i + len(s) if include else i]
    return text


class IncrementalDetokenizer:
    """Text of one output. ``decode(ids) -> str`` is the tokenizer's decode (special tokens
    skipped); ``stop``: strings that end the output; ``include_stop``: keep the stop string."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = (), include_stop: bool = False):
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.decode = decode
        self.stop = list(stop)
        self.include_stop = include_stop
        self.ids: list[int] = []
        self._raw = ""              # decoded text of ids[:read]
        self._prefix = 0            # window start: a character boundary before ``read``
        self._read = 0              # tokens whose text is in ``_raw``
        self._checked = 0           # characters of ``_raw`` already searched for stop strings
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._final: str | None = None
        self.stopped = False
        self.sent = 0               # characters handed out by ``delta``

    def push(self, new_ids: Sequence[int]) -> int | None:
        """Append ``new_ids`` one by one. Returns k when the k-th of them completes a stop string
        (the rest are not taken), else None."""
        if self.stopped or self._final is not None:
            raise RuntimeError("the output already ended")
        for k, tok in enumerate(new_ids, start=1):
            self.ids.append(tok)
            if self._advance() and self.stop and self._hit_stop():
                self.stopped = True
                self._final = cut_at_stop(self._raw, self.stop, self.include_stop)
                return k
        return None

    def finish(self) -> str:
        """End the output: decode what is left (an incomplete character as U+FFFD, as a full
        decode gives it) and cut at the stop strings. Returns ``text``."""
        if self._final is None:
            if self._read < len(self.ids):
                self._raw += self._window_text(len(self.ids))
                self._read = len(self.ids)
            self._final = cut_at_stop(self._raw, self.stop, self.include_stop)
        return self._final

    @property
    def text(self) -> str:
        """The text so far (cut at the stop string once one was hit or the output finished)."""
        return self._final if self._final is not None else self._raw

    def delta(self) -> str:
        """New text that can no longer change: held back while it could be the start of a stop
        string (until the output ends). The concatenated deltas equal the final ``text``."""
        text = self.text
        safe = len(text)
        if self._final is None and self.stop:
            hold = 0
            for s in self.stop:
                hold = next((n for n in range(min(len(s) - 1, safe), hold, -1) if text.endswith(s[:n])), hold)
            safe -= hold
        if safe <= self.sent:
            return ""
        out, self.sent = text[self.sent:safe], safe
        return out

    # -- internals -------------------------------------------------------------------------
    def _window_text(self, end: int) -> str:
        """Text that ids[read:end] add after ids[prefix:read]."""
        before = self.decode(self.ids[self._prefix:self._read]) if self._read > self._prefix else ""
        return self.decode(self.ids[self._prefix:end])[len(before):]

    def _advance(self) -> bool:
        """Decode the window; True when new complete text was appended."""
        new = self._window_text(len(self.ids))
        if not new or new.endswith("\ufffd"):
            return False
        self._raw += new
        self._prefix, self._read = self._read, len(self.ids)
        return True

    def _hit_stop(self) -> bool:
        start = max(0, self._checked - self._hold)
        window = self._raw[start:]
        self._checked = len(self._raw)
        return any(s in window for s in self.stop)
