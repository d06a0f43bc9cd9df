"""Prefill and decode servers on loopback (engines on the CPU, K/V through NIXL). As processes of
their own: completions and chat through a decode server and two prefill servers equal one server's,
with no speculation, ngram and MTP; 200 requests at 16 streams complete while a prefill server is
killed; both roles shut down gracefully on SIGTERM. In the test process: a prefill server that is
down is skipped for another, none at all (or none with the decode server's MTP head) is a 503.
Afterwards neither side holds a KV block."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import signal
import threading
import urllib.error
import urllib.request
from contextlib import ExitStack

import pytest

pytest.importorskip("nixl", reason="KV transfer needs NIXL: pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1")

from serve_process import ServeProcess  # noqa: E402
from server_fixtures import LiveServer, tiny_config  # noqa: E402
from tiny_models import TinySpec, random_head_weights, tiny_model_paths, write_head_file  # noqa: E402

from cupyspec.spec_decode.speculative_config import SpeculativeConfig  # noqa: E402

# completions and chat, greedy and seeded, whole and streamed, with top-5 logprobs; no two prompts share
# a block (one server's prefix cache would compute the second's last rows apart: other roundings)
BODIES = [
    {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "logprobs": 5, "echo": True},
    {"prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0.8, "seed": 7, "logprobs": 5},
    {"prompt": "Hello there", "max_tokens": 12, "temperature": 0, "logprobs": 5, "stream": True},
    {"prompt": "One two three four five", "max_tokens": 12, "temperature": 0.7, "top_p": 0.9, "seed": 3,
     "logprobs": 5, "echo": True, "stream": True},
    {"messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 12, "temperature": 0,
     "logprobs": True, "top_logprobs": 5},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}], "max_tokens": 12,
     "temperature": 0.8, "seed": 5, "logprobs": True, "top_logprobs": 5, "stream": True},
]
# the fixed back-off rule: drafts do not depend on timing, so speculate_metrics are one server's
SPECULATION = {None: None, "ngram": {"method": "ngram", "num_speculative_tokens": 3},
               "mtp": {"method": "mtp", "num_speculative_tokens": 3, "num_model_steps": 3}}


def post(base_url: str, body: dict) -> tuple[int, str]:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    request = urllib.request.Request(base_url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def answers(base_url: str) -> list[tuple[object, ...]]:
    """Each body's answer, one at a time: its text, logprobs and speculate_metrics (a stream's joined)."""
    results = []
    for body in BODIES:
        status, text = post(base_url, body)
        assert status == 200, text
        if body.get("stream"):
            events = [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
            choices = [e["choices"][0] for e in events if e["choices"]]
            results.append(("".join(c.get("text") or c.get("delta", {}).get("content") or "" for c in choices),
                            [c["logprobs"] for c in choices], events[-1].get("speculate_metrics")))
        else:
            answer = json.loads(text)
            choice = answer["choices"][0]
            results.append((choice.get("text") or choice["message"]["content"], choice["logprobs"],
                            answer.get("speculate_metrics")))
    return results


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[str, str]:
    """The tiny model's GGUF and a random MTP head for it."""
    folder = tmp_path_factory.mktemp("disagg-model")
    return str(tiny_model_paths(folder, "llama")[1]), str(write_head_file(folder / "head.safetensors",
                                                                            random_head_weights(TinySpec())))


def serve(model: tuple[str, str], method: str | None, log_path, *args: str) -> ServeProcess:
    """`cupyspec-serve` on the CPU, one BLAS thread, the tiny model, speculating with `method`."""
    speculation = SPECULATION[method]
    if speculation is not None:
        speculation = {**speculation, "cost_aware_backoff": False, "min_acceptance_rate": 0.0,
                       **({"model": model[1]} if method == "mtp" else {})}
    flags = ["--speculative-config", json.dumps(speculation)] if speculation else []
    return ServeProcess(["--model", model[0], "--device", "cpu", "--cpu-threads", "1", "--kv-cache-memory", "32MiB",
                         *flags, *args], log_path)


@pytest.mark.parametrize("method", [None, "ngram", "mtp"])
def test_a_decode_server_with_two_prefill_servers_answers_as_one_server(model, method, tmp_path):
    with serve(model, method, tmp_path / "single.log") as single:
        want = answers(single.wait_ready().base_url)
    with ExitStack() as servers:
        prefills = [servers.enter_context(serve(model, method, tmp_path / f"prefill{i}.log", "--role", "prefill"))
                    for i in range(2)]
        urls = [flag for p in prefills for flag in ("--prefill-url", p.wait_ready().base_url)]
        decode = servers.enter_context(serve(model, method, tmp_path / "decode.log", "--role", "decode", *urls))
        got = answers(decode.wait_ready().base_url)
        decode_metrics = decode.wait_idle()
        prefill_metrics = [p.wait_idle() for p in prefills]
    assert got == want
    if method is not None:  # drafts were verified
        assert sum(speculate["num_draft_tokens"] for _, _, speculate in got) > 0
    assert all(m["prompt_tokens_total"] > 0 for m in prefill_metrics)  # both prefill servers ran prompts
    blocks, nbytes = decode_metrics["kv_transfer_blocks_total"], decode_metrics["kv_transfer_bytes_total"]
    layers = 3 if method == "mtp" else 2  # the head's K/V moves with the target's
    assert blocks >= len(BODIES) and nbytes == blocks * 2 * layers * 16 * 2 * 16 * 4  # [K and V, L, 16, 2, 16] fp32
    assert decode_metrics["kv_transfer_failures_total"] == 0
    assert decode_metrics["kv_cache_usage_perc"] == 0 and all(m["kv_cache_usage_perc"] == 0 for m in prefill_metrics)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return tiny_config(tmp_path_factory.mktemp("disagg-in-process"))


