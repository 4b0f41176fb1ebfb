"""OpenAI-compatible HTTP API over the continuous-batching ``Scheduler``.

``create_app(llm, config)`` returns a FastAPI app with ``POST /v1/completions``,
``POST /v1/chat/completions`` (JSON or server-sent events ending with ``data: [DONE]``),
``GET /v1/models`` (and ``/v1/models/{id}``), ``GET /health`` (never needs the API key), ``GET /metrics`` and vLLM's
``POST /tokenize`` / ``POST /detokenize``.

Contract
- Request bodies are validated by the pydantic models of ``protocol``; unknown fields are ignored (as
  OpenAI does); invalid JSON, wrong types, out-of-range values and features this server lacks
  (``logit_bias``, tools, echo, beam search, guided decoding, ...) give 400 in OpenAI's error shape
  ``{"error": {"message", "type", "param", "code"}}``. Every error response has that shape.
- A prompt over ``max_prompt_tokens``, or prompt + ``max_tokens`` over ``max_model_len``: 400
  saying the limit. Bodies over ``max_body_bytes``: 413. Queue full (no room for all ``n``
  choices): 429. Unknown model: 404. Wrong or missing ``Authorization: Bearer <api_key>`` when a
  key is set: 401.
- ``n`` choices are ``n`` engine requests decoded in the running batch (with a ``seed``, choice i
  uses seed + i). Completions also take a batch of prompts (up to 64; choice index = prompt x n +
  j) and ``echo`` (the prompt before the completion, with its tokens' logprobs when ``logprobs``
  is set, the first token's null; ``max_tokens`` 0 with echo scores a prompt without generating).
  Text, streaming, logprobs and cancellation: see ``responses``.
- ``response_cache`` > 0: greedy (temperature 0) requests without logprobs are answered from an
  LRU of that many entries keyed by everything that determines the output.
- ``logprobs`` (completions) / ``logprobs`` + ``top_logprobs`` (chat): the target's raw
  log-probabilities of every output token, in OpenAI's shapes (``logprob_format``).
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import threading
import time
import uuid
import dataclasses
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..llm import LLM
from ..sampling import SamplingParams
from .logprob_format import TokenTexts
from .metrics import CONTENT_TYPE, ServerMetrics
from .policy import SpecPolicy
from .protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest,
                       TokenizeRequest, _Common)
from .responses import ClientGone, Shape, error_body, make_choices, respond
from .scheduler import NotAccepting, QueueFull, RequestFailed, Scheduler, TokenEvent

# ---------------------------------------------------------------------------- configuration
@dataclass
class ServeConfig:
    model_name: str
    max_num_seqs: int = 8
    max_model_len: int = 2048
    max_prompt_tokens: int = 8192
    api_key: str | None = None
    max_queue: int = 1024
    request_timeout: float | None = None
    response_cache: int = 0
    policy: SpecPolicy | None = None
    shutdown_grace_s: float = 10.0

    @property
    def max_body_bytes(self) -> int:
        return max(2 << 20, 64 * self.max_prompt_tokens)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: Any = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


# ---------------------------------------------------------------------------- the server
class _Server:
    """State shared by the routes: the model, the scheduler, metrics, response cache."""

    def __init__(self, llm: LLM, cfg: ServeConfig):
        self.llm, self.cfg = llm, cfg
        self.metrics = ServerMetrics()
        self.scheduler: Scheduler | None = None
        self.cache: OrderedDict[tuple, tuple[list[int], str]] = OrderedDict()
        self.tok_lock = threading.Lock()
        self.token_texts = TokenTexts(llm.tokenizer, self.tok_lock)
        self.created = int(time.time())
        self.names = {cfg.model_name, llm.target.name, str(llm.target.path)}

    def start(self) -> None:
        self.scheduler = Scheduler(self.llm, max_num_seqs=self.cfg.max_num_seqs,
                                   max_model_len=self.cfg.max_model_len, metrics=self.metrics,
                                   max_queue=self.cfg.max_queue, request_timeout=self.cfg.request_timeout,
                                   policy=self.cfg.policy, decode=self.decode)
        self.scheduler.start()

    def decode(self, ids: list[int]) -> str:
        with self.tok_lock:
            return self.llm._decode(ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self.tok_lock:
            return self.llm.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    # -- request preparation ---------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{self.cfg.model_name}`.", param="model", code="model_not_found")

    async def completion_prompts(self, prompt: Any) -> list[tuple[str, list[int]]]:
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

    async def chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        plain = [{"role": m.role, "content": m.text()} for m in messages]

        def render() -> list[int]:
            with self.tok_lock:
                text = self.llm.apply_chat_template(plain)
                return self.llm.tokenizer(text, add_special_tokens=False).input_ids
        try:
            return await asyncio.to_thread(render)     # as LLM.chat does
        except Exception as e:      # noqa: BLE001 - a template may reject any conversation
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from e

    def sampling_params(self, req: _Common, n_prompt: int, max_tokens: int | None,
                        kind: str) -> SamplingParams:
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
        try:
            params = SamplingParams(
                logit_bias=req.bias(), allowed_token_ids=req.allowed_token_ids,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k is None else req.top_k, max_tokens=max_tokens,
                seed=req.seed, stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
                stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
                logprobs=req.logprob_count(), min_p=req.min_p or 0.0, min_tokens=req.min_tokens or 0,
                include_stop_str_in_output=req.include_stop_str_in_output,
                presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty)
            params.check_vocab(self.llm.target.config.vocab_size)          # as LLM.generate checks
            return params
        except ValueError as e:
            raise APIError(400, str(e)) from e

    # -- generation ------------------------------------------------------------------------
    def cache_key(self, ids: list[int], p: SamplingParams) -> tuple | None:
        if self.cfg.response_cache <= 0 or not p.greedy or p.logprobs is not None or p.prompt_logprobs is not None:
            return None
        return (tuple(ids), p.max_tokens, tuple(p.stop), tuple(p.stop_token_ids), p.ignore_eos,
                p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens,
                p.include_stop_str_in_output, tuple(sorted((p.logit_bias or {}).items())),
                tuple(p.allowed_token_ids or ()))

    def cache_get(self, key: tuple | None) -> tuple[list[int], str] | None:
        if key is None or key not in self.cache:
            return None
        self.cache.move_to_end(key)
        self.metrics.cache_hits.inc()
        return self.cache[key]

    def cache_put(self, key: tuple | None, ids: list[int], reason: str | None) -> None:
        if key is None or reason not in ("stop", "length"):
            return
        self.cache[key] = (list(ids), reason)
        self.cache.move_to_end(key)
        while len(self.cache) > self.cfg.response_cache:
            self.cache.popitem(last=False)

    def submit(self, items: list[tuple[list[int], SamplingParams]]) -> list[AsyncIterator[TokenEvent]]:
        """Events of one choice per (prompt ids, params): a cached answer or a new request (the new
        ones are queued all or none)."""
        out: list = [None] * len(items)
        todo = []
        for i, (ids, p) in enumerate(items):
            key = self.cache_key(ids, p)
            hit = self.cache_get(key)
            if hit is not None:
                out[i] = _replay(hit)
            else:
                todo.append((i, key))
        if todo and self.scheduler is None:
            raise APIError(503, "the server is not running", "service_unavailable")
        try:
            handles = self.scheduler.submit_group([items[i] for i, _ in todo]) if todo else []
        except QueueFull as e:
            raise APIError(429, str(e), "rate_limit_error", code="queue_full") from e
        except NotAccepting as e:
            raise APIError(503, str(e), "service_unavailable") from e
        for (i, key), h in zip(todo, handles):
            out[i] = self._recording(self.scheduler.events(h), key)
        return out

    async def answer(self, request: Request, req: _Common, prompts: list[tuple[str, list[int]]],
                     params: list[SamplingParams], shape: Shape, echo: bool = False,
                     score_only: bool = False) -> Response:
        """Submit ``req.n`` choices per prompt (choice index = prompt * n + j; with a seed, choice
        j uses seed + j) and respond, whole or streamed."""
        items, echoes = [], []
        for (text, ids), p in zip(prompts, params):
            for j in range(req.n):
                items.append((ids, p.for_choice(j)))
                echoes.append((text, ids) if echo else None)
        choices = make_choices(self.submit(items), [p for _, p in items], shape.chat, self.decode,
                               self.token_texts.get, echoes, score_only)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        n_prompt = sum(len(ids) for _, ids in prompts)
        return await respond(request, choices, shape, n_prompt, req.stream, include_usage)

    async def _recording(self, events: AsyncIterator[TokenEvent], key: tuple | None) -> AsyncIterator[TokenEvent]:
        ids: list[int] = []
        async with contextlib.aclosing(events):
            async for ev in events:
                ids.extend(ev.token_ids)
                if ev.finished:
                    self.cache_put(key, ids, ev.finish_reason)
                yield ev


async def _replay(hit: tuple[list[int], str]) -> AsyncIterator[TokenEvent]:
    yield TokenEvent(list(hit[0]), True, hit[1])


# ---------------------------------------------------------------------------- middleware
class GuardMiddleware:
    """Pure ASGI: API-key check (all paths but ``/health``) and a request-body size limit."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, on_error: Callable[[int], None]):
        self.app, self.api_key, self.max_body = app, api_key, max_body_bytes
        self.on_error = on_error

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.api_key is not None and scope["path"] != "/health":
            why = self._auth_problem(dict(scope["headers"]).get(b"authorization", b""))
            if why:
                return await self._reject(scope, receive, send, 401, why, "invalid_api_key")
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body, more = [], True
            size = 0
            while more:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return
                size += len(msg.get("body", b""))
                if size > self.max_body:
                    return await self._reject(scope, receive, send, 413,
                                              f"the request body exceeds {self.max_body} bytes",
                                              "request_too_large")
                body.append(msg.get("body", b""))
                more = msg.get("more_body", False)
            receive = _replay_body(b"".join(body), receive)
        await self.app(scope, receive, send)

    def _auth_problem(self, header: bytes) -> str | None:
        value = header.decode("latin-1").strip()
        scheme, _, token = value.partition(" ")
        if not value:
            return "You didn't provide an API key: send 'Authorization: Bearer <key>'."
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("latin-1"),
                                                                self.api_key.encode("utf-8")):
            return "Incorrect API key provided."
        return None

    async def _reject(self, scope, receive, send, status: int, message: str, code: str) -> None:
        self.on_error(status)
        type_ = "invalid_request_error"
        await error_response(status, message, type_, None, code)(scope, receive, send)


