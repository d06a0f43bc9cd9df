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
        prefill_stats = prefill.wait_idle()
        prompts_run = prefill.engine.block_manager.num_prefix_query_tokens
    assert got == single_answers
    assert prompts_run > 0  # the prompts ran on the prefill server
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
