"""Batched decoding in-process, without HTTP: the engine's counterpart of llama.cpp's batched-bench.

    python tools/bench_engine.py --device cuda --batch-sizes 1 8 32 64 128 256 --prompt-len 128 --gen-len 128

For each batch size B, B requests of `prompt-len` random token ids each generate `gen-len` tokens
(greedy, ignoring end-of-sequence) through AsyncEngine.generate, all submitted at once. Reported:
the prefill time (until every request has its first token), the decode throughput over the rest
(the tokens that arrive after that, over the time they take: early requests decode while the last
prompts are still filled, and those tokens are not the decode phase's), and the whole run's
generated tokens per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np

from cupyspec.config import EngineConfig, SchedulerConfig
from cupyspec.engine import AsyncEngine
from cupyspec.engine.gc_policy import settle_garbage_collector
from cupyspec.sampling.params import SamplingParams
from cupyspec.spec_decode.speculative_config import SpeculativeConfig


async def run_batch(engine: AsyncEngine, batch: int, prompt_len: int, gen_len: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(100, engine.model_config.vocab_size, (batch, prompt_len)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)

    async def one(prompt: list[int]) -> list[tuple[float, int]]:
        """When each of the request's outputs arrived, and its tokens."""
        return [(time.perf_counter(), sum(len(d.token_ids) for d in out.deltas))
                async for out in engine.generate(prompt, params)]

    start = time.perf_counter()
    requests = await asyncio.gather(*(one(p) for p in prompts))
    end = time.perf_counter()
    prefilled = max(outputs[0][0] for outputs in requests)  # every request has its first token
    generated = sum(tokens for outputs in requests for _, tokens in outputs)
    decoded = sum(tokens for outputs in requests for arrived, tokens in outputs if arrived > prefilled)
    return {"batch": batch, "prompt_len": prompt_len, "gen_len": gen_len, "generated": generated,
            "prefill_s": prefilled - start, "prefill_tok_per_s": batch * prompt_len / (prefilled - start),
            "decode_tok_per_s": decoded / (end - prefilled), "total_tok_per_s": generated / (end - start)}


async def main(args: argparse.Namespace) -> None:
    speculative = SpeculativeConfig.from_json(args.speculative_config)
    config = EngineConfig(model=args.model, device=args.device, cuda_graphs=not args.enforce_eager,
                          tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization,
                          overlap_scheduling=not args.no_overlap_scheduling, speculative=speculative,
                          scheduler=SchedulerConfig(max_num_seqs=max(args.batch_sizes),
                                                    max_num_batched_tokens=args.max_num_batched_tokens))
    engine = await AsyncEngine.create(config)
    settle_garbage_collector()  # as cupyspec-serve does
    try:
        await run_batch(engine, 1, args.prompt_len, 8, seed=0)  # warm-up
        for batch in args.batch_sizes:
            print(json.dumps(await run_batch(engine, batch, args.prompt_len, args.gen_len, seed=batch)), flush=True)
    finally:
        await engine.shutdown()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--speculative-config", default=None, help="JSON, as cupyspec-serve takes it")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs the model is split across")
    p.add_argument("--quantization", choices=("wint8", "wint4"), help="weight-only, as cupyspec-serve takes it")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--no-overlap-scheduling", action="store_true")
    asyncio.run(main(p.parse_args()))
