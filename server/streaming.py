"""Engine requests as streams of outputs, and Server-Sent Events to the client.

A request's first output is fetched before any response header is sent, so that validation
errors (raised by the engine on the first iteration) become a 400 JSON body. Every stream that
does not run to its end (client gone, handler cancelled, error) is aborted in the engine, so its
KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import Any, Protocol

import msgspec
from aiohttp import web

from cupyspec.outputs import RequestOutput
from cupyspec.server.errors import internal_error, to_api_error
from cupyspec.server.protocol import StreamOptions, Usage

log = logging.getLogger("cupyspec.server")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"


class Aborter(Protocol):
    async def abort(self, request_id: str) -> None: ...


class EngineStream:
    """One engine request whose first output has been fetched; iterate it once, then `close` it."""

    def __init__(self, engine: Aborter, outputs: AsyncIterator[RequestOutput], request_id: str,
                 first: RequestOutput | None) -> None:
        self._engine = engine
        self._outputs = outputs
        self.request_id = request_id
        self._first = first
        self.finished = first is None or first.finished

    @classmethod
    async def open(cls, engine: Aborter, outputs: AsyncIterator[RequestOutput], request_id: str) -> EngineStream:
        """Start the request; its validation and admission errors are raised here."""
        try:
            first = await anext(outputs)
        except StopAsyncIteration:
            first = None
        except BaseException:
            await _release(engine, outputs, request_id, abort=True)
            raise
        return cls(engine, outputs, request_id, first)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        if self.finished:
            return
        async for output in self._outputs:
            self.finished = output.finished
            yield output
        self.finished = True

    async def close(self) -> None:
        """Release the request: abort it unless it ran to its end. Safe to call again."""
        abort, self.finished = not self.finished, True
        await _release(self._engine, self._outputs, self.request_id, abort)


async def _release(engine: Aborter, outputs: AsyncIterator[RequestOutput], request_id: str, abort: bool) -> None:
    """Abort the request in the engine (freeing its KV blocks) if asked, then close its iterator."""
    try:
        if abort:
            await asyncio.shield(engine.abort(request_id))
    finally:
        aclose = getattr(outputs, "aclose", None)
        if aclose is not None:
            await aclose()


@asynccontextmanager
async def engine_streams(engine: Aborter, requests: list[tuple[AsyncIterator[RequestOutput], str]],
                         ) -> AsyncIterator[list[EngineStream]]:
    """Open several requests at once and close them all on exit. If any fails to open, the
    others are aborted and its error is raised. A single request is opened in place (see `merged`)."""
    if len(requests) == 1:
        streams = [await EngineStream.open(engine, *requests[0])]
    else:
        streams = await _open_all(engine, requests)
    try:
        yield streams
    finally:
        for stream in streams:
            await stream.close()


async def _open_all(engine: Aborter, requests: list[tuple[AsyncIterator[RequestOutput], str]]) -> list[EngineStream]:
    """Open the requests concurrently; on any error or cancellation, close those that opened and raise."""
    tasks = [asyncio.ensure_future(EngineStream.open(engine, outputs, rid)) for outputs, rid in requests]
    try:
        await asyncio.wait(tasks)
    except BaseException:  # cancelled while opening: settle every task, abort what opened
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
        for stream in _opened(tasks):
            await stream.close()
        raise
    streams = _opened(tasks)
    errors = [t.exception() for t in tasks if t.exception() is not None]
    if errors:
        for stream in streams:
            await stream.close()
        raise errors[0]  # type: ignore[misc]
    return streams


def _opened(tasks: list[asyncio.Future[EngineStream]]) -> list[EngineStream]:
    return [t.result() for t in tasks if not t.cancelled() and t.exception() is None]


async def merged(streams: list[EngineStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of all streams as they come, tagged with the stream's index. A single stream is
    iterated in place: every task between the engine and the response costs the output a turn of
    the event loop, and on a GPU the loop turns once a step while the engine's host work outlasts
    the device's."""
    if len(streams) == 1:
        async with aclosing(streams[0].__aiter__()) as outputs:
            async for output in outputs:
                yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: EngineStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
            queue.put_nowait((index, None))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait((index, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class UsageCounter:
    """Token counts of a response: prompts counted once per request, outputs of every choice."""

    def __init__(self) -> None:
        self._prompt: dict[int, int] = {}
        self._completion: dict[int, int] = {}

    def update(self, index: int, output: RequestOutput) -> None:
        self._prompt[index] = output.num_prompt_tokens
        self._completion[index] = output.num_output_tokens

    def usage(self) -> Usage:
        prompt, completion = sum(self._prompt.values()), sum(self._completion.values())
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def include_usage(options: StreamOptions | None) -> bool:
    """Whether a stream ends with a usage chunk (`stream_options.include_usage`)."""
    return options is not None and bool(options.include_usage)


def sse_event(payload: Any) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


async def write_sse(request: web.Request, events: AsyncIterator[Any]) -> web.StreamResponse:
    """Send `events` as `data:` lines, then `data: [DONE]`. An error after the headers becomes an
    error event; a client that went away ends the stream quietly (`events` is closed either way)."""
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    try:
        async with aclosing(events):
            try:
                async for event in events:
                    await response.write(sse_event(event))
            except ConnectionResetError:
                raise
            except Exception as exc:  # noqa: BLE001 - headers are out: report in the stream
                error = to_api_error(exc)
                if error is None:
                    log.exception("unexpected error while streaming %s", request.path)
                    error = internal_error()
                await response.write(b"data: " + error.body() + b"\n\n")
        await response.write(DONE)
        await response.write_eof()
    except ConnectionResetError:
        log.debug("client left %s before the end of its stream", request.path)
    return response
