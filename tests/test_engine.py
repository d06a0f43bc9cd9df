"""The engine end to end on a tiny random model: batching, preemption, sampling, stops, aborts."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from tiny_models import tiny_model_paths

from cupyspec.config import CacheConfig, EngineConfig, SchedulerConfig
from cupyspec.engine import AsyncEngine
from cupyspec.errors import EngineOverloadedError, InvalidRequestError
from cupyspec.model.kv_arrays import KVCacheArrays
from cupyspec.sampling.params import SamplingParams
from cupyspec.spec_decode.speculative_config import SpeculativeConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    return str(tiny_model_paths(tmp_path_factory.mktemp("engine"), "llama")[1])


def run(coro):
    return asyncio.run(coro)


async def make_engine(path: str, *, kv_blocks: int | None = None, block_size: int = 4, overlap_scheduling: bool = True,
                      speculative: SpeculativeConfig | None = None, **scheduler) -> AsyncEngine:
    cache = CacheConfig(block_size=block_size)
    if kv_blocks is not None:  # size the pool in blocks of the tiny model (fp32: 2 layers x 2 heads x 16)
        cache = CacheConfig(block_size=block_size, kv_cache_memory_bytes=kv_blocks * 2 * 2 * block_size * 2 * 16 * 4)
    return await AsyncEngine.create(EngineConfig(model=path, device="cpu", cache=cache,
                                                 overlap_scheduling=overlap_scheduling,
                                                 speculative=speculative or SpeculativeConfig(),
                                                 scheduler=SchedulerConfig(**scheduler)))


async def collect(engine: AsyncEngine, prompt, params: SamplingParams = GREEDY) -> dict:
    """Tokens, text, logprobs and finish reason of every choice, plus the final output."""
    result: dict = {"tokens": {}, "text": {}, "logprobs": {}, "finish": {}}
    async for out in engine.generate(prompt, params):
        for d in out.deltas:
            result["tokens"].setdefault(d.index, []).extend(d.token_ids)
            result["text"][d.index] = result["text"].get(d.index, "") + d.text
            result["logprobs"].setdefault(d.index, []).extend(d.logprobs or ())
            if d.finish_reason:
                result["finish"][d.index] = d.finish_reason
        if out.prompt_logprobs is not None:
            result["prompt_logprobs"] = out.prompt_logprobs
        result["last"] = out
    return result


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, int(rng.integers(1, 40))).tolist() for _ in range(n)]


def test_concurrent_requests_equal_each_alone(tiny_gguf):
    async def main():
        engine = await make_engine(tiny_gguf, max_num_batched_tokens=16)  # forces chunked prefill
        alone = [await collect(engine, p) for p in prompts(8)]
        together = await asyncio.gather(*(collect(engine, p) for p in prompts(8)))
        assert engine.stats().num_used_kv_blocks == 0
        await engine.shutdown()
        return alone, together

    alone, together = run(main())
    for a, b in zip(alone, together):
        assert a["tokens"] == b["tokens"] and len(a["tokens"][0]) == 12
        assert a["finish"] == {0: "length"}


def test_preemption_by_recompute_keeps_outputs(tiny_gguf):
    async def main():
        big = await make_engine(tiny_gguf)
        want = [await collect(big, p, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
                for p in prompts(6, 1)]
        await big.shutdown()
        small = await make_engine(tiny_gguf, kv_blocks=40)  # 160 tokens for 6 requests of up to 70
        got = await asyncio.gather(*(collect(small, p, SamplingParams(temperature=0.0, max_tokens=30,
                                                                         ignore_eos=True)) for p in prompts(6, 1)))
        preemptions = small.scheduler.num_preemptions
        used = small.stats().num_used_kv_blocks
        await small.shutdown()
        return want, got, preemptions, used

    want, got, preemptions, used = run(main())
    assert preemptions > 0
    assert used == 0
    assert [w["tokens"] for w in want] == [g["tokens"] for g in got]


def test_seeded_sampling_reproduces_whatever_shares_the_batch(tiny_gguf):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)

    async def main():
        engine = await make_engine(tiny_gguf)
        alone = await collect(engine, [5, 6, 7], params)
        crowd = await asyncio.gather(collect(engine, [5, 6, 7], params),
                                     *(collect(engine, p, SamplingParams(temperature=1.0, max_tokens=16))
                                       for p in prompts(5, 2)))
        other_seed = await collect(engine, [5, 6, 7], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16,
                                                                     seed=99, ignore_eos=True))
        await engine.shutdown()
        return alone, crowd[0], other_seed

    alone, crowded, other = run(main())
    assert alone["tokens"] == crowded["tokens"]
    assert alone["tokens"] != other["tokens"]


def test_n_choices_are_independent_and_indexed(tiny_gguf):
    async def main():
        engine = await make_engine(tiny_gguf)
        out = await collect(engine, [9, 10, 11], SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=5,
                                                                ignore_eos=True))
        await engine.shutdown()
        return out

    out = run(main())
    assert sorted(out["tokens"]) == [0, 1, 2]
    assert all(len(t) == 10 for t in out["tokens"].values())
    assert len({tuple(t) for t in out["tokens"].values()}) > 1
    assert out["last"].num_output_tokens == 30 and out["last"].finished


def test_logprobs_are_the_models_log_softmax(tiny_gguf):
    async def main():
        engine = await make_engine(tiny_gguf)
        out = await collect(engine, [20, 21, 22, 23], SamplingParams(temperature=0.7, max_tokens=5, seed=3,
                                                                     logprobs=3, prompt_logprobs=2,
                                                                     ignore_eos=True))
        await engine.shutdown()
        return engine, out

    engine, out = run(main())
    tokens = [20, 21, 22, 23] + out["tokens"][0]
    from cupyspec.model.batch import DeviceBatch, Segment, build_flat_batch

    model = engine.runner.model
    kv = KVCacheArrays(np, engine.model_config, 8, 4, np.float32)
    batch = DeviceBatch.of(np, build_flat_batch([Segment(tokens, 0, list(range(8)))], 4))
    logits = model.compute_logits(model.forward(batch, kv))
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)
    for i, lp in enumerate(out["logprobs"][0]):  # output token i is predicted by row 3 + i
        row = logp[3 + i]
        assert lp.token_id == tokens[4 + i]
        assert abs(lp.logprob - row[lp.token_id]) < 1e-4
        assert [t for t, _ in lp.top] == np.argsort(-row, kind="stable")[:3].tolist()
    prompt_lps = out["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == 4
    for position in range(1, 4):
        assert abs(prompt_lps[position].logprob - logp[position - 1][tokens[position]]) < 1e-4
        assert len(prompt_lps[position].top) == 2


def test_stop_strings_stop_tokens_and_eos(tiny_gguf):
    async def main():
        engine = await make_engine(tiny_gguf)
        free = await collect(engine, [40, 41], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
        text, tokens = free["text"][0], free["tokens"][0]
        stop = text[len(text) // 2: len(text) // 2 + 2]
        by_string = await collect(engine, [40, 41], SamplingParams(temperature=0.0, max_tokens=20,
                                                                   ignore_eos=True, stop=(stop,)))
        by_token = await collect(engine, [40, 41], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                                                  stop_token_ids=(tokens[5],)))
        await engine.shutdown()
        return text, tokens, stop, by_string, by_token

    text, tokens, stop, by_string, by_token = run(main())
    assert by_string["finish"][0] == "stop" and by_string["last"].deltas[-1].stop_reason == stop
    assert by_string["text"][0] == text[: text.index(stop)]
    assert by_token["finish"][0] == "stop"
    assert by_token["tokens"][0] == tokens[: tokens.index(tokens[5]) + 1]


def test_abort_and_closing_the_stream_free_kv_blocks(tiny_gguf):
    async def main():
        engine = await make_engine(tiny_gguf)
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        stream = engine.generate([1, 2, 3], long, request_id="a")
        await anext(stream)
        await engine.abort("a")
        finals = [out async for out in stream]
        other = engine.generate([4, 5, 6], long)
        await anext(other)
        await other.aclose()  # a caller that walks away
        for _ in range(100):
            if engine.stats().num_used_kv_blocks == 0 and engine.stats().num_running == 0:
                break
            await asyncio.sleep(0.01)
        stats = engine.stats()
        assert engine.is_serving
        await engine.shutdown()
        assert not engine.is_serving
        return finals, stats

    finals, stats = run(main())
    assert finals[-1].finished and finals[-1].deltas[-1].finish_reason == "abort"
    assert stats.num_used_kv_blocks == 0 and stats.num_running == 0 and stats.num_waiting == 0


def test_bad_requests_raise_before_any_output(tiny_gguf):
    async def main():
        engine = await make_engine(tiny_gguf, max_model_len=64, max_waiting_requests=2)
        errors = []
        for prompt, params in [([], GREEDY), ([1, 99999], GREEDY), ([1] * 60, SamplingParams(max_tokens=10)),
                               ([-1], GREEDY)]:
            with pytest.raises(InvalidRequestError) as info:
                await anext(engine.generate(prompt, params))
            errors.append(info.value.param)
        with pytest.raises(InvalidRequestError):
            await anext(engine.chat([], GREEDY))
        with pytest.raises(EngineOverloadedError):
            await anext(engine.generate([1], SamplingParams(n=3)))
        ok = await collect(engine, [1, 2], GREEDY)
        await engine.shutdown()
        return errors, ok

    errors, ok = run(main())
    assert errors == ["prompt", "prompt", "max_tokens", "prompt"]
    assert len(ok["tokens"][0]) == 12


def test_prefix_cache_hits_give_the_same_output(tiny_gguf):
    async def main():
        engine = await make_engine(tiny_gguf)
        prompt = prompts(1, 7)[0] * 3
        first = await collect(engine, prompt)
        hits_before = engine.block_manager.num_prefix_hit_tokens
        second = await collect(engine, prompt)
        hits = engine.block_manager.num_prefix_hit_tokens - hits_before
        await engine.shutdown()
        return first, second, hits, len(prompt)

    first, second, hits, length = run(main())
    assert hits >= (length - 1) // 4 * 4 - 4
    assert first["tokens"] == second["tokens"]
