"""The prefill role's routes, which decode servers call (cupyspec/disagg/prefill_client.py): the
layout of its KV pool, and a prompt run with its first token sampled, its K/V held for the caller."""

from __future__ import annotations

from aiohttp import web

from cupyspec.disagg.prefill_client import PrefillBody
from cupyspec.server.context import ServerContext, decode_body, json_response


async def handle_layout(request: web.Request) -> web.Response:
    return json_response(ServerContext.of(request).engine.kv_agent.layout())


async def handle_prefill(request: web.Request) -> web.Response:
    body = await decode_body(request, PrefillBody)
    prefilled = await ServerContext.of(request).engine.prefill(body.prompt_token_ids, body.params, body.sampling_key)
    return json_response(prefilled)
