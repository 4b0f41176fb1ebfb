"""Responses of the two completion endpoints: one JSON body or server-sent events, ``n`` choices.

Contract
- Each choice is one engine request with its own ``TokenEvent`` stream. Its text is the
  concatenation of its events' ``text`` (made by the scheduler's incremental detokenizer: the
  output cut at the first stop string, as ``LLM.generate`` returns it).
- Whole responses list the choices by ``index``; ``usage.completion_tokens`` sums over them.
- Streams send one chunk per engine step and choice (the event's new text, held back by the
  detokenizer while it ends in an incomplete character or a possible start of a stop string), so
  the concatenated deltas of a choice equal its whole text. Chat streams open each choice with a
  ``role`` chunk. ``stream_options.include_usage``: every chunk has ``usage: null`` and a last
  chunk with no choices carries the totals. Then ``data: [DONE]``.
- Logprobs (when asked) go with the chunk that sends the text of their tokens.
- ``speculative_stats: true``: each choice (whole response) or each choice's finishing chunk
  (stream) carries that request's drafts, accepted tokens per position and mean acceptance
  length (bonus token included). A cached answer reports the stats of the run it replays.
- An error after the stream started is sent as ``data: {"error": ...}``, then ``[DONE]``.
- A client that goes away (while waiting or mid-stream) cancels every choice's request.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..core.logprobs import TokenLogprob
from ..core.params import SamplingParams
from .errors import error_body
from .logprob_format import LogprobFormatter
from .scheduler import RequestFailed, TokenEvent


class ClientGone(Exception):
    """The client disconnected before the response started."""


async def race_disconnect(request: Request, coro) -> Any:
    """Await ``coro``; if the client disconnects first, cancel it and raise ``ClientGone``."""
    async def until_disconnected() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.5)
    task = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(until_disconnected())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGone()


# ---------------------------------------------------------------------------- shapes
@dataclass
class Shape:
    """How one endpoint names and wraps its outputs. ``acceptance``: the engine's rule as
    ``{"acceptance": name, "lossy": bool}``, sent as the ``verispec`` field of whole responses and,
    when lossy, of every stream chunk (so no client misses that an output was lossy)."""
    chat: bool
    rid: str
    created: int
    model: str
    acceptance: dict | None = None

    def choice(self, index: int, text: str, reason: str, logprobs: dict | None) -> dict:
        if self.chat:
            return {"index": index, "message": {"role": "assistant", "content": text},
                    "logprobs": logprobs, "finish_reason": reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

    def full(self, choices: list[dict], usage: dict) -> dict:
        out = {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices, "usage": usage}
        if self.acceptance is not None:
            out["verispec"] = self.acceptance
        return out

    def chunk(self, index: int, delta: str | None, reason: str | None, usage: Any = False, role: bool = False,
              logprobs: dict | None = None) -> dict:
        if self.chat:
            d = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta else {})
            choices = [{"index": index, "delta": d, "logprobs": logprobs, "finish_reason": reason}]
        else:
            choices = [{"index": index, "text": delta or "", "logprobs": logprobs, "finish_reason": reason}]
        out = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices}
        if usage is not False:
            out["usage"] = usage
        if self.acceptance is not None and self.acceptance["lossy"]:
            out["verispec"] = self.acceptance
        return out

    def usage_chunk(self, usage: dict) -> dict:
        out = self.chunk(0, None, None, usage)
        out["choices"] = []
        return out


def usage(n_prompt: int, n_out: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


class SSEResponse(StreamingResponse):
    """A streaming response that always closes its body iterator (so the requests are cancelled
    when the client goes away, whichever way the server notices)."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


# ---------------------------------------------------------------------------- choices
@dataclass
class Choice:
    """One choice's events, text and logprobs. ``echo``: the prompt (text, token ids) goes before
    the completion, with the prompt tokens' logprobs (the first token has none). ``score_only``:
    the one generated token is dropped (``max_tokens`` 0 with echo: scoring a prompt)."""
    index: int
    events: AsyncIterator[TokenEvent]
    lp: LogprobFormatter | None
    echo: tuple[str, list[int]] | None = None
    score_only: bool = False
    pending: list = field(default_factory=list)      # logprob entries whose text is not sent yet
    reason: str | None = None
    output_text: str = ""
    output_tokens: int = 0
    want_stats: bool = False                          # the request asked for ``speculative_stats``
    stats: dict | None = None                         # the finished event's, when asked

    @property
    def text(self) -> str:
        return (self.echo[0] if self.echo else "") + ("" if self.score_only else self.output_text)

    @property
    def num_tokens(self) -> int:
        return 0 if self.score_only else self.output_tokens

    def prefix(self, first: TokenEvent) -> tuple[str, dict | None] | None:
        """The echoed prompt and its logprobs, sent before anything else (or None)."""
        if self.echo is None:
            return None
        text, ids = self.echo
        entries = [TokenLogprob(ids[0], None, 0, ())] + list(first.prompt_logprobs or [])
        return text, (self.lp.format(entries) if self.lp else None)

    def _take(self, ev: TokenEvent) -> str:
        """Record ``ev``; its text delta ("" when score-only)."""
        self.output_tokens += len(ev.token_ids)
        self.output_text += ev.text
        if not self.score_only:
            self.pending.extend(ev.logprobs or [])
        if ev.finished:
            self.reason = "length" if self.score_only else (ev.finish_reason or "stop")
            self.stats = ev.spec_stats if self.want_stats else None
        return "" if self.score_only else ev.text

    def push(self, ev: TokenEvent) -> tuple[str, dict | None] | None:
        """(delta, logprobs) to send for ``ev``, or None when nothing is to be sent yet."""
        delta = self._take(ev)
        if not (delta or ev.finished):
            return None
        logprobs = self.lp.format(self.pending) if self.lp and (self.pending or not self.score_only) else None
        self.pending = []
        return delta, logprobs

    async def collect(self) -> None:
        """Read every event. Logprob entries: prompt (echo), then output."""
        first = True
        async with contextlib.aclosing(self.events):
            async for ev in self.events:
                if first and self.echo is not None:
                    self.pending += [TokenLogprob(self.echo[1][0], None, 0, ())] + list(ev.prompt_logprobs or [])
                first = False
                self._take(ev)
                if ev.finished:
                    return
        raise RuntimeError("the event stream ended without a finished event")


