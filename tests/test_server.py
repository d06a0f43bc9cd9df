"""The HTTP server over the real engine (tiny model on the CPU): error bodies, stream format,
disconnects freeing the KV cache, 503 on a full queue and while shutting down, health during a long
prefill, graceful shutdown of the CLI on SIGTERM and SIGINT."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from serve_process import ServeProcess
from server_fixtures import (
    TINY_MAX_WAITING,
    LiveServer,
    default_model_file,
    sse_events,
    tiny_config,
    tiny_server,  # noqa: F401
)
from tiny_models import tiny_model_paths

from cupyspec.config import EngineConfig, SchedulerConfig

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "Hello there"}]


def http(server: LiveServer, method: str, path: str, body: object = None,
         raw: bytes | None = None) -> tuple[int, str, str]:
    """(status, content type, body text) of one request."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read().decode()


BAD_REQUESTS = [
    (COMPLETIONS, b"{not json", 400, None),
    (COMPLETIONS, {"max_tokens": 3}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": "3"}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    (COMPLETIONS, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    (COMPLETIONS, {"prompt": "hi", "n": 0}, 400, "n"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 600}, 400, "max_tokens"),  # the context is 512
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 600, "stream": True}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": [5, 99999]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": []}, 400, "prompt"),
    (COMPLETIONS, {"prompt": ["hi", [1, 2]]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "suffix": "!"}, 400, "suffix"),
    (COMPLETIONS, {"prompt": "hi", "n": 2, "best_of": 3}, 400, "best_of"),
    (COMPLETIONS, {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    (COMPLETIONS, {"prompt": "hi", "n": TINY_MAX_WAITING + 1}, 503, None),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content[0].type"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_object"}}, 400, "response_format"),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    (CHAT, {"messages": USER, "max_completion_tokens": 0, "stream": True}, 400, "max_completion_tokens"),
]


