"""A real engine behind the HTTP app on 127.0.0.1, run by an event loop in a background thread,
so tests can talk to it over a socket with any client, synchronous or not; and the parser of a
streamed response's events.

Import the fixtures into a test module: `from server_fixtures import tiny_server  # noqa: F401`.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from tiny_models import tiny_model_paths

from cupyspec.config import CacheConfig, EngineConfig, SchedulerConfig
from cupyspec.engine import AsyncEngine, EngineStats
from cupyspec.loader.default_model import DEFAULT_MODEL, KNOWN_MODELS, MODEL_ENV_VAR, cache_dir
from cupyspec.server.app import create_app, start_server

T = TypeVar("T")

TINY_MAX_WAITING = 64  # small, so that one request with n > 64 is refused with 503


class LiveServer:
    """An AsyncEngine serving HTTP on a free port of 127.0.0.1 until `stop()`."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="live-server", daemon=True)
        self.engine: AsyncEngine
        self.base_url = ""

    def start(self) -> LiveServer:
        self._thread.start()
        self.run(self._start())
        return self

    def __enter__(self) -> LiveServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _start(self) -> None:
        self.engine = await AsyncEngine.create(self.config)
        self._runner, port = await start_server(create_app(self.engine, self.config.role == "prefill"), "127.0.0.1", 0)
        self.base_url = f"http://127.0.0.1:{port}"

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        """Run a coroutine on the server's event loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    def stats(self) -> EngineStats:
        async def snapshot() -> EngineStats:
            return self.engine.stats()
        return self.run(snapshot())

    def wait_idle(self, timeout: float = 10.0) -> EngineStats:
        """Wait until no request runs or waits and no KV block is held; returns the last snapshot."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            idle = stats.num_running == 0 and stats.num_waiting == 0 and stats.num_used_kv_blocks == 0
            if idle or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def stop(self) -> None:
        async def close() -> None:
            await self._runner.cleanup()
            await self.engine.shutdown(5.0)
        try:
            self.run(close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()


def sse_events(text: str) -> list[dict]:
    """The JSON payloads of a streamed response's `data:` events, checking that it ends with [DONE]."""
    blocks = text.split("\n\n")
    assert blocks[-2:] == ["data: [DONE]", ""] and all(b.startswith("data: ") for b in blocks[:-1]), text[-300:]
    return [json.loads(b[len("data: "):]) for b in blocks[:-2]]


def tiny_config(model_dir: Path, **scheduler: Any) -> EngineConfig:
    """A tiny random llama model (512-token context, ChatML) on the CPU with a small KV pool."""
    _hf_dir, gguf_path = tiny_model_paths(model_dir, "llama")
    return EngineConfig(model=str(gguf_path), device="cpu", served_model_name="tiny-llama",
                        cache=CacheConfig(kv_cache_memory_bytes=32 * 2**20),
                        scheduler=SchedulerConfig(max_num_seqs=64, max_waiting_requests=TINY_MAX_WAITING,
                                                  **scheduler))


def default_model_file() -> Path | None:
    """The default model's GGUF if it is already on disk (tests never download it)."""
    override = os.environ.get(MODEL_ENV_VAR)
    path = Path(override) if override else cache_dir() / KNOWN_MODELS[DEFAULT_MODEL].filename
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with LiveServer(tiny_config(tmp_path_factory.mktemp("tiny-model"))) as server:
        yield server
