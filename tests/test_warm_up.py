"""The start-up warm-up runs every step path, verification included, and leaves no trace: no
metrics, no learned costs, no KV held, and the same outputs afterwards."""

from __future__ import annotations

import asyncio

import pytest
from test_engine import collect, prompts
from tiny_models import tiny_model_paths

import cupyspec.engine.warm_up as warm_up_module
from cupyspec.config import CacheConfig, EngineConfig
from cupyspec.engine import AsyncEngine
from cupyspec.sampling.params import SamplingParams
from cupyspec.spec_decode.speculative_config import SpeculativeConfig


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    return str(tiny_model_paths(tmp_path_factory.mktemp("warm_up"), "llama")[1])


def test_the_warm_up_verifies_drafts_then_leaves_no_trace(tiny_gguf, monkeypatch):
    during: dict[str, float] = {}
    forget = AsyncEngine._forget_warm_up

    def recording_forget(engine: AsyncEngine) -> None:
        during["requests"] = engine.metrics.requests_arrived.value()
        during["drafts"] = engine.metrics.spec_drafts.value()
        during["cost_steps"] = engine.drafter.num_steps
        forget(engine)

    monkeypatch.setattr(AsyncEngine, "_forget_warm_up", recording_forget)
    requests = [(prompts(2, 7)[0], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)),
                (prompts(2, 7)[1], SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True))]  # no seed

    async def outputs(warm: bool) -> tuple[list[dict], AsyncEngine]:
        config = EngineConfig(model=tiny_gguf, device="cpu", cache=CacheConfig(block_size=4), warm_up=warm,
                              speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3))
        engine = await AsyncEngine.create(config)
        fresh = (engine.metrics.requests_arrived.value(), engine.drafter.num_steps,
                 engine.stats().num_used_kv_blocks, len(engine.outputs.requests))
        results = [await collect(engine, p, params) for p, params in requests]
        await engine.shutdown()
        return [(r["tokens"], r["text"]) for r in results], fresh

    warm, fresh = asyncio.run(outputs(True))
    assert during["requests"] == len(warm_up_module.WARM_UP_REQUESTS) + 1
    assert during["drafts"] > 0 and during["cost_steps"] > 0
    assert fresh == (0, 0, 0, 0)
    cold, _ = asyncio.run(outputs(False))
    assert warm == cold


def test_the_warm_up_ends_with_a_prompt_prefilled_in_one_step(tiny_gguf, monkeypatch):
    """Steps of more rows than the kernels take run cuBLAS, whose first use is slow: the warm-up
    takes one (here of 300 rows: the tiny model's context is too short for KERNEL_MAX_ROWS + 1)."""
    monkeypatch.setattr(warm_up_module, "LONG_PROMPT_TOKENS", 300)
    rows: list[int] = []

    async def main() -> float:
        engine = await AsyncEngine.create(EngineConfig(model=tiny_gguf, device="cpu", warm_up=False))
        prepare = engine.runner.prepare
        engine.runner.prepare = lambda sched, *args: rows.append(sched.num_tokens) or prepare(sched, *args)
        await engine.warm_up()
        arrived = engine.metrics.requests_arrived.value()
        await engine.shutdown()
        return arrived

    assert asyncio.run(main()) == len(warm_up_module.WARM_UP_REQUESTS) + 2 and max(rows) == 300