@pytest.mark.parametrize("path, body, status, param", BAD_REQUESTS)
def test_bad_request_gets_an_error_body(tiny_server: LiveServer, path: str, body: object, status: int,  # noqa: F811
                                        param: str | None) -> None:
    raw = body if isinstance(body, bytes) else None
    got, content_type, text = http(tiny_server, "POST", path, None if raw else body, raw)
    assert got == status and content_type.startswith("application/json"), text
    error = json.loads(text)["error"]
    assert error["message"] and error["param"] == param and error["type"] in (
        "invalid_request_error", "not_found_error", "server_error")
    ok, _, text = http(tiny_server, "POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
    assert ok == 200 and json.loads(text)["usage"]["completion_tokens"] == 2
    assert tiny_server.wait_idle().num_used_kv_blocks == 0


def test_unknown_route_and_wrong_method(tiny_server: LiveServer) -> None:  # noqa: F811
    status, content_type, text = http(tiny_server, "GET", "/v1/nothing")
    assert status == 404 and content_type.startswith("application/json")
    assert json.loads(text)["error"]["type"] == "not_found_error"
    status, _, text = http(tiny_server, "GET", CHAT)
    assert status == 405 and json.loads(text)["error"]["message"]
    status, _, text = http(tiny_server, "POST", "/health", {})
    assert status == 405
    assert http(tiny_server, "GET", "/health")[0] == 200


def test_stream_format(tiny_server: LiveServer) -> None:  # noqa: F811
    status, content_type, text = http(tiny_server, "POST", CHAT, {
        "messages": USER, "max_tokens": 5, "n": 2, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True}})
    assert status == 200 and content_type.startswith("text/event-stream")
    events = sse_events(text)
    assert {e["object"] for e in events} == {"chat.completion.chunk"} and len({e["id"] for e in events}) == 1
    assert events[0]["id"].startswith("chatcmpl-") and events[0]["model"] == tiny_server.model_name
    by_choice: dict[int, list[dict]] = {0: [], 1: []}
    for event in events[:-1]:
        (choice,) = event["choices"]
        by_choice[choice["index"]].append(choice)
    for choices in by_choice.values():
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        assert [c["finish_reason"] for c in choices[1:]] == [None] * (len(choices) - 2) + ["length"]
        assert all("role" not in c["delta"] for c in choices[1:])
    usage = events[-1]["usage"]
    assert events[-1]["choices"] == [] and usage["completion_tokens"] == 10
    assert usage["total_tokens"] == usage["prompt_tokens"] + 10

    status, _, text = http(tiny_server, "POST", COMPLETIONS, {"prompt": "Hello", "max_tokens": 4, "stream": True,
                                                              "ignore_eos": True, "logprobs": 2})
    events = sse_events(text)
    assert events[0]["id"].startswith("cmpl-") and all(e["object"] == "text_completion" for e in events)
    tokens = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    offsets = [o for e in events for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert len(tokens) == 4 and offsets == sorted(offsets) and events[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in events[-1]


def test_disconnecting_clients_free_the_kv_cache(tiny_server: LiveServer) -> None:  # noqa: F811
    url = tiny_server.base_url + COMPLETIONS

    def body(i: int) -> dict:  # 400 tokens each: minutes for 50 clients unless they are aborted
        return {"prompt": f"Tell story number {i}", "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            async def start_stream(i: int) -> aiohttp.ClientResponse:
                response = await session.post(url, json=body(i))
                assert response.status == 200
                assert (await response.content.readline()).startswith(b"data: ")
                return response

            async def leave_before_headers(i: int) -> None:
                task = asyncio.ensure_future(session.post(url, json=body(i)))
                await asyncio.sleep(0.02 * i)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

            streams = await asyncio.gather(*(start_stream(i) for i in range(40)))
            load = tiny_server.stats()
            assert load.num_running + load.num_waiting >= 40 and load.num_used_kv_blocks > 0
            for response in streams:
                response.close()
            await asyncio.gather(*(leave_before_headers(i) for i in range(10)))

    asyncio.run(main())
    stats = tiny_server.wait_idle(timeout=5.0)
    assert (stats.num_running, stats.num_waiting, stats.num_used_kv_blocks) == (0, 0, 0)
    status, _, text = http(tiny_server, "POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
    assert status == 200 and json.loads(text)["choices"][0]["finish_reason"] == "length"


def test_metrics_endpoint(tiny_server: LiveServer) -> None:  # noqa: F811
    http(tiny_server, "POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
    status, content_type, text = http(tiny_server, "GET", "/metrics")
    assert status == 200 and content_type.startswith("text/plain")
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    success = sum(float(v) for k, v in values.items() if k.startswith('cupyspec:request_success_total{'))
    names = {k.split("{")[0] for k in values}
    generated = sum(float(v) for k, v in values.items() if k.split("{")[0] == "cupyspec:generation_tokens_total")
    assert success >= 1 and generated >= 3
    assert "cupyspec:kv_cache_usage_perc" in names and "# TYPE cupyspec:time_to_first_token_seconds histogram" in text


@pytest.fixture
def held_server(tmp_path: Path) -> Iterator[tuple[LiveServer, threading.Event]]:
    """A fresh server for one running sequence and two waiting, whose model steps wait (in their worker
    thread, the event loop free) until the event is set: requests pile up for as long as a test needs."""
    config = tiny_config(tmp_path)
    config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, max_num_seqs=1,
                                                                       max_waiting_requests=2))
    server = LiveServer(config).start()
    release = threading.Event()
    launch_step = server.engine.runner.launch

    def held_step(inputs: Any) -> Any:
        release.wait(60)
        return launch_step(inputs)

    server.engine.runner.launch = held_step
    try:
        yield server, release
    finally:
        release.set()
        server.stop()


async def post(session: aiohttp.ClientSession, path: str, body: dict) -> tuple[int, dict]:
    async with session.post(path, json=body) as response:
        return response.status, json.loads(await response.text())


async def until_load(server: LiveServer, running: int, waiting: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        stats = await asyncio.to_thread(server.stats)
        if (stats.num_running, stats.num_waiting) == (running, waiting):
            return
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.01)


def assert_503(status: int, body: dict, code: str) -> None:
    assert status == 503 and set(body) == {"error"}, body
    error = body["error"]
    assert (error["type"], error["param"], error["code"]) == ("server_error", None, code) and error["message"]


CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=30)  # a request the server should refuse must not hang the test
SHORT = {"prompt": "hi", "max_tokens": 3, "ignore_eos": True}
REFUSED_REQUESTS = [(COMPLETIONS, SHORT), (COMPLETIONS, {**SHORT, "stream": True}),
                    (CHAT, {"messages": USER, "max_tokens": 3}), (CHAT, {"messages": USER, "stream": True})]


def test_full_waiting_queue_answers_503_then_serves_again(held_server: tuple[LiveServer, threading.Event]) -> None:
    server, release = held_server

    async def main() -> None:
        async with aiohttp.ClientSession(base_url=server.base_url, timeout=CLIENT_TIMEOUT) as session:
            queued = [asyncio.ensure_future(post(session, COMPLETIONS, SHORT))]
            await until_load(server, running=1, waiting=0)  # admitted before the queue fills behind it
            queued += [asyncio.ensure_future(post(session, COMPLETIONS, SHORT)) for _ in range(2)]
            await until_load(server, running=1, waiting=2)
            for path, body in REFUSED_REQUESTS:
                assert_503(*await post(session, path, body), code="overloaded")
            assert (await asyncio.to_thread(server.stats)).num_waiting == 2  # the refused ones left no trace
            release.set()
            for status, response in await asyncio.gather(*queued):
                assert status == 200 and response["usage"]["completion_tokens"] == 3
            status, response = await post(session, COMPLETIONS, SHORT)
            assert status == 200 and response["choices"][0]["finish_reason"] == "length"

    asyncio.run(main())
    assert server.wait_idle().num_used_kv_blocks == 0


def test_requests_during_shutdown_get_503_while_running_ones_finish(
        held_server: tuple[LiveServer, threading.Event]) -> None:
    server, release = held_server

    async def main() -> None:
        async with aiohttp.ClientSession(base_url=server.base_url, timeout=CLIENT_TIMEOUT) as session:
            running = asyncio.ensure_future(post(session, COMPLETIONS, SHORT))
            await until_load(server, running=1, waiting=0)
            shutdown = asyncio.ensure_future(asyncio.to_thread(server.run, server.engine.shutdown(30.0)))
            while server.engine.is_serving:
                await asyncio.sleep(0.01)
            for path, body in REFUSED_REQUESTS:
                assert_503(*await post(session, path, body), code="engine_closed")
            async with session.get("/health") as health:
                assert health.status == 503
            assert not running.done() and not shutdown.done()
            release.set()
            status, response = await running
            assert status == 200 and response["choices"][0]["finish_reason"] == "length"
            await shutdown

    asyncio.run(main())
    assert server.stats().num_used_kv_blocks == 0


def test_health_answers_during_a_long_prefill() -> None:
    model = default_model_file()
    if model is None:
        pytest.skip("the default model is not on disk")
    config = EngineConfig(model=str(model), device="cpu",
                          scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8))
    server = LiveServer(config).start()
    try:
        prompt = server.engine.tokenizer.encode("The history of the river valley, told in detail. " * 400)[:4000]

        async def main() -> None:
            async with aiohttp.ClientSession() as session:
                long_request = asyncio.ensure_future(
                    session.post(server.base_url + COMPLETIONS, json={"prompt": prompt, "max_tokens": 1}))
                await asyncio.sleep(0.5)
                for _ in range(5):
                    start = time.monotonic()
                    async with session.get(server.base_url + "/health") as response:
                        assert response.status == 200
                    assert time.monotonic() - start < 1.0
                    await asyncio.sleep(0.1)
                assert not long_request.done(), "the prefill ended before the health checks; use a longer prompt"
                long_request.cancel()
                await asyncio.gather(long_request, return_exceptions=True)

        asyncio.run(main())
        assert server.wait_idle(timeout=10.0).num_used_kv_blocks == 0
    finally:
        server.stop()


@pytest.mark.parametrize(("stop_signal", "event_loop"), [(signal.SIGTERM, "uvloop"), (signal.SIGINT, "uvloop"),
                                                        (signal.SIGTERM, "asyncio")])
def test_cli_serves_and_shuts_down_gracefully(tmp_path: Path, stop_signal: signal.Signals, event_loop: str) -> None:
    _hf, gguf_path = tiny_model_paths(tmp_path, "llama")
    with ServeProcess(["--model", str(gguf_path), "--device", "cpu", "--served-model-name", "tiny",
                       "--event-loop", event_loop], tmp_path / "serve.log") as server:
        server.wait_ready(60)
        request = urllib.request.Request(server.base_url + COMPLETIONS, method="POST", data=json.dumps(
            {"prompt": "Once", "max_tokens": 300, "ignore_eos": True, "stream": True}).encode())
        with urllib.request.urlopen(request, timeout=60) as response:
            first = response.readline()
            server.process.send_signal(stop_signal)
            rest = response.read().decode()
        events = sse_events(first.decode() + rest)
        assert events[-1]["choices"][0]["finish_reason"] == "length"  # finished, not cut off
        assert server.process.wait(timeout=60) == 0
