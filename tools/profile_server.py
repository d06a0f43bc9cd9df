"""What serving over HTTP costs the host per token, on any machine: the engine with a modeled GPU,
driven in-process and through the server by `bench_serve.py`.

    python tools/profile_server.py --concurrency 64 256 --rounds 2

The engine runs for real (scheduler, detokenizer, outputs), its steps on the event loop as on a
GPU and on uvloop; only the model is replaced, by simulate_speculation.py's ScriptedDevice: every
request gets the same scripted reply, and a step takes the H100's modeled device time. With
`--device cuda` the model runs on the GPU instead, which compares the two modes on the same engine,
workload and machine. Each round serves the same random-word chat prompts (`bench_serve.py --dataset
random`, greedy, `ignore_eos`) twice: in-process through `AsyncEngine.chat`, and over HTTP from
`bench_serve.py` (`--client-processes` of them) against the server running in this process, the
two in turn and the first of them alternating from round to round, so that a machine's drift falls
on both. Reported per mode: output tok/s and this process's CPU µs per output token (the engine's
host work, plus the server's over HTTP); then, per concurrency, the median over the rounds of the
HTTP throughput over the in-process one. Wrap the command in `py-spy record` to see where the
server's share goes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from bench_datasets import DatasetSpec, load_prompts
from simulate_speculation import SIMULATED_KV_BYTES, ScriptedDevice

from cupyspec.config import CacheConfig, EngineConfig, SchedulerConfig
from cupyspec.engine import AsyncEngine, step_loop, worker
from cupyspec.engine.gc_policy import settle_garbage_collector
from cupyspec.sampling.params import SamplingParams
from cupyspec.server.app import create_app, start_server
from cupyspec.server.cli import run_loop

TOOLS = Path(__file__).resolve().parent
GPU_KV_BYTES = 8 * 2**30
MODES = ("in-process", "http")


async def in_process(engine: AsyncEngine, prompts: list[str], concurrency: int, max_tokens: int) -> int:
    """Output tokens of every prompt's greedy chat answer, `concurrency` requests at a time."""
    queue, emitted = list(prompts), 0
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def client() -> None:
        nonlocal emitted
        while queue:
            async for out in engine.chat([{"role": "user", "content": queue.pop()}], params):
                emitted += sum(len(d.token_ids) for d in out.deltas)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return emitted


async def over_http(base_url: str, args: argparse.Namespace, concurrency: int, num_prompts: int) -> dict:
    """The summary of `bench_serve.py` against the server at base_url."""
    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "result.json"
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(TOOLS / "bench_serve.py"), "--base-url", base_url, "--dataset", "random",
            "--num-prompts", str(num_prompts), "--random-input-len", str(args.input_words),
            "--max-tokens", str(args.max_tokens), "--max-concurrency", str(concurrency), "--ignore-eos",
            "--temperature", "0", "--warmup", "0", "--no-progress", "--result-file", str(result),
            "--processes", str(args.client_processes),
            stdout=asyncio.subprocess.DEVNULL)
        if await process.wait():
            raise RuntimeError(f"bench_serve.py exited with {process.returncode}")
        return json.loads(result.read_text())["summary"]


async def start_engine(args: argparse.Namespace) -> AsyncEngine:
    """The engine on the GPU, or with its model replaced by a ScriptedDevice."""
    scheduler = SchedulerConfig(max_num_seqs=max(args.concurrency))
    if args.device == "cuda":
        engine = await AsyncEngine.create(EngineConfig(model=args.model, device="cuda", scheduler=scheduler,
                                                       cache=CacheConfig(kv_cache_memory_bytes=GPU_KV_BYTES)))
    else:
        step_loop.StepThread = lambda name: worker.InlineSteps()  # steps on the event loop, as on a GPU
        engine = await AsyncEngine.create(EngineConfig(
            model=args.model, device="cpu", warm_up=False, scheduler=scheduler,
            cache=CacheConfig(kv_cache_memory_bytes=SIMULATED_KV_BYTES)))
        device = ScriptedDevice(engine, args.sample_ms, verify_ms=0.0)
        reply = np.random.default_rng(0).integers(100, 40000, 4096).tolist()  # any request's prompt + reply
        device.scripts = defaultdict(lambda: reply)
    settle_garbage_collector()
    return engine


async def main(args: argparse.Namespace) -> None:
    engine = await start_engine(args)
    runner, port = await start_server(create_app(engine), "127.0.0.1", 0)
    shares: dict[int, list[float]] = defaultdict(list)  # per concurrency: HTTP tok/s over in-process, a round each
    try:
        for round_ in range(args.rounds):
            for concurrency in args.concurrency:
                num_prompts = args.prompts_per_stream * concurrency
                spec = DatasetSpec(name="random", num_prompts=num_prompts, random_input_len=args.input_words)
                prompts = [p.text for p in load_prompts(spec)]
                rates = {}
                for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
                    start, cpu = time.perf_counter(), time.process_time()
                    if mode == "http":  # the client's own figures: its start-up is not the server's time
                        summary = await over_http(f"http://127.0.0.1:{port}", args, concurrency, num_prompts)
                        tokens, tok_per_s = summary["total_output_tokens"], summary["output_throughput"]
                        client = {"client_cpu_share": round(summary["client_cpu_share"], 2)}
                    else:
                        tokens = await in_process(engine, prompts, concurrency, args.max_tokens)
                        tok_per_s, client = tokens / (time.perf_counter() - start), {}
                    cpu = time.process_time() - cpu
                    print(json.dumps({"round": round_, "mode": mode, "concurrency": concurrency,
                                      "output_tokens": tokens, "tok_per_s": round(tok_per_s),
                                      "host_us_per_token": round(1e6 * cpu / tokens, 1), **client}), flush=True)
                    rates[mode] = tok_per_s
                shares[concurrency].append(rates["http"] / rates["in-process"])
        for concurrency, values in shares.items():
            print(json.dumps({"concurrency": concurrency, "rounds": len(values),
                              "http_over_in_process": round(float(np.median(values)), 3)}), flush=True)
    finally:
        await runner.cleanup()
        await engine.shutdown()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="its tokenizer and chat template are used")
    p.add_argument("--device", default="scripted", choices=("scripted", "cuda"),
                   help="scripted: the model replaced by a modeled H100; cuda: the model on the GPU")
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    p.add_argument("--prompts-per-stream", type=int, default=3)
    p.add_argument("--input-words", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--sample-ms", type=float, default=0.04, help="device ms of sampling and the copy per step")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--client-processes", type=int, default=1,
                   help="bench_serve.py processes sharing the HTTP streams (its --processes)")
    p.add_argument("--event-loop", default="uvloop", choices=("uvloop", "asyncio"), help="as cupyspec-serve takes it")
    return p.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    run_loop(arguments.event_loop, main(arguments))
