"""MTP steps that verify drafts overlap too: a step is formed and launched before the host has the
tokens, accepted-draft counts and drafts of the step before, which the device feeds to it
(cupyspec/model/device_tokens.py). Nothing changes in the outputs, no KV block leaks, and while a
request needs its verified tokens on the host (logprobs, sampling) steps wait for them."""

from __future__ import annotations

import asyncio

import pytest
from test_engine import collect, make_engine, prompts
from test_overlap_scheduling import log_launches

from cupyspec.engine import AsyncEngine
from cupyspec.sampling.params import SamplingParams
from cupyspec.spec_decode.speculative_config import SpeculativeConfig


@pytest.fixture(scope="module")
def tiny(tiny_mtp) -> tuple[str, str]:
    return tiny_mtp


async def mtp_engine(tiny: tuple[str, str], overlap: bool, policy: str = "normal",
                     kv_blocks: int | None = None, max_num_batched_tokens: int = 16) -> AsyncEngine:
    """The tiny model drafting with MTP on every step (fixed rules), counting the verifying steps
    launched while the step before was uncollected."""
    model, head = tiny
    speculative = SpeculativeConfig(method="mtp", model=head, num_model_steps=3, num_speculative_tokens=3,
                                    accept_policy=policy, cost_aware_backoff=False, min_acceptance_rate=0.0)
    engine = await make_engine(model, kv_blocks=kv_blocks, overlap_scheduling=overlap, speculative=speculative,
                               max_num_batched_tokens=max_num_batched_tokens)
    engine.launches = log_launches(engine)
    return engine


def overlapped_verifying(engine: AsyncEngine) -> int:
    """Steps that verify drafts, launched while the step before was uncollected."""
    return sum(overlapped and bool(inputs.num_drafts.any()) for overlapped, inputs in engine.launches)


def greedy(max_tokens: int, **more) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **more)


async def run_all(engine: AsyncEngine, requests: list[tuple[list[int], SamplingParams]]) -> list[dict]:
    """Every request, each a little after the one before, so that they join a running batch."""
    async def delayed(i: int, prompt: list[int], params: SamplingParams) -> dict:
        await asyncio.sleep(0.002 * i)
        return await collect(engine, prompt, params)

    return await asyncio.gather(*(delayed(i, p, params) for i, (p, params) in enumerate(requests)))


def outputs(results: list[dict]) -> list[tuple]:
    return [(r["tokens"], r["finish"]) for r in results]


@pytest.mark.parametrize("policy", ["normal", "accept_all"])
def test_overlapped_verifying_steps_give_the_outputs_of_a_step_at_a_time(tiny, policy):
    p = prompts(7, 5)

    async def main():
        results, counts = {}, {}
        for overlap in (False, True):
            # accept_all emits every draft a step verifies: a token budget that leaves each sequence
            # its drafts keeps its outputs from depending on the batch
            engine = await mtp_engine(tiny, overlap, policy, max_num_batched_tokens=16 if policy == "normal" else 256)
            first = await collect(engine, p[4], greedy(20))
            stop = first["tokens"][0][7]  # ends the request at its eighth token (or before), maybe inside a run
            requests = [(p[0], greedy(20)), (p[1], greedy(33)), (p[2], greedy(2)), (p[3], greedy(25, n=2)),
                        (p[4], greedy(40, stop_token_ids=(stop,))), (p[5], greedy(17)), (p[6], greedy(1))]
            results[overlap] = await run_all(engine, requests)
            engine.scheduler.check_invariants()
            counts[overlap] = overlapped_verifying(engine), engine.stats().num_used_kv_blocks
            await engine.shutdown()
        return results, counts

    results, counts = asyncio.run(main())
    if policy == "accept_all":  # its outputs depend on how many drafts a step verifies, and near the length
        for r in (*results[True], *results[False]):  # limit an overlapped step may verify more: keep all but
            r["tokens"] = {i: t[:-3] for i, t in r["tokens"].items()}  # the last num_model_steps tokens
    assert outputs(results[True]) == outputs(results[False])
    assert results[True][4]["finish"] == {0: "stop"}
    assert counts[False] == (0, 0)
    assert counts[True][0] > 8 and counts[True][1] == 0


def test_a_request_verified_on_the_host_holds_verifying_steps_back_while_it_lives(tiny):
    p = prompts(4, 5)
    requests = [(p[0], greedy(40)), (p[1], greedy(12, logprobs=2)), (p[2], greedy(30))]

    async def main():
        results, counts = {}, {}
        for overlap in (False, True):
            engine = await mtp_engine(tiny, overlap)
            results[overlap] = await run_all(engine, requests)
            counts[overlap] = overlapped_verifying(engine), engine.stats().num_used_kv_blocks
            await engine.shutdown()
        return results, counts

    results, counts = asyncio.run(main())
    assert outputs(results[True]) == outputs(results[False])
    assert [len(lps) for lps in results[True][1]["logprobs"].values()] == [12]
    overlapped, used = counts[True]
    assert 0 < overlapped and used == 0  # before the second request came and after it finished


def test_preemption_under_overlapped_verifying_steps_keeps_outputs_and_frees_blocks(tiny):
    many = [(p, greedy(30)) for p in prompts(6, 1)]

    async def main():
        big = await mtp_engine(tiny, overlap=False)
        want = await run_all(big, many)
        await big.shutdown()
        small = await mtp_engine(tiny, overlap=True, kv_blocks=40)
        got = await run_all(small, many)
        stats = small.stats()
        small.scheduler.check_invariants()
        await small.shutdown()
        return want, got, small.scheduler.num_preemptions, overlapped_verifying(small), stats

    want, got, preemptions, overlapped, stats = asyncio.run(main())
    assert preemptions > 0 and overlapped > 0
    assert outputs(got) == outputs(want)
    assert stats.num_used_kv_blocks == 0 and stats.num_running == 0
