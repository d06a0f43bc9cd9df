"""CUDA graphs on the GPU: a replayed step gives the eager step's logits bit for bit, and the engine
gives the same greedy outputs with graphs as without, with and without speculation; with overlap
scheduling and speculation, the outputs of a step at a time up to near-ties."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from golden import GOLDEN_PROMPTS

from cupyspec.config import CacheConfig, EngineConfig
from cupyspec.engine import AsyncEngine
from cupyspec.model.attention import FEW_ROWS
from cupyspec.model.batch import DeviceBatch, FlatBatch, Segment, build_flat_batch
from cupyspec.model.cuda_graphs import BUCKETS, LOGIT_ROWS
from cupyspec.model.linear import GEMV_MAX_ROWS, KERNEL_MAX_ROWS
from cupyspec.outputs import TokenLogprob
from cupyspec.sampling.params import SamplingParams
from cupyspec.spec_decode.speculative_config import SpeculativeConfig

BLOCK_SIZE = 16
MAX_MODEL_LEN = 2048


def test_kernel_boundaries_are_buckets() -> None:
    """A padded step must pick the matrix-product kernel family and the attention CTA size that the
    eager step picks."""
    assert GEMV_MAX_ROWS in BUCKETS
    assert FEW_ROWS in BUCKETS
    assert BUCKETS[-1] == KERNEL_MAX_ROWS  # no graph holds a step that the eager pass gives to cuBLAS


def _flat_batch(rng: np.random.Generator, vocab_size: int, parts: list[tuple[int, int]]) -> FlatBatch:
    """A step of parts (new tokens, cached positions before them) of requests with blocks of their own."""
    bounds = np.cumsum([0] + [-(-(start + n) // BLOCK_SIZE) for n, start in parts])  # each request's blocks
    segments = [Segment(rng.integers(0, vocab_size, n).tolist(), start, list(range(lo, hi)))
                for (n, start), lo, hi in zip(parts, bounds[:-1], bounds[1:])]
    return build_flat_batch(segments, BLOCK_SIZE)


@pytest.fixture(scope="module")
def model_and_graphs(default_model_path):
    import cupy

    from cupyspec.backend import select_backend
    from cupyspec.loader import load_model
    from cupyspec.model.cuda_graphs import CudaGraphs
    from cupyspec.model.kv_arrays import KVCacheArrays
    from cupyspec.model.llama import LlamaModel

    loaded = load_model(default_model_path)
    backend = select_backend("cuda")
    model = LlamaModel(loaded.config, loaded.weights, backend)
    kv = KVCacheArrays(cupy, loaded.config, 512, BLOCK_SIZE, backend.dtype)
    stream = cupy.cuda.Stream(non_blocking=True)
    return model, kv, stream, CudaGraphs(model, kv, stream, KERNEL_MAX_ROWS, MAX_MODEL_LEN, cupy.zeros(1, np.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("parts", [
    [(1, 0)], [(1, 37)], [(1, 100), (6, 50), (1, 16)], [(20, 0), (1, 300), (6, 15)], [(1, 5)] * 8, [(3, 40)] * 3,
    [(1, 900), (6, 1000)] * 4,
], ids=str)
def test_replayed_step_gives_the_eager_logits(model_and_graphs, parts: list[tuple[int, int]]) -> None:
    """parts: (new tokens, cached positions before them) of each request."""
    import cupy

    model, kv, stream, graphs = model_and_graphs
    flat = _flat_batch(np.random.default_rng(len(parts)), model.config.vocab_size, parts)
    with stream:
        eager = model.compute_logits(model.forward(DeviceBatch.of(cupy, flat), kv)).get()  # [T, V]
        replayed = graphs.run(flat)
        assert replayed.every_row
        replayed_logits = replayed.logits.get()  # [T, V], copied on the graphs' stream
    assert np.isfinite(eager).all()
    np.testing.assert_array_equal(replayed_logits, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("parts", [[(600, 0), (1, 40)], [(300, 10)] * 2 + [(1, 200)] * 30, [(513, 0)], [(2048, 0)]],
                         ids=lambda p: f"{sum(n for n, _ in p)}rows")
def test_a_large_replayed_step_gives_the_eager_logits_of_its_asked_rows(model_and_graphs, parts) -> None:
    """A step past EVERY_ROW_MAX rows (prefill chunks beside decode rows) replays a graph that computes
    the logits of the rows asked for only, with the eager step's bits; more than LOGIT_ROWS of them
    runs eagerly (None)."""
    import cupy

    model, kv, stream, graphs = model_and_graphs
    rng = np.random.default_rng(sum(n for n, _ in parts))
    flat = _flat_batch(rng, model.config.vocab_size, parts)
    last_rows = np.cumsum([n for n, _ in parts]) - 1  # each request's last row: what samples
    asked = (last_rows[::2], last_rows[1::2])  # in two lists, as targets and prompt-logprob rows come
    with stream:
        hidden = model.forward(DeviceBatch.of(cupy, flat), kv)  # [T, H]
        eager = model.compute_logits(hidden[cupy.asarray(np.concatenate(asked))]).get()  # [R, V]
        replayed = graphs.run(flat, logit_rows=asked)
        assert not replayed.every_row
        replayed_logits = replayed.logits.get()  # [R, V], copied on the graphs' stream
        assert graphs.run(flat, logit_rows=(np.arange(LOGIT_ROWS + 1),)) is None
    assert np.isfinite(eager).all()
    np.testing.assert_array_equal(replayed_logits, eager)


KV_CACHE_BYTES = 1 << 30  # per engine: the engines of a test run one after the other, and a finished one
# may hold its memory until a garbage collection (its parts refer to each other)


Answer = tuple[list[int], list[TokenLogprob], bytes]  # a request's tokens, logprob records and rendered entries


async def _greedy_answers(model_path: str, cuda_graphs: bool, method: str | None, overlap_scheduling: bool = True,
                          logprobs: int | None = None, render: bool = False) -> list[Answer]:
    """Each prompt's greedy tokens, and their logprobs with `logprobs` alternatives when asked: as
    records, or as rendered entries when `render`."""
    speculative = SpeculativeConfig(method=method, num_speculative_tokens=5 if method else 0, cost_aware_backoff=False)
    engine = await AsyncEngine.create(EngineConfig(model=model_path, device="cuda", cuda_graphs=cuda_graphs,
                                                   speculative=speculative, overlap_scheduling=overlap_scheduling,
                                                   cache=CacheConfig(kv_cache_memory_bytes=KV_CACHE_BYTES)))
    params = SamplingParams(temperature=0.0, max_tokens=96, logprobs=logprobs, render_logprobs=render)

    async def answer(prompt: str) -> Answer:
        tokens: list[int] = []
        entries: list[TokenLogprob] = []
        rendered = b""
        async for out in engine.chat([{"role": "user", "content": prompt}], params):
            tokens += [t for d in out.deltas for t in d.token_ids]
            entries += [e for d in out.deltas for e in d.logprobs or ()]
            rendered += b"".join(bytes(d.logprobs_json.data) for d in out.deltas if d.logprobs_json is not None)
        return tokens, entries, rendered

    prompts = [p for p, _ in GOLDEN_PROMPTS] + ["Repeat this list exactly: " + ", ".join(map(str, range(40)))]
    try:
        return list(await asyncio.gather(*(answer(p) for p in prompts)))
    finally:
        await engine.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("method, logprobs, render", [(None, None, False), ("ngram", None, False), (None, 3, False),
                                                      (None, 3, True), ("ngram", 3, True)])
def test_greedy_outputs_with_cuda_graphs_equal_eager(default_model_path, method: str | None, logprobs: int | None,
                                                     render: bool) -> None:
    """Steps of many requests, their logprobs too (replayed as graphs with the forward pass's)."""
    eager = asyncio.run(_greedy_answers(default_model_path, False, method, logprobs=logprobs, render=render))
    graphed = asyncio.run(_greedy_answers(default_model_path, True, method, logprobs=logprobs, render=render))
    assert graphed == eager
    if logprobs is not None:
        assert all((rendered if render else entries) for _, entries, rendered in eager)


# Two logprobs closer than this (nats) are a near-tie: a row's logits differ in the last bits between
# the gemv kernels (steps of up to GEMV_MAX_ROWS rows) and the tiles (larger steps), which can pick
# either token of such a pair.
NEAR_TIE = 0.1


def assert_equal_up_to_near_ties(got: list[list[int]], want: list[Answer]) -> None:
    """Each answer in `got` equals its reference in `want` or leaves it where the reference's token and
    the one taken instead are a near-tie (the two most likely tokens there, from the reference's logprobs)."""
    for tokens, (reference, entries, _) in zip(got, want, strict=True):
        if tokens == reference:
            continue
        at = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
        assert at < min(len(tokens), len(reference)), "one answer ends where the other goes on"
        top = dict(entries[at].top)
        taken = top.get(tokens[at])
        assert taken is not None and entries[at].logprob - taken < NEAR_TIE, (
            f"token {at}: {tokens[at]} instead of {reference[at]} ({entries[at].logprob:.4f}; top {top})")


@pytest.mark.gpu
def test_greedy_outputs_with_overlap_scheduling_equal_a_step_at_a_time(default_model_path) -> None:
    """Plain decoding overlaps every step; ngram overlaps the steps in which nobody drafts. Its verify
    steps compute a row in a larger step than plain decoding does, hence the near-ties (DESIGN.md)."""
    one_at_a_time = asyncio.run(_greedy_answers(default_model_path, True, None, overlap_scheduling=False, logprobs=2))
    for method in (None, "ngram"):
        answers = asyncio.run(_greedy_answers(default_model_path, True, method))
        assert_equal_up_to_near_ties([tokens for tokens, _, _ in answers], one_at_a_time)
