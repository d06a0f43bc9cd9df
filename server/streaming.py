"""Engine requests as streams of outputs, and Server-Sent Events to the client.

A request's first output is fetched before any response header is sent, so that validation
errors (raised by the engine on the first iteration) become a 400 JSON body. The later outputs are
forwarded to the response as the engine makes them (`deliver`): a streamed response writes each
output's chunks from inside the engine's step, with no task between the two. Every stream that
does not run to its end (client gone, handler cancelled, error) is aborted in the engine, so its
KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol

import msgspec
from aiohttp import hdrs, web

from cupyspec.engine.request_stream import Item, RequestStream
from cupyspec.outputs import RequestOutput
from cupyspec.server.errors import internal_error, to_api_error
from cupyspec.server.protocol import StreamOptions, Usage

log = logging.getLogger("cupyspec.server")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"


class EngineStream:
    """One engine request whose first output has been fetched; its outputs go on through `forward`."""

    def __init__(self, outputs: RequestStream, first: RequestOutput | None) -> None:
        self._outputs = outputs
        self._first = first
        self.finished = first is None or first.finished

    @classmethod
    async def open(cls, outputs: RequestStream) -> EngineStream:
        """Start the request; its validation and admission errors are raised here."""
        try:
            first = await anext(outputs)
        except StopAsyncIteration:
            first = None
        except BaseException:
            await outputs.aclose()
            raise
        return cls(outputs, first)

    def forward(self, consumer: Callable[[Item], None]) -> None:
        """Hand the first output, then each later one as the engine makes it, to `consumer`."""
        first, self._first = self._first, None
        if first is not None:
            consumer(first)
        if not self.finished:
            self._outputs.forward(consumer)

    async def close(self) -> None:
        """Release the request: abort it unless it ran to its end. Safe to call again."""
        self.finished = True
        await self._outputs.aclose()


@asynccontextmanager
async def engine_streams(requests: list[RequestStream]) -> AsyncIterator[list[EngineStream]]:
    """Open several requests at once and close them all on exit. If any fails to open, the
    others are aborted and its error is raised."""
    if len(requests) == 1:
        streams = [await EngineStream.open(requests[0])]
    else:
        streams = await _open_all(requests)
    try:
        yield streams
    finally:
        for stream in streams:
            await stream.close()


async def _open_all(requests: list[RequestStream]) -> list[EngineStream]:
    """Open the requests concurrently; on any error or cancellation, close those that opened and raise."""
    tasks = [asyncio.ensure_future(EngineStream.open(outputs)) for outputs in requests]
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


async def deliver(streams: list[EngineStream], on_output: Callable[[int, RequestOutput], None]) -> None:
    """Call `on_output(index, output)` with every output of every stream, in each stream's order, as
    the engine makes them; return once every stream has finished. An error from the engine or
    from `on_output` ends the delivery and is raised here (the caller closes the streams)."""
    done = asyncio.get_running_loop().create_future()
    # -1 stands for the forwarding itself, so that delivery ends only after every stream's first output
    unfinished = {i for i, stream in enumerate(streams) if not stream.finished} | {-1}

    def consumer(index: int) -> Callable[[Item], None]:
        def consume(item: Item) -> None:
            if done.done():
                return
            try:
                if isinstance(item, BaseException):
                    raise item
                on_output(index, item)
            except Exception as exc:  # noqa: BLE001 - raised by `deliver`, never into the engine's step
                done.set_exception(exc)
                return
            if item.finished:
                _settled(index)
        return consume

    def _settled(index: int) -> None:
        unfinished.discard(index)
        if not unfinished:
            done.set_result(None)

    for index, stream in enumerate(streams):
        stream.forward(consumer(index))
    _settled(-1)
    await done


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


def sse_events(payloads: list[Any]) -> bytes:
    """Each payload as a `data:` event."""
    return b"".join(b"data: " + msgspec.json.encode(p) + b"\n\n" for p in payloads)


class Job(Protocol):
    """A response built from its requests' outputs (server/chat.py, server/completions.py)."""

    def opening(self) -> list[Any]: ...  # the chunks that come before any output's
    def chunks(self, index: int, output: RequestOutput) -> list[Any]: ...  # stream `index`'s output's
    def closing(self) -> list[Any]: ...  # the chunks after the last output's


class EventWriter:
    """Writes events to a started response at once, without awaiting, so that it can be called from
    the engine's step: straight to the connection's transport, as HTTP/1.1 chunks where the response
    is chunked. A slow client's events wait in the transport's buffer."""

    def __init__(self, request: web.Request, response: web.StreamResponse) -> None:
        self._transport = request.transport
        self._chunked = response.headers.get(hdrs.TRANSFER_ENCODING, "").lower() == "chunked"

    def write(self, payloads: list[Any]) -> None:
        if not payloads:
            return
        data = sse_events(payloads)
        if self._transport is None or self._transport.is_closing():
            raise ConnectionResetError("the client left")
        self._transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)


async def write_sse(request: web.Request, job: Job, streams: list[EngineStream]) -> web.StreamResponse:
    """Send the job's chunks as `data:` lines, then `data: [DONE]`: its opening chunks with the
    headers, each output's as the engine delivers it, then its closing chunks. An error after the
    headers becomes an error event; a client that went away ends the stream quietly."""
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    try:
        try:
            await response.write(sse_events(job.opening()))  # with the headers
            writer = EventWriter(request, response)
            await deliver(streams, lambda index, output: writer.write(job.chunks(index, output)))
            tail = sse_events(job.closing())
        except ConnectionResetError:
            raise
        except Exception as exc:  # noqa: BLE001 - headers are out: report in the stream
            error = to_api_error(exc)
            if error is None:
                log.exception("unexpected error while streaming %s", request.path)
                error = internal_error()
            tail = b"data: " + error.body() + b"\n\n"
        await response.write(tail + DONE)
        await response.write_eof()
    except ConnectionResetError:
        log.debug("client left %s before the end of its stream", request.path)
    return response
