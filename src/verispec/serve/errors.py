"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

``APIError`` is raised anywhere on a request's path; the app's handlers turn it (and every other
exception) into ``error_response``. Knows nothing about models or the scheduler.
"""
from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}


def error_body(message: str, type_: str, param: str | None = None, code: Any = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: Any = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)
