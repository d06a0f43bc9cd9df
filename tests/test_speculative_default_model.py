"""The default model: greedy output with speculation equals greedy output without it, token for token,
on the golden prompts and 20 HumanEval code-rewrite prompts, while sampled requests share the batch;
MTP with the head that ships for the model."""

from __future__ import annotations

import asyncio

import pytest
from bench_datasets import DatasetSpec, load_prompts
from golden import GOLDEN_PROMPTS

from cupyspec.config import EngineConfig
from cupyspec.engine import AsyncEngine
from cupyspec.loader import DEFAULT_MODEL
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


SETTINGS = {  # name -> (speculative config, per-request drafts to try)
    "ngram": (SpeculativeConfig(method="ngram", num_speculative_tokens=5, cost_aware_backoff=False), (1, 3, 5)),
    "suffix": (SpeculativeConfig(method="suffix", num_speculative_tokens=5, cost_aware_backoff=False), (1, 3, 5)),
    "naive": (SpeculativeConfig(method="naive", cost_aware_backoff=False), (None,)),
    "mtp": (SpeculativeConfig(method="mtp", num_speculative_tokens=3, num_model_steps=3, cost_aware_backoff=False),
            (1, 3)),
    "mtp with_ngram": (SpeculativeConfig(method="mtp", num_speculative_tokens=5, num_model_steps=3,
                                         mtp_strategy="with_ngram", cost_aware_backoff=False), (2, 5)),
}


@pytest.mark.slow
@pytest.mark.parametrize("method", SETTINGS)
def test_speculation_keeps_greedy_outputs_of_the_default_model(default_model_path, prompts, baseline, method):
    speculative, ks = SETTINGS[method]
    # by its name (resolved as default_model_path is), so that MTP takes the head shipped for it
    config = EngineConfig(model=DEFAULT_MODEL, device="cpu", speculative=speculative)

    async def main():
        engine = await AsyncEngine.create(config)
        try:
            return {k: await _answers(engine, prompts, k) for k in ks}
        finally:
            await engine.shutdown()

    for k, (outputs, metrics) in asyncio.run(main()).items():
        for i, (got, want) in enumerate(zip(outputs, baseline)):
            assert got == want, (method, k, prompts[i][:60])
        if speculative.method != "naive":
            accepted = sum(m.num_accepted_tokens for m in metrics)
            assert accepted > 0, (method, k)
