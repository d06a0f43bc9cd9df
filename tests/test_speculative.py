"""Speculative decoding end to end: lossless where it claims to be, stops, policies, back-off."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import astuple, replace

import numpy as np
import pytest

from cupyspec.config import CacheConfig, EngineConfig, SchedulerConfig
from cupyspec.engine import AsyncEngine
from cupyspec.errors import InvalidRequestError
from cupyspec.sampling.params import SamplingParams
from cupyspec.scheduling.sequence import Sequence
from cupyspec.spec_decode.drafter import (EXPLORE_SEQS, EXPLORE_STEPS, MAX_BACKOFF, OVERHEAD_BUDGET_CAP,
                                   SAME_ROWS_STREAK_FACTOR, WARM_UP_PERIOD, Drafter)
from cupyspec.spec_decode.backoff.policy import best_drafts, draft_limits
from cupyspec.spec_decode.proposers.base import Drafts, Proposer
from cupyspec.spec_decode.backoff.step_cost import (MAX_OUTLIER_RUN, MIN_DRAFTING_STEPS, MIN_PLAIN_STEPS, REFIT_STEPS, StepCost,
                                     StepCostModel, StepShape)
from cupyspec.spec_decode.speculative_config import RequestSpeculation, SpeculativeConfig
from tiny_models import tiny_model_paths

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
def test_accept_policies(tiny_gguf, policy):
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
        engine.drafter.step_cost.fit = lambda sequences: StepCost(1e-3, 0.0)
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


def test_request_speculation_setting(tiny_gguf):
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


def _decoding_seq(max_drafts: int, acceptance: float = 1.0, hit_rate: float = 1.0) -> Sequence:
    seq = Sequence("r", 0, [1, 2, 3], SamplingParams(max_tokens=100), 103, 0.0, 0, max_drafts=max_drafts)
    seq.output_token_ids = [4]
    seq.num_computed_tokens = 3
    seq.spec.recent_accepted, seq.spec.recent_tested = acceptance, 1.0
    seq.spec.recent_found, seq.spec.recent_asked = hit_rate, 1.0
    return seq


def test_back_off_rule():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=5, max_draft_tokens_per_step=12,
                               min_acceptance_rate=0.2)
    few = [_decoding_seq(5) for _ in range(2)]
    assert list(draft_limits(few, config).values()) == [5, 5]
    crowd = [_decoding_seq(5) for _ in range(4)]
    assert list(draft_limits(crowd, config).values()) == [3, 3, 3, 3]  # 12 drafts, earliest positions first
    many = list(draft_limits([_decoding_seq(5) for _ in range(13)], config).values())
    assert sum(many) == 12 and max(many) == 1
    mixed = [_decoding_seq(5, acceptance=0.9), _decoding_seq(5, acceptance=0.5), _decoding_seq(5)]
    assert list(draft_limits(mixed, replace(config, max_draft_tokens_per_step=6)).values()) == [1, 0, 5]
    poor = _decoding_seq(5, acceptance=0.1)
    assert list(draft_limits([poor], config).values()) == [0]
    near_end = _decoding_seq(5)
    near_end.max_total_tokens = near_end.num_tokens + 3
    assert list(draft_limits([near_end], config).values()) == [2]  # the step emits at most 3 tokens


def test_draft_acceptance_counts_tested_drafts():
    seq = _decoding_seq(5)
    seq.spec.recent_accepted = seq.spec.recent_tested = 0.0
    seq.spec.record((True, True, False, False), 3)  # 3 tested: 2 accepted, then the first rejection
    assert seq.spec.draft_acceptance == pytest.approx(2 / 3)
    seq.spec.record((True, True), 3)  # both tested and accepted
    assert seq.spec.draft_acceptance == pytest.approx((0.7 * 2 + 2) / (0.7 * 3 + 2))


def test_drafts_are_taken_while_they_pay_for_their_time():
    acceptance, limits = np.array([0.9, 0.5, 0.1]), np.array([5, 5, 5])
    # a step of 1 ms for 3 tokens whose rows cost 1 us: every draft that may be kept pays
    assert best_drafts(acceptance, limits, 3, 1e-3, 1e-6, 1e-6).tolist() == [5, 5, 2]
    # 256 sequences in 27 ms: a draft row costs 20 us, a drafting sequence 80 us more
    assert best_drafts(acceptance, limits, 256, 27e-3, 20e-6, 80e-6).tolist() == [5, 0, 0]
    # drafts that cost more than a whole step's tokens are worth: none
    assert best_drafts(acceptance, limits, 256, 27e-3, 1e-3, 0.0).tolist() == [0, 0, 0]


def test_a_drafting_step_must_also_pay_for_the_overlap_it_gives_up():
    acceptance, limits = np.array([0.9]), np.array([5])
    # one sequence, a 1 ms step: 5 drafts keep 3.69 tokens in expectation for 0.1 ms more
    assert best_drafts(acceptance, limits, 1, 1e-3, 10e-6, 50e-6).tolist() == [5]
    # giving up overlap costs 2 ms: (1 + 3.69) / 3.1 ms still beats 1 / 1 ms
    assert best_drafts(acceptance, limits, 1, 1e-3, 10e-6, 50e-6, per_drafting_step=2e-3).tolist() == [5]
    # at 4 ms it does not: (1 + 3.69) / 5.1 ms < 1 / 1 ms
    assert best_drafts(acceptance, limits, 1, 1e-3, 10e-6, 50e-6, per_drafting_step=4e-3).tolist() == [0]
    # a proposer that finds drafts one time in five: 0.2 * 3.69 kept for 2.1 ms more does not pay
    assert best_drafts(acceptance, limits, 1, 1e-3, 10e-6, 50e-6, per_drafting_step=2e-3,
                       hit_rate=np.array([0.2])).tolist() == [0]


def test_proposals_that_miss_lower_what_drafting_is_worth():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=5)
    missing = [_decoding_seq(5, acceptance=0.9, hit_rate=0.2), _decoding_seq(5, acceptance=0.9)]
    costly_step = StepCost(1e-3, 0.0, per_drafting_step=2e-3, per_draft_row=10e-6, per_drafting_seq=50e-6)
    # when a drafting step costs much more than a draft-free one (overlap scheduling given up), the
    # sequence whose proposer mostly misses makes drafting not pay, unlike one that finds drafts
    assert list(draft_limits(missing[:1], config, costly_step).values()) == [0]
    assert list(draft_limits(missing, config, costly_step).values()) == [5, 5]
    assert list(draft_limits(missing[:1], config, replace(costly_step, per_drafting_step=0.0)).values()) == [5]


class _Constant(Proposer):
    method = "constant"

    def propose(self, requests):
        return [Drafts(np.full(r.max_drafts, 7)) for r in requests]


def test_between_evaluations_the_last_plan_stands():
    """The cost-aware rule is evaluated within the overhead budget; in between, the sequences its
    last plan asked drafts of keep them (within the tokens each may still emit). A decoding sequence
    the plan has not seen makes the rule evaluate anew when the plan drafts (at one sequence, each
    new request would otherwise wait for the budget), on credit up to a bound, and waits when it
    drafts nothing (under load)."""
    drafter = Drafter(SpeculativeConfig(method="ngram", num_speculative_tokens=3), _Constant())
    drafter.step_cost.fit = lambda sequences: StepCost(1e-3, 0.0)  # drafts are free
    first, near_end, newcomer = _decoding_seq(3), _decoding_seq(3), _decoding_seq(3)
    drafter._budget = 1.0
    assert drafter.plan([first, near_end]) == {first.seq_id: 3, near_end.seq_id: 3}
    drafter._budget = 0.0
    near_end.output_token_ids += [5] * 97  # 101 of its 103 tokens: room for one more draft
    near_end.num_computed_tokens = near_end.num_tokens - 1
    assert drafter.plan([first, near_end]) == {first.seq_id: 3, near_end.seq_id: 1}
    assert drafter._budget == 0.0  # the plan stood: nothing was evaluated
    assert drafter.plan([first, near_end, newcomer]) == {first.seq_id: 3, near_end.seq_id: 1, newcomer.seq_id: 3}
    assert drafter._budget < 0.0  # evaluated, on credit
    later = _decoding_seq(3)
    drafter._budget = -2 * OVERHEAD_BUDGET_CAP  # too deep in debt: the newcomer waits
    assert drafter.plan([first, near_end, newcomer, later]) == {first.seq_id: 3, near_end.seq_id: 1,
                                                                newcomer.seq_id: 3}
    drafter._last_plan = {first.seq_id: 0, near_end.seq_id: 0}
    drafter._budget = 0.0
    assert drafter.plan([first, near_end, newcomer]) == {}


def test_a_step_whose_sequences_asked_for_drafts_and_got_none_is_a_draft_free_step(tiny_gguf):
    """It verifies nothing and runs overlapped: taken as a drafting step of no draft rows, its price
    made the cost fit charge verification to the draft rows."""
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
        drafter.observe_step = lambda shape, seconds: (shapes.append(shape), observe(shape, seconds))
        drafter.plan = lambda running: plans.append(plan(running)) or plans[-1]
        await collect(engine, REPEAT, GREEDY)
        await engine.shutdown()
        return shapes, plans

    shapes, plans = asyncio.run(shapes_and_plans())
    assert sum(1 for limits in plans if any(limits.values())) >= 30  # the rule asked at nearly every step
    assert all(shape.drafting == shape.draft_rows == 0 for shape in shapes)


@pytest.mark.parametrize("emitted, recovers", [(7, True), (8, False)])
def test_shadow_probes_let_a_sequence_that_stopped_drafting_recover(emitted: int, recovers: bool):
    """A sequence below min_acceptance_rate drafts nothing; its proposer's unverified drafts, scored
    against the tokens emitted since, bring it back once its text turns predictable."""
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, min_acceptance_rate=0.5)
    drafter = Drafter(config, _Constant())
    seq = _decoding_seq(3, acceptance=0.05)
    plans = []
    for _ in range(80):  # (every EXPLORE_STEPS steps without drafts, one explores: its drafts are not verified here)
        plans.append(drafter.plan([seq]).get(seq.seq_id, 0))
        drafter.after_step([seq])
        seq.output_token_ids.append(emitted)
        seq.num_computed_tokens += 1
        seq.spec.record((), 1)
        drafter.observe_step(StepShape(1, plans[-1] > 0), 0.1)  # OVERHEAD_SHARE of it: budget for probes
    assert plans[0] == 0
    assert drafter.plan([seq]).get(seq.seq_id, 0) == (3 if recovers else 0)
    assert seq.spec.num_draft_tokens == 0 and seq.spec.proposal_hit_rate > 0.99  # nothing was verified


def test_shadow_probes_have_a_budget_of_their_own():
    """At one sequence an evaluation of the cost-aware rule costs the overhead share of many steps;
    the probes that bring a written-off sequence back must not wait for it."""
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, min_acceptance_rate=0.5)
    assert config.cost_aware_backoff
    drafter = Drafter(config, _Constant())

    def dear_fit(sequences: int) -> StepCost:
        time.sleep(2e-3)  # 200 steps' share of 1e-3 s
        return StepCost(1e-3, 0.0)

    drafter.step_cost.fit = dear_fit
    seq = _decoding_seq(3, acceptance=0.05)
    for _ in range(40):
        drafter.plan([seq])
        drafter.after_step([seq])
        seq.output_token_ids.append(7)  # what the proposer drafts: its probes are kept
        seq.num_computed_tokens += 1
        seq.spec.record((), 1)
        drafter.observe_step(StepShape(1), 1e-3)
    assert seq.spec.draft_acceptance > 0.5


@pytest.mark.parametrize("overlap", [False, True])
def test_a_run_of_drafting_steps_is_broken_to_measure_a_plain_one(overlap: bool):
    """The cost fit cannot tell what a step without drafts costs from drafting steps alone: the
    cost-aware rule skips drafting once every EXPLORE_STEPS steps, until the fit has taken a
    draft-free step. Under overlap scheduling the first draft-free step after a drafting one is
    refilled, which the fit leaves out, so two run: else the fit's draft-free price would never be
    brought up to date while drafting pays."""
    drafter = Drafter(SpeculativeConfig(method="ngram", num_speculative_tokens=3), _Constant())
    drafter.step_cost.fit = lambda sequences: StepCost(1e-3, 0.0)  # drafts are free
    seq = _decoding_seq(3)
    plans = []
    for _ in range(2 * EXPLORE_STEPS + 4):
        plans.append(drafter.plan([seq]).get(seq.seq_id, 0))
        refilled = overlap and len(plans) > 1 and plans[-2] > 0 and not plans[-1]
        drafter.observe_step(StepShape(4, plans[-1] > 0, refilled=refilled), 1e-3)
    plain = [EXPLORE_STEPS, EXPLORE_STEPS + 1, 2 * EXPLORE_STEPS + 2, 2 * EXPLORE_STEPS + 3] if overlap else \
        [EXPLORE_STEPS, 2 * EXPLORE_STEPS + 1]
    assert [i for i, k in enumerate(plans) if k == 0] == plain


def test_at_an_unchanged_batch_drafting_runs_longer_before_a_plain_step():
    """A draft-free step at the rows of the last one the fit took shows nothing new (one sequence
    decoding alone): drafting steps then run SAME_ROWS_STREAK_FACTOR times as long in a row."""
    drafter = Drafter(SpeculativeConfig(method="ngram", num_speculative_tokens=3), _Constant())
    drafter.step_cost.fit = lambda sequences: StepCost(1e-3, 0.0)  # drafts are free
    seq = _decoding_seq(3)
    drafter.observe_step(StepShape(1), 1e-3)  # a draft-free step of this batch's one row
    plans = []
    for _ in range(SAME_ROWS_STREAK_FACTOR * EXPLORE_STEPS + 1):
        plans.append(drafter.plan([seq]).get(seq.seq_id, 0))
        drafter.observe_step(StepShape(4 if plans[-1] else 1, plans[-1] > 0, 3 if plans[-1] else 0), 1e-3)
    assert [i for i, k in enumerate(plans) if k == 0] == [SAME_ROWS_STREAK_FACTOR * EXPLORE_STEPS]


def _explorations(drafter: Drafter, seqs: list[Sequence], step_seconds: float,
                  steps: int = 2 * EXPLORE_STEPS + 2) -> list[dict[int, int]]:
    plans = []
    for _ in range(steps):
        drafter._budget = 1.0  # the rule is evaluated at every step
        plans.append(drafter.plan(seqs))
        drafter.observe_step(StepShape(len(seqs), sum(k > 0 for k in plans[-1].values()), sequences=len(seqs)),
                             step_seconds)
    return plans


def test_a_run_of_steps_without_drafts_is_broken_to_measure_drafting_again():
    """A cost fit that makes drafting look hopeless would never be corrected by steps that do not
    draft: once every EXPLORE_STEPS steps the EXPLORE_SEQS likeliest sequences draft anyway, while
    such a step adds at most 1 / EXPLORE_STEPS of the time since the last one."""
    drafter = Drafter(SpeculativeConfig(method="ngram", num_speculative_tokens=3), _Constant())
    # a drafting sequence adds 0.3 ms to a 1 ms step: never worth it for 3 drafts at these acceptances
    drafter.step_cost.fit = lambda sequences: StepCost(1e-3, 0.0, per_drafting_seq=3e-4)
    seqs = [_decoding_seq(3, acceptance=0.5 + 0.04 * i) for i in range(EXPLORE_SEQS + 4)]
    plans = _explorations(drafter, seqs, step_seconds=3e-3)  # 32 steps: 96 ms, at least 32 * 8 * 0.3 ms
    exploring = [i for i, plan in enumerate(plans) if any(plan.values())]
    assert exploring == [EXPLORE_STEPS]  # the next one backs off (below)
    likeliest = {s.seq_id for s in seqs[-EXPLORE_SEQS:]}
    assert plans[EXPLORE_STEPS] == {s.seq_id: 3 if s.seq_id in likeliest else 0 for s in seqs}
    drafter = Drafter(SpeculativeConfig(method="ngram", num_speculative_tokens=3), _Constant())
    drafter.step_cost.fit = lambda sequences: StepCost(1e-3, 0.0, per_drafting_seq=3e-4)
    plans = _explorations(drafter, seqs, step_seconds=1e-3)  # 32 steps: 32 ms, less than 32 * 8 * 0.3 ms
    assert not any(any(plan.values()) for plan in plans)


def test_while_exploring_finds_nothing_that_pays_it_backs_off():
    """Each exploring step after which no other step drafted doubles the wait for the next one, up
    to MAX_BACKOFF times the first; the first step that drafts restores it."""
    drafter = Drafter(SpeculativeConfig(method="ngram", num_speculative_tokens=3), _Constant())
    hopeless = StepCost(1e-3, 0.0, per_drafting_seq=3e-4)  # 0.3 ms per drafting sequence on 1 ms steps
    drafter.step_cost.fit = lambda sequences: hopeless
    seqs = [_decoding_seq(3, acceptance=0.5 + 0.04 * i) for i in range(EXPLORE_SEQS + 4)]
    plans = _explorations(drafter, seqs, step_seconds=3e-3, steps=620)
    exploring = [i for i, plan in enumerate(plans) if any(plan.values())]
    # an exploring step of 8 sequences adds 2.4 ms: at backoff b the next waits 32 * 2.4 ms * b of 3 ms steps
    gaps = [later - earlier - 1 for earlier, later in zip(exploring, exploring[1:])]
    assert exploring[0] == EXPLORE_STEPS and [round(gap / 25.6) for gap in gaps] == [2, 4, MAX_BACKOFF, MAX_BACKOFF]
    drafter.step_cost.fit = lambda sequences: StepCost(1e-3, 0.0)  # drafts turn free: the rule drafts
    assert any(_explorations(drafter, seqs, step_seconds=3e-3, steps=1)[0].values())
    drafter.step_cost.fit = lambda sequences: hopeless
    plans = _explorations(drafter, seqs, step_seconds=3e-3, steps=EXPLORE_STEPS + 2)
    assert [i for i, plan in enumerate(plans) if any(plan.values())] == [EXPLORE_STEPS]


def test_an_exploring_step_that_took_long_makes_the_next_one_wait():
    """The fit leaves out a step far slower than it predicts, so it cannot price an exploring step whose
    proposals indexed whole prompts: the next one waits for EXPLORE_STEPS times what the last added."""
    drafter = Drafter(SpeculativeConfig(method="ngram", num_speculative_tokens=3), _Constant())
    drafter.step_cost.fit = lambda sequences: StepCost(1e-3, 0.0, per_drafting_seq=1e-6)  # exploring looks cheap
    seqs = [_decoding_seq(3, acceptance=0.01) for _ in range(EXPLORE_SEQS)]  # below the acceptance floor
    exploring = []
    for step in range(4 * EXPLORE_STEPS):
        drafting = sum(k > 0 for k in drafter.plan(seqs).values())
        if drafting:
            exploring.append(step)
        seconds = 0.1 if drafting else 1e-3  # exploring adds 99 ms: the next waits 32 * 99 ms of 1 ms steps
        drafter.observe_step(StepShape(len(seqs) + 3 * drafting, drafting, 3 * drafting, sequences=len(seqs)), seconds)
    assert exploring == [EXPLORE_STEPS]


def test_an_exploring_step_verifies_sequences_whatever_their_acceptance():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, min_acceptance_rate=0.5)
    drafter = Drafter(config, _Constant())
    seq = _decoding_seq(3, acceptance=0.05)  # written off by the acceptance floor
    plans = []
    for _ in range(EXPLORE_STEPS + 1):
        drafter._budget = 1.0
        plans.append(drafter.plan([seq]).get(seq.seq_id, 0))
        drafter.observe_step(StepShape(1, plans[-1] > 0), 1e-3)
    assert plans == [0] * EXPLORE_STEPS + [3]


def test_a_new_sequence_expects_what_finished_ones_showed_weighed_by_evidence():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=5)
    drafter = Drafter(config, _Constant())
    assert drafter.new_stats().draft_acceptance == 1.0 and drafter.new_stats().proposal_hit_rate == 1.0
    good, unlucky = _decoding_seq(5), _decoding_seq(5)
    for _ in range(10):  # 4 of 5 drafts kept at every step
        good.spec.record_proposal(True)
        good.spec.record((True,) * 4 + (False,), 5)
    unlucky.spec.record_proposal(True)
    unlucky.spec.record((False,) * 5, 1)  # one step, nothing kept
    drafter.on_sequence_finished(unlucky)
    drafter.on_sequence_finished(good)
    expected = (0.81 * 1 + 0.9 * 0 + 40) / (0.81 * 1 + 0.9 * 1 + 50)
    assert drafter.new_stats().draft_acceptance == pytest.approx(expected)  # about 0.79, not dragged to 0
    assert drafter.new_stats().proposal_hit_rate == 1.0


def test_until_the_cost_fit_is_ready_one_step_in_a_few_drafts():
    drafter = Drafter(SpeculativeConfig(method="ngram", num_speculative_tokens=3), _Constant())
    seq = _decoding_seq(3)
    plans = []
    while drafter.step_cost.fit(1) is None:
        # (+ 1: a drafting step is observed with the step after it)
        assert len(plans) < WARM_UP_PERIOD * (MIN_PLAIN_STEPS + MIN_DRAFTING_STEPS) + 1
        plans.append(drafter.plan([seq]).get(seq.seq_id, 0))
        refilled = len(plans) > 1 and plans[-2] > 0  # under overlap scheduling, the step after a drafting one
        drafter.observe_step(StepShape(1 + plans[-1], plans[-1] > 0, plans[-1], refilled=refilled),
                             1e-3 + 1e-3 * (plans[-1] > 0))
    assert plans == [3 if i % WARM_UP_PERIOD == 0 else 0 for i in range(len(plans))]


def test_proposal_hit_rate():
    seq = _decoding_seq(5)
    seq.spec.record_proposal(False)
    seq.spec.record_proposal(True)
    assert seq.spec.proposal_hit_rate == pytest.approx((0.7 * 0.7 + 1) / (0.7 * 0.7 + 0.7 + 1))


def _drafting_episodes(model: StepCostModel, rng: np.random.Generator, device_bound: bool) -> None:
    """300 steps: draft-free ones of 1e-3 + 4e-6 s a row, and drafting ones adding 2e-4 s, 5e-6 s a
    draft row, 30e-6 s a drafting sequence and 8e-6 s a kept draft, each after a draft-free step
    (it waits for that one, the drain) and before a refilled one. Device-bound, the refilled step
    saves what the drain took; host-bound it saves nothing."""
    for _ in range(100):
        seqs = int(rng.integers(1, 257))
        model.observe(StepShape(seqs, sequences=seqs), 1e-3 + 4e-6 * seqs)
        drafting = int(rng.integers(1, seqs + 1))
        draft_rows = drafting * int(rng.integers(0, 6))
        kept = int(rng.integers(0, draft_rows + 1))
        drain = float(rng.random()) * 5e-4
        added = 2e-4 + 5e-6 * draft_rows + 30e-6 * drafting + 8e-6 * kept
        model.observe(StepShape(seqs + draft_rows, drafting, draft_rows, kept=kept, sequences=seqs),
                      1e-3 + 4e-6 * seqs + added + drain)
        model.observe(StepShape(seqs, refilled=True, sequences=seqs),
                      1e-3 + 4e-6 * seqs - (drain if device_bound else 0.0))


def test_the_step_cost_fit_recovers_the_terms():
    """Draft-free steps give the price of a row; a drafting step together with the refilled step
    after it gives what drafting adds: where the device is the bottleneck the wait for the step in
    flight only moves from the refilled step to the drafting one."""
    model = StepCostModel()
    assert model.fit(200) is None  # too few steps
    _drafting_episodes(model, np.random.default_rng(0), device_bound=True)
    assert astuple(model.fit(200)) == pytest.approx((1e-3, 4e-6, 2e-4, 5e-6, 30e-6, 8e-6), rel=1e-3)


def test_observing_a_step_leaves_the_fits_to_learn():
    """Observing a step only records it; `learn` judges it and fits, and `fit` learns first."""
    model = StepCostModel()
    _drafting_episodes(model, np.random.default_rng(0), device_bound=True)
    fitted = astuple(model.fit(200))
    solved = []
    for fit in (model._plain, *model._drafting):
        fit._solve = (lambda solve: lambda: solved.append(1) or solve())(fit._solve)
    _drafting_episodes(model, np.random.default_rng(1), device_bound=True)
    assert not solved  # observing solved nothing
    model.learn()
    assert solved and astuple(model.fit(200)) == pytest.approx(fitted, rel=0.05)


def test_where_the_host_is_the_bottleneck_drafting_is_charged_its_wait():
    """A draft-free step of a host-bound engine waits for nothing, so the refilled step saves
    nothing: the drafting step's wait for the step in flight is what drafting costs."""
    model = StepCostModel()
    _drafting_episodes(model, np.random.default_rng(0), device_bound=False)
    cost = model.fit(200)
    assert cost.per_drafting_step == pytest.approx(2e-4 + 2.5e-4, rel=0.2)  # plus the drain's mean
    assert astuple(cost)[:2] == pytest.approx((1e-3, 4e-6), rel=1e-3)


