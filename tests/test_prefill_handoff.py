"""The prefill role's half of a handoff, on the CPU: a prefilled prompt's first token and logprobs are
those `generate` gives with the same sampling key, its K/V is the prompt's, and its blocks are held
until released or expired, then freed."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cupyspec.backend import select_backend
from cupyspec.config import CacheConfig, EngineConfig
from cupyspec.engine import AsyncEngine
from cupyspec.loader import load_model
from cupyspec.model.batch import DeviceBatch, Segment, build_flat_batch
from cupyspec.model.kv_arrays import KVCacheArrays
from cupyspec.model.llama import LlamaModel
from cupyspec.sampling.params import SamplingParams
from cupyspec.sampling.uniforms import sampling_key
from cupyspec.scheduling.block_manager import BlockManager
from cupyspec.scheduling.sequence import Sequence

PROMPT = [7, 8, 9, 10, 11, 12] * 3 + [40, 41]  # 20 tokens: 5 blocks of 4
BLOCK_SIZE = 4


async def make_engine(model: str, hold_seconds: float = 60.0) -> AsyncEngine:
    return await AsyncEngine.create(EngineConfig(model=model, device="cpu", cache=CacheConfig(block_size=BLOCK_SIZE),
                                                 prefill_hold_seconds=hold_seconds))


async def first_token(engine: AsyncEngine, params: SamplingParams):
    token, logprob, prompt_logprobs = None, None, None
    async for out in engine.generate(PROMPT, params):
        prompt_logprobs = out.prompt_logprobs or prompt_logprobs
        for delta in out.deltas:
            token = delta.token_ids[0] if delta.token_ids and token is None else token
            logprob = delta.logprobs[0] if delta.logprobs and logprob is None else logprob
    return token, logprob, prompt_logprobs


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, prompt_logprobs=2),
    SamplingParams(temperature=0.9, top_k=20, seed=11, max_tokens=8, logprobs=1, repetition_penalty=1.3),
], ids=["greedy", "seeded"])
def test_a_prefilled_prompt_has_generates_first_token_and_logprobs_and_the_prompts_kv(tiny_mtp, params):
    model, _ = tiny_mtp

    async def main():
        engine = await make_engine(model)
        want = await first_token(engine, params)
        key = sampling_key(params.seed if params.seed is not None else 123, 0)  # greedy draws nothing
        got = await engine.prefill(PROMPT, params, key)
        kv = engine.runner.kv
        held = (kv.k[:, list(got.block_ids)].copy(), kv.v[:, list(got.block_ids)].copy())
        used = engine.stats().num_used_kv_blocks
        assert engine.release_prefilled(got.handoff_id) and not engine.release_prefilled(got.handoff_id)
        freed = engine.stats().num_used_kv_blocks
        if params.seed is not None:  # the key, not the request's seed, draws the token
            others = [await engine.prefill(PROMPT, params, key + i) for i in range(1, 6)]
            assert any(other.token_id != got.token_id for other in others)
        await engine.shutdown()
        return want, got, held, used, freed

    (token, logprob, prompt_logprobs), got, (k, v), used, freed = asyncio.run(main())
    assert got.token_id == token
    assert got.logprob.token_id == logprob.token_id and got.logprob.logprob == pytest.approx(logprob.logprob)
    assert [t for t, _ in got.logprob.top] == [t for t, _ in logprob.top]
    if params.prompt_logprobs is not None:
        assert [e and e.token_id for e in got.prompt_logprobs] == [e and e.token_id for e in prompt_logprobs]
    assert len(got.block_ids) == len(PROMPT) // BLOCK_SIZE and used == len(got.block_ids) and freed == 0
    want_k, want_v = reference_kv(model)  # [L, P, Hkv, D] each
    np.testing.assert_allclose(k.reshape(want_k.shape[0], -1, *want_k.shape[2:]), want_k, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v.reshape(want_v.shape[0], -1, *want_v.shape[2:]), want_v, rtol=1e-5, atol=1e-5)


def reference_kv(model: str) -> tuple[np.ndarray, np.ndarray]:
    """The prompt's K/V computed by the model alone, at positions 0..P-1: [L, P, Hkv, D] each."""
    loaded = load_model(model)
    backend = select_backend("cpu")
    blocks = len(PROMPT) // BLOCK_SIZE
    kv = KVCacheArrays(np, loaded.config, blocks, BLOCK_SIZE, backend.dtype)
    llama = LlamaModel(loaded.config, loaded.weights, backend)
    llama.forward(DeviceBatch.of(np, build_flat_batch([Segment(PROMPT, 0, list(range(blocks)))], BLOCK_SIZE)), kv)
    shape = (kv.k.shape[0], blocks * BLOCK_SIZE, *kv.k.shape[3:])
    return kv.k[:, :blocks].reshape(shape), kv.v[:, :blocks].reshape(shape)


