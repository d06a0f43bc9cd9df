"""What every handler needs: the engine, the served model name, token strings, and JSON in and out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from aiohttp import web

from cupyspec.server.errors import APIError
from cupyspec.text.token_text import TokenText

if TYPE_CHECKING:
    from cupyspec.engine import AsyncEngine

T = TypeVar("T")


@dataclass(frozen=True)
class ServerContext:
    """Per-application state, stored in the app under `CONTEXT`."""

    engine: AsyncEngine
    model_name: str
    token_text: TokenText
    created: int  # when the server started (the model card's `created`)

    @staticmethod
    def of(request: web.Request) -> ServerContext:
        return request.app[CONTEXT]

    def check_model(self, model: str | None) -> None:
        """A request may omit `model`; if it names one, it must be the served model."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")


CONTEXT = web.AppKey("cupyspec_context", ServerContext)


async def decode_body(request: web.Request, kind: type[T]) -> T:
    """The JSON body as `kind`; malformed JSON and wrong types raise msgspec errors (HTTP 400).

    msgspec raises UnicodeDecodeError for invalid UTF-8 inside a string it decodes, and
    RecursionError for arrays or objects nested deeper than the interpreter's recursion limit
    (in fields it skips too); both are the client's error, an APIError (HTTP 400)."""
    body = await request.read()
    try:
        return msgspec.json.decode(body, type=kind)
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: a string is not valid UTF-8 ({exc.reason})",
                       code="invalid_json") from exc
    except RecursionError as exc:
        raise APIError(400, "the request body nests JSON arrays or objects too deeply",
                       code="invalid_json") from exc


def json_response(payload: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(payload), content_type="application/json")
