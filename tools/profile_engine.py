"""Where the engine loop's host time goes while serving a dataset in-process (no HTTP).

    python tools/profile_engine.py --device cuda --dataset code-rewrite --num-prompts 24 --concurrency 1 \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 5}'

Prompts go through AsyncEngine.chat (or generate, with --endpoint completions) at a fixed
concurrency, greedy. Each phase of the loop (planning and proposing drafts, scheduling, preparing
inputs, running or launching a step, collecting one, processing outputs, the drafter's bookkeeping)
is wrapped with a timer; the report gives each phase's calls, host time per call and per engine
step, next to the output tokens per second and the mean acceptance length. Phases on the step
thread (run, launch_after, collect) include their waits for the device: `device_wait` is that part.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_datasets import DATASETS, DEFAULT_CACHE, DatasetSpec, load_prompts

from cupyspec.config import EngineConfig, SchedulerConfig
from cupyspec.engine import AsyncEngine
from cupyspec.gc_policy import settle_garbage_collector
from cupyspec.sampling.params import SamplingParams
from cupyspec.speculative_config import SpeculativeConfig

PHASES = {  # attribute path on the engine -> method names to time
    "drafter": ("plan", "propose", "after_step"),
    "scheduler": ("schedule",),
    "runner": ("prepare", "run", "launch_after", "collect"),
    "outputs": ("process_step",),
}


class PhaseTimer:
    """Seconds and calls per wrapped method, summed."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, owner: Any, name: str) -> None:
        method: Callable = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started
                self.calls[name] += 1

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


async def serve(engine: AsyncEngine, prompts: list, concurrency: int, endpoint: str, extra: dict) -> dict:
    """Serve every prompt, `concurrency` at a time; output tokens, drafted steps and accepted drafts."""
    queue = list(reversed(prompts))
    totals = defaultdict(int)

    async def worker() -> None:
        while queue:
            prompt = queue.pop()
            params = SamplingParams(temperature=0.0, max_tokens=prompt.max_tokens, **extra)
            outputs = (engine.chat([{"role": "user", "content": prompt.text}], params) if endpoint == "chat"
                       else engine.generate(prompt.text, params))
            async for out in outputs:
                totals["tokens"] += sum(len(d.token_ids) for d in out.deltas)
                if out.finished and out.speculate_metrics is not None:
                    totals["steps"] += out.speculate_metrics.num_steps
                    totals["accepted"] += out.speculate_metrics.num_accepted_tokens
                    totals["drafted"] += out.speculate_metrics.num_draft_tokens

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return totals


async def main(args: argparse.Namespace) -> None:
    config = EngineConfig(model=args.model, device=args.device, speculative=SpeculativeConfig.from_json(args.speculative_config),
                          scheduler=SchedulerConfig(max_num_seqs=max(args.concurrency, 8)))
    engine = await AsyncEngine.create(config)
    settle_garbage_collector()
    prompts = load_prompts(DatasetSpec(name=args.dataset, num_prompts=args.num_prompts, endpoint=args.endpoint,
                                       output_len=args.max_tokens, cache_dir=args.dataset_cache))
    extra = {"logprobs": args.top_logprobs} if args.top_logprobs is not None else {}
    timer = PhaseTimer()
    for attribute, names in PHASES.items():
        owner = getattr(engine, attribute)
        if owner is not None:
            for name in names:
                timer.wrap(owner, name)
    try:
        await serve(engine, prompts[: args.concurrency], args.concurrency, args.endpoint, extra)  # warm-up
        timer.reset()
        engine.runner.device_wait = 0.0
        started = time.perf_counter()
        totals = await serve(engine, prompts, args.concurrency, args.endpoint, extra)
        seconds = time.perf_counter() - started
    finally:
        await engine.shutdown()
    steps = max(timer.calls["schedule"], 1)
    report = {"output_tok_per_s": totals["tokens"] / seconds, "seconds": seconds, "engine_steps": steps,
              "us_per_step": 1e6 * seconds / steps,
              "mean_acceptance_length": totals["tokens"] / totals["steps"] if totals["steps"] else None,
              "acceptance_rate": totals["accepted"] / totals["drafted"] if totals["drafted"] else None,
              "phases": {name: {"calls": timer.calls[name], "us_per_call": 1e6 * timer.seconds[name] / timer.calls[name],
                                "us_per_step": 1e6 * timer.seconds[name] / steps}
                         for name in sorted(timer.calls, key=lambda n: -timer.seconds[n])}}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dataset", choices=DATASETS, default="code-rewrite")
    p.add_argument("--dataset-cache", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=None, help="default: from the dataset")
    p.add_argument("--top-logprobs", type=int, default=None, help="ask every request for this many top logprobs")
    p.add_argument("--speculative-config", default=None, help="JSON, as cupyspec-serve takes it")
    asyncio.run(main(p.parse_args()))
