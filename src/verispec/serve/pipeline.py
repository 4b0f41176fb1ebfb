"""The request pipeline: what a completion request goes through, in one place, in order.

    body ──► 1) model and prompts ──► 2) limits, SamplingParams ──► 3) cache or scheduler
         ──► 4) choices ──► 5) response (JSON or SSE, see ``responses``)

Route handlers call ``RequestPipeline.completions`` / ``.chat`` (and ``.tokenize`` /
``.detokenize``) and nothing else. ``SamplingParams`` come from the request by
``protocol.sampling_params`` (derived from the dataclass's fields); the cache key from
``SamplingParams.cache_key``. Tokenizer calls hold one lock (HF tokenizers are not safe to share
across threads) and run off the event loop.
"""
from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from ..llm import LLM
from ..core.params import SamplingParams
from .errors import APIError
from .logprob_format import TokenTexts
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .protocol import _Common, sampling_params
from .response_cache import ResponseCache
from .responses import Shape, make_choices, respond
from .scheduler import NotAccepting, QueueFull, Scheduler, TokenEvent


class RequestPipeline:
    """The server's state (model, scheduler, metrics, cache) and every request's path through it.
    ``cfg`` is the app's ``ServeConfig``."""

    def __init__(self, llm: LLM, cfg, metrics: ServerMetrics):
        self.llm, self.cfg, self.metrics = llm, cfg, metrics
        self.scheduler: Scheduler | None = None
        self.cache = ResponseCache(cfg.response_cache, metrics)
        self.tok_lock = threading.Lock()
        self.token_texts = TokenTexts(llm.tokenizer, self.tok_lock)
        self.names = {cfg.model_name, llm.target.name, str(llm.target.path)}
        self.acceptance = {"acceptance": llm.acceptance.name, "lossy": llm.acceptance.lossy}
        self.draining = False

    def begin_drain(self) -> None:
        """From now on new requests get 503 with Retry-After; running ones go on (``drain``)."""
        self.draining = True

    @property
    def busy(self) -> bool:
        """Requests queued or decoding."""
        return self.scheduler is not None and self.scheduler.num_in_flight > 0

    def start(self) -> None:
        self.scheduler = Scheduler(self.llm, max_num_seqs=self.cfg.max_num_seqs,
                                   max_model_len=self.cfg.max_model_len, metrics=self.metrics,
                                   max_queue=self.cfg.max_queue, request_timeout=self.cfg.request_timeout,
                                   policy=self.cfg.policy, decode=self.decode, warmup=self.cfg.warmup,
                                   prefill_chunk=self.cfg.prefill_chunk, kv=self.cfg.kv)
        self.scheduler.start()

    @property
    def alive(self) -> bool:
        return self.scheduler is not None and self.scheduler.alive

    @property
    def warmed(self) -> bool:
        """The scheduler's warm-up is over (requests sent before it wait in the queue)."""
        return self.scheduler is not None and self.scheduler.warmed.is_set()

    # -- the two completion endpoints ------------------------------------------------------
    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        self.check_model(body.model)
        prompts = await self._completion_prompts(body.prompt)                                   # 1)
        self._screen(request, [text for text, _ in prompts])
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        params = [self._params(body, len(ids), max(max_tokens, 1), "prompt") for _, ids in prompts]   # 2)
        if body.echo and body.logprobs is not None:
            params = [dataclasses.replace(p, prompt_logprobs=body.logprobs) for p in params]
        shape = Shape(False, f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.cfg.model_name, self.acceptance)
        return await self._answer(request, body, prompts, params, shape, echo=body.echo,
                                  score_only=max_tokens == 0)

    async def chat(self, request: Request, body: ChatCompletionRequest) -> Response:
        self.check_model(body.model)
        self._screen(request, [m.text() for m in body.messages])
        ids = await self._chat_prompt(body.messages)                                            # 1)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = self._params(body, len(ids), max_tokens, "messages")                           # 2)
        shape = Shape(True, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.cfg.model_name, self.acceptance)
        return await self._answer(request, body, [("", ids)], [params], shape)

    async def _answer(self, request: Request, req: _Common, prompts: list[tuple[str, list[int]]],
                      params: list[SamplingParams], shape: Shape, echo: bool = False,
                      score_only: bool = False) -> Response:
        """3) to 5): ``req.n`` choices per prompt (choice index = prompt * n + j; with a seed,
        choice j uses seed + j), then the response, whole or streamed."""
        items, echoes = [], []
        for (text, ids), p in zip(prompts, params):
            for j in range(req.n):
                items.append((ids, p.for_choice(j)))
                echoes.append((text, ids) if echo else None)
        choices = make_choices(self._submit(items), [p for _, p in items], shape.chat,           # 4)
                               self.token_texts.get, echoes, score_only, req.speculative_stats)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        n_prompt = sum(len(ids) for _, ids in prompts)
        return await respond(request, choices, shape, n_prompt, req.stream, include_usage)      # 5)

    def _submit(self, items: list[tuple[list[int], SamplingParams]]) -> list[AsyncIterator[TokenEvent]]:
        """3) Events of one choice per (prompt ids, params): a cached answer or a new request
        (the new ones are queued all or none)."""
        out: list = [None] * len(items)
        todo = []
        for i, (ids, p) in enumerate(items):
            key = self.cache.key(ids, p)
            out[i] = self.cache.replay(key)
            if out[i] is None:
                todo.append((i, key))
        if todo and self.draining:
            raise APIError(503, "the server is draining (shutting down); retry on another replica",
                           "service_unavailable", headers={"Retry-After": str(max(1, round(self.cfg.shutdown_grace_s)))})
        if todo and self.scheduler is None:
            raise APIError(503, "the server is not running", "service_unavailable")
        try:
            handles = self.scheduler.submit_group([items[i] for i, _ in todo]) if todo else []
        except QueueFull as e:
            raise APIError(429, str(e), "rate_limit_error", code="queue_full") from e
        except NotAccepting as e:
            raise APIError(503, str(e), "service_unavailable") from e
        for (i, key), h in zip(todo, handles):
            out[i] = self.cache.recording(self.scheduler.events(h), key)
        return out

    # -- 1) and 2): prompts and params -----------------------------------------------------
    def _screen(self, request: Request, texts: list[str]) -> None:
        """The prompt denylist (400 on a match); the prompt text left for the audit log."""
        request.state.prompt = texts[0] if len(texts) == 1 else texts
        deny = self.cfg.prompt_denylist
        line = deny.match(texts) if deny is not None else None
        if line is not None:
            self.metrics.prompt_denied.inc()
            raise APIError(400, f"the prompt matches pattern {line} of this server's prompt denylist",
                           param="prompt", code="prompt_denied")

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{self.cfg.model_name}`.", param="model", code="model_not_found")

    def _check_pool(self, n_prompt: int, max_tokens: int, kind: str) -> None:
        """A request the paged KV pool could never hold whole (--kv-cache-mb) is a 400, not a wait."""
        why = self.scheduler.engine.kv_shortfall(n_prompt, max_tokens) if self.scheduler is not None else None
        if why:
            raise APIError(400, f"This request does not fit this server's KV cache (--kv-cache-mb): {why}. "
                                f"Please reduce the length of the {kind} or completion.",
                           param=kind, code="context_length_exceeded")

    def _params(self, req: _Common, n_prompt: int, max_tokens: int | None, kind: str) -> SamplingParams:
        """Check the limits and build ``SamplingParams``; raises ``APIError`` (400)."""
        why = req.unsupported()
        if why:
            raise APIError(400, why)
        if n_prompt == 0:
            raise APIError(400, f"the {kind} is empty", param=kind)
        limit = self.cfg.max_model_len
        if n_prompt > self.cfg.max_prompt_tokens:
            raise APIError(400, f"The {kind} has {n_prompt} tokens, more than this server's limit of "
                                f"{self.cfg.max_prompt_tokens} prompt tokens (--max-prompt-tokens).",
                           param=kind, code="context_length_exceeded")
        if max_tokens is None and n_prompt >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your "
                                f"{kind} resulted in {n_prompt} tokens. Please reduce the length of the "
                                f"{kind}.", param=kind, code="context_length_exceeded")
        max_tokens = max_tokens if max_tokens is not None else limit - n_prompt
        if n_prompt + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you "
                                f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the {kind}, "
                                f"{max_tokens} in the completion). Please reduce the length of the "
                                f"{kind} or completion.", param=kind, code="context_length_exceeded")
        self._check_pool(n_prompt, max_tokens, kind)
        try:
            params = sampling_params(req, max_tokens)
            self.llm.check_params(params)          # as LLM.generate checks: vocabulary, grammar
            return params
        except ValueError as e:
            raise APIError(400, str(e)) from e

    async def _completion_prompts(self, prompt: Any) -> list[tuple[str, list[int]]]:
        """(text, token ids) of each prompt: a string, a token list, or a batch of either."""
        batch = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
        if not batch:
            raise APIError(400, "the prompt batch is empty", param="prompt")
        out = []
        for p in batch:
            if isinstance(p, str):
                out.append((p, await asyncio.to_thread(self.encode, p)))   # as LLM.encode_prompt does
                continue
            ids = list(p)
            vocab = self.llm.target.config.vocab_size
            bad = [i for i in ids if not 0 <= i < vocab]
            if bad:
                raise APIError(400, f"prompt token ids out of the vocabulary [0, {vocab}): {bad[:5]}",
                               param="prompt")
            out.append((await asyncio.to_thread(self.decode, ids), ids))
        return out

    async def _chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        plain = [{"role": m.role, "content": m.text()} for m in messages]

        def render() -> list[int]:
            with self.tok_lock:
                text = self.llm.apply_chat_template(plain)
                return self.llm.tokenizer(text, add_special_tokens=False).input_ids
        try:
            return await asyncio.to_thread(render)     # as LLM.chat does
        except Exception as e:      # noqa: BLE001 - a template may reject any conversation
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from e

    # -- tokenizer endpoints and calls -----------------------------------------------------
    async def tokenize(self, body: TokenizeRequest) -> dict:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            ids = await self._chat_prompt(body.messages)
        else:
            ids = await asyncio.to_thread(self.encode, body.prompt, body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.cfg.max_model_len}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        self.check_model(body.model)
        (text, _), = await self._completion_prompts(body.tokens)          # vocabulary check, decode
        return {"prompt": text}

    def decode(self, ids: list[int]) -> str:
        with self.tok_lock:
            return self.llm._decode(ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self.tok_lock:
            return self.llm.tokenizer(text, add_special_tokens=add_special_tokens).input_ids
