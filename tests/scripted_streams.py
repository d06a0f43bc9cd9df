"""Engine request streams fed from a script, for servers tested without an engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace

from cupyspec.engine.request_stream import OutputChannel, RequestStream
from cupyspec.outputs import RequestOutput


def scripted_stream(outputs: AsyncIterator[RequestOutput], request_id: str,
                    on_abort: Callable[[str], None] = lambda request_id: None) -> RequestStream:
    """A RequestStream whose outputs (or error) a task takes from `outputs`, as the engine's step
    loop puts a request's; aborting it stops the task and calls `on_abort(request_id)`."""
    request = SimpleNamespace(request_id=request_id, channel=OutputChannel(), finished=False)
    tasks: list[asyncio.Task] = []

    async def pump() -> None:
        try:
            async for output in outputs:
                request.finished = output.finished
                request.channel.put(output)
        except Exception as exc:  # noqa: BLE001 - the request's caller gets it
            request.channel.put(exc)

    async def opening() -> SimpleNamespace:
        tasks.append(asyncio.ensure_future(pump()))
        return request

    def abort(request_id: str) -> None:
        for task in tasks:
            task.cancel()
        on_abort(request_id)

    return RequestStream(opening(), abort)
