"""The aiohttp application: OpenAI-compatible routes over an AsyncEngine, plus health and metrics."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from aiohttp import web

from cupyspec.disagg.prefill_client import LAYOUT_ROUTE, PREFILL_ROUTE
from cupyspec.server.chat import handle_chat
from cupyspec.server.completions import handle_completions
from cupyspec.server.context import CONTEXT, ServerContext, json_response
from cupyspec.server.disagg import handle_layout, handle_prefill
from cupyspec.server.errors import error_middleware
from cupyspec.server.protocol import ModelCard, ModelList
from cupyspec.text.token_text import TokenText

if TYPE_CHECKING:
    from cupyspec.engine import AsyncEngine

MAX_BODY_BYTES = 32 * 2**20  # long prompts as token-id lists stay far below this
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _model_card(ctx: ServerContext) -> ModelCard:
    return ModelCard(id=ctx.model_name, created=ctx.created, max_model_len=ctx.engine.max_model_len)


async def list_models(request: web.Request) -> web.Response:
    return json_response(ModelList(data=[_model_card(ServerContext.of(request))]))


async def get_model(request: web.Request) -> web.Response:
    ctx = ServerContext.of(request)
    ctx.check_model(request.match_info["model"])
    return json_response(_model_card(ctx))


async def health(request: web.Request) -> web.Response:
    if not ServerContext.of(request).engine.is_serving:
        return web.Response(status=503, text="engine stopped")
    return web.Response(text="OK")


async def metrics(request: web.Request) -> web.Response:
    """The engine's metrics in the Prometheus text format 0.0.4, which `generate_latest` writes."""
    text = ServerContext.of(request).engine.metrics_text()
    return web.Response(body=text.encode(), headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})


def create_app(engine: AsyncEngine, prefill_role: bool = False) -> web.Application:
    """The HTTP application. The caller owns the engine (creates it, and shuts it down). prefill_role:
    with the routes decode servers call (the engine's role is "prefill")."""
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY_BYTES)
    app[CONTEXT] = ServerContext(engine=engine, model_name=engine.model_name, token_text=TokenText(engine.tokenizer),
                                 created=int(time.time()))
    app.router.add_post("/v1/completions", handle_completions)
    app.router.add_post("/v1/chat/completions", handle_chat)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    if prefill_role:
        app.router.add_get(LAYOUT_ROUTE, handle_layout)
        app.router.add_post(PREFILL_ROUTE, handle_prefill)
    return app


async def start_server(app: web.Application, host: str, port: int,
                       shutdown_timeout: float = 30.0) -> tuple[web.AppRunner, int]:
    """Serve `app` on host:port (0: any free port); returns the runner (`cleanup()` stops it) and
    the port. Handlers of clients that disconnect are cancelled, which aborts their requests."""
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, runner.addresses[0][1]
