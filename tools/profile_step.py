"""Where a step's time goes on the GPU: host launch time against device time, per phase and batch size.

    python tools/profile_step.py --batch-sizes 1 8 64 256 --context 256 --query-len 1 6
    python tools/profile_step.py --batch-sizes 1 --query-len 1 8 16 --context 200 512 1000 2000

Builds synthetic decode (query length 1) and verify (query length k + 1) steps on the engine's own
model and KV cache, and times the forward pass with the logits of every row (of each sequence's
last past cuda_graphs.LOGIT_ROWS rows, as in prefill), eager and replayed as a CUDA graph, then
greedy sampling, each with CUDA events (device time) and the host clock (the
time Python needs to launch it). A phase whose host time exceeds its device time is launch-bound.
Verify steps also time verification, with and without logprobs, to the host (wall time).
With --kernels, each step of one decoder layer is timed on its own from a CUDA graph. With an MTP
head (--speculative-config '{"method": "mtp", ...}'), the forward graphs include its catch-up, and
its drafting graph is timed too (`mtp_draft_*`: num_model_steps head steps from each sequence);
with --kernels, so is each part of a head step (`mtp_*_us`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from cupyspec.config import CacheConfig, EngineConfig
from cupyspec.engine import AsyncEngine
from cupyspec.model.attention import paged_attention_cuda
from cupyspec.model.batch import DeviceBatch, FlatBatch, Segment, build_flat_batch
from cupyspec.model.cuda_graphs import LOGIT_ROWS
from cupyspec.model.fused import norm_gate_up_swiglu, norm_qkv_rope, rms_norm, rope_and_cache, swiglu
from cupyspec.model.linear import GEMV_MAX_ROWS, KERNEL_MAX_ROWS, add_linear, linear
from cupyspec.sampling.argmax import argmax_logprobs
from cupyspec.sampling.params import SamplingParams
from cupyspec.sampling.sampler import SamplingRow, sample
from cupyspec.spec_decode.speculative_config import SpeculativeConfig
from cupyspec.spec_decode.verification.verify import VerifyInput
from cupyspec.spec_decode.verification.verify_step import LogprobRequests, launch_verify


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


def graphed_us(xp: Any, fn: Callable[[], Any], repeats: int) -> float:
    """Device microseconds per call of fn, from a CUDA graph of `repeats` calls (no launch cost)."""
    stream = xp.cuda.get_current_stream()
    fn()  # warm-up: compiles, fills the memory pool
    stream.begin_capture()
    for _ in range(repeats):
        fn()
    graph = stream.end_capture()
    graph.launch(stream)
    start, end = xp.cuda.Event(), xp.cuda.Event()
    start.record(stream)
    graph.launch(stream)
    end.record(stream)
    end.synchronize()
    return 1e3 * xp.cuda.get_elapsed_time(start, end) / repeats


def layer_kernels(engine: AsyncEngine, flat: FlatBatch, repeats: int) -> dict[str, float]:
    """Device microseconds of each step of one decoder layer on `flat` as the forward pass runs it, of
    the final norm and of the LM head. Up to GEMV_MAX_ROWS rows a step is one kernel; above, the norm_*
    steps are a norm, a product and an epilogue kernel, which are also timed on their own."""
    runner, xp, dt = engine.runner, engine.backend.xp, engine.backend.dtype
    model, kv, c = runner.model, runner.kv, runner.model.config
    w, eps, rows = model.layers[0], c.rms_norm_eps, flat.num_tokens
    batch = DeviceBatch.of(xp, flat)
    rope = (model.rope_cos, model.rope_sin, batch.positions, batch.slot_mapping, kv.k[0], kv.v[0])
    residual = xp.ones((rows, c.hidden_size), np.float32)  # [T, H]
    q = norm_qkv_rope(xp, residual, w.input_norm, eps, w.qkv, w.qkv_bias, *rope)  # [T, Hq, D]
    attn = paged_attention_cuda(q, kv.k[0], kv.v[0], batch.block_tables, batch.batch_id_per_token, batch.positions,
                                c.head_dim ** -0.5).reshape(rows, -1)  # [T, Hq D]
    act = norm_gate_up_swiglu(xp, residual, w.post_norm, eps, w.gate_up)  # [T, F]
    x = rms_norm(xp, residual, w.input_norm, eps, dt)  # [T, H]
    steps = {
        "norm_qkv_rope": lambda: norm_qkv_rope(xp, residual, w.input_norm, eps, w.qkv, w.qkv_bias, *rope),
        "attention": lambda: paged_attention_cuda(q, kv.k[0], kv.v[0], batch.block_tables, batch.batch_id_per_token,
                                                  batch.positions, c.head_dim ** -0.5),
        "o_add": lambda: add_linear(xp, residual, attn, w.o),
        "norm_gate_up_swiglu": lambda: norm_gate_up_swiglu(xp, residual, w.post_norm, eps, w.gate_up),
        "down_add": lambda: add_linear(xp, residual, act, w.down),
        "final_norm": lambda: rms_norm(xp, residual, model.final_norm, eps, dt),
        "lm_head": lambda: model.compute_logits(x),
    }
    if rows > GEMV_MAX_ROWS:
        qkv, gate_up = linear(xp, x, w.qkv), linear(xp, x, w.gate_up)
        steps |= {
            "rms_norm": lambda: rms_norm(xp, residual, w.input_norm, eps, dt),
            "qkv": lambda: linear(xp, x, w.qkv),
            "rope_and_cache": lambda: rope_and_cache(xp, qkv, *rope),
            "gate_up": lambda: linear(xp, x, w.gate_up),
            "swiglu": lambda: swiglu(xp, gate_up),
        }
    if runner.mtp is not None:
        steps |= head_kernels(engine, batch, residual)
    return {f"{name}_us": graphed_us(xp, fn, repeats) for name, fn in steps.items()}


def head_kernels(engine: AsyncEngine, batch: DeviceBatch, hidden: Any) -> dict[str, Callable[[], Any]]:
    """What one MTP head step runs over the batch's rows, each part on its own: the head's input
    rows, with eh_proj, its decoder layer, the final norm with the LM head, and the argmax with its
    logprob; then a whole head step."""
    runner, xp = engine.runner, engine.backend.xp
    head, kv = runner.mtp.head, runner.kv
    residual = head._input(hidden, batch)  # [T, H] fp32
    logits = head.logits(residual)  # [T, Vd]
    return {
        "mtp_input": lambda: head._input_rows(hidden, batch),
        "mtp_input_eh_proj": lambda: head._input(hidden, batch),
        "mtp_layer": lambda: head.target.run_layer(residual, head.layer, kv.k[head.kv_layer], kv.v[head.kv_layer],
                                                   batch),
        "mtp_norm_lm_head": lambda: head.logits(residual),
        "mtp_argmax_logprob": lambda: argmax_logprobs(xp, logits),
        "mtp_head_step": lambda: argmax_logprobs(xp, head.logits(head.step(hidden, batch, kv))),
    }


def verify_ms(engine: AsyncEngine, logits: Any, batch: int, num_drafts: int, repeats: int) -> dict[str, float]:
    """Wall ms of verifying `num_drafts` greedy drafts per sequence from logits [R, V], results on the
    host: without logprobs, then with top-5 token and draft logprobs (on the runner's logprob stream)."""
    xp, runner = engine.backend.xp, engine.runner
    drafts = np.random.default_rng(1).integers(0, 1000, (batch, num_drafts))  # [B, K]
    inp = VerifyInput(drafts, np.full(batch, num_drafts), None,
                      (SamplingRow(SamplingParams(temperature=0.0), 0.0),) * len(logits), np.zeros(len(logits)))
    wants = {"verify": LogprobRequests((None,) * batch, (False,) * batch),
             "verify_logprobs": LogprobRequests((5,) * batch, (True,) * batch)}
    return {f"{name}_ms": timed(xp, lambda w=w: launch_verify(xp, logits, inp, w, "rejection", "normal",
                                                              runner.logprob_stream).result(), repeats)[0]
            for name, w in wants.items()}


def profile(engine: AsyncEngine, batch: int, query_len: int, context: int, repeats: int, kernels: bool) -> dict:
    runner = engine.runner
    xp, model, kv = engine.backend.xp, runner.model, runner.kv
    blocks_each = -(-(context + query_len) // kv.block_size)
    if batch * blocks_each > kv.num_blocks:
        raise SystemExit(f"{batch} x {context + query_len} positions need more KV blocks than "
                         f"--kv-cache-memory holds ({kv.num_blocks})")
    rng = np.random.default_rng(0)
    segments = [Segment(rng.integers(0, 1000, query_len).tolist(), context,
                        list(range(b * blocks_each, (b + 1) * blocks_each))) for b in range(batch)]
    flat = build_flat_batch(segments, kv.block_size)
    # every row gets logits, as in a decode or verify step; past LOGIT_ROWS rows each sequence's last, as in prefill
    asked = np.arange(flat.num_tokens) if flat.num_tokens <= LOGIT_ROWS else np.arange(1, batch + 1) * query_len - 1
    rows = xp.asarray(asked)
    next_ids = np.zeros(flat.num_tokens, np.int32)  # the token after each row, for an MTP head's catch-up
    no_shift = np.full(flat.num_tokens, -1, np.int32)
    params = [SamplingRow(SamplingParams(temperature=0.0), 0.0)] * len(asked)
    result: dict = {"batch": batch, "query_len": query_len, "context": context}
    with runner.stream:
        eager_host, eager_dev, logits = timed(
            xp, lambda: model.compute_logits(model.forward(DeviceBatch.of(xp, flat), kv)[rows]), repeats)
        result |= {"eager_host_ms": eager_host, "eager_device_ms": eager_dev}
        step_ms = max(eager_host, eager_dev)
        if runner.graphs is not None and runner.graphs.run(flat, next_ids, no_shift, (asked,)) is not None:
            graph_host, graph_dev, graphed = timed(xp, lambda: runner.graphs.run(flat, next_ids, no_shift, (asked,)),
                                                   repeats)
            logits = graphed.logits
            result |= {"graph_host_ms": graph_host, "graph_device_ms": graph_dev}
            step_ms = max(graph_host, graph_dev)
            if runner.draft_graphs is not None:
                first_rows = np.arange(batch) * query_len
                host, dev, _ = timed(xp, lambda: runner.draft_graphs.run(first_rows), repeats)
                steps = runner.mtp.num_model_steps
                result |= {"mtp_draft_host_ms": host, "mtp_draft_device_ms": dev,
                           "mtp_draft_device_us_per_step": 1e3 * dev / steps}
        sample_host, sample_dev, _ = timed(xp, lambda: sample(xp, logits, params), repeats)
        if query_len > 1 and len(asked) == flat.num_tokens:
            result |= verify_ms(engine, logits, batch, query_len - 1, repeats)
        if kernels and flat.num_tokens <= KERNEL_MAX_ROWS:  # larger steps take cuBLAS, which graphs refuse
            result |= layer_kernels(engine, flat, repeats)
    result |= {"sample_host_ms": sample_host, "sample_device_ms": sample_dev,
               "step_tok_per_s": flat.num_tokens / (1e-3 * (step_ms + max(sample_host, sample_dev)))}
    return result


async def main(args: argparse.Namespace) -> None:
    engine = await AsyncEngine.create(EngineConfig(model=args.model, device="cuda", quantization=args.quantization,
                                                   cache=CacheConfig(kv_cache_memory_bytes=args.kv_cache_memory),
                                                   speculative=SpeculativeConfig.from_json(args.speculative_config)))
    try:
        for context in args.context:
            for query_len in args.query_len:
                for batch in args.batch_sizes:
                    result = profile(engine, batch, query_len, context, args.repeats, args.kernels)
                    print(json.dumps(result), flush=True)
    finally:
        await engine.shutdown()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--query-len", type=int, nargs="+", default=[1, 6], help="1: decode; k + 1: verify k drafts")
    p.add_argument("--context", type=int, nargs="+", default=[256], help="cached positions before the step")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--kernels", action="store_true", help="also time each kernel of one layer, from CUDA graphs")
    p.add_argument("--kv-cache-memory", type=int, default=4 << 30, help="bytes")
    p.add_argument("--quantization", choices=("wint8", "wint4"), help="weight-only, as cupyspec-serve takes it")
    p.add_argument("--speculative-config", default=None, help="JSON, as cupyspec-serve takes it (an MTP head: timed)")
    asyncio.run(main(p.parse_args()))
