"""Continuous batching for the server: one background thread owns the ``Engine``.

    asyncio handlers ──submit──► waiting queue ──admit (Engine.add)──► running batch ──step──►
          ▲                                                                           │
          └──────────── asyncio.Queue per request ◄── events (call_soon_threadsafe) ──┘

Contract
- ``submit`` (from the event loop) queues a request or raises ``QueueFull`` (more than
  ``max_queue`` waiting) / ``NotAccepting`` (shutting down). The thread admits waiting requests
  into free batch rows between decode steps, in arrival order, and retires finished ones at once
  (their rows are free for the next admission).
- Each request receives ``TokenEvent``s: the token ids a step emitted to it (one event per
  step, possibly several tokens with speculation), the last one with ``finished`` and the
  engine's finish reason ("stop" | "length"); or one ``ErrorEvent`` (status 408 timeout, 500
  engine error, 503 shutdown) after which nothing follows.
- ``cancel`` (client gone) aborts the sequence between steps and frees its row (``Engine.abort``).
- A request older than its timeout is aborted between steps and gets ``ErrorEvent(408)``.
- An exception from the engine never ends the thread: a failed ``add`` fails that request; a
  failed ``step`` fails every running request (one batched forward serves them all) and the
  engine is rebuilt if it cannot be cleaned up. All get ``ErrorEvent(500)``.
- ``stop(grace_s)`` stops admitting, fails queued requests with 503, lets running ones finish
  for up to ``grace_s`` seconds, aborts the rest (503) and joins the thread.
- Each request's text is made in this thread by its own ``IncrementalDetokenizer`` (the engine's
  stop hook for its stop strings); events carry the new text that can no longer change.
With a prefix cache (``LLM(prefix_cache_mb=...)``, shared by every engine the scheduler builds) its
counters go to the metrics after each admit/step round.
Chunked prefill (``prefill_chunk``, on by default): admission only takes a row (``Engine.begin``);
each round then runs one decoding step for the running sequences and at most ``prefill_chunk``
prompt tokens of the admitted ones (``Engine.prefill_step``), so a long prompt delays running
streams by a chunk at a time. A sequence whose prompt is done joins the next step. The chunks lie
on the engine's grid of ``prefill_chunk`` positions (``core.prefill``), so a prompt's numbers and
outputs never depend on the load.
Each running request's draft budget is the engine's draft-budget estimator's (``Engine.gate``:
its own acceptance against this batch size's step costs); the optional ``policy`` (a user's
``num_speculative_tokens_per_batch_size`` table, see ``policy``) caps it per step
(``Engine.step(budget=...)``) and is told each step's batch size, budget, rows, time and tokens.
The scheduler uses only the engine's public surface (admit, step, abort); it never edits it.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from ..core.detokenizer import IncrementalDetokenizer
from ..core.kv_budget import PagedKV
from ..core.engine import PREFILL_CHUNK, Engine, Sequence
from ..llm import LLM
from ..models.packed import DENSE_MIN_ROWS
from ..core.logprobs import TokenLogprob
from ..core.params import SamplingParams
from .metrics import ServerMetrics
from .policy import SpecPolicy

log = logging.getLogger("verispec.serve")
DEFAULT_PREFILL_CHUNK = PREFILL_CHUNK   # per round while others decode; the grid LLM.generate prefills on
MIN_PREFILL_CHUNK = DENSE_MIN_ROWS   # smaller chunks would leave the packed kernels' prefill path
_IDLE_PREFILL = 2048            # prompt tokens per round when nothing decodes
_req_ids = itertools.count()


class QueueFull(RuntimeError):
    """Too many requests are waiting for a batch row."""


class NotAccepting(RuntimeError):
    """The scheduler is stopping or stopped."""


@dataclass(frozen=True)
class TokenEvent:
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None     # one per token id, when the request asked
    prompt_logprobs: list[TokenLogprob] | None = None   # first event only, when the request asked
    text: str = ""                                 # new text of the output (``IncrementalDetokenizer.delta``)
    spec_stats: dict | None = None                 # finished event: the request's speculative stats


@dataclass(frozen=True)
class ErrorEvent:
    status: int
    message: str
    type: str


def spec_stats(stats) -> dict:
    """A request's speculative-decoding stats as responses report them (``SpecStats``; the mean
    acceptance length includes the bonus token)."""
    return {"num_steps": stats.num_steps, "num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens,
            "mean_acceptance_length": round(stats.mean_acceptance_length, 4),
            "accepted_per_pos": list(stats.accepted_per_pos),
            "acceptance_rate_per_pos": [round(x, 4) for x in stats.acceptance_rate_per_pos],
            "draft_budgets": {str(k): v for k, v in sorted(stats.budgets.items())},
            "acceptance": stats.acceptance, "lossy": stats.lossy}


class RequestFailed(Exception):
    def __init__(self, event: ErrorEvent):
        super().__init__(event.message)
        self.event = event


@dataclass(eq=False)
class EngineRequest:
    """A submitted request: its inputs, its event queue and its engine sequence once admitted."""
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    deadline: float | None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    request_id: int = field(default_factory=lambda: next(_req_ids))
    arrival: float = field(default_factory=time.perf_counter)
    seq: Sequence | None = None
    detok: IncrementalDetokenizer | None = None
    last_emit: float | None = None
    done: bool = False            # final event sent (set by the scheduler thread)
    started: bool = False         # a token event was sent


class Scheduler:
    def __init__(self, llm: LLM, *, max_num_seqs: int, max_model_len: int, metrics: ServerMetrics,
                 max_queue: int = 1024, request_timeout: float | None = None,
                 policy: SpecPolicy | None = None, decode: Callable[[list[int]], str] | None = None,
                 warmup: bool = False, prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
                 kv: PagedKV | None = None):
        """``decode``: the tokenizer's decode for the requests' text (e.g. one that holds a lock).
        ``prefill_chunk``: chunked prefill, prompt tokens prefilled per round while other sequences
        decode (at least ``MIN_PREFILL_CHUNK``; None: every prompt whole at admission).
        ``warmup``: before serving, the scheduler thread decodes a short prompt at batch 1 and then
        2 (``warm_up``), so a compiled model's graphs (one-token, prefill/verify, any batch size)
        are made before the first request, not inside it; ``warmed`` is set when that is over.
        ``kv``: the engine's paged KV pool (``core.kv_budget.PagedKV``; None: static rows). A request waits
        in the queue until the pool can hold its worst case (``core.kv_budget``)."""
        self.llm = llm
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.max_queue = max_queue
        self.request_timeout = request_timeout
        self.policy = policy
        self.decode = decode
        if prefill_chunk is not None and prefill_chunk < MIN_PREFILL_CHUNK:
            raise ValueError(f"prefill_chunk must be at least {MIN_PREFILL_CHUNK} tokens, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.kv = kv
        self.engine = self._new_engine()
        self._cond = threading.Condition()
        self._waiting: collections.deque[EngineRequest] = collections.deque()
        self._cancels: list[EngineRequest] = []
        self._active: dict[int, EngineRequest] = {}       # seq_id -> request, running only
        self._accepting = True
        self._stop_at: float | None = None                # set by stop(): drain deadline
        self._thread = threading.Thread(target=self._run, name="verispec-scheduler", daemon=True)
        self.steps = 0
        self.warmup = warmup
        self.warmed = threading.Event()
        if not warmup:
            self.warmed.set()

    def _new_engine(self) -> Engine:
        engine = self.llm.make_engine(self.max_num_seqs, self.max_model_len, kv=self.kv,
                                      prefill_chunk=self.prefill_chunk or PREFILL_CHUNK)
        self.metrics.observe_kv(*engine.kv_usage())
        if self.policy is not None:
            self.policy.bind(engine.max_tree_nodes)
        self.metrics.reset_spec_baseline()
        self.metrics.set_acceptance(engine.acceptance)
        return engine

    # ------------------------------------------------------------------ event-loop side
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._accepting

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_in_flight(self) -> int:
        """Requests queued or decoding."""
        return len(self._waiting) + len(self._active)

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> EngineRequest:
        """Queue a validated request; call from the event loop that will read its events."""
        return self.submit_group([(prompt_ids, params)])[0]

    def submit_group(self, items: list[tuple[list[int], SamplingParams]]) -> list[EngineRequest]:
        """Queue one request per (prompt ids, params) (the choices of one API request): all of
        them, or none when the queue has no room for all."""
        deadline = time.perf_counter() + self.request_timeout if self.request_timeout else None
        loop = asyncio.get_running_loop()
        reqs = [EngineRequest(list(ids), p, loop, deadline) for ids, p in items]
        with self._cond:
            if not self._accepting:
                raise NotAccepting("the server is shutting down")
            if len(self._waiting) + len(reqs) > self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting "
                                f"(--max-queue {self.max_queue}); retry later")
            self._waiting.extend(reqs)
            self.metrics.waiting.set(len(self._waiting))
            self._cond.notify()
        return reqs

    def cancel(self, req: EngineRequest) -> None:
        """Abort ``req`` between steps (no-op when it already ended)."""
        if req.done:
            return
        with self._cond:
            self._cancels.append(req)
            self._cond.notify()

    async def events(self, req: EngineRequest) -> AsyncIterator[TokenEvent]:
        """``req``'s token events until the finished one; raises ``RequestFailed`` on an error
        event. Leaving early (client gone, task cancelled) cancels the request."""
        try:
            while True:
                ev = await req.events.get()
                if isinstance(ev, ErrorEvent):
                    raise RequestFailed(ev)
                yield ev
                if ev.finished:
                    return
        finally:
            if not req.done:
                self.cancel(req)

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop admitting, fail queued requests, finish or abort running ones, join the thread."""
        with self._cond:
            self._accepting = False
            self._stop_at = time.perf_counter() + grace_s
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(grace_s + 30.0)

    # ------------------------------------------------------------------ scheduler thread
    def warm_up(self) -> float:
        """Decode 8 tokens of a short prompt alone, then two at once, on a short engine of the
        server's ``max_num_seqs`` rows (the same forwards, drafter and gate the server's engine
        runs; compiled graphs are shared per model and specialise on a one-row cache only, so a
        cache of as many rows makes them the server's). Returns the seconds it took. Lossless
        and unobservable: nothing reaches a request, and the prefix cache is left out (its
        blocks and counters are the requests' alone)."""
        t0 = time.perf_counter()
        ids = self.llm.tokenizer("Hello, how are you?", add_special_tokens=False).input_ids or [0]
        params = SamplingParams(temperature=0.0, max_tokens=8)
        cache, self.llm.prefix_cache = self.llm.prefix_cache, None
        try:
            # the server's kind of cache (paged or static): the graphs read its tensors
            engine = self.llm.make_engine(self.max_num_seqs, len(ids) + 16,
                                          kv=None if self.kv is None else PagedKV(4 * len(ids) + 64,
                                                                                  self.kv.block_size))
            for batch in sorted({1, min(2, self.max_num_seqs)}):
                engine.run([Sequence(prompt_ids=list(ids), params=params) for _ in range(batch)])
        finally:
            self.llm.prefix_cache = cache
        return time.perf_counter() - t0

    def _run(self) -> None:
        if self.warmup:
            try:
                log.info("warm-up done in %.1f s", self.warm_up())
            except Exception:        # noqa: BLE001 - a failed warm-up leaves compiling to the first requests
                log.exception("warm-up failed; serving without it")
            if self.llm.compiled is not None:   # the warm-up's compiling, on /metrics before any request
                self.metrics.observe_compiled(self.llm.compiled)
            self.warmed.set()
        while True:
            try:
                if not self._iteration():
                    break
            except Exception:        # noqa: BLE001 - the thread must outlive any bug
                log.exception("scheduler iteration failed; failing running requests")
                with contextlib.suppress(Exception):
                    self._fail_running(500, "internal error in the scheduler")
        self._shutdown()

    def _iteration(self) -> bool:
        """One admit/step round; False when it is time to stop."""
        with self._cond:
            while not (self._waiting or self._cancels or self._busy or self._stop_at):
                self._cond.wait()
            cancels, self._cancels = self._cancels, []
            if self._stop_at is not None:
                self._fail_waiting(503, "the server is shutting down")
                if not self._busy or time.perf_counter() > self._stop_at:
                    return False
        self._process_cancels(cancels)
        self._expire()
        self._admit()
        self._step()
        self._prefill()
        if self.engine.prefix_cache is not None:
            self.metrics.observe_prefix_cache(self.engine.prefix_cache.stats())
        if self.llm.compiled is not None:
            self.metrics.observe_compiled(self.llm.compiled)
        self.metrics.observe_kv(*self.engine.kv_usage())
        self.metrics.running.set(self.engine.num_running)
        self.metrics.waiting.set(len(self._waiting))
        return True

    @property
    def _busy(self) -> bool:
        """Sequences decoding or prefilling."""
        return bool(self.engine.num_running or self.engine.num_prefilling)

    def _shutdown(self) -> None:
        with self._cond:
            self._fail_waiting(503, "the server is shutting down")
        self._fail_running(503, "the server is shutting down")
        self.metrics.running.set(0)
        self.metrics.waiting.set(0)

    def _fail_waiting(self, status: int, message: str) -> None:
        """Caller holds the lock."""
        while self._waiting:
            self._error(self._waiting.popleft(), status, message, "service_unavailable")

    def _process_cancels(self, cancels: list[EngineRequest]) -> None:
        for req in cancels:
            if req.done:
                continue
            with self._cond:
                if req in self._waiting:
                    self._waiting.remove(req)
            self._abort(req, "abort")

    def _expire(self) -> None:
        now = time.perf_counter()
        with self._cond:
            late = [r for r in self._waiting if r.deadline is not None and now > r.deadline]
            for r in late:
                self._waiting.remove(r)
        late += [r for r in self._active.values() if r.deadline is not None and now > r.deadline]
        for r in late:
            self._abort(r, "timeout")

    def _abort(self, req: EngineRequest, reason: str) -> None:
        """End ``req`` (waiting or running) with reason "abort" (nobody listens) or "timeout"."""
        if req.seq is not None and not req.done:
            self._active.pop(req.seq.seq_id, None)
            try:
                self.engine.abort(req.seq)
            except Exception:         # noqa: BLE001
                log.exception("engine.abort failed; rebuilding the engine")
                self._rebuild_engine()
        if reason == "timeout":
            self._error(req, 408, f"the request timed out after {self.request_timeout:g} s "
                                  "(--request-timeout)", "timeout", finished_reason="timeout")
        else:
            self._finish(req, TokenEvent([], True, "abort"), "abort")

    def _admit(self) -> None:
        while self.engine.can_admit():
            with self._cond:
                if not self._waiting or self._stop_at is not None:
                    return
                if not self.engine.can_admit(self._waiting[0]):
                    return                    # the KV pool is booked: the oldest request waits
                req = self._waiting.popleft()
                self.metrics.waiting.set(len(self._waiting))
            try:
                seq, req.detok = self.llm.new_sequence(req.prompt_ids, req.params, decode=self.decode,
                                                       on_tokens=lambda s, new, req=req: self._on_tokens(req, s, new))
            except ValueError as e:       # a grammar that compiled at validation but not now
                self._error(req, 400, str(e), "invalid_request_error")
                continue
            seq.start_time = req.arrival
            req.seq = seq
            self._active[seq.seq_id] = req
            try:                              # all or nothing: a failure leaves no row taken
                if self.prefill_chunk is None:
                    self.engine.add(seq)
                else:
                    self.engine.begin(seq)    # prefilled by ``_prefill``, chunk by chunk
            except Exception as e:     # noqa: BLE001
                log.exception("engine.add failed")
                self._active.pop(seq.seq_id, None)
                self._error(req, 500, f"the engine failed to start the request: {e}", "internal_error")
                continue
            self.metrics.prompt_tokens.inc(len(req.prompt_ids))

    def _step(self) -> None:
        eng = self.engine
        batch = eng.num_running
        if not batch:
            return
        budget = self.policy.budget(batch) if self.policy is not None else None
        try:
            report = eng.step(budget)
        except Exception as e:        # noqa: BLE001
            log.exception("engine.step failed")
            self._fail_running(500, f"the engine failed during a decoding step: {e}")
            return
        self.steps += 1
        if self.policy is not None:
            self.policy.observe(len(report.seqs), report.budget, report.time_s, report.emitted, rows=report.rows)
        if eng.drafter is not None:
            self.metrics.draft_budget.set(report.budget)
        self.metrics.observe_spec(eng.stats)

    def _prefill(self) -> None:
        """One chunk budget of the prompts admitted for chunked prefill (between two decoding
        steps, so a long prompt delays each running stream by one chunk, not by its whole
        forward); with nothing decoding, whole prompts. A failure fails that request only."""
        eng = self.engine
        if not eng.num_prefilling:
            return
        budget = self.prefill_chunk if eng.num_running else max(self.prefill_chunk, _IDLE_PREFILL)
        try:
            eng.prefill_step(budget)
        except Exception as e:        # noqa: BLE001
            log.exception("prefill failed")
            for req in [r for r in self._active.values() if r.seq is not None and r.seq.finished and not r.done]:
                self._active.pop(req.seq.seq_id, None)
                self._error(req, 500, f"the engine failed to prefill the request: {e}", "internal_error")

    def _fail_running(self, status: int, message: str) -> None:
        reqs = list(self._active.values())
        self._active.clear()
        broken = False
        for req in reqs:
            try:
                if req.seq is not None:
                    self.engine.abort(req.seq)
            except Exception:         # noqa: BLE001
                broken = True
            self._error(req, status, message, "internal_error" if status == 500 else "service_unavailable")
        if broken or self._busy:
            self._rebuild_engine()

    def _rebuild_engine(self) -> None:
        for req in list(self._active.values()):
            self._error(req, 500, "the engine was restarted after an error", "internal_error")
        self._active.clear()
        try:
            self.engine = self._new_engine()
        except Exception:             # noqa: BLE001
            log.exception("could not rebuild the engine; keeping the old one")

    # ------------------------------------------------------------------ delivery
    def _on_tokens(self, req: EngineRequest, seq: Sequence, new: list[int]) -> None:
        """Engine callback (scheduler thread): metrics, then the event to the request's loop."""
        now = time.perf_counter()
        since_last = None if req.last_emit is None else now - req.last_emit
        if new:
            self.metrics.observe_tokens(len(new), since_last, now - req.arrival)
            req.last_emit = now
        lps = None if seq.logprobs is None else seq.logprobs[len(seq.logprobs) - len(new):]
        plps = None if req.started else seq.prompt_logprobs
        req.started = True
        if seq.finished:
            req.detok.finish()
            self._active.pop(seq.seq_id, None)
            self._finish(req, TokenEvent(list(new), True, seq.finish_reason, lps, plps, req.detok.delta(),
                                         spec_stats(seq.stats)), seq.finish_reason or "stop")
        else:
            self._put(req, TokenEvent(list(new), False, None, lps, plps, req.detok.delta()))

    def _finish(self, req: EngineRequest, event: TokenEvent | ErrorEvent, reason: str) -> None:
        if req.done:
            return
        req.done = True
        self.metrics.running.set(self.engine.num_running)
        self.metrics.observe_finished(reason, time.perf_counter() - req.arrival)
        self._put(req, event)

    def _error(self, req: EngineRequest, status: int, message: str, type_: str,
               finished_reason: str = "error") -> None:
        self._finish(req, ErrorEvent(status, message, type_), finished_reason)

    @staticmethod
    def _put(req: EngineRequest, event: TokenEvent | ErrorEvent) -> None:
        with contextlib.suppress(RuntimeError):      # the loop is closed: nobody to tell
            req.loop.call_soon_threadsafe(req.events.put_nowait, event)
