"""The default model: greedy output with speculation equals greedy output without it, token for token,
on the golden prompts and 20 HumanEval code-rewrite prompts, while sampled requests share the batch."""

from __future__ import annotations

import asyncio

import pytest
from bench_datasets import DatasetSpec, load_prompts
from golden import GOLDEN_PROMPTS

from cupyspec.config import EngineConfig
from cupyspec.engine import AsyncEngine
from cupyspec.sampling.params import SamplingParams
from cupyspec.spec_decode.speculative_config import RequestSpeculation, SpeculativeConfig

MAX_TOKENS = 48
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
NOISE = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=MAX_TOKENS, seed=3)


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    code = [p.text for p in load_prompts(DatasetSpec(name="code-rewrite", num_prompts=20))]
    return [p for p, _ in GOLDEN_PROMPTS] + code


async def _answers(engine: AsyncEngine, prompts: list[str], k: int | None) -> tuple[list[list[int]], list]:
    async def one(prompt: str, params: SamplingParams, spec: RequestSpeculation | None):
        tokens, metrics = [], None
        async for out in engine.chat([{"role": "user", "content": prompt}], params, speculation=spec):
            for d in out.deltas:
                tokens += d.token_ids
            metrics = out.speculate_metrics
        return tokens, metrics

    spec = RequestSpeculation(k) if k is not None else None
    noise = [one("Tell me a story about a dragon.", NOISE, spec), one("Write a limerick.", NOISE, spec)]
    results = await asyncio.gather(*(one(p, GREEDY, spec) for p in prompts), *noise)
    return [r[0] for r in results[:len(prompts)]], [r[1] for r in results[:len(prompts)]]


@pytest.fixture(scope="module")
def baseline(default_model_path, prompts) -> list[list[int]]:
    async def main():
        engine = await AsyncEngine.create(EngineConfig(model=default_model_path, device="cpu"))
        try:
            return (await _answers(engine, prompts, None))[0]
        finally:
            await engine.shutdown()

    return asyncio.run(main())


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "suffix", "naive"])
def test_speculation_keeps_greedy_outputs_of_the_default_model(default_model_path, prompts, baseline, method):
    config = EngineConfig(model=default_model_path, device="cpu",
                          speculative=SpeculativeConfig(method=method, num_speculative_tokens=5, cost_aware_backoff=False))

    async def main():
        engine = await AsyncEngine.create(config)
        try:
            ks = (None,) if method == "naive" else (1, 3, 5)
            return {k: await _answers(engine, prompts, k) for k in ks}
        finally:
            await engine.shutdown()

    for k, (outputs, metrics) in asyncio.run(main()).items():
        for i, (got, want) in enumerate(zip(outputs, baseline)):
            assert got == want, (method, k, prompts[i][:60])
        if method != "naive":
            accepted = sum(m.num_accepted_tokens for m in metrics)
            assert accepted > 0, (method, k)
