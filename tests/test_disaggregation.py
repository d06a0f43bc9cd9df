"""A request handed from a prefill engine to a decode engine, in one process on the CPU, its prompt's
K/V moved between their pools through NIXL: outputs, logprobs, prompt logprobs and speculate_metrics
equal one engine's, with and without speculation (with MTP, the prefill engine's head drafts for the
decode engine's first step); a failed fetch or a short pool computes the prompt on the
decode side instead, with the same outputs; no KV block stays in use on either side."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("nixl", reason="KV transfer needs NIXL: pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1")

from cupyspec.config import CacheConfig, EngineConfig  # noqa: E402
from cupyspec.disagg.kv_transfer import KVTransferAgent, KVTransferError  # noqa: E402
from cupyspec.engine import AsyncEngine  # noqa: E402
from cupyspec.sampling.params import SamplingParams  # noqa: E402
from cupyspec.sampling.uniforms import sampling_key  # noqa: E402
from cupyspec.spec_decode.speculative_config import SpeculativeConfig  # noqa: E402

PROMPTS = [[7, 8, 9, 10, 11, 12] * 4, [3, 4, 5, 3, 4, 5, 3, 4], list(range(20, 47))]
REQUESTS = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3, prompt_logprobs=2),
            SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=16, ignore_eos=True, logprobs=1)]
# each choice's key, as `generate` derives it from a seed (greedy requests draw nothing with theirs)
KEYS = [sampling_key(params.seed if params.seed is not None else 1000 + i, 0) for i, params in enumerate(REQUESTS)]
TIMEOUT = 30


def engine_config(model: str, method: str | None, kv_bytes: int | None = None, role: str = "both",
                  head: str | None = None) -> EngineConfig:
    speculative = SpeculativeConfig(method=method, num_speculative_tokens=3, cost_aware_backoff=False,
                                    min_acceptance_rate=0.0, model=head if method == "mtp" else None,
                                    num_model_steps=3 if method == "mtp" else 1) if method else SpeculativeConfig()
    return EngineConfig(model=model, device="cpu", speculative=speculative, role=role,
                        cache=CacheConfig(block_size=4, kv_cache_memory_bytes=kv_bytes))


async def collect(outputs) -> dict:
    result = {"tokens": [], "logprobs": [], "prompt_logprobs": None, "speculate_metrics": None}
    async for out in outputs:
        result["prompt_logprobs"] = out.prompt_logprobs or result["prompt_logprobs"]
        result["speculate_metrics"] = out.speculate_metrics or result["speculate_metrics"]
        for delta in out.deltas:
            result["tokens"] += delta.token_ids
            result["logprobs"] += delta.logprobs or ()
    return result


async def one_engine(model: str, method: str | None, head: str | None = None) -> list[dict]:
    engine = await AsyncEngine.create(engine_config(model, method, head=head))
    results = await asyncio.gather(*(collect(engine.generate(p, r)) for p, r in zip(PROMPTS, REQUESTS)))
    await engine.shutdown()
    return results


async def handed_over(model: str, method: str | None, break_fetch: bool = False, decode_kv_bytes: int | None = None,
                      head: str | None = None) -> tuple[list[dict], int, int, int]:
    """Each request prefilled by a prefill-role engine (which releases what is read as the
    notifications come; with MTP, it has the head too) and decoded by another: the results, the
    blocks in use on each side once they are done, and the fetches that copied blocks."""
    prefill = await AsyncEngine.create(engine_config(model, "mtp" if method == "mtp" else None, role="prefill",
                                                     head=head))
    decode = await AsyncEngine.create(engine_config(model, method, decode_kv_bytes, head=head))
    decode_agent = KVTransferAgent("decode", decode.runner.kv, "float32")
    peer = decode_agent.connect(prefill.kv_agent.layout())
    fetches = 0  # that copied blocks

    async def request(prompt, params, key):
        handed = await prefill.prefill(prompt, params, key)

        async def fetch(remote, local):
            nonlocal fetches
            if break_fetch:
                raise KVTransferError("the prefill server went away")
            if remote:
                fetches += 1
                transfer = decode_agent.read(peer, remote, local, handed.handoff_id.encode())
                await asyncio.to_thread(transfer.wait, TIMEOUT)
            else:
                decode_agent.notify(peer, handed.handoff_id.encode())

        return await collect(decode.generate_prefilled(prompt, params, key, handed, fetch))

    try:
        results = await asyncio.gather(*(request(p, r, k) for p, r, k in zip(PROMPTS, REQUESTS, KEYS)))
        while decode.handoff_tasks or (len(prefill.held_prompts) and not break_fetch):
            await asyncio.sleep(0.01)
        in_use = prefill.stats().num_used_kv_blocks, decode.stats().num_used_kv_blocks
    finally:
        decode_agent.close()
        await decode.shutdown()
        await prefill.shutdown()
    return results, *in_use, fetches


def assert_same(got: list[dict], want: list[dict]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g["tokens"] == w["tokens"] and len(g["tokens"]) == 16
        assert [(e.token_id, [t for t, _ in e.top]) for e in g["logprobs"]] == \
            [(e.token_id, [t for t, _ in e.top]) for e in w["logprobs"]]
        assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(g["logprobs"], w["logprobs"]))
        assert g["speculate_metrics"] == w["speculate_metrics"]
    prompt_got, prompt_want = got[0]["prompt_logprobs"], want[0]["prompt_logprobs"]
    assert prompt_got is not None and [e and e.token_id for e in prompt_got] == [e and e.token_id for e in prompt_want]


@pytest.mark.parametrize("method", [None, "ngram", "mtp"])
def test_a_handed_over_request_gives_one_engines_outputs(tiny_mtp, method):
    model, head = tiny_mtp
    want = asyncio.run(one_engine(model, method, head))
    got, prefill_used, decode_used, fetches = asyncio.run(handed_over(model, method, head=head))
    assert_same(got, want)
    if method is not None:  # the first decode step verified drafts, as one engine's does
        assert all(g["speculate_metrics"].num_draft_tokens > 0 for g in got)
    assert fetches == len(PROMPTS) and prefill_used == decode_used == 0


def test_a_prompt_the_decode_pool_cannot_take_yet_is_computed_there_later(tiny_mtp):
    """A pool of 12 blocks takes the first two prompts' K/V (6 and 2 blocks), not the third's (7)."""
    model, _ = tiny_mtp
    want = asyncio.run(one_engine(model, None))
    got, prefill_used, decode_used, fetches = asyncio.run(handed_over(model, None, decode_kv_bytes=12 * 2048))
    assert_same(got, want)
    assert fetches < len(PROMPTS) and prefill_used == decode_used == 0


def test_a_failed_fetch_computes_the_prompt_on_the_decode_side(tiny_mtp):
    model, _ = tiny_mtp
    want = asyncio.run(one_engine(model, None))
    got, prefill_used, decode_used, fetches = asyncio.run(handed_over(model, None, break_fetch=True))
    assert_same(got, want)
    assert fetches == 0 and decode_used == 0
    assert prefill_used == sum(-(-len(p) // 4) for p in PROMPTS)  # never read: held until their deadline


def test_a_decode_engine_warms_up_without_its_prefill_servers(tiny_mtp):
    model, _ = tiny_mtp
    config = EngineConfig(model=model, device="cpu", role="decode", prefill_urls=("http://127.0.0.1:9",),
                          warm_up=True, cache=CacheConfig(block_size=4))

    async def start_and_stop() -> int:
        engine = await AsyncEngine.create(config)  # the prefill server at the discard port refuses
        await engine.shutdown()
        return engine.stats().num_used_kv_blocks

    assert asyncio.run(start_and_stop()) == 0


@pytest.mark.parametrize("fetch_ends", [True, False])
def test_shutdown_lets_a_request_whose_kv_is_on_its_way_finish_or_aborts_it(tiny_mtp, fetch_ends):
    """Shutdown waits for a request whose prompt's K/V is still being fetched, which then finishes; one
    whose fetch outlasts shutdown's time is aborted (its stream ends) and shutdown returns."""
    model, _ = tiny_mtp

    async def main() -> tuple[dict, float]:
        prefill = await AsyncEngine.create(engine_config(model, None, role="prefill"))
        decode = await AsyncEngine.create(engine_config(model, None))
        handed = await prefill.prefill(PROMPTS[1], REQUESTS[1], KEYS[1])
        release = asyncio.Event()

        async def fetch(remote, local):  # a copy that ends when told (the K/V stays zeros)
            await release.wait()

        result = asyncio.ensure_future(collect(decode.generate_prefilled(PROMPTS[1], REQUESTS[1], KEYS[1], handed,
                                                                         fetch)))
        await asyncio.sleep(0.05)  # the first token delivered, the K/V on its way
        started = time.monotonic()
        stopping = asyncio.ensure_future(decode.shutdown(timeout=5.0 if fetch_ends else 0.2))
        await asyncio.sleep(0.3)
        if fetch_ends:
            release.set()
        await stopping
        await prefill.shutdown()
        return await asyncio.wait_for(result, 10), time.monotonic() - started

    result, seconds = asyncio.run(main())
    assert len(result["tokens"]) == (16 if fetch_ends else 1)
    assert seconds < 3
