"""Prefill and decode servers on loopback (engines on the CPU, K/V through NIXL): completions through
them equal one server's, a prefill server that is down is skipped for another, none at all is a 503,
and afterwards neither side holds a KV block."""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request

import pytest

pytest.importorskip("nixl", reason="KV transfer needs NIXL: pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1")

from server_fixtures import LiveServer, tiny_config  # noqa: E402

BODIES = [
    {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "logprobs": 3, "echo": True},
    {"prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0.8, "seed": 7, "logprobs": 1},
    {"prompt": "Hello there", "max_tokens": 12, "temperature": 0, "stream": True},
]


def post(base_url: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(base_url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def answers(base_url: str) -> list[object]:
    """Each body's answer: its choices (text, logprobs), or its stream's text."""
    results = []
    for body in BODIES:
        status, text = post(base_url, body)
        assert status == 200, text
        if body.get("stream"):
            events = [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
            results.append("".join(e["choices"][0]["text"] for e in events if e["choices"]))
        else:
            choice = json.loads(text)["choices"][0]
            results.append((choice["text"], choice["logprobs"]))
    return results


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return tiny_config(tmp_path_factory.mktemp("disagg-model"))


@pytest.fixture(scope="module")
def single_answers(config):
    with LiveServer(config) as server:
        return answers(server.base_url)


def test_a_decode_server_with_a_prefill_server_answers_as_one_server(config, single_answers):
    with LiveServer(dataclasses.replace(config, role="prefill")) as prefill:
        with LiveServer(dataclasses.replace(config, role="decode", prefill_urls=(prefill.base_url,))) as decode:
            got = answers(decode.base_url)
            decode_stats = decode.wait_idle()
            fetched = decode.engine.metrics.kv_fetched_blocks.value(), decode.engine.metrics.kv_fetched_bytes.value()
        prefill_stats = prefill.wait_idle()
        prompts_run = prefill.engine.block_manager.num_prefix_query_tokens
    assert got == single_answers
    assert prompts_run > 0  # the prompts ran on the prefill server
    blocks, nbytes = fetched  # each prompt fits one block of 16 tokens: [K and V, 2 layers, 16, 2 heads, 16] fp32
    assert blocks == len(BODIES) and nbytes == blocks * 2 * 2 * 16 * 2 * 16 * 4
    assert decode_stats.num_used_kv_blocks == prefill_stats.num_used_kv_blocks == 0


def test_a_prefill_server_that_is_down_is_skipped_and_none_at_all_is_a_503(config, single_answers):
    down = "http://127.0.0.1:9"  # the discard port: refused
    with LiveServer(dataclasses.replace(config, role="prefill")) as prefill:
        with LiveServer(dataclasses.replace(config, role="decode", prefill_urls=(down, prefill.base_url))) as decode:
            got = answers(decode.base_url)
    assert got == single_answers
    with LiveServer(dataclasses.replace(config, role="decode", prefill_urls=(down,))) as decode:
        status, text = post(decode.base_url, BODIES[0])
        stats = decode.wait_idle()
    assert status == 503 and json.loads(text)["error"]["code"] == "prefill_unavailable"
    assert stats.num_used_kv_blocks == 0


def test_requests_survive_a_prefill_server_stopped_mid_run(config):
    """200 requests, 16 at a time, over two prefill servers, one of which stops after the first 50:
    every request completes (the decode server skips the stopped one, or computes a prompt itself
    whose K/V it could no longer read) or fails with an OpenAI error body; no block stays in use."""
    import concurrent.futures
    import threading

    body = {"prompt": "Count: 1 2 3", "max_tokens": 8, "temperature": 0}
    config = dataclasses.replace(config, prefill_timeout_seconds=5.0)  # a read of the stopped pool gives up
    with LiveServer(dataclasses.replace(config, role="prefill")) as keeps:
        doomed = LiveServer(dataclasses.replace(config, role="prefill")).start()
        urls = (doomed.base_url, keeps.base_url)
        with LiveServer(dataclasses.replace(config, role="decode", prefill_urls=urls)) as decode:
            done, stopped = [], threading.Event()

            def one(_: int) -> tuple[int, str]:
                result = post(decode.base_url, body)
                done.append(result)
                if len(done) >= 50 and not stopped.is_set():
                    stopped.set()
                    doomed.stop()
                return result

            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                results = list(pool.map(one, range(200)))
            decode_stats = decode.wait_idle()
        keeps_stats = keeps.wait_idle()
    assert stopped.is_set()
    texts = {json.loads(text)["choices"][0]["text"] for status, text in results if status == 200}
    assert len(texts) == 1  # one greedy answer, wherever its prompt ran
    failed = [json.loads(text)["error"] for status, text in results if status != 200]
    assert all(status in (200, 503) for status, _ in results) and all(e["message"] for e in failed)
    assert len(failed) < 20
    assert decode_stats.num_used_kv_blocks == keeps_stats.num_used_kv_blocks == 0
