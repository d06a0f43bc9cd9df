"""Errors the engine raises to its callers; the server maps each to an HTTP status."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request is malformed or out of range (HTTP 400); `param` names the culprit."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (HTTP 503); the client may retry later."""


class EngineClosedError(RuntimeError):
    """The engine is shutting down or has stopped (HTTP 503)."""


class PrefillUnavailableError(RuntimeError):
    """Decode role: no prefill server ran the request's prompt (HTTP 503)."""
