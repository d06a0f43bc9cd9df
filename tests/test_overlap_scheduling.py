"""Overlap scheduling: forming and launching step N+1 before the host has seen the tokens of step N
changes no output, leaks no KV block, and really overlaps (the runner sees a step launched while
the one before it is uncollected)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from spec_fixtures import rule_alone
from test_engine import collect, prompts
from test_engine import make_engine as make_tiny_engine
from tiny_models import tiny_model_paths

from cupyspec.engine import AsyncEngine
from cupyspec.model.embedding import embed_tokens
from cupyspec.sampling.params import SamplingParams
from cupyspec.spec_decode.backoff.step_cost import StepCost
from cupyspec.spec_decode.speculative_config import SpeculativeConfig


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    return str(tiny_model_paths(tmp_path_factory.mktemp("overlap"), "llama")[1])


async def make_engine(path: str, overlap: bool, kv_blocks: int | None = None,
                      speculative: SpeculativeConfig | None = None) -> AsyncEngine:
    """test_engine's engine (chunked prefill of 16 tokens), counting the steps that overlapped and
    the drafts verified."""
    engine = await make_tiny_engine(path, kv_blocks=kv_blocks, overlap_scheduling=overlap, speculative=speculative,
                                    max_num_batched_tokens=16)
    engine.launches = log_launches(engine)
    return engine


def overlapped_steps(engine: AsyncEngine) -> int:
    """Steps launched while the step before was uncollected."""
    return sum(overlapped for overlapped, _ in engine.launches)


def verified_drafts(engine: AsyncEngine) -> int:
    return sum(int(inputs.num_drafts.sum()) for _, inputs in engine.launches)


def log_launches(engine: AsyncEngine) -> list[tuple[bool, Any]]:
    """The engine's launched steps from now on: (launched while a step before was uncollected, its
    StepInputs)."""
    log, uncollected = [], set()  # the ids of launched steps' inputs, not collected yet
    launch, collect = engine.runner.launch, engine.runner.collect

    def logging_launch(inputs):
        log.append((bool(uncollected), inputs))
        launched = launch(inputs)
        uncollected.add(id(launched.inputs))
        return launched

    def logging_collect(launched, *args):
        uncollected.discard(id(launched.inputs))
        return collect(launched, *args)

    engine.runner.launch, engine.runner.collect = logging_launch, logging_collect
    return log


def workload(stop_token: int) -> list[tuple[list[int], SamplingParams]]:
    """Requests that use what a step's tokens feed: stops, seeds, logprobs, several choices."""
    p = prompts(9, 3)
    return [
        (p[0], SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)),
        (p[1], SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=11, ignore_eos=True)),
        (p[2], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=3, prompt_logprobs=2)),
        (p[3], SamplingParams(temperature=1.0, top_k=20, seed=3, n=2, max_tokens=8, ignore_eos=True, logprobs=1)),
        (p[4], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)),
        (p[0], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=(stop_token,))),
        (p[5], SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True)),
    ]


def assert_same_outputs(got: list[dict], want: list[dict]) -> None:
    """Tokens, text and finish reasons equal; logprobs equal to 1e-4 with the same tokens and ranks
    (NumPy's matrix products round by batch shape, and the batches differ)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g["tokens"], g["text"], g["finish"]) == (w["tokens"], w["text"], w["finish"])
        pairs = [(a, b) for i in w["logprobs"] for a, b in zip(g["logprobs"][i], w["logprobs"][i], strict=True)]
        pairs += list(zip(g.get("prompt_logprobs", ())[1:], w.get("prompt_logprobs", ())[1:], strict=True))
        for a, b in pairs:
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert np.allclose([a.logprob, *(lp for _, lp in a.top)], [b.logprob, *(lp for _, lp in b.top)],
                               atol=1e-4, rtol=0)


async def run_workload(engine: AsyncEngine, requests: list[tuple[list[int], SamplingParams]]) -> list[dict]:
    """All requests at once, each a little after the one before, so they join a running batch."""
    async def delayed(i: int, prompt: list[int], params: SamplingParams) -> dict:
        await asyncio.sleep(0.002 * i)
        return await collect(engine, prompt, params)

    results = await asyncio.gather(*(delayed(i, p, params) for i, (p, params) in enumerate(requests)))
    for result in results:
        del result["last"]  # holds timings
    return results


async def plain_workload(path: str) -> tuple[int, list[dict]]:
    """The workload's stop token and its outputs from plain decoding, one step at a time."""
    plain = await make_engine(path, overlap=False)
    stop_token = (await collect(plain, prompts(9, 3)[0], SamplingParams(temperature=0.0, max_tokens=14,
                                                                       ignore_eos=True)))["tokens"][0][5]
    want = await run_workload(plain, workload(stop_token))
    await plain.shutdown()
    return stop_token, want


