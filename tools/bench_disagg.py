"""Prefill/decode disaggregation against one server, on the same machine: starts one server and a
prefill + decode pair (`cupyspec-serve --role ...`, each process its own GPU memory), then runs
tools/bench_serve.py's benchmark against each in turn, alternating, at every concurrency (after
one untimed run of each), every run with prompts of its own, and reports output throughput, TTFT
and the K/V transfer's bandwidth (the decode server's metrics).

    python tools/bench_disagg.py --model model.gguf --concurrency 1 64 --rounds 2 --kv-cache-memory 8GiB
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import sys
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from bench_datasets import DatasetSpec
from bench_serve import BenchConfig, benchmark
from serve_process import ServeProcess

SPECULATION = ("spec_draft_tokens", "acceptance_rate", "mean_acceptance_length")  # bench_serve's, where it speculates
TRANSFER_METRICS = ("kv_transfer_bytes_total", "kv_transfer_blocks_total", "kv_transfer_seconds_sum",
                    "kv_transfer_seconds_count", "kv_transfer_failures_total")


def run_one(url: str, args: argparse.Namespace, concurrency: int, seed: int) -> dict:
    """bench_serve's summary of one run at `concurrency` against the server at `url`, its random
    prompts drawn with `seed` (new prompts, so that no prefix cache holds them)."""
    dataset = DatasetSpec(name="random", num_prompts=max(args.min_prompts, args.prompts_per_stream * concurrency),
                          endpoint="completions", random_input_len=args.input_len, random_output_len=args.output_len,
                          output_len=args.output_len, seed=seed)
    config = BenchConfig(dataset=dataset, base_url=url, max_concurrency=concurrency, ignore_eos=True,
                         progress=False)
    with contextlib.redirect_stdout(io.StringIO()):  # its table: the rows printed here say what counts
        return asyncio.run(benchmark(config))["summary"]


def same_answers(single: ServeProcess, decode: ServeProcess, count: int) -> int:
    """How many of `count` greedy completions (64 tokens with their logprobs, one at a time) the
    pair returns exactly as the single server does."""
    same = 0
    for i in range(count):
        body = json.dumps({"prompt": f"Question {i}: name {i + 2} rivers of Europe and say where each begins.",
                           "max_tokens": 64, "temperature": 0, "logprobs": 1, "ignore_eos": True}).encode()
        answers = []
        for server in (single, decode):
            request = urllib.request.Request(server.base_url + "/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as response:
                choice = json.loads(response.read())["choices"][0]
            answers.append((choice["text"], choice["logprobs"]))
        same += answers[0] == answers[1]
    return same


def transfer_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The K/V fetches between two snapshots of the decode server's metrics."""
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in TRANSFER_METRICS}
    seconds, count = delta["kv_transfer_seconds_sum"], delta["kv_transfer_seconds_count"]
    return {"transfers": count, "blocks": delta["kv_transfer_blocks_total"], "bytes": delta["kv_transfer_bytes_total"],
            "failures": delta["kv_transfer_failures_total"],
            "mean_transfer_ms": 1000 * seconds / count if count else 0.0,
            "bandwidth_gib_s": delta["kv_transfer_bytes_total"] / seconds / 2**30 if seconds else 0.0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--kv-cache-memory", default="8GiB", help="each server's KV pool")
    p.add_argument("--server-args", default="", help="more flags for every server, e.g. a --speculative-config")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    p.add_argument("--rounds", type=int, default=2, help="runs of each setting, alternating")
    p.add_argument("--input-len", type=int, default=512, help="words per random prompt")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompts-per-stream", type=int, default=4)
    p.add_argument("--min-prompts", type=int, default=16)
    p.add_argument("--check", type=int, default=8, help="greedy completions compared between the two first")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--log-dir", type=Path, default=Path("."))
    p.add_argument("--result-file", type=Path, default=None)
    args = p.parse_args()
    common = ["--model", args.model, "--kv-cache-memory", args.kv_cache_memory, *args.server_args.split()]
    results = []
    with ExitStack() as stack:
        def start(name: str, *flags: str) -> ServeProcess:
            server = ServeProcess([*common, *flags], args.log_dir / f"{name}.log")
            stack.callback(server.stop)
            return server

        single = start("single").wait_ready(args.start_timeout)
        prefill = start("prefill", "--role", "prefill").wait_ready(args.start_timeout)
        decode = start("decode", "--role", "decode", "--prefill-url", prefill.base_url).wait_ready(args.start_timeout)
        if args.check:
            print(json.dumps({"same_greedy_answers": same_answers(single, decode, args.check), "of": args.check}))
        runs = iter(range(1, 1 << 30))  # each run's prompt seed
        for concurrency in args.concurrency:
            for setting_server in (single, decode):  # untimed: graphs and pools of this batch size
                run_one(setting_server.base_url, args, concurrency, next(runs))
            for round_index in range(args.rounds):
                for setting, server in (("single", single), ("disaggregated", decode)):
                    before = decode.metrics()
                    summary = run_one(server.base_url, args, concurrency, next(runs))
                    row = {"setting": setting, "concurrency": concurrency, "round": round_index,
                           "output_throughput": summary["output_throughput"], "ttft_mean_ms": summary["mean_ttft_ms"],
                           "ttft_p50_ms": summary["p50_ttft_ms"], "ttft_p99_ms": summary["p99_ttft_ms"],
                           "tpot_mean_ms": summary["mean_tpot_ms"], "failed": summary["failed_requests"],
                           **{key: summary[key] for key in SPECULATION if key in summary}}
                    if setting == "disaggregated":
                        row |= transfer_figures(before, decode.metrics())
                    results.append(row)
                    print(json.dumps(row), flush=True)
    if args.result_file is not None:
        args.result_file.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
