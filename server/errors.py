"""OpenAI-style error bodies: exceptions mapped to an HTTP status, and the middleware that does it."""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

from cupyspec.errors import EngineClosedError, EngineOverloadedError, InvalidRequestError, PrefillUnavailableError
from cupyspec.server.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger("cupyspec.server")

_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
                413: "invalid_request_error", 503: "server_error"}
_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_FIELD = re.compile(r"(?:missing required|unknown) field `([^`]+)`")
OVERLOADED_RETRY_AFTER_SECONDS = 1  # a full queue drains as running requests finish: retry soon


class APIError(Exception):
    """An error the client should see with this status, type, param and code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 error_type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = error_type or _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}  # sent with the error response, e.g. Retry-After

    def body(self) -> bytes:
        return msgspec.json.encode(ErrorResponse(ErrorInfo(self.message, self.type, self.param, self.code)))

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        return web.Response(status=self.status, body=self.body(), content_type="application/json",
                            headers={**self.headers, **(headers or {})})


def validation_param(message: str) -> str | None:
    """The request field a msgspec validation message points at, e.g. `messages[0].role`, or the
    missing or unknown field it names, e.g. `speculative.foo`."""
    path_match = _PATH.search(message)
    path = path_match.group(1) if path_match else ""
    named = _FIELD.search(message)
    if named:
        return f"{path}.{named.group(1)}" if path else named.group(1)
    return path or None


def to_api_error(exc: Exception) -> APIError | None:
    """The client-facing form of an expected exception; None for an unexpected one (a 500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, msgspec.ValidationError):
        message = str(exc)
        return APIError(400, f"invalid request: {message}", validation_param(message))
    if isinstance(exc, msgspec.DecodeError):
        return APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json")
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), exc.param)
    if isinstance(exc, EngineOverloadedError):
        return APIError(503, str(exc) or "the server is overloaded; retry later", code="overloaded",
                        headers={"Retry-After": str(OVERLOADED_RETRY_AFTER_SECONDS)})
    if isinstance(exc, EngineClosedError):
        return APIError(503, str(exc) or "the engine is shutting down", code="engine_closed")
    if isinstance(exc, PrefillUnavailableError):
        return APIError(503, str(exc), code="prefill_unavailable")
    return None


def internal_error() -> APIError:
    return APIError(500, "internal server error; see the server log", code="internal_error")


def _http_error(request: web.Request, exc: web.HTTPException) -> web.Response:
    if exc.status == 404:
        error = APIError(404, f"no route for {request.method} {request.path}", code="not_found")
    elif exc.status == 405:
        error = APIError(405, f"method {request.method} is not allowed for {request.path}",
                         code="method_not_allowed")
    else:
        error = APIError(exc.status, exc.text or exc.reason)
    allow = exc.headers.get("Allow")
    return error.response({"Allow": allow} if allow else None)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every failure into a JSON error body; unexpected ones are logged with their traceback."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _http_error(request, exc)
    except Exception as exc:  # noqa: BLE001 - the server must keep serving
        error = to_api_error(exc)
        if error is None:
            log.exception("unexpected error in %s %s", request.method, request.path)
            error = internal_error()
        return error.response()
