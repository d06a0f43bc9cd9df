"""A request's outputs on their way from the step loop to its caller: the channel the engine puts
them in, and the stream the caller reads them from, or has them forwarded from."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from cupyspec.outputs import RequestOutput

if TYPE_CHECKING:
    from cupyspec.engine.output_processor import RequestState

Item = RequestOutput | BaseException  # an output, or the error that ends the request's outputs
Consumer = Callable[[Item], None]


class OutputChannel:
    """A request's outputs, or the error that ends them, in order, for one reader: an awaiting one
    (`take`, `ready`), or a consumer the engine calls with each as it is put (`forward`).

    Lighter than asyncio.Queue (no size bound, no task accounting, one reader), since the engine
    puts one output per request and step.
    """

    __slots__ = ("_items", "_waiter", "_consumer")

    def __init__(self) -> None:
        self._items: deque[Item] = deque()
        self._waiter: asyncio.Future | None = None
        self._consumer: Consumer | None = None

    def put(self, item: Item) -> None:
        if self._consumer is not None:
            self._consumer(item)
            return
        self._items.append(item)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def take(self) -> Item | None:
        """The next item, or None if there is none yet (then await `ready()`)."""
        return self._items.popleft() if self._items else None

    def ready(self) -> asyncio.Future:
        """A future done once an item is put."""
        self._waiter = asyncio.get_running_loop().create_future()
        return self._waiter

    def forward(self, consumer: Consumer | None) -> None:
        """Hand the items put so far, then each one as it is put, to `consumer` (None: queue them
        again). It is called from the engine's step: it must not raise, nor block."""
        self._consumer = consumer
        while consumer is not None and self._items:
            consumer(self._items.popleft())


class RequestStream:
    """A request's outputs as the engine delivers them, for `async for`; its last is `finished`.

    The request is added on the first `anext` (`opening`), which raises what is wrong with it. Once
    added, `forward` may hand every later output to a callback instead, called from the step that
    makes it, which spares the caller a turn of the event loop per output. `aclose` (or dropping the
    stream) aborts a request that has not finished, which frees its KV blocks; a stream dropped on
    another thread (a garbage collection there) aborts it on the event loop that added it.
    """

    def __init__(self, opening: Coroutine[Any, Any, RequestState] | None, abort: Callable[[str], None]) -> None:
        self._opening = opening
        self._abort = abort
        self._request: RequestState | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop that added the request
        self._ended = False  # the last output or an error was read, or the stream closed

    @classmethod
    def of(cls, request: RequestState, abort: Callable[[str], None]) -> RequestStream:
        """The stream of a request added already."""
        stream = cls(None, abort)
        stream._request, stream._loop = request, asyncio.get_running_loop()
        return stream

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._ended:
            raise StopAsyncIteration
        if self._request is None:
            await self._open()
        channel = self._request.channel
        item = channel.take()
        while item is None:
            await channel.ready()
            item = channel.take()
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        self._ended = item.finished
        return item

    async def _open(self) -> None:
        opening, self._opening = self._opening, None
        if opening is None:
            raise RuntimeError("the request's stream was closed before it opened")
        try:
            self._request, self._loop = await opening, asyncio.get_running_loop()
        except BaseException:
            self._ended = True
            raise

    def forward(self, consumer: Consumer) -> None:
        """Hand the outputs not read yet, then each one as the engine makes it (or the error that ends
        them), to `consumer`, until the stream is closed. The stream must have been read from."""
        if self._request is None:
            raise RuntimeError("a request's outputs are forwarded once its first has been read")
        self._request.channel.forward(consumer)

    async def aclose(self) -> None:
        self._close()

    def _close(self) -> None:
        """Stop forwarding, and abort the request unless it finished."""
        self._ended = True
        if self._opening is not None:  # never opened: nothing was added
            self._opening.close()
            self._opening = None
        request, self._request = self._request, None
        if request is not None:
            request.channel.forward(None)
            if not request.finished:
                self._abort(request.request_id)

    def __del__(self) -> None:
        if self._opening is None and self._request is None:
            return
        try:
            here = asyncio.get_running_loop() is self._loop
        except RuntimeError:  # no loop runs on this thread
            here = False
        if here or self._request is None:  # never opened: closing its coroutine touches no engine state
            self._close()
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._close)
