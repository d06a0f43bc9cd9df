"""MTP speculative decoding in the engine, on the CPU with tiny random heads: greedy outputs and
logprobs as without speculation, the head's K/V consistent after rejected drafts and prefix hits."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from reference_model import reference_hidden, reference_mtp_step
from safetensors.numpy import load_file
from tiny_models import TinySpec, random_head_weights, write_head_file

from cupyspec.config import CacheConfig, EngineConfig, SchedulerConfig
from cupyspec.engine import AsyncEngine
from cupyspec.loader import load_model
from cupyspec.model.mtp import DRAFT_VOCAB
from cupyspec.sampling.params import SamplingParams
from cupyspec.spec_decode.speculative_config import SpeculativeConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
PROMPTS = [[7, 8, 9, 10, 11, 12] * 4, [3, 4, 5, 3, 4, 5, 3, 4], list(range(20, 47))]


@pytest.fixture(scope="module")
def tiny(tiny_mtp) -> tuple[str, str]:
    return tiny_mtp


async def make_engine(target: str, prefix_caching: bool = True, **spec) -> AsyncEngine:
    """The tiny model; with `spec`, speculation that drafts on every step (fixed back-off rules)."""
    speculative = SpeculativeConfig(**{"cost_aware_backoff": False, "min_acceptance_rate": 0.0} | spec) \
        if spec else SpeculativeConfig()
    return await AsyncEngine.create(EngineConfig(
        model=target, device="cpu", cache=CacheConfig(block_size=4, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=64), speculative=speculative))


async def run(engine: AsyncEngine, prompt: list[int], params: SamplingParams = GREEDY) -> dict:
    result = {"tokens": [], "logprobs": [], "spec": None}
    async for out in engine.generate(prompt, params):
        for delta in out.deltas:
            result["tokens"] += delta.token_ids
            result["logprobs"] += delta.logprobs or ()
        result["spec"] = out.speculate_metrics
    return result


def with_draft_vocab(head: str, folder: Path, vocab_size: int | None = None) -> tuple[str, np.ndarray]:
    """The head file `head` with a draft vocabulary of every other token id of the target's (the tiny
    model's by default): (its path, the vocab)."""
    weights = load_file(head)
    vocab = np.arange(0, vocab_size or TinySpec().vocab, 2, dtype=np.int32)
    return str(write_head_file(folder / "vocab.safetensors", weights | {DRAFT_VOCAB: vocab})), vocab


@pytest.mark.parametrize("steps,strategy,drafts,draft_vocab", [
    (1, "default", 1, False), (2, "default", 2, False), (3, "default", 3, False), (2, "with_ngram", 4, False),
    (2, "default", 2, True)])
def test_mtp_keeps_greedy_outputs_and_logprobs(tiny, tmp_path, steps, strategy, drafts, draft_vocab):
    model, head = tiny
    if draft_vocab:
        head, _vocab = with_draft_vocab(head, tmp_path)

    async def main():
        plain = await make_engine(model)
        want = await asyncio.gather(*(run(plain, p) for p in PROMPTS))
        await plain.shutdown()
        mtp = await make_engine(model, method="mtp", model=head, num_model_steps=steps, mtp_strategy=strategy,
                                num_speculative_tokens=drafts)
        got = await asyncio.gather(*(run(mtp, p) for p in PROMPTS))
        stats = mtp.stats()
        await mtp.shutdown()
        return want, got, stats

    want, got, stats = asyncio.run(main())
    for w, g in zip(want, got):
        assert g["tokens"] == w["tokens"]
        for a, b in zip(w["logprobs"], g["logprobs"]):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
    drafted = sum(g["spec"].num_draft_tokens for g in got)
    assert drafted >= sum(len(w["tokens"]) for w in want) // 2  # most steps verified drafts
    assert stats.num_used_kv_blocks == 0


def record_drafts(engine: AsyncEngine) -> list[tuple[int, int, list[int]]]:
    """Every collected step's MTP drafts as (seq_id, tokens the sequence holds once the step's are in,
    drafts): the drafts continue those tokens."""
    records, lengths = [], {}
    collect = engine.runner.collect

    def recording(launched, *args):
        outputs = collect(launched, *args)
        inputs = launched.inputs
        prompts = {seq.seq_id: seq.num_prompt_tokens for seq in engine.scheduler.running}
        for s, (seq_id, i) in enumerate(zip(inputs.seq_ids, inputs.owners)):
            lengths[seq_id] = lengths.get(seq_id, prompts.get(seq_id, 0)) + len(outputs[i].token_ids)
            if launched.mtp_drafts is not None:
                records.append((seq_id, lengths[seq_id], launched.mtp_drafts.result()[0][s].tolist()))
        return outputs

    engine.runner.collect = recording
    return records


