"""Where a step's time goes on the GPU: host launch time against device time, per phase and batch size.

    python tools/profile_step.py --batch-sizes 1 8 64 256 --context 256 --query-len 1 6

Builds synthetic decode (query length 1) and verify (query length k + 1) steps on the engine's own
model and KV cache, and times each phase with CUDA events (device time) and the host clock (the
time Python needs to launch it). A phase whose host time exceeds its device time is launch-bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from cupyspec.batch import Segment, build_flat_batch
from cupyspec.config import CacheConfig, EngineConfig
from cupyspec.engine import AsyncEngine
from cupyspec.sampling.params import SamplingParams
from cupyspec.sampling.sampler import SamplingRow, sample


def timed(xp: Any, fn: Callable[[], Any], repeats: int) -> tuple[float, float, Any]:
    """(host ms, device ms, last result) per call, averaged over `repeats` after one warm-up."""
    result = fn()
    xp.cuda.get_current_stream().synchronize()
    start, end = xp.cuda.Event(), xp.cuda.Event()
    host = 0.0
    start.record()
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        host += time.perf_counter() - t0
    end.record()
    end.synchronize()
    return 1e3 * host / repeats, xp.cuda.get_elapsed_time(start, end) / repeats, result


def profile(engine: AsyncEngine, batch: int, query_len: int, context: int, repeats: int) -> dict:
    runner = engine.runner
    xp, model, kv = engine.backend.xp, runner.model, runner.kv
    blocks_each = -(-(context + query_len) // kv.block_size)
    rng = np.random.default_rng(0)
    segments = [Segment(rng.integers(0, 1000, query_len).tolist(), context,
                        list(range(b * blocks_each, (b + 1) * blocks_each))) for b in range(batch)]
    flat = build_flat_batch(segments, kv.block_size)
    rows = xp.asarray(flat.last_rows())
    params = [SamplingRow(SamplingParams(temperature=0.0), 0.0)] * batch
    forward_host, forward_dev, hidden = timed(xp, lambda: model.forward(flat, kv), repeats)
    logits_host, logits_dev, logits = timed(xp, lambda: model.compute_logits(hidden[rows]), repeats)
    sample_host, sample_dev, _ = timed(xp, lambda: sample(xp, logits, params), repeats)
    total_dev = forward_dev + logits_dev + sample_dev
    return {"batch": batch, "query_len": query_len, "context": context,
            "forward_host_ms": forward_host, "forward_device_ms": forward_dev,
            "logits_host_ms": logits_host, "logits_device_ms": logits_dev,
            "sample_host_ms": sample_host, "sample_device_ms": sample_dev,
            "step_tok_per_s": batch * query_len / (1e-3 * max(total_dev, forward_host + logits_host + sample_host))}


async def main(args: argparse.Namespace) -> None:
    engine = await AsyncEngine.create(EngineConfig(model=args.model, device="cuda",
                                                   cache=CacheConfig(kv_cache_memory_bytes=args.kv_cache_memory)))
    try:
        for query_len in args.query_len:
            for batch in args.batch_sizes:
                print(json.dumps(profile(engine, batch, query_len, args.context, args.repeats)), flush=True)
    finally:
        await engine.shutdown()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--query-len", type=int, nargs="+", default=[1, 6], help="1: decode; k + 1: verify k drafts")
    p.add_argument("--context", type=int, default=256, help="cached positions before the step")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--kv-cache-memory", type=int, default=4 << 30, help="bytes")
    asyncio.run(main(p.parse_args()))
