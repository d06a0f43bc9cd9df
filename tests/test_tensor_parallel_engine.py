"""The engine split across ranks (on the CPU, threads meeting at ThreadGroup's collectives): the
outputs and logprobs of one rank, with and without speculation; a failing rank fails the requests
instead of leaving the others waiting."""

from __future__ import annotations

import asyncio

import pytest

from cupyspec.config import CacheConfig, EngineConfig, SchedulerConfig
from cupyspec.engine import AsyncEngine
from cupyspec.errors import EngineClosedError
from cupyspec.parallel.runner import ParallelRunner
from cupyspec.sampling.params import SamplingParams
from cupyspec.spec_decode.speculative_config import SpeculativeConfig

PROMPTS = [[7, 8, 9, 10, 11, 12] * 4, [3, 4, 5, 3, 4, 5, 3, 4], list(range(20, 47))]
REQUESTS = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3, prompt_logprobs=2),
            SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=20, ignore_eos=True, logprobs=1)]
SPECULATION = {
    "none": {},
    "ngram": {"method": "ngram", "num_speculative_tokens": 3},
    "mtp": {"method": "mtp", "num_model_steps": 2, "num_speculative_tokens": 2},
}


async def make_engine(model: str, size: int, head: str, method: str) -> AsyncEngine:
    spec = SPECULATION[method]
    if method == "mtp":
        spec = spec | {"model": head}
    speculative = SpeculativeConfig(**spec, cost_aware_backoff=False, min_acceptance_rate=0.0) \
        if spec else SpeculativeConfig()
    return await AsyncEngine.create(EngineConfig(
        model=model, device="cpu", tensor_parallel_size=size, cache=CacheConfig(block_size=4),
        scheduler=SchedulerConfig(max_num_batched_tokens=64), speculative=speculative))


async def run(engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> dict:
    result = {"tokens": [], "logprobs": [], "prompt_logprobs": None, "drafts": 0}
    async for out in engine.generate(prompt, params):
        result["prompt_logprobs"] = out.prompt_logprobs or result["prompt_logprobs"]
        result["drafts"] = out.speculate_metrics.num_draft_tokens if out.speculate_metrics else 0
        for delta in out.deltas:
            result["tokens"] += delta.token_ids
            result["logprobs"] += delta.logprobs or ()
    return result


async def outputs_of(model: str, size: int, head: str, method: str) -> tuple[list[dict], int, bool]:
    """Each request's result, the KV blocks still in use afterwards, and whether the ranks' runner ran."""
    engine = await make_engine(model, size, head, method)
    results = await asyncio.gather(*(run(engine, p, r) for p, r in zip(PROMPTS, REQUESTS)))
    parallel = isinstance(engine.runner, ParallelRunner)
    await engine.shutdown()
    return results, engine.stats().num_used_kv_blocks, parallel


def close_logprobs(a, b) -> bool:
    return a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4 and \
        [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("method", list(SPECULATION))
def test_ranks_give_one_ranks_outputs_and_logprobs(tiny_mtp, size, method):
    model, head = tiny_mtp
    want, _, _ = asyncio.run(outputs_of(model, 1, head, method))
    got, used, parallel = asyncio.run(outputs_of(model, size, head, method))
    assert parallel
    assert used == 0
    assert (sum(g["drafts"] for g in got) > 20) == (method != "none")  # the ranks verified drafts
    for w, g in zip(want, got):
        assert g["tokens"] == w["tokens"]
        assert len(g["logprobs"]) == len(w["logprobs"]) == 20
        assert all(close_logprobs(a, b) for a, b in zip(w["logprobs"], g["logprobs"]))
    prompt_want, prompt_got = want[0]["prompt_logprobs"], got[0]["prompt_logprobs"]
    assert prompt_got is not None and len(prompt_got) == len(prompt_want)
    assert all(a is b is None or close_logprobs(a, b) for a, b in zip(prompt_want, prompt_got))


def test_a_size_the_model_does_not_split_into_is_refused(tiny_mtp):
    model, head = tiny_mtp
    with pytest.raises(ValueError, match="tensor parallel size 3"):
        asyncio.run(make_engine(model, 3, head, "none"))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)


def test_a_failing_rank_fails_the_requests_and_releases_the_others(tiny_mtp):
    """Rank 1 raising in a step would leave rank 0 waiting at its first collective: the group is
    aborted, the step fails, and every request ends with the engine's error."""
    model, head = tiny_mtp

    async def main():
        engine = await make_engine(model, 2, head, "none")
        rank1 = engine.runner.runners[1]

        def broken(inputs):
            raise RuntimeError("rank 1 failed")

        rank1.launch = broken
        with pytest.raises(EngineClosedError, match="rank 1 failed"):
            await asyncio.wait_for(run(engine, PROMPTS[0], REQUESTS[1]), timeout=30)
        await engine.shutdown()

    asyncio.run(main())
