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
    """The JSON body as `kind`; malformed JSON and wrong types raise msgspec errors (HTTP 400)."""
    return msgspec.json.decode(await request.read(), type=kind)


def json_response(payload: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(payload), content_type="application/json")
