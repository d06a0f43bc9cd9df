"""Where the engine's model steps run: on the event loop itself (a GPU), or on a thread of their own (the CPU).

Both run calls in order and await the same way: `steps.run(fn, *args)` starts the call and returns
a future of its result, and `await steps.until(ready)` comes before a call that would wait for the
device.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class InlineSteps:
    """Calls run on the event loop. On a GPU no call blocks: launching a step only queues device
    work and copies, and `until` polls for them between the loop's other tasks, so collecting
    finds its results on the host. Handing each call to a thread would cost two thread switches,
    as much as the host work of a small step."""

    @staticmethod
    def run(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """`fn(*args)` now; its result as a done future."""
        future = asyncio.get_running_loop().create_future()
        future.set_result(fn(*args))
        return future

    @staticmethod
    async def until(ready: Callable[[], bool]) -> None:
        """Return once `ready()` holds, letting the loop run its other tasks meanwhile, and at least
        once even when it holds at once: a host-bound engine would otherwise keep the loop from
        streaming outputs and taking requests."""
        await asyncio.sleep(0)
        while not ready():
            await asyncio.sleep(0)

    def close(self) -> None:
        pass


class StepThread:
    """Runs calls one at a time, in order, on one daemon thread; each call's result is an asyncio future.
    For the CPU, where a step computes for as long as the model takes: the event loop never blocks.

    Cheaper than `asyncio.to_thread` per call (no executor, no context copy, one lock-free queue).
    """

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[asyncio.AbstractEventLoop, asyncio.Future, Callable, tuple] | None] = \
            queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def run(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """`fn(*args)` on the thread, after the calls before it; await the returned future for its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._calls.put((loop, future, fn, args))
        return future

    @staticmethod
    async def until(ready: Callable[[], bool]) -> None:
        """Nothing to poll: a call that needs the device's results waits for them on the thread."""

    def close(self) -> None:
        """Let the thread end once the calls already queued are done."""
        self._calls.put(None)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            loop, future, fn, args = call
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                result, error = None, exc
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:  # the loop is closed: nobody awaits the result any more
                pass


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
