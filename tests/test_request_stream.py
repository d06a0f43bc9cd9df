"""A request's outputs between the step loop and its caller (cupyspec/engine/request_stream.py)."""

from __future__ import annotations

import asyncio
import gc
import threading
import warnings
from types import SimpleNamespace

import pytest

from cupyspec.engine.request_stream import OutputChannel, RequestStream


def _request(request_id: str = "r") -> SimpleNamespace:
    return SimpleNamespace(request_id=request_id, channel=OutputChannel(), finished=False)


def _output(name: str, finished: bool = False) -> SimpleNamespace:
    return SimpleNamespace(name=name, finished=finished)


def test_outputs_are_read_in_order_and_the_stream_ends_after_the_finished_one():
    async def main() -> list[str]:
        request, aborted = _request(), []
        stream = RequestStream.of(request, aborted.append)
        for name, finished in (("a", False), ("b", False), ("c", True)):
            request.channel.put(_output(name, finished))
        request.finished = True
        names = [output.name async for output in stream]
        await stream.aclose()
        assert aborted == []
        return names

    assert asyncio.run(main()) == ["a", "b", "c"]


def test_forwarding_hands_over_the_queued_outputs_then_each_as_it_is_put_until_closed():
    async def main() -> None:
        request, got, aborted = _request(), [], []
        stream = RequestStream.of(request, aborted.append)
        request.channel.put(_output("a"))
        assert (await anext(stream)).name == "a"
        request.channel.put(_output("b"))
        stream.forward(lambda item: got.append(item.name))
        assert got == ["b"]
        request.channel.put(_output("c"))
        assert got == ["b", "c"]
        await stream.aclose()
        request.channel.put(_output("d"))
        assert got == ["b", "c"] and aborted == ["r"]

    asyncio.run(main())


def test_a_stream_dropped_unfinished_aborts_its_request_and_one_never_read_adds_none():
    async def main() -> tuple[list[str], list[str]]:
        aborted, added = [], []
        stream = RequestStream.of(_request("dropped"), aborted.append)
        del stream
        gc.collect()

        async def opening() -> SimpleNamespace:
            added.append("unread")
            return _request("unread")

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "coroutine was never awaited"
            unread = RequestStream(opening(), aborted.append)
            del unread
            gc.collect()
        return aborted, added

    assert asyncio.run(main()) == (["dropped"], [])


def test_a_stream_dropped_on_another_thread_aborts_its_request_on_the_loop_that_added_it():
    async def main() -> list[tuple[str, bool]]:
        loop, aborted = asyncio.get_running_loop(), []
        on_loop = threading.get_ident()
        streams = [RequestStream.of(_request("elsewhere"),
                                    lambda request_id: aborted.append((request_id, threading.get_ident() == on_loop)))]
        dropper = threading.Thread(target=streams.clear)  # the last reference goes on another thread
        dropper.start()
        dropper.join()
        for _ in range(3):
            await asyncio.sleep(0)
        assert loop.is_running()
        return aborted

    assert asyncio.run(main()) == [("elsewhere", True)]


def test_outputs_are_forwarded_only_once_the_stream_has_been_read():
    async def opening() -> SimpleNamespace:
        return _request()

    async def main() -> None:
        stream = RequestStream(opening(), lambda request_id: None)
        with pytest.raises(RuntimeError, match="first has been read"):
            stream.forward(lambda item: None)
        await stream.aclose()

    asyncio.run(main())