def _replay_body(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


# ---------------------------------------------------------------------------- the app
async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    """The JSON body (whatever the Content-Type says) validated by ``model``; 400 otherwise."""
    raw = await request.body()
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"The request body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"The request body must be a JSON object, got {type(obj).__name__}.",
                       code="invalid_json")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e.errors(include_input=False, include_context=False)) from None
    except RecursionError:
        raise APIError(400, "The request body is nested too deeply.", code="invalid_value") from None


def validation_error(errors: list[dict]) -> APIError:
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    msg = f"{where}: {first.get('msg')}{more}" if where else f"{first.get('msg')}{more}"
    return APIError(400, msg, param=where or None, code="invalid_value")


def create_app(llm: LLM, cfg: ServeConfig) -> FastAPI:
    """The FastAPI app; its lifespan starts the scheduler thread and stops it gracefully.
    ``cfg.max_model_len`` is capped at ``llm.max_model_len``."""
    cfg.max_model_len = min(cfg.max_model_len, llm.max_model_len)
    srv = _Server(llm, cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        srv.start()
        try:
            yield
        finally:
            await asyncio.to_thread(srv.scheduler.stop, cfg.shutdown_grace_s)

    app = FastAPI(title="verispec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = srv
    count_error = lambda status: srv.metrics.http_errors.labels(status=str(status)).inc()  # noqa: E731
    app.add_middleware(GuardMiddleware, api_key=cfg.api_key, max_body_bytes=cfg.max_body_bytes,
                       on_error=count_error)
    _install_error_handlers(app, count_error)

    @app.get("/health")
    async def health() -> Response:
        if srv.scheduler is None or not srv.scheduler.alive:
            return error_response(503, "the scheduler is not running", "service_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(srv.metrics.render(), media_type=CONTENT_TYPE)

    card = {"id": cfg.model_name, "object": "model", "created": srv.created, "owned_by": "verispec",
            "root": str(llm.target.path), "max_model_len": cfg.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        srv.check_model(model_id)
        return card

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await parse_body(request, TokenizeRequest)
        srv.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            ids = await srv.chat_prompt(body.messages)
        else:
            ids = await asyncio.to_thread(srv.encode, body.prompt, body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": cfg.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body = await parse_body(request, DetokenizeRequest)
        srv.check_model(body.model)
        (_, ids), = await srv.completion_prompts(body.tokens)          # vocabulary check
        return {"prompt": await asyncio.to_thread(srv.decode, ids)}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        srv.check_model(body.model)
        prompts = await srv.completion_prompts(body.prompt)
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        params = [srv.sampling_params(body, len(ids), max(max_tokens, 1), "prompt") for _, ids in prompts]
        if body.echo and body.logprobs is not None:
            params = [dataclasses.replace(p, prompt_logprobs=body.logprobs) for p in params]
        shape = Shape(False, f"cmpl-{uuid.uuid4().hex}", int(time.time()), cfg.model_name)
        return await srv.answer(request, body, prompts, params, shape, echo=body.echo, score_only=max_tokens == 0)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        srv.check_model(body.model)
        ids = await srv.chat_prompt(body.messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = srv.sampling_params(body, len(ids), max_tokens, "messages")
        shape = Shape(True, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), cfg.model_name)
        return await srv.answer(request, body, [("", ids)], [params], shape)

    return app


def _install_error_handlers(app: FastAPI, count_error: Callable[[int], None]) -> None:
    """Every error leaves in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        count_error(exc.status)
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        count_error(exc.status_code)
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.exception_handler(RequestFailed)
    async def failed(request: Request, exc: RequestFailed) -> Response:
        count_error(exc.event.status)
        return error_response(exc.event.status, exc.event.message, exc.event.type, None, exc.event.status)

    @app.exception_handler(ClientGone)
    async def gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> Response:
        count_error(500)
        return error_response(500, f"internal server error: {type(exc).__name__}", "internal_error")