def make_choices(streams: list[AsyncIterator[TokenEvent]], params: list[SamplingParams], chat: bool,
                 token_texts: Callable, echo: list[tuple[str, list[int]] | None] | None = None,
                 score_only: bool = False, want_stats: bool = False) -> list[Choice]:
    """One ``Choice`` per stream, indexed in order; ``params`` / ``echo`` per stream."""
    echo = echo or [None] * len(streams)
    return [Choice(i, ev, LogprobFormatter(chat, token_texts) if p.logprobs is not None else None, e, score_only,
                   want_stats=want_stats)
            for i, (ev, p, e) in enumerate(zip(streams, params, echo))]


def _with_stats(choice: dict, c: Choice) -> dict:
    """``choice`` with ``speculative_stats`` once ``c`` finished, when its request asked."""
    if c.stats is not None:
        choice["speculative_stats"] = c.stats
    return choice


async def respond(request: Request, choices: list[Choice], shape: Shape, n_prompt: int,
                  stream: bool, include_usage: bool) -> Response:
    """The whole response, or an SSE stream once every choice has its first event (so an error
    before any token still gets its HTTP status). ``n_prompt``: prompt tokens for ``usage``,
    which is also left in ``request.state.usage`` (for the audit log) when the response ends."""
    if not stream:
        async def collect_all() -> None:
            results = await asyncio.gather(*(c.collect() for c in choices), return_exceptions=True)
            await _close_all(choices)
            for r in results:
                if isinstance(r, BaseException):
                    raise r
        try:
            await race_disconnect(request, collect_all())
        finally:
            await _close_all(choices)
        body = []
        for c in choices:
            logprobs = await asyncio.to_thread(c.lp.format, c.pending) if c.lp else None
            body.append(_with_stats(shape.choice(c.index, c.text, c.reason or "stop", logprobs), c))
        request.state.usage = usage(n_prompt, sum(c.num_tokens for c in choices))
        return JSONResponse(shape.full(body, request.state.usage))
    async def first_events() -> list[TokenEvent]:
        got = await asyncio.gather(*(c.events.__anext__() for c in choices), return_exceptions=True)
        bad = next((g for g in got if isinstance(g, BaseException)), None)
        if bad is not None:
            raise bad
        return got
    try:
        firsts = await race_disconnect(request, first_events())
    except BaseException:
        await _close_all(choices)
        raise
    return SSEResponse(_sse_body(choices, firsts, shape, n_prompt, include_usage, request.state),
                       media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _merged(choices: list[Choice], firsts: list[TokenEvent]) -> AsyncIterator[tuple[Choice, TokenEvent]]:
    """(choice, event) pairs in arrival order, each choice's first event first; raises a
    choice's ``RequestFailed``; closing it closes every choice's events (cancelling them)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: Choice) -> None:
        try:
            async for ev in c.events:
                await queue.put((c, ev))
        except BaseException as e:   # noqa: BLE001 - handed to the reader
            await queue.put((c, e))

    for c, ev in zip(choices, firsts):
        yield c, ev
    live = [c for c, ev in zip(choices, firsts) if not ev.finished]
    tasks = [asyncio.ensure_future(pump(c)) for c in live]
    try:
        while live:
            c, ev = await queue.get()
            if isinstance(ev, BaseException):
                raise ev
            if ev.finished:
                live.remove(c)
            yield c, ev
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close_all(choices)


async def _close_all(choices: list[Choice]) -> None:
    """Close every choice's events (cancelling unfinished requests); never raises."""
    for c in choices:
        with contextlib.suppress(Exception):
            await c.events.aclose()


async def _sse_body(choices: list[Choice], firsts: list[TokenEvent], shape: Shape, n_prompt: int,
                    include_usage: bool, state) -> AsyncIterator[str]:
    usage_field: Any = None if include_usage else False
    events = _merged(choices, firsts)
    async with contextlib.aclosing(events):
        try:
            for c, first in zip(choices, firsts):
                if shape.chat:
                    yield sse(shape.chunk(c.index, None, None, usage_field, role=True))
                head = c.prefix(first)
                if head is not None:
                    yield sse(shape.chunk(c.index, head[0], None, usage_field, logprobs=head[1]))
            async for c, ev in events:
                out = c.push(ev)
                if out is not None:
                    chunk = shape.chunk(c.index, out[0], c.reason if ev.finished else None, usage_field,
                                        logprobs=out[1])
                    _with_stats(chunk["choices"][0], c)
                    yield sse(chunk)
            if include_usage:
                yield sse(shape.usage_chunk(usage(n_prompt, sum(c.num_tokens for c in choices))))
        except RequestFailed as e:
            yield sse(error_body(e.event.message, e.event.type, None, e.event.status))
        finally:
            state.usage = usage(n_prompt, sum(c.num_tokens for c in choices))
        yield sse("[DONE]")