def test_a_prefill_server_that_is_down_is_skipped_and_none_at_all_is_a_503(config):
    with LiveServer(config) as single:
        want = answers(single.base_url)
    down = "http://127.0.0.1:9"  # the discard port: refused
    with LiveServer(dataclasses.replace(config, role="prefill")) as prefill:
        with LiveServer(dataclasses.replace(config, role="decode", prefill_urls=(down, prefill.base_url))) as decode:
            got = answers(decode.base_url)
    assert got == want
    with LiveServer(dataclasses.replace(config, role="decode", prefill_urls=(down,))) as decode:
        status, text = post(decode.base_url, BODIES[0])
        stats = decode.wait_idle()
    assert status == 503 and json.loads(text)["error"]["code"] == "prefill_unavailable"
    assert stats.num_used_kv_blocks == 0


def test_a_prefill_server_without_the_decode_servers_mtp_head_answers_with_a_503(config, tmp_path):
    head = write_head_file(tmp_path / "head.safetensors", random_head_weights(TinySpec()))
    mtp = SpeculativeConfig(method="mtp", model=str(head), num_speculative_tokens=1)
    with LiveServer(dataclasses.replace(config, role="prefill")) as prefill:
        decode_config = dataclasses.replace(config, role="decode", prefill_urls=(prefill.base_url,), speculative=mtp)
        with LiveServer(decode_config) as decode:
            status, text = post(decode.base_url, BODIES[0])
            stats = decode.wait_idle()
    assert status == 503 and "does not match ours" in json.loads(text)["error"]["message"]
    assert stats.num_used_kv_blocks == 0


def test_requests_survive_a_prefill_server_killed_mid_run(model, tmp_path):
    """200 requests, 16 at a time, over two prefill servers, one of which is killed (SIGKILL) after the
    first 50 answers: every request completes (the decode server skips the dead one, or computes a
    prompt itself whose K/V it could no longer read) or fails with an OpenAI error body; afterwards
    no block is in use on the decode server or the surviving prefill server."""
    body = {"prompt": "Count: 1 2 3", "max_tokens": 8, "temperature": 0}
    with ExitStack() as servers:
        keeps, doomed = (servers.enter_context(serve(model, None, tmp_path / f"{name}.log", "--role", "prefill"))
                         for name in ("keeps", "doomed"))
        urls = ("--prefill-url", doomed.wait_ready().base_url, "--prefill-url", keeps.wait_ready().base_url)
        decode = servers.enter_context(serve(model, None, tmp_path / "decode.log", "--role", "decode",
                                             "--prefill-timeout", "5", *urls))
        decode.wait_ready()
        done, killed = [], threading.Event()

        def one(_: int) -> tuple[int, str]:
            result = post(decode.base_url, body)
            done.append(result)
            if len(done) >= 50 and not killed.is_set():
                killed.set()
                doomed.kill()
            return result

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(one, range(200)))
        decode_metrics, keeps_metrics = decode.wait_idle(), keeps.wait_idle()
    assert killed.is_set()
    texts = {json.loads(text)["choices"][0]["text"] for status, text in results if status == 200}
    assert len(texts) == 1  # one greedy answer, wherever its prompt ran
    failed = [json.loads(text)["error"] for status, text in results if status != 200]
    assert all(status in (200, 503) for status, _ in results) and all(e["message"] for e in failed)
    assert len(failed) < 20
    assert decode_metrics["kv_cache_usage_perc"] == keeps_metrics["kv_cache_usage_perc"] == 0


def test_both_roles_shut_down_gracefully_on_sigterm(model, tmp_path):
    """A decode server told to stop finishes the stream it serves and exits 0; so does its prefill
    server, idle by then, which lets go of what it held."""
    with serve(model, None, tmp_path / "prefill.log", "--role", "prefill") as prefill:
        flags = ("--role", "decode", "--prefill-url", prefill.wait_ready().base_url)
        with serve(model, None, tmp_path / "decode.log", *flags) as decode:
            body = json.dumps({"prompt": "Once", "max_tokens": 200, "ignore_eos": True, "stream": True}).encode()
            request = urllib.request.Request(decode.wait_ready().base_url + "/v1/completions", body,
                                             {"Content-Type": "application/json"}, method="POST")
            with urllib.request.urlopen(request, timeout=60) as response:
                first = response.readline()
                decode.process.send_signal(signal.SIGTERM)
                rest = response.read().decode()
            assert decode.process.wait(timeout=60) == 0
        events = [json.loads(line[6:]) for line in (first.decode() + rest).split("\n\n") if line.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length"  # finished, not cut off
        assert prefill.wait_idle()["kv_cache_usage_perc"] == 0
        prefill.process.send_signal(signal.SIGTERM)
        assert prefill.process.wait(timeout=60) == 0
