"""The response cache: an LRU of finished greedy outputs, keyed by everything that decides them.

A key is ``(prompt token ids, SamplingParams.cache_key())``: every field of the params, so a new
sampling field can never be left out of it. Only greedy requests without logprobs are cached (a
sampled output is not a function of its inputs; logprobs are not stored). An entry is the output's
token ids, text, finish reason and speculative stats; a hit is replayed as one finished
``TokenEvent``.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import AsyncIterator

from ..core.params import SamplingParams
from .metrics import ServerMetrics
from .scheduler import TokenEvent


class ResponseCache:
    def __init__(self, size: int, metrics: ServerMetrics):
        self.size = size
        self.metrics = metrics
        self.entries: OrderedDict[tuple, tuple[list[int], str, str, dict | None]] = OrderedDict()

    def key(self, ids: list[int], params: SamplingParams) -> tuple | None:
        """The key of a cacheable request, or None."""
        if self.size <= 0 or not params.greedy or params.logprobs is not None or params.prompt_logprobs is not None:
            return None
        return tuple(ids), params.cache_key()

    def replay(self, key: tuple | None) -> AsyncIterator[TokenEvent] | None:
        """The cached answer's events, or None on a miss."""
        if key is None or key not in self.entries:
            return None
        self.entries.move_to_end(key)
        self.metrics.cache_hits.inc()
        ids, text, reason, stats = self.entries[key]

        async def events() -> AsyncIterator[TokenEvent]:
            yield TokenEvent(list(ids), True, reason, text=text, spec_stats=stats)
        return events()

    async def recording(self, events: AsyncIterator[TokenEvent], key: tuple | None) -> AsyncIterator[TokenEvent]:
        """``events`` passed through; a request that ends with "stop" or "length" is stored."""
        ids: list[int] = []
        text: list[str] = []
        async with contextlib.aclosing(events):
            async for ev in events:
                ids.extend(ev.token_ids)
                text.append(ev.text)
                if ev.finished and key is not None and ev.finish_reason in ("stop", "length"):
                    self._put(key, ids, "".join(text), ev.finish_reason, ev.spec_stats)
                yield ev

    def _put(self, key: tuple, ids: list[int], text: str, reason: str, stats: dict | None) -> None:
        self.entries[key] = (list(ids), text, reason, stats)
        self.entries.move_to_end(key)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