def reference_drafts(loaded, head: dict, tokens: list[int], steps: int) -> tuple[list[int], float]:
    """The drafts a head run afresh over `tokens` (every position with the target's hidden state)
    makes after them, and the smallest gap between the two likeliest tokens of its steps."""
    hidden = reference_hidden(loaded.config, loaded.weights, tokens[:-1])  # [m, H]: positions 0..m-1
    history, next_tokens, drafts, gap = hidden, list(tokens[1:]), [], np.inf
    for _ in range(steps):
        residual, logits = reference_mtp_step(loaded.config, loaded.weights, head, history, next_tokens,
                                              np.arange(len(history)))
        top2 = np.sort(logits[-1])[-2:]
        gap = min(gap, top2[1] - top2[0])
        drafts.append(int(logits[-1].argmax()))
        history = np.concatenate([history, residual[-1:]])
        next_tokens.append(drafts[-1])
    return drafts, gap


def skip_drafting(engine: AsyncEngine, period: int) -> None:
    """The head drafts in no step of every `period` (as where the back-off drafts nobody)."""
    prepare, count = engine.runner.prepare, iter(range(1 << 30))

    def skipping(sched, draft_ahead=True):
        return prepare(sched, draft_ahead and next(count) % period != 0)

    engine.runner.prepare = skipping


@pytest.mark.parametrize("policy,skipped", [("normal", False), ("accept_all", False), ("normal", True)])
def test_the_heads_drafts_match_a_head_run_afresh_over_the_tokens(tiny, policy, skipped):
    """Every step's drafts equal those of the head run from scratch over the sequence's tokens, so no
    K/V that a rejected draft's row (or an earlier drafting step) left behind is read; also where
    the head skips steps, whose boundaries' K/V it still mends."""
    model, head_path = tiny
    steps = 3

    async def main():
        engine = await make_engine(model, method="mtp", model=head_path, num_model_steps=steps,
                                   num_speculative_tokens=steps, accept_policy=policy)
        records = record_drafts(engine)
        if skipped:
            skip_drafting(engine, 3)
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        results = await asyncio.gather(*(run(engine, p, params) for p in PROMPTS[:2]))
        await engine.shutdown()
        return records, {seq_id: p + r["tokens"] for seq_id, p, r in zip(sorted({r[0] for r in records}),
                                                                           PROMPTS[:2], results)}

    records, tokens_of = asyncio.run(main())
    loaded = load_model(model)
    from safetensors.numpy import load_file
    head = load_file(head_path)
    checked = 0
    for seq_id, length, drafts in records:
        tokens = tokens_of[seq_id]
        if length > len(tokens):  # drafts past the last token
            continue
        want, gap = reference_drafts(loaded, head, tokens[:length], steps)
        if gap > 1e-3:  # a near-tie may go either way in float32
            assert drafts == want, tokens[:length]
            checked += 1
    assert checked >= len(records) * 3 // 4 and checked > 10


def test_a_prefix_hit_gives_the_head_the_kv_of_a_cold_prompt(tiny):
    """A cached block is shared only with sequences that also agree on the token after it: the
    head's K/V at a block's last position reads that token."""
    model, head = tiny
    shared = list(range(30, 46))  # four blocks of 4
    first, second = shared + [50, 51, 52], shared[:12] + [60, 61, 62, 63, 64]

    async def drafts_of_second(prefix_caching: bool) -> tuple[list, int]:
        engine = await make_engine(model, prefix_caching, method="mtp", model=head, num_model_steps=2,
                                   num_speculative_tokens=2)
        records = record_drafts(engine)
        await run(engine, first)
        records.clear()
        await run(engine, second)
        hits = engine.block_manager.num_prefix_hit_tokens
        await engine.shutdown()
        return [(length, drafts) for _, length, drafts in records], hits

    cold, _ = asyncio.run(drafts_of_second(False))
    warm, hits = asyncio.run(drafts_of_second(True))
    assert hits == 8  # blocks 0 and 1; block 2 ends before a token the two prompts do not share
    assert warm == cold


def test_mtp_without_a_fitting_head_is_an_error_at_start_up(tiny, tmp_path):
    model, _head = tiny
    other = write_head_file(tmp_path / "wide.safetensors", random_head_weights(TinySpec(hidden=32, head_dim=8)))
    with pytest.raises(ValueError, match="does not fit|shape"):
        asyncio.run(make_engine(model, method="mtp", model=str(other), num_speculative_tokens=1))