def test_a_burst_of_slow_steps_is_left_out_and_a_lasting_change_is_learned():
    """Steps that waited while a burst of requests came in (or a kernel compiled) say nothing of
    what drafting costs: the fit leaves out a few far slower than it predicts. More in a row than
    MAX_OUTLIER_RUN are a new cost, which it learns."""
    model = StepCostModel()
    for _ in range(30):
        model.observe(StepShape(1), 7e-4)
        model.observe(StepShape(6, 1, 5), 7e-4 + 1e-4)
    before = model.fit(1).drafting_seconds(5, 1)
    for _ in range(MAX_OUTLIER_RUN // 2):
        model.observe(StepShape(6, 1, 5), 70e-3)  # the steps a burst of requests ran beside
        model.observe(StepShape(1, refilled=True), 20e-3)
    for _ in range(REFIT_STEPS):
        model.observe(StepShape(1), 7e-4)
    assert model.fit(1).drafting_seconds(5, 1) == pytest.approx(before, rel=1e-2)
    for _ in range(3 * MAX_OUTLIER_RUN):
        model.observe(StepShape(6, 1, 5), 7e-4 + 5e-3)  # drafting now adds 5 ms
        model.observe(StepShape(1), 7e-4)
    assert model.fit(1).drafting_seconds(5, 1) > 2e-3


def test_what_drafting_adds_is_learned_apart_for_each_load():
    """A price of drafting learned at 128 sequences (the host the bottleneck: a drafting step gives
    up the overlap of a long step) does not hold at one sequence, nor the other way round."""
    model = StepCostModel()
    for i in range(60):
        model.observe(StepShape(1, sequences=1), 7e-4)
        model.observe(StepShape(128, sequences=128), 2e-3)
        if i % 3 == 0:
            model.observe(StepShape(6, 1, 5, sequences=1), 7e-4 + 1e-4)
            model.observe(StepShape(128 + 40, 8, 40, sequences=128), 2e-3 + 8e-3)
    assert model.fit(1).drafting_seconds(5, 1) == pytest.approx(1e-4, rel=1e-2)
    assert model.fit(128).drafting_seconds(40, 8) == pytest.approx(8e-3, rel=1e-2)
    assert model.fit(100).drafting_seconds(40, 8) == model.fit(128).drafting_seconds(40, 8)  # one band
    assert model.fit(8) is None  # no drafting step seen at that load yet


def test_kept_drafts_are_charged_what_the_host_spends_on_them():
    """Each kept draft costs the host `per_kept` (a token to process): drafts pay while that is
    less than a draft-free step spends per token, and not beyond."""
    acceptance, limits = np.array([0.9, 0.9]), np.array([4, 4])
    cheap = best_drafts(acceptance, limits, 2, 1e-3, 1e-6, 1e-5, 1e-4, per_kept=1e-5)
    assert cheap.tolist() == [4, 4]
    dear = best_drafts(acceptance, limits, 2, 1e-3, 1e-6, 1e-5, 1e-4, per_kept=6e-4)  # more than 0.5 ms a token
    assert dear.tolist() == [0, 0]


def _one_sequence_fit(steps: int, plain_seconds: float,
                      drafting_step: Callable[[np.random.Generator], tuple[StepShape, float]]) -> StepCost:
    """The fit at one sequence after `steps` steps, half of them (at random) draft-free ones of
    `plain_seconds`, the others drafting steps from `drafting_step`."""
    model, rng = StepCostModel(), np.random.default_rng(0)
    for _ in range(steps):
        model.observe(*(drafting_step(rng) if rng.random() >= 0.5 else (StepShape(1), plain_seconds)))
    return model.fit(1)


def test_the_step_cost_fit_charges_rows_that_do_not_vary_to_the_step():
    """At one sequence every drafting step has the most drafts: the fit cannot tell the step from
    its rows, and charges the step, so that fewer drafts do not look cheaper (a minimum-norm fit
    gave the rows most of the price)."""
    def drafting_step(rng: np.random.Generator) -> tuple[StepShape, float]:
        kept = int(rng.integers(0, 8))
        return StepShape(8, 1, 7, kept=kept), 8e-4 + 5e-4 + 1e-5 * kept

    cost = _one_sequence_fit(100, 8e-4, drafting_step)
    assert cost.seconds(1) == pytest.approx(8e-4, rel=1e-3) and cost.per_row < 1e-7
    assert cost.per_draft_row < 1e-7
    assert cost.drafting_seconds(7, 1) == pytest.approx(5e-4, rel=1e-2)
    assert cost.drafting_seconds(1, 1) == pytest.approx(5e-4, rel=1e-2)  # 6 drafts fewer save nothing
    assert cost.per_kept_draft == pytest.approx(1e-5, rel=1e-2)


def test_a_term_the_fit_would_make_negative_is_left_out_and_the_others_fitted_again():
    """Where draft rows vary a little and the steps with more happened to be quicker, the rows' slope
    comes out negative; set to 0, it must not leave the step the price it offset (clipped alone, a
    7-row drafting step was priced at several times what any took, and speculation stopped)."""
    def drafting_step(rng: np.random.Generator) -> tuple[StepShape, float]:
        draft_rows = int(rng.integers(6, 8))
        return (StepShape(1 + draft_rows, 1, draft_rows, kept=int(rng.integers(0, 8))),
                7e-4 + (6e-4 if draft_rows == 6 else 4e-4))

    cost = _one_sequence_fit(120, 7e-4, drafting_step)
    assert min(cost.per_drafting_step, cost.per_draft_row, cost.per_drafting_seq, cost.per_kept_draft) >= 0.0
    assert 4e-4 <= cost.drafting_seconds(7, 1) <= 6e-4  # between what 7-row and 6-row steps added


def test_a_fit_from_one_count_of_drafting_sequences_charges_each_sequence():
    """While every drafting step had 8 drafting sequences (a busy server's exploring steps), part of
    the price goes to each of them: more drafting sequences look dearer, not free."""
    model = StepCostModel()
    for i in range(60):
        model.observe(StepShape(128, sequences=128), 2e-3)
        if i % 3 == 0:
            model.observe(StepShape(128 + 24, 8, 24, kept=int(i % 5), sequences=128), 2e-3 + 4e-3 + 1e-6 * (i % 5))
    cost = model.fit(128)
    assert cost.drafting_seconds(24, 8) == pytest.approx(4e-3, rel=1e-2)
    assert cost.drafting_seconds(84 * 3, 84) > 5 * cost.drafting_seconds(24, 8)


def test_learned_costs_drive_the_back_off(tiny_gguf):
    async def metrics_with(cost: StepCost):
        engine = await make_engine(tiny_gguf, method="ngram", num_speculative_tokens=3, cost_aware_backoff=True)
        engine.drafter.step_cost.fit = lambda sequences: cost
        out = await collect(engine, REPEAT, GREEDY)
        await engine.shutdown()
        return out["out"].speculate_metrics

    free = asyncio.run(metrics_with(StepCost(1e-3, 0.0)))
    assert len(free.accepted_per_position) == 3  # drafts that cost nothing: full steps of 3 drafts
    # drafting adds 10 times a draft-free step's time (as the fit has it; the tiny model's steps take
    # longer, so exploring stays cheap): only the exploring steps draft (one in EXPLORE_STEPS + 1),
    # and their plans survive the wait for the step in flight that drafting needs
    costly = asyncio.run(metrics_with(StepCost(1e-5, 0.0, per_drafting_step=1e-4)))
    assert costly.num_steps > EXPLORE_STEPS
    assert 0 < costly.num_draft_tokens <= 3 * (costly.num_steps // EXPLORE_STEPS)


