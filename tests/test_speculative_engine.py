"""The engine under speculative decoding, end to end on a tiny model: lossless where it claims to be,
stops inside accepted runs, accept policies, per-request settings, and the back-off rule at work."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest
from spec_fixtures import rule_alone
from tiny_models import tiny_model_paths

from cupyspec.config import CacheConfig, EngineConfig, SchedulerConfig
from cupyspec.engine import AsyncEngine
from cupyspec.errors import InvalidRequestError
from cupyspec.sampling.params import SamplingParams
from cupyspec.spec_decode.backoff.step_cost import StepCost
from cupyspec.spec_decode.drafter import EXPLORE_STEPS
from cupyspec.spec_decode.proposers.base import Drafts, Proposer
from cupyspec.spec_decode.speculative_config import RequestSpeculation, SpeculativeConfig

REPEAT = [7, 8, 9, 10, 11, 12] * 6  # a prompt the ngram proposer can draft from


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    return str(tiny_model_paths(tmp_path_factory.mktemp("spec"), "llama")[1])


async def make_engine(path: str, **spec) -> AsyncEngine:
    """An engine on the tiny model; speculation (if any) with the fixed back-off rules unless asked."""
    speculative = SpeculativeConfig(**{"cost_aware_backoff": False} | spec) if spec else SpeculativeConfig()
    return await AsyncEngine.create(EngineConfig(model=path, device="cpu", cache=CacheConfig(block_size=4),
                                                 scheduler=SchedulerConfig(max_num_batched_tokens=256),
                                                 speculative=speculative))


async def collect(engine: AsyncEngine, prompt, params: SamplingParams, k: int | None = None) -> dict:
    result = {"tokens": [], "text": "", "logprobs": [], "finish": None, "stop_reason": None}
    async for out in engine.generate(prompt, params, speculation=RequestSpeculation(k)):
        for d in out.deltas:
            result["tokens"] += d.token_ids
            result["text"] += d.text
            result["logprobs"] += d.logprobs or ()
            result["finish"] = d.finish_reason or result["finish"]
            result["stop_reason"] = d.stop_reason or result["stop_reason"]
        result["out"] = out
    return result


GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("method", ["ngram", "suffix", "naive"])
def test_greedy_tiny_model_output_and_logprobs_do_not_change(tiny_gguf, method):
    prompts = [REPEAT, [3, 4, 5, 3, 4, 5, 3, 4], list(range(20, 60))]

    async def main():
        plain = await make_engine(tiny_gguf)
        want = [await collect(plain, p, GREEDY) for p in prompts]
        await plain.shutdown()
        spec = await make_engine(tiny_gguf, method=method, num_speculative_tokens=5)
        ks = (None,) if method == "naive" else (1, 3, 5)  # naive drafts nothing
        got = {k: await asyncio.gather(*(collect(spec, p, GREEDY, k) for p in prompts)) for k in ks}
        await spec.shutdown()
        return want, got

    want, got = asyncio.run(main())
    for k, outs in got.items():
        for w, g in zip(want, outs):
            assert g["tokens"] == w["tokens"], (method, k)
            for a, b in zip(w["logprobs"], g["logprobs"]):
                assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
    if method == "ngram":  # drafts were really taken
        assert sum(g["out"].speculate_metrics.num_accepted_tokens for g in got[5]) > 0


def test_target_match_reproduces_seeded_sampling_exactly(tiny_gguf):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=30, ignore_eos=True,
                            frequency_penalty=0.5)
    prompt = list(range(3, 300))  # every token occurs earlier: the ngram proposer always drafts

    async def main():
        plain = await make_engine(tiny_gguf)
        want = await collect(plain, prompt, params)
        await plain.shutdown()
        spec = await make_engine(tiny_gguf, method="ngram", num_speculative_tokens=4, verify_strategy="target_match")
        got = await collect(spec, prompt, params)
        await spec.shutdown()
        return want, got

    want, got = asyncio.run(main())
    assert got["tokens"] == want["tokens"]
    assert got["out"].speculate_metrics.num_draft_tokens > 0


@pytest.mark.parametrize("policy", ["reject_all", "accept_all"])
def test_reject_all_accepts_no_draft_and_accept_all_accepts_every_draft(tiny_gguf, policy):
    async def main():
        engine = await make_engine(tiny_gguf, method="ngram", num_speculative_tokens=3, accept_policy=policy)
        out = await collect(engine, REPEAT, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        await engine.shutdown()
        return out["out"].speculate_metrics

    metrics = asyncio.run(main())
    assert metrics.num_draft_tokens > 0
    if policy == "reject_all":
        assert metrics.num_accepted_tokens == 0 and metrics.mean_acceptance_length == 1.0
    else:
        assert metrics.num_accepted_tokens == metrics.num_draft_tokens
        assert metrics.mean_acceptance_length > 1.0


def test_stops_inside_an_accepted_run_cut_the_output(tiny_gguf):
    prompt = [5] * 20  # the tiny model's greedy continuation keeps drafts accepted
    base = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def main():
        engine = await make_engine(tiny_gguf, method="ngram", num_speculative_tokens=5)
        free = await collect(engine, prompt, base)
        tokens, text = free["tokens"], free["text"]
        stop_token = tokens[9]
        by_token = await collect(engine, prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                               stop_token_ids=(stop_token,)))
        by_length = await collect(engine, prompt, SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
        stop = text[len(text) // 2: len(text) // 2 + 3]
        by_string = await collect(engine, prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                                stop=(stop,)))
        await engine.shutdown()
        return free, by_token, by_length, by_string, stop_token, stop

    free, by_token, by_length, by_string, stop_token, stop = asyncio.run(main())
    assert free["out"].speculate_metrics.mean_acceptance_length > 2  # runs of several tokens per step
    cut = free["tokens"].index(stop_token) + 1
    assert by_token["tokens"] == free["tokens"][:cut] and by_token["finish"] == "stop"
    assert by_token["out"].num_output_tokens == cut
    assert by_length["tokens"] == free["tokens"][:9] and by_length["finish"] == "length"
    assert by_length["out"].num_output_tokens == 9
    assert by_string["text"] == free["text"][:free["text"].index(stop)] and by_string["stop_reason"] == stop


def test_rejected_drafts_never_reach_the_prefix_cache(tiny_gguf):
    async def main():
        spec = await make_engine(tiny_gguf, method="ngram", num_speculative_tokens=5)
        first = await collect(spec, REPEAT, GREEDY)
        follow_up = REPEAT + first["tokens"]
        cached = await collect(spec, follow_up, GREEDY)  # reuses blocks written by speculative steps
        await spec.shutdown()
        fresh_engine = await make_engine(tiny_gguf)
        fresh = await collect(fresh_engine, follow_up, GREEDY)
        await fresh_engine.shutdown()
        return first, cached, fresh, spec.block_manager.num_prefix_hit_tokens

    first, cached, fresh, hits = asyncio.run(main())
    assert first["out"].speculate_metrics.num_draft_tokens > first["out"].speculate_metrics.num_accepted_tokens
    assert hits > len(REPEAT)
    assert cached["tokens"] == fresh["tokens"]


@pytest.mark.parametrize("cost_aware", [False, True])
def test_suffix_decoding_accepts_more_when_a_prompt_comes_again(tiny_gguf, cost_aware: bool):
    """The first response enters the global trie while the engine is idle, before the second comes
    (with the cost-aware rule too: drafts are made free here, so that both rules draft alike)."""
    prompt = list(range(30, 70))

    async def main():
        engine = await make_engine(tiny_gguf, method="suffix", num_speculative_tokens=5, cost_aware_backoff=cost_aware)
        rule_alone(engine.drafter).step_cost.fit = lambda sequences: StepCost(1e-3, 0.0)
        first = await collect(engine, prompt, GREEDY)
        for _ in range(100):  # the idle engine caches the response
            await asyncio.sleep(0.001)
        assert not engine.drafter.catch_up(0.0)
        second = await collect(engine, prompt, GREEDY)
        await engine.shutdown()
        return first["out"].speculate_metrics, second["out"].speculate_metrics, first["tokens"], second["tokens"]

    first, second, a, b = asyncio.run(main())
    assert a == b
    assert second.num_accepted_tokens > first.num_accepted_tokens
    assert second.mean_acceptance_length > 2


def test_a_request_may_turn_speculation_off_but_not_ask_for_more_drafts_than_the_server(tiny_gguf):
    async def main():
        engine = await make_engine(tiny_gguf, method="ngram", num_speculative_tokens=3)
        off = await collect(engine, REPEAT, GREEDY, k=0)
        with pytest.raises(InvalidRequestError) as info:
            await collect(engine, REPEAT, GREEDY, k=4)
        await engine.shutdown()
        return off["out"].speculate_metrics, info.value.param

    metrics, param = asyncio.run(main())
    assert metrics.num_draft_tokens == 0 and metrics.num_steps > 0
    assert param == "speculative.num_speculative_tokens"


def test_a_step_whose_sequences_asked_for_drafts_and_got_none_is_a_draft_free_step(tiny_gguf):
    """It verifies nothing and runs overlapped: taken as a drafting step of no draft rows, its price
    would make the cost fit charge verification to the draft rows."""
    class Missing(Proposer):
        method = "missing"

        def propose(self, requests):
            return [Drafts(np.zeros(0, np.int32)) for _ in requests]

    async def shapes_and_plans():
        engine = await make_engine(tiny_gguf, method="ngram", num_speculative_tokens=3)
        drafter = engine.drafter
        drafter.proposer = Missing()
        shapes, plans = [], []
        observe, plan = drafter.observe_step, drafter.plan
        drafter.observe_step = lambda shape, *args: (shapes.append(shape), observe(shape, *args))
        drafter.plan = lambda running: plans.append(plan(running)) or plans[-1]
        await collect(engine, REPEAT, GREEDY)
        await engine.shutdown()
        return shapes, plans

    shapes, plans = asyncio.run(shapes_and_plans())
    assert sum(1 for limits in plans if any(limits.values())) >= 30  # the rule asked at nearly every step
    assert all(shape.drafting == shape.draft_rows == 0 for shape in shapes)


def test_the_cost_aware_rule_drafts_fully_when_drafts_are_free_and_rarely_when_they_are_dear(tiny_gguf):
    params = replace(GREEDY, max_tokens=EXPLORE_STEPS + 8)  # long enough for the rule to explore

    async def metrics_with(cost: StepCost):
        engine = await make_engine(tiny_gguf, method="ngram", num_speculative_tokens=3, cost_aware_backoff=True)
        rule_alone(engine.drafter).step_cost.fit = lambda sequences: cost
        out = await collect(engine, REPEAT, params)
        await engine.shutdown()
        return out["out"].speculate_metrics

    free = asyncio.run(metrics_with(StepCost(1e-3, 0.0)))
    assert len(free.accepted_per_position) == 3  # drafts that cost nothing: full steps of 3 drafts
    # drafting adds 10 times a draft-free step's time (as the fit has it; the tiny model's steps take
    # longer, so exploring stays cheap): only the exploring steps draft, and their plans survive the
    # wait for the step in flight that drafting needs
    costly = asyncio.run(metrics_with(StepCost(1e-5, 0.0, per_drafting_step=1e-4)))
    assert 0 < costly.num_draft_tokens <= 3 * costly.num_steps / 10  # at most one step in ten drafts