def test_overlap_gives_the_outputs_of_a_step_at_a_time(tiny_gguf):
    async def main():
        results, overlapped, used = {}, {}, {}
        for overlap in (False, True):
            engine = await make_engine(tiny_gguf, overlap)
            greedy = await collect(engine, prompts(9, 3)[0], SamplingParams(temperature=0.0, max_tokens=14,
                                                                            ignore_eos=True))
            stop_token = greedy["tokens"][0][5]  # the sixth token of the first request stops the sixth
            results[overlap] = await run_workload(engine, workload(stop_token))
            overlapped[overlap], used[overlap] = overlapped_steps(engine), engine.stats().num_used_kv_blocks
            engine.scheduler.check_invariants()
            await engine.shutdown()
        return results, overlapped, used

    results, overlapped, used = asyncio.run(main())
    assert_same_outputs(results[True], results[False])
    assert results[True][5]["finish"] == {0: "stop"} and len(results[True][5]["tokens"][0]) <= 6
    assert overlapped[False] == 0 and overlapped[True] > 20
    assert used == {False: 0, True: 0}


def test_a_speculating_engine_overlaps_the_steps_that_do_not_draft(tiny_gguf):
    """A drafting step waits for the step in flight (the proposer reads every token); the steps in
    between overlap. Whatever the mix, outputs are those of plain decoding one step at a time:
    `target_match` keeps seeded sampling exact too."""
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3, verify_strategy="target_match")
    costs = {"drafting is free": StepCost(1e-3, 0.0),
             "drafting costs its overlap": StepCost(1e-3, 0.0, per_drafting_step=1.0)}  # a second per drafting step

    async def main():
        stop_token, want = await plain_workload(tiny_gguf)
        got, counts = {}, {}
        for name, cost in costs.items():
            engine = await make_engine(tiny_gguf, overlap=True, speculative=ngram)
            rule_alone(engine.drafter).step_cost.fit = lambda sequences, cost=cost: cost
            got[name] = await run_workload(engine, workload(stop_token))
            counts[name] = overlapped_steps(engine), verified_drafts(engine), engine.stats().num_used_kv_blocks
            await engine.shutdown()
        return want, got, counts

    want, got, counts = asyncio.run(main())
    for name in costs:
        assert_same_outputs(got[name], want)
    (free_overlapped, free_drafts, free_used), (probe_overlapped, probe_drafts, probe_used) = counts.values()
    assert free_drafts > probe_drafts  # free: drafts whenever the proposer finds some; costly: probes only
    assert probe_overlapped > 2 * free_overlapped and probe_overlapped >= 10
    assert free_used == probe_used == 0


def test_the_engine_reports_each_steps_shape_to_the_cost_model(tiny_gguf):
    """The draft-free step after a drafting one has no step in flight (refilled); draft rows are the
    drafts the runner verified, kept drafts the ones it accepted; sequences those the step ran."""
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3)

    async def main():
        engine = await make_engine(tiny_gguf, overlap=True, speculative=ngram)
        # drafting is free: drafts whenever found
        rule_alone(engine.drafter).step_cost.fit = lambda sequences: StepCost(1e-3, 0.0)
        shapes, observe = [], engine.drafter.observe_step
        engine.drafter.observe_step = lambda shape, *args: (shapes.append(shape), observe(shape, *args))
        await run_workload(engine, [(p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
                                    for p in prompts(6, 3)])
        verified, accepted = verified_drafts(engine), engine.metrics.spec_accepted.value()
        await engine.shutdown()
        return shapes, verified, accepted

    shapes, verified, accepted = asyncio.run(main())
    assert sum(s.draft_rows for s in shapes) == verified > 0
    assert sum(s.kept for s in shapes) == accepted > 0
    assert all(not s.draft_rows for s in shapes if s.refilled)
    after_drafts = [b for a, b in zip(shapes, shapes[1:]) if a.draft_rows and not b.draft_rows]
    assert after_drafts and all(s.refilled for s in after_drafts)
    assert max(s.sequences for s in shapes) == 6 and min(s.sequences for s in shapes) >= 1


def test_the_engine_learns_step_costs_while_the_next_step_runs(tiny_gguf, monkeypatch):
    """Judging an observed step (which solves a cost fit now and then) waits until the next step is
    launched: it stays out of the host's gap between a drafting step and the next. Steps launch on
    the event loop, as on a GPU (worker.InlineSteps)."""
    import cupyspec.engine.step_loop as step_loop
    from cupyspec.engine.worker import InlineSteps

    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3)

    async def main():
        monkeypatch.setattr(step_loop, "StepThread", lambda name: InlineSteps())
        engine = await make_engine(tiny_gguf, overlap=True, speculative=ngram)
        events, launch, learn = [], engine.runner.launch, engine.drafter.learn_step_costs
        engine.runner.launch = lambda inputs: (events.append("launch"), launch(inputs))[1]
        engine.drafter.learn_step_costs = lambda: (events.append("learn"), learn())[1]
        await run_workload(engine, [(p, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
                                    for p in prompts(3, 3)])
        await engine.shutdown()
        return events

    events = asyncio.run(main())
    assert events.count("learn") == events.count("launch") > 10
    assert all(before == "launch" for before, event in zip(events, events[1:]) if event == "learn")


def test_a_penalized_request_takes_its_steps_one_at_a_time(tiny_gguf):
    """Penalties read every output token on the host: while one runs, steps do not overlap, and
    the outputs stay those of the engine without overlap."""
    penalized = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, frequency_penalty=0.7)
    plain = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def main():
        results, counts = {}, {}
        for overlap in (False, True):
            engine = await make_engine(tiny_gguf, overlap)
            results[overlap] = await run_workload(engine, [(prompts(2, 5)[0], plain), (prompts(2, 5)[1], penalized)])
            counts[overlap] = overlapped_steps(engine), engine.outputs.num_penalized
            await engine.shutdown()
        return results, counts

    results, counts = asyncio.run(main())
    assert_same_outputs(results[True], results[False])
    overlapped, penalized_left = counts[True]
    assert penalized_left == 0 and 0 < overlapped < 40 - 12  # overlaps before and after, not while it runs


