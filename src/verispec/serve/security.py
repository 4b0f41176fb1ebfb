"""Operator controls on what a request may carry and what is recorded of it.

- ``PromptDenylist``: regex patterns (one per line of a file; blank lines and ``#`` comments
  skipped), searched in every completion prompt and every chat message. A match is refused with
  400 ``prompt_denied`` naming the pattern's line, and ``verispec:prompt_denied_total`` goes up.
- ``AuditLogMiddleware``: one JSON line per API request (health, readiness and metrics probes
  excluded): time, request id, method and path, a hash of the API key (sha256, 16 hex digits;
  never the key), HTTP status, prompt and completion tokens, latency. The prompt text is written
  only when the operator asks (``include_prompts``). Rejected requests (401, 413, 400, 429, ...)
  are logged too.
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
import time
import uuid
from pathlib import Path

_UNLOGGED = ("/health", "/ready", "/metrics")


class PromptDenylist:
    def __init__(self, patterns: list[str]):
        self.patterns: list[tuple[int, re.Pattern]] = []
        for line, pat in enumerate(patterns, start=1):
            if not pat.strip() or pat.lstrip().startswith("#"):
                continue
            try:
                self.patterns.append((line, re.compile(pat)))
            except re.error as e:
                raise ValueError(f"prompt denylist line {line}: not a regular expression ({e}): {pat!r}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "PromptDenylist":
        try:
            return cls(Path(path).read_text(encoding="utf-8").splitlines())
        except OSError as e:
            raise ValueError(f"prompt denylist {path}: {e.strerror or e}") from None

    def match(self, texts: list[str]) -> int | None:
        """The line of the first pattern found in any of ``texts``, or None."""
        for line, pat in self.patterns:
            if any(pat.search(t) for t in texts):
                return line
        return None


def key_hash(authorization: str | None) -> str | None:
    """sha256 of the bearer token, 16 hex digits (None without one)."""
    if not authorization:
        return None
    token = authorization.split(" ", 1)[1] if authorization.lower().startswith("bearer ") else authorization
    return hashlib.sha256(token.strip().encode()).hexdigest()[:16]


class AuditLogMiddleware:
    """ASGI middleware writing the audit line of each request to ``path`` (appended, flushed per
    line). The pipeline leaves ``usage`` (and ``prompt``) in the request's state."""

    def __init__(self, app, path: str | Path, include_prompts: bool = False):
        self.app, self.include_prompts = app, include_prompts
        self.file = open(path, "a", encoding="utf-8")        # noqa: SIM115 - lives as long as the app
        self.lock = threading.Lock()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in _UNLOGGED:
            await self.app(scope, receive, send)
            return
        t0, status = time.perf_counter(), [0]
        scope.setdefault("state", {})

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
        try:
            await self.app(scope, receive, sending)
        finally:
            self._write(scope, status[0] or 500, time.perf_counter() - t0)

    def _write(self, scope, status: int, latency_s: float) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        state = scope.get("state", {})
        usage = state.get("usage") or {}
        rec = {"time": round(time.time(), 3), "request_id": uuid.uuid4().hex, "method": scope.get("method"),
               "path": scope["path"], "api_key_sha256": key_hash(headers.get("authorization")), "status": status,
               "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
               "latency_s": round(latency_s, 4)}
        if self.include_prompts:
            rec["prompt"] = state.get("prompt")
        with self.lock:
            self.file.write(json.dumps(rec, ensure_ascii=False) + "\n")
            self.file.flush()
