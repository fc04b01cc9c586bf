"""Errors as OpenAI sends them: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx
or 5xx status, for every way a request can fail (what OpenAI's clients parse)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from levanter_core.inference.engine import RequestError

logger = logging.getLogger(__name__)

# OpenAI's error type for each status this server answers with
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class ApiError(Exception):
    """A request answered with an error: ``status`` and what goes in the body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @classmethod
    def from_engine(cls, error: RequestError, *, param: str | None = None, code: str | None = None) -> ApiError:
        """The engine's refusal (400, 429 a full queue, 500 a request whose generation failed,
        503 shutting down or failed) as an answer."""
        if error.status == 429:
            code = "rate_limit_exceeded"
        elif error.status == 500:
            code = "generation_failed"
        elif error.status == 503:
            code = "engine_unavailable"
        return cls(error.status, str(error), param=param, code=code)

    def body(self) -> dict:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 429 else None
        if self.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def validation_error(error: RequestValidationError) -> ApiError:
    """pydantic's complaints about a request body as one 400 (FastAPI's own answer is a 422
    in a shape OpenAI's clients do not read), naming the first bad field as ``param``."""
    problems, params = [], []
    for e in error.errors():
        where = _dotted(e["loc"][1:] if e["loc"][:1] == ("body",) else e["loc"])
        if e["type"] == "json_invalid":
            problems.append(f"the body is not valid JSON ({e.get('ctx', {}).get('error', e['msg'])})")
            continue
        if e["type"] == "missing" and not where:
            problems.append("the request has no JSON body")
            continue
        params.append(where)
        problems.append(f"{where}: {e['msg']}" if where else e["msg"])
    return ApiError(400, "; ".join(problems) or "invalid request", param=params[0] if params else None)


def _dotted(loc) -> str:
    """``("messages", 0, "role")`` as ``messages[0].role``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def install_error_handlers(app: FastAPI) -> None:
    """Answer every failure of ``app`` in OpenAI's shape."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return e.response()

    @app.exception_handler(RequestError)
    async def engine_error(request: Request, e: RequestError):
        return ApiError.from_engine(e).response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        return validation_error(e).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        code = "not_found" if e.status_code == 404 else None
        message = e.detail if isinstance(e.detail, str) else str(e.detail)
        if e.status_code == 404:
            message = f"{request.method} {request.url.path}: no such endpoint (see /docs)"
        return ApiError(e.status_code, message, code=code).response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        logger.exception("request %s %s failed", request.method, request.url.path)
        return ApiError(500, f"the server failed: {type(e).__name__}: {e}").response()