def test_preemption_and_aborts_under_overlap_keep_outputs_and_free_blocks(tiny_gguf):
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)

    async def main():
        big = await make_engine(tiny_gguf, overlap=False)
        want = [await collect(big, p, greedy) for p in prompts(6, 1)]
        await big.shutdown()
        small = await make_engine(tiny_gguf, overlap=True, kv_blocks=40)  # 160 tokens for 6 requests of up to 70
        got = await asyncio.gather(*(collect(small, p, greedy) for p in prompts(6, 1)))
        long = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
        stream = small.generate([1, 2, 3], long, request_id="a")
        await anext(stream)
        await anext(stream)
        await small.abort("a")
        finals = [out async for out in stream]
        for _ in range(100):
            if small.stats().num_used_kv_blocks == 0:
                break
            await asyncio.sleep(0.01)
        stats = small.stats()
        await small.shutdown()
        return want, got, small.scheduler.num_preemptions, overlapped_steps(small), finals, stats

    want, got, preemptions, overlapped, finals, stats = asyncio.run(main())
    assert preemptions > 0 and overlapped > 0
    assert [w["tokens"] for w in want] == [g["tokens"] for g in got]
    assert finals[-1].deltas[-1].finish_reason == "abort"
    assert stats.num_used_kv_blocks == 0 and stats.num_running == 0


def test_a_sequence_that_fills_the_pool_keeps_its_last_token(tiny_gguf):
    """Without max_tokens a sequence grows until the KV pool is full, then ends with "length";
    under overlap its last token is still on the device then, and is not lost."""
    unbounded = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)

    async def main():
        results = {}
        for overlap in (False, True):
            engine = await make_engine(tiny_gguf, overlap, kv_blocks=10)  # 40 positions
            results[overlap] = await collect(engine, prompts(1, 9)[0], unbounded)
            assert engine.stats().num_used_kv_blocks == 0
            await engine.shutdown()
        return results

    results = asyncio.run(main())
    assert results[True]["finish"] == results[False]["finish"] == {0: "length"}
    assert results[True]["tokens"] == results[False]["tokens"]
    assert len(prompts(1, 9)[0]) + len(results[True]["tokens"][0]) == 41  # 40 positions of KV, then one more token


def test_placeholder_ids_embed_the_previous_steps_tokens():
    table = np.arange(40, dtype=np.float32).reshape(10, 4)  # [V, H]
    previous = np.array([7, 3, 9], dtype=np.int32)  # [S]
    ids = np.array([5, ~2, 0, ~0], dtype=np.int32)  # [T]: ~s stands for previous[s]
    assert np.array_equal(embed_tokens(np, table, ids, previous), table[[5, 9, 0, 7]])


def test_steps_on_the_event_loop_give_the_outputs_of_the_step_thread(tiny_gguf, monkeypatch):
    """On a GPU the loop launches steps itself and polls for their results (worker.InlineSteps);
    here the CPU engine is made to do the same. Plain and speculative steps, overlapped or not,
    give the outputs of plain decoding on the step thread, one step at a time."""
    import cupyspec.engine.step_loop as step_loop
    from cupyspec.engine.worker import InlineSteps

    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3, verify_strategy="target_match")

    async def main():
        stop_token, want = await plain_workload(tiny_gguf)
        monkeypatch.setattr(step_loop, "StepThread", lambda name: InlineSteps())
        engine = await make_engine(tiny_gguf, overlap=True, speculative=ngram)
        # drafting is free: drafts when it can
        rule_alone(engine.drafter).step_cost.fit = lambda sequences: StepCost(1e-3, 0.0)
        got = await run_workload(engine, workload(stop_token))
        counts = overlapped_steps(engine), verified_drafts(engine), engine.stats().num_used_kv_blocks
        await engine.shutdown()
        return want, got, counts

    want, got, (overlapped, drafts, used) = asyncio.run(main())
    assert_same_outputs(got, want)
    assert overlapped > 0 and drafts > 0 and used == 0


