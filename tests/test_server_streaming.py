"""Engine requests as streams (server/streaming.py): opening, merging and closing, without a model."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest

from cupyspec.server.streaming import engine_streams, merged


class _Engine:
    """Records aborts, as AsyncEngine.abort frees a request's KV blocks."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _output(name: str, finished: bool = False) -> SimpleNamespace:
    return SimpleNamespace(name=name, finished=finished)


async def _gated(names: list[str], gate: asyncio.Event) -> AsyncIterator[SimpleNamespace]:
    """The first output at once, each later one after `gate` is set (and cleared)."""
    for i, name in enumerate(names):
        if i:
            await gate.wait()
            gate.clear()
        yield _output(name, finished=i == len(names) - 1)


def test_a_single_stream_reaches_its_consumer_in_one_turn_of_the_loop():
    """No task stands between one request's engine outputs and its response: on a GPU the event
    loop turns once a step while the engine's host work outlasts the device's, so each task in
    between would hold every chunk back by a step."""
    async def main() -> None:
        gate, got = asyncio.Event(), []
        async with engine_streams(_Engine(), [(_gated(["a", "b", "c"], gate), "r")]) as streams:
            async def consume() -> None:
                async for index, output in merged(streams):
                    got.append((index, output.name))

            consumer = asyncio.create_task(consume())
            await asyncio.sleep(0)
            assert got == [(0, "a")]
            for expected in ("b", "c"):
                gate.set()
                await asyncio.sleep(0)  # one turn
                assert got[-1] == (0, expected)
            await consumer

    asyncio.run(main())


def test_several_streams_are_merged_as_their_outputs_come():
    async def main() -> None:
        gates = [asyncio.Event(), asyncio.Event()]
        requests = [(_gated([f"{i}{j}" for j in range(3)], gates[i]), f"r{i}") for i in range(2)]
        got = []
        async with engine_streams(_Engine(), requests) as streams:
            async def consume() -> None:
                async for index, output in merged(streams):
                    got.append((index, output.name))

            consumer = asyncio.create_task(consume())
            for i in (1, 1, 0, 0):
                for _ in range(3):
                    await asyncio.sleep(0)
                gates[i].set()
            await consumer
        assert sorted(got) == [(0, "00"), (0, "01"), (0, "02"), (1, "10"), (1, "11"), (1, "12")]
        assert [name for index, name in got if index == 1] == ["10", "11", "12"]
        assert got.index((1, "12")) < got.index((0, "01"))  # stream 1 ran ahead

    asyncio.run(main())


@pytest.mark.parametrize("num_requests", [1, 2])
def test_streams_left_unfinished_are_aborted(num_requests: int):
    """A response that stops early (client gone) aborts its requests in the engine; finished ones are not."""
    async def main() -> list[str]:
        engine, gate = _Engine(), asyncio.Event()
        requests = [(_gated(["a", "b"], gate), f"r{i}") for i in range(num_requests)]
        async with engine_streams(engine, requests) as streams:
            async for _ in merged(streams):
                break
        return engine.aborted

    assert sorted(asyncio.run(main())) == [f"r{i}" for i in range(num_requests)]


@pytest.mark.parametrize("num_requests", [1, 2])
def test_a_request_that_fails_to_open_raises_and_aborts_the_others(num_requests: int):
    async def failing() -> AsyncIterator[SimpleNamespace]:
        raise ValueError("bad prompt")
        yield  # an async generator

    async def main(engine: _Engine) -> None:
        requests = [(failing(), "bad")] + [(_gated(["a", "b"], asyncio.Event()), f"r{i}")
                                             for i in range(num_requests - 1)]
        async with engine_streams(engine, requests):
            pytest.fail("opened")

    engine = _Engine()
    with pytest.raises(ValueError, match="bad prompt"):
        asyncio.run(main(engine))
    assert sorted(engine.aborted) == ["bad"] + [f"r{i}" for i in range(num_requests - 1)]
