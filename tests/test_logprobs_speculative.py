"""Logprobs under speculation: equal to plain decoding's, and draft logprobs that match the verdicts."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from dataclasses import replace

import numpy as np
import pytest
from tiny_models import tiny_model_paths

from cupyspec.config import CacheConfig, EngineConfig, SchedulerConfig
from cupyspec.engine import AsyncEngine
from cupyspec.outputs import TokenLogprob
from cupyspec.sampling.params import SamplingParams
from cupyspec.spec_decode.speculative_config import RequestSpeculation, SpeculativeConfig
from cupyspec.text.token_text import TokenText

TOP = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=TOP)
SEEDED = SamplingParams(temperature=0.9, top_k=40, seed=5, max_tokens=24, ignore_eos=True, logprobs=TOP)


def prompts() -> list[list[int]]:
    """20 prompts, most of them repetitive enough for the proposers to draft from."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(20):
        motif = rng.integers(5, 120, size=int(rng.integers(2, 7))).tolist()
        out.append(motif * int(rng.integers(2, 6)) if i % 4 else rng.integers(5, 120, size=12).tolist())
    return out


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    return str(tiny_model_paths(tmp_path_factory.mktemp("spec_lp"), "llama")[1])


async def make_engine(path: str, **spec) -> AsyncEngine:
    return await AsyncEngine.create(EngineConfig(
        model=path, device="cpu", cache=CacheConfig(block_size=4),
        scheduler=SchedulerConfig(max_num_batched_tokens=256),
        speculative=SpeculativeConfig(**spec, cost_aware_backoff=False) if spec else SpeculativeConfig()))


async def collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams, k: int | None = None) -> dict:
    result: dict = {"tokens": [], "logprobs": [], "drafts": [], "steps": [], "rendered": [], "text": ""}
    async for out in engine.generate(prompt, params, speculation=RequestSpeculation(k)):
        for d in out.deltas:
            result["steps"].append((len(result["tokens"]), d.draft_logprobs or ()))  # (position, drafts)
            result["tokens"] += d.token_ids
            result["text"] += d.text
            result["logprobs"] += d.logprobs or ()
            result["drafts"] += d.draft_logprobs or ()
            result["rendered"] += [d.logprobs_json] if d.logprobs_json is not None else []
            result["draft_field"] = d.draft_logprobs
        result["out"] = out
    return result


def assert_same_logprobs(want: list[TokenLogprob], got: list[TokenLogprob]) -> None:
    assert len(want) == len(got)
    for a, b in zip(want, got):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]  # same tokens, same ranks
        assert np.allclose([lp for _, lp in a.top], [lp for _, lp in b.top], atol=1e-4)


def record_verified_drafts(engine: AsyncEngine) -> dict[str, list[int]]:
    """request id -> every draft the runner verified for it, in order."""
    drafts: dict[str, list[int]] = defaultdict(list)
    prepare = engine.runner.prepare

    def recording(sched, *args):  # noqa: ANN001, ANN002, ANN202
        inputs = prepare(sched, *args)
        for s, i in enumerate(inputs.owners):
            drafts[sched.scheduled[i].seq.request_id] += inputs.drafts[s, :inputs.num_drafts[s]].tolist()
        return inputs

    engine.runner.prepare = recording
    return drafts


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_logprobs_do_not_change_with_speculation(tiny_gguf, method, params):
    # seeded sampling keeps its tokens under target_match (each position's draw is fixed by seed and position)
    strategy = "rejection" if params.greedy else "target_match"

    async def main():
        plain = await make_engine(tiny_gguf)
        want = await asyncio.gather(*(collect(plain, p, params) for p in prompts()))
        await plain.shutdown()
        spec = await make_engine(tiny_gguf, method=method, num_speculative_tokens=5, verify_strategy=strategy)
        got = {k: await asyncio.gather(*(collect(spec, p, params, k) for p in prompts())) for k in (1, 3, 5)}
        await spec.shutdown()
        return want, got

    want, got = asyncio.run(main())
    for k, outs in got.items():
        for w, g in zip(want, outs):
            assert g["tokens"] == w["tokens"], (method, k)
            assert len(g["logprobs"]) == len(g["tokens"])  # the first token's and every bonus token's too
            assert_same_logprobs(w["logprobs"], g["logprobs"])
    accepted = sum(o["out"].speculate_metrics.num_accepted_tokens for outs in got.values() for o in outs)
    assert accepted > 0  # drafts were taken


