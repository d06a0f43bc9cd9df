"""Engine requests as streams (server/streaming.py): opening, delivering and closing, without a model."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from cupyspec.engine.request_stream import OutputChannel, RequestStream
from cupyspec.server.streaming import deliver, engine_streams


class _Engine:
    """Hands out request streams whose outputs a test puts, as the step loop puts them, and
    records aborts, as the step loop frees an aborted request's KV blocks."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.requests: dict[str, SimpleNamespace] = {}

    def stream(self, request_id: str, error: Exception | None = None) -> RequestStream:
        async def opening() -> SimpleNamespace:
            if error is not None:
                raise error
            request = SimpleNamespace(request_id=request_id, channel=OutputChannel(), finished=False)
            self.requests[request_id] = request
            request.channel.put(SimpleNamespace(name=f"{request_id}:0", finished=False))
            return request

        return RequestStream(opening(), self.aborted.append)

    def put(self, request_id: str, name: str, finished: bool = False) -> None:
        request = self.requests[request_id]
        request.finished = finished
        request.channel.put(SimpleNamespace(name=name, finished=finished))


def test_outputs_reach_the_consumer_from_inside_the_step_that_makes_them():
    """No task stands between a request's outputs and its response: on a GPU the event loop turns
    once a step while the engine's host work outlasts the device's, so each turn in between would
    cost the host time per output that the step loop needs."""
    async def main() -> None:
        engine, got = _Engine(), []
        async with engine_streams([engine.stream("r")]) as streams:
            delivery = asyncio.ensure_future(deliver(streams, lambda index, output: got.append(output.name)))
            await asyncio.sleep(0)
            assert got == ["r:0"]
            engine.put("r", "r:1")
            assert got == ["r:0", "r:1"]  # no turn of the loop in between
            engine.put("r", "r:2", finished=True)
            await asyncio.wait_for(delivery, 1)
        assert engine.aborted == []

    asyncio.run(main())


def test_several_streams_are_delivered_as_their_outputs_come_and_end_when_all_have_finished():
    async def main() -> None:
        engine, got = _Engine(), []
        async with engine_streams([engine.stream("a"), engine.stream("b")]) as streams:
            delivery = asyncio.ensure_future(deliver(streams, lambda index, output: got.append((index, output.name))))
            await asyncio.sleep(0)
            engine.put("b", "b:1")
            engine.put("b", "b:2", finished=True)
            await asyncio.sleep(0)
            assert not delivery.done()  # stream a has not finished
            engine.put("a", "a:1", finished=True)
            await asyncio.wait_for(delivery, 1)
        assert got == [(0, "a:0"), (1, "b:0"), (1, "b:1"), (1, "b:2"), (0, "a:1")]
        assert engine.aborted == []

    asyncio.run(main())


@pytest.mark.parametrize("num_requests", [1, 2])
def test_streams_left_unfinished_are_aborted_and_forward_nothing_more(num_requests: int):
    """A response that stops early (client gone) aborts its requests in the engine; finished ones are
    not, and nothing reaches the response after it has closed its streams."""
    async def main() -> tuple[list[str], list[str]]:
        engine, got = _Engine(), []
        ids = [f"r{i}" for i in range(num_requests)]
        async with engine_streams([engine.stream(rid) for rid in ids]) as streams:
            delivery = asyncio.ensure_future(deliver(streams, lambda index, output: got.append(output.name)))
            await asyncio.sleep(0)
            if num_requests > 1:
                engine.put("r1", "r1:1", finished=True)
            delivery.cancel()
        engine.put("r0", "r0:late")
        return engine.aborted, got

    aborted, got = asyncio.run(main())
    assert aborted == ["r0"]
    assert "r0:late" not in got


def test_an_error_from_the_engine_or_the_consumer_ends_the_delivery_and_is_raised_there():
    async def main(fail_in: str) -> list[str]:
        engine, got = _Engine(), []

        def consume(index: int, output: SimpleNamespace) -> None:
            if output.name == "r:1" and fail_in == "consumer":
                raise ValueError("cannot render")
            got.append(output.name)

        async with engine_streams([engine.stream("r")]) as streams:
            delivery = asyncio.ensure_future(deliver(streams, consume))
            await asyncio.sleep(0)
            if fail_in == "engine":
                engine.requests["r"].channel.put(ValueError("the engine failed"))
            else:
                engine.put("r", "r:1")  # the consumer's error does not reach the engine's step
            engine.put("r", "r:2")
            with pytest.raises(ValueError):
                await delivery
        assert engine.aborted == ["r"]
        return got

    assert asyncio.run(main("engine")) == ["r:0"]
    assert asyncio.run(main("consumer")) == ["r:0"]


@pytest.mark.parametrize("num_requests", [1, 2])
def test_a_request_that_fails_to_open_raises_and_aborts_the_others(num_requests: int):
    async def main(engine: _Engine) -> None:
        requests = [engine.stream("bad", ValueError("bad prompt"))] + [engine.stream(f"r{i}")
                                                                         for i in range(num_requests - 1)]
        async with engine_streams(requests):
            pytest.fail("opened")

    engine = _Engine()
    with pytest.raises(ValueError, match="bad prompt"):
        asyncio.run(main(engine))
    assert sorted(engine.aborted) == [f"r{i}" for i in range(num_requests - 1)]
