"""OpenAI-compatible HTTP API over the continuous-batching ``Scheduler``.

``create_app(llm, config)`` returns a FastAPI app with ``POST /v1/completions``,
``POST /v1/chat/completions`` (JSON or server-sent events ending with ``data: [DONE]``),
``GET /v1/models`` (and ``/v1/models/{id}``), ``GET /health`` (liveness) and ``GET /ready``
(readiness; neither needs the API key), ``GET /metrics`` and vLLM's ``POST /tokenize`` /
``POST /detokenize``. ``drain.DrainingServer`` runs it with a graceful drain on SIGTERM.

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
  LRU of that many entries keyed by everything that determines the output (``response_cache``).
- Each route hands its validated body to the ``RequestPipeline`` (``pipeline``), which takes it
  from prompts to the response in one pass.
- ``logprobs`` (completions) / ``logprobs`` + ``top_logprobs`` (chat): the target's raw
  log-probabilities of every output token, in OpenAI's shapes (``logprob_format``).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..llm import LLM
from .errors import APIError, error_response
from .metrics import CONTENT_TYPE, ServerMetrics
from .pipeline import RequestPipeline
from .policy import SpecPolicy
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .responses import ClientGone
from ..core.kv_budget import PagedKV
from .scheduler import DEFAULT_PREFILL_CHUNK, RequestFailed
from .security import AuditLogMiddleware, PromptDenylist

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
    prompt_denylist: PromptDenylist | None = None   # prompts matching a pattern are refused (400)
    audit_log: str | None = None                    # JSONL file: one line per request
    audit_log_prompts: bool = False                 # ... with the prompt text
    warmup: bool = False                            # decode a short prompt (batch 1, then 2) before /ready
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK   # chunked prefill: prompt tokens a round (None: off)
    kv: PagedKV | None = None                       # the paged KV pool (None: static rows)

    @property
    def max_body_bytes(self) -> int:
        return max(2 << 20, 64 * self.max_prompt_tokens)


# ---------------------------------------------------------------------------- middleware
class GuardMiddleware:
    """Pure ASGI: API-key check (all paths but ``/health``) and a request-body size limit."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, on_error: Callable[[int], None]):
        self.app, self.api_key, self.max_body = app, api_key, max_body_bytes
        self.on_error = on_error

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.api_key is not None and scope["path"] not in ("/health", "/ready"):
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
    metrics = ServerMetrics()
    pipe = RequestPipeline(llm, cfg, metrics)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        pipe.start()
        try:
            yield
        finally:
            await asyncio.to_thread(pipe.scheduler.stop, cfg.shutdown_grace_s)

    app = FastAPI(title="verispec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = pipe
    count_error = lambda status: metrics.http_errors.labels(status=str(status)).inc()  # noqa: E731
    app.add_middleware(GuardMiddleware, api_key=cfg.api_key, max_body_bytes=cfg.max_body_bytes,
                       on_error=count_error)
    if cfg.audit_log:                      # outermost: requests the guard rejects are logged too
        app.add_middleware(AuditLogMiddleware, path=cfg.audit_log, include_prompts=cfg.audit_log_prompts)
    _install_error_handlers(app, count_error)
    _install_info_routes(app, pipe, metrics, {"id": cfg.model_name, "object": "model", "created": created,
                                              "owned_by": "verispec", "root": str(llm.target.path),
                                              "max_model_len": cfg.max_model_len})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        return await pipe.tokenize(await parse_body(request, TokenizeRequest))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        return await pipe.detokenize(await parse_body(request, DetokenizeRequest))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await pipe.completions(request, await parse_body(request, CompletionRequest))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await pipe.chat(request, await parse_body(request, ChatCompletionRequest))

    return app


def _install_info_routes(app: FastAPI, pipe: RequestPipeline, metrics: ServerMetrics, card: dict) -> None:
    """``/health``, ``/metrics`` and the model list."""

    @app.get("/health")
    async def health() -> Response:
        """Liveness: the scheduler thread runs (also while draining)."""
        if not pipe.alive:
            return error_response(503, "the scheduler is not running", "service_unavailable")
        return JSONResponse({"status": "draining" if pipe.draining else "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        """Readiness: alive, warmed up and taking new requests (false at once when a drain begins)."""
        if not pipe.alive or pipe.draining:
            return error_response(503, "the server is draining" if pipe.draining else "the scheduler is not running",
                                  "service_unavailable")
        if not pipe.warmed:
            return error_response(503, "the server is warming up (compiling its forwards)", "service_unavailable")
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        pipe.check_model(model_id)
        return card


def _install_error_handlers(app: FastAPI, count_error: Callable[[int], None]) -> None:
    """Every error leaves in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        count_error(exc.status)
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

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