@pytest.mark.parametrize("method", [None, "ngram", "suffix"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_rendered_logprobs_equal_the_records(tiny_gguf, method, params):
    """Chat JSON entries (SamplingParams.render_logprobs), plain or speculative, against the records
    of plain decoding: one entry per token, the same tokens, ranks and logprobs; also where a stop
    string cuts a step's tokens."""
    strategy = "rejection" if params.greedy else "target_match"

    async def main():
        plain = await make_engine(tiny_gguf)
        want = await asyncio.gather(*(collect(plain, p, params) for p in prompts()))
        stops = [replace(params, stop=(w["text"][9:12],)) for w in want]  # each ends mid-run
        want += await asyncio.gather(*(collect(plain, p, stop) for p, stop in zip(prompts(), stops)))
        texts = TokenText(plain.tokenizer)
        await plain.shutdown()
        spec = dict(method=method, num_speculative_tokens=5, verify_strategy=strategy) if method else {}
        engine = await make_engine(tiny_gguf, **spec)
        got = await asyncio.gather(*(collect(engine, p, replace(each, render_logprobs=True), 3 if method else None)
                                     for p, each in zip(prompts() * 2, [params] * len(stops) + stops)))
        await engine.shutdown()
        return want, got, texts

    want, got, texts = asyncio.run(main())
    assert any(len(w["tokens"]) < params.max_tokens for w in want)  # stopped early
    for w, g in zip(want, got):
        assert g["tokens"] == w["tokens"] and not g["logprobs"]
        entries = [e for part in g["rendered"] for e in json.loads(part.json())]
        assert len(entries) == len(w["logprobs"]) == sum(map(len, g["rendered"]))
        for record, entry in zip(w["logprobs"], entries):
            assert entry["token"] == texts.text(record.token_id) and entry["bytes"] == texts.bytes(record.token_id)
            assert abs(entry["logprob"] - record.logprob) < 1e-4
            assert [e["token"] for e in entry["top_logprobs"]] == [texts.text(t) for t in record.top_ids]
            assert np.allclose([e["logprob"] for e in entry["top_logprobs"]], record.top_logprobs, atol=1e-4)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_draft_logprobs_list_the_verified_drafts_with_their_verdicts(tiny_gguf, method):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=TOP, include_draft_logprobs=True)

    async def main():
        plain = await make_engine(tiny_gguf)
        want = await asyncio.gather(*(collect(plain, p, params) for p in prompts()))
        await plain.shutdown()
        spec = await make_engine(tiny_gguf, method=method, num_speculative_tokens=4)
        verified = record_verified_drafts(spec)
        got = await asyncio.gather(*(collect(spec, p, params) for p in prompts()))
        await spec.shutdown()
        return want, got, verified

    want, got, verified = asyncio.run(main())
    total_drafts = 0
    for w, g in zip(want, got):
        metrics, drafts = g["out"].speculate_metrics, g["drafts"]
        assert [d.token_id for d in drafts] == verified[g["out"].request_id]
        assert len(drafts) == metrics.num_draft_tokens
        assert sum(d.accepted for d in drafts) == metrics.num_accepted_tokens
        total_drafts += len(drafts)
        # Draft j of a step scores output position start + j; while the step's earlier drafts were
        # accepted its context is plain decoding's, so its top list and logprob agree with it.
        for start, step_drafts in g["steps"]:
            for j, d in enumerate(step_drafts):
                assert d.logprob <= 0 and len(d.top) == TOP
                assert d.accepted == all(e.accepted for e in step_drafts[:j + 1])  # a run from the first
                if start + j >= len(w["logprobs"]) or not all(e.accepted for e in step_drafts[:j]):
                    continue
                plain_at = w["logprobs"][start + j]
                assert [t for t, _ in d.top] == [t for t, _ in plain_at.top]
                plain_top = dict(plain_at.top)
                if d.token_id in plain_top:
                    assert abs(d.logprob - plain_top[d.token_id]) < 1e-4
                assert d.accepted == (d.token_id == plain_at.token_id)  # greedy: accepted iff the argmax
        assert g["tokens"] == w["tokens"]
    assert total_drafts > 0


def test_draft_logprobs_without_speculation_are_empty_and_absent_unless_asked(tiny_gguf):
    async def main():
        plain = await make_engine(tiny_gguf)
        asked = await collect(plain, [5, 6, 7], SamplingParams(max_tokens=4, include_draft_logprobs=True))
        not_asked = await collect(plain, [5, 6, 7], SamplingParams(max_tokens=4))
        await plain.shutdown()
        return asked, not_asked

    asked, not_asked = asyncio.run(main())
    assert asked["draft_field"] == () and asked["drafts"] == []
    assert not_asked["draft_field"] is None


def test_a_steps_logprobs_go_to_the_sequences_that_sampled() -> None:
    """ModelRunner.add_logprobs: sequence 1 only ran its prompt, so its output keeps no logprobs."""
    from types import SimpleNamespace

    from cupyspec.engine.runner import LaunchedStep, ModelRunner
    from cupyspec.engine.step_outputs import SeqStepOutput
    from cupyspec.spec_decode.verification.verify_step import LogprobRequests, StepLogprobs

    records = [(TokenLogprob(7, -0.5, [7], [-0.5]),), (TokenLogprob(9, -0.1, [9], [-0.1]),)]
    logprobs = StepLogprobs(tuple(records), (None, None), ("drafts 0", "drafts 2"))
    verdict = SimpleNamespace(logprobs=lambda: logprobs)
    inputs = SimpleNamespace(owners=(0, 2), logprobs=LogprobRequests((TOP, TOP), (True, True)))
    outputs = [SeqStepOutput((7,), num_drafts=2, accepted=(False, False)),
               SeqStepOutput(prompt_logprobs=((3, records[0][0]),)), SeqStepOutput((9,))]
    got = ModelRunner.add_logprobs(LaunchedStep(inputs, None, 0, verdict), outputs)
    assert got == [outputs[0]._replace(logprobs=records[0], draft_logprobs="drafts 0"), outputs[1],
                   outputs[2]._replace(logprobs=records[1], draft_logprobs="drafts 2")]
    assert all(type(out) is SeqStepOutput for out in got)