def test_a_prefilled_prompt_that_is_never_read_is_released_at_its_deadline(tiny_mtp):
    model, _ = tiny_mtp

    async def main():
        engine = await make_engine(model, hold_seconds=0.2)
        got = await engine.prefill(PROMPT, SamplingParams(temperature=0.0), 1)
        held = engine.stats().num_used_kv_blocks
        await asyncio.sleep(0.5)
        expired = engine.stats().num_used_kv_blocks, engine.release_prefilled(got.handoff_id)
        await engine.shutdown()
        return held, expired

    held, (used, released) = asyncio.run(main())
    assert held == 5 and used == 0 and not released


def test_shutdown_releases_the_held_prompts(tiny_mtp):
    model, _ = tiny_mtp

    async def main():
        engine = await make_engine(model)
        await engine.prefill(PROMPT, SamplingParams(temperature=0.0), 1)
        await engine.shutdown()
        return engine.stats().num_used_kv_blocks

    assert asyncio.run(main()) == 0


def test_held_blocks_outlive_their_sequence_and_count_in_the_books():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    seq = Sequence("r", 0, list(range(10)), SamplingParams(), 20, 0.0, 1)
    bm.allocate_for_prefill(seq)
    assert bm.ensure_slots(seq, 10)
    blocks = bm.hold(seq.block_ids[:2])
    bm.free(seq)
    bm.check_invariants([])
    assert bm.num_used_blocks == 2
    with pytest.raises(ValueError, match="not in use"):
        bm.hold([7])
    bm.release(blocks)
    bm.check_invariants([])
    assert bm.num_used_blocks == 0
    with pytest.raises(ValueError, match="not held"):
        bm.release(blocks)


def test_the_first_token_comes_before_the_kv_and_a_request_left_meanwhile_frees_its_blocks(tiny_mtp):
    """Decode role: the first token is streamed while the fetch is still running; a client that leaves
    then has its blocks freed once the fetch ends (not before: the fetch writes them)."""
    model, _ = tiny_mtp

    async def main():
        prefill, decode = await make_engine(model), await make_engine(model)
        params = SamplingParams(temperature=0.0, max_tokens=8)
        handed = await prefill.prefill(PROMPT, params, 1)
        may_finish, asked = asyncio.Event(), []

        async def fetch(remote, local):
            asked.append((remote, local))
            await may_finish.wait()

        outputs = decode.generate_prefilled(PROMPT, params, 1, handed, fetch)
        first = await outputs.__anext__()
        while not asked:  # the fetch has started
            await asyncio.sleep(0.001)
        await outputs.aclose()
        await asyncio.sleep(0.05)
        during = decode.stats().num_used_kv_blocks
        may_finish.set()
        while decode.handoff_tasks:
            await asyncio.sleep(0.01)
        after = decode.stats().num_used_kv_blocks
        await decode.shutdown()
        await prefill.shutdown()
        return first, asked, during, after, handed

    first, asked, during, after, handed = asyncio.run(main())
    assert tuple(first.deltas[0].token_ids) == (handed.token_id,)
    assert asked == [(list(handed.block_ids), asked[0][1])] and len(asked[0][1]) == 5
    assert during == 5 and after == 0


def test_a_prefilled_request_the_decode_side_refuses_lets_the_prefill_side_go(tiny_mtp):
    """A decode engine that cannot take the request (here: too many choices) still tells the prefill
    side, through an empty fetch, that it may release the blocks."""
    model, _ = tiny_mtp

    async def main():
        prefill, decode = await make_engine(model), await make_engine(model)
        handed = await prefill.prefill(PROMPT, SamplingParams(temperature=0.0), 1)

        async def fetch(remote, local):
            assert not remote and not local
            prefill.release_prefilled(handed.handoff_id)

        with pytest.raises(ValueError, match="one choice"):
            async for _ in decode.generate_prefilled(PROMPT, SamplingParams(n=2), 1, handed, fetch):
                pass
        used = prefill.stats().num_used_kv_blocks
        await decode.shutdown()
        await prefill.shutdown()
        return used

    assert asyncio.run(main()) == 0