def test_steps_on_the_event_loop_let_other_tasks_run_at_every_step(tiny_gguf, monkeypatch):
    """Even when every step's results are ready at once (a host-bound engine), the loop runs its other
    tasks between steps: a ticker advances about once a step while a request generates."""
    import cupyspec.engine.step_loop as step_loop
    from cupyspec.engine.worker import InlineSteps

    async def main():
        monkeypatch.setattr(step_loop, "StepThread", lambda name: InlineSteps())
        engine = await make_engine(tiny_gguf, overlap=True)
        ticks, generating = [0], [True]

        async def ticker():
            while generating[0]:
                ticks[0] += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        before = ticks[0]
        await collect(engine, prompts(9, 3)[0], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        generating[0] = False
        await task
        await engine.shutdown()
        return ticks[0] - before

    assert asyncio.run(main()) >= 40


def test_inline_steps_poll_while_the_loop_runs_other_tasks():
    from cupyspec.engine.worker import InlineSteps

    async def main():
        steps, ticks = InlineSteps(), []

        async def other_task():
            for i in range(5):
                ticks.append(i)
                await asyncio.sleep(0)

        task = asyncio.create_task(other_task())
        await steps.until(lambda: len(ticks) == 5)  # ready only once the other task has run to its end
        await task
        return await steps.run(lambda a, b: a + b, 2, 3), ticks

    assert asyncio.run(main()) == (5, [0, 1, 2, 3, 4])


def test_a_stop_string_inside_an_accepted_run_cuts_it_after_the_next_step_was_formed(tiny_gguf, monkeypatch):
    """A drafting step's tokens go to their sequences before they are detokenized, so that the next
    step is formed and launched first; a stop string found afterwards inside the step's accepted run
    cuts the run there and ends the choice, and frees its KV blocks. Every draft is accepted here
    (long runs): each stop string ends the text where the unstopped text first has it."""
    import cupyspec.engine.async_engine as engine_module
    from cupyspec.text.detokenizer import IncrementalDetokenizer

    cuts = []  # (tokens of a step, of them before the stop), where a stop cut a step's run

    class CountingDetokenizer(IncrementalDetokenizer):
        def add(self, token_ids):
            delta = super().add(token_ids)
            if delta.num_tokens_accepted < len(token_ids):
                cuts.append((len(token_ids), delta.num_tokens_accepted))
            return delta

    accept_all = SpeculativeConfig(method="ngram", num_speculative_tokens=4, ngram_min=1, accept_policy="accept_all")

    async def main():
        monkeypatch.setattr(engine_module, "IncrementalDetokenizer", CountingDetokenizer)
        engine = await make_engine(tiny_gguf, overlap=True, speculative=accept_all)
        # drafting is free: drafts when it can
        rule_alone(engine.drafter).step_cost.fit = lambda sequences: StepCost(1e-3, 0.0)
        placed, place_tokens = [], engine.outputs.place_tokens
        engine.outputs.place_tokens = lambda sched, outputs: placed.append(place_tokens(sched, outputs)) or placed[-1]
        finished, on_finished = [], engine.outputs.on_sequence_finished
        engine.outputs.on_sequence_finished = lambda seq: (finished.append(list(seq.output_token_ids)),
                                                           on_finished(seq))
        results = []
        for prompt in prompts(3, 5):
            unstopped = await collect(engine, prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
            text = unstopped["text"][0]
            for start in range(len(text) // 4, 3 * len(text) // 4, 5):
                stop = text[start:start + 3]
                got = await collect(engine, prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                                   stop=[stop]))
                results.append((unstopped, stop, got, finished[-1]))
        stats = engine.stats()
        await engine.shutdown()
        return results, placed, stats

    results, placed, stats = asyncio.run(main())
    for unstopped, stop, got, kept in results:
        assert got["text"][0] == unstopped["text"][0][:unstopped["text"][0].index(stop)]
        assert got["finish"] == {0: "stop"}
        assert got["tokens"][0] == kept == unstopped["tokens"][0][:len(kept)]  # the sequence holds what it delivered
    assert any(placed) and any(kept > 1 for _, kept in cuts)  # runs placed ahead, some cut after accepted drafts
    assert stats.num_used_kv_blocks == 0 and stats.num_running == 0
