"""Tensor parallelism on two GPUs: NCCL's collectives in and out of CUDA graphs, and the engine split
across the GPUs giving one GPU's greedy outputs (up to near-ties: the ranks' partial sums round
differently) on a random model worth splitting, with and without an MTP head."""

from __future__ import annotations

import asyncio
import gc

import numpy as np
import pytest
from random_model import Shape, write_random_model
from test_cuda_graphs import NEAR_TIE, assert_equal_up_to_near_ties
from tiny_models import TinySpec, random_head_weights, write_head_file

from cupyspec.config import CacheConfig, EngineConfig
from cupyspec.sampling.params import SamplingParams
from cupyspec.spec_decode.speculative_config import SpeculativeConfig

pytestmark = pytest.mark.gpu

SHAPE = Shape("llama", 1024, 4, 16, 4, 2816, 10000.0, 1e-5, 2048, False)  # splits 2 ways (K/V heads too)
PROMPTS = ["Tell me about the sea.", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18",
           "Write a poem about the moon and the stars at night."]


@pytest.fixture(scope="module")
def two_gpus():
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")


@pytest.fixture(scope="module")
def random_model(default_model_path, tmp_path_factory) -> tuple[str, str]:
    """A random model of SHAPE with the default model's tokenizer, and a random MTP head for it."""
    folder = tmp_path_factory.mktemp("tp")
    path = write_random_model(folder / "random.gguf", SHAPE, default_model_path)
    head = random_head_weights(TinySpec(hidden=SHAPE.hidden, heads=SHAPE.heads, kv_heads=SHAPE.kv_heads,
                                        head_dim=SHAPE.hidden // SHAPE.heads, ffn=SHAPE.ffn))
    return str(path), str(write_head_file(folder / "head.safetensors", head))


def test_nccl_sums_and_gathers_uneven_widths_in_and_out_of_a_cuda_graph(two_gpus):
    import cupy

    from cupyspec.backend import select_backend
    from cupyspec.parallel.groups import NcclGroup
    from cupyspec.parallel.ranks import RankThreads

    groups = NcclGroup.create([0, 1])
    widths = (5, 3)
    base = np.arange(12, dtype=np.float32).reshape(3, 4)

    def work(rank: int):
        group, stream = groups[rank], cupy.cuda.Stream(non_blocking=True)
        with stream:
            summed = cupy.asarray(base * (rank + 1))
            group.all_reduce(summed)
            part = cupy.asarray(np.full((3, widths[rank]), rank + 1, np.float32))
            gathered = group.all_gather(part, widths)
            replayed = cupy.asarray(base * (rank + 1))
            stream.begin_capture()
            group.all_reduce(replayed)
            graph = stream.end_capture()
            graph.launch(stream)
            stream.synchronize()
        return summed.get(), gathered.get(), replayed.get()

    threads = RankThreads(groups, select_backend("cuda"))
    results = threads.map(work)
    threads.close()  # the graph went with `work`: the communicators can go
    for summed, gathered, replayed in results:
        np.testing.assert_array_equal(summed, base * 3)
        np.testing.assert_array_equal(gathered, np.repeat([[1] * 5 + [2] * 3], 3, axis=0))
        np.testing.assert_array_equal(replayed, base * 3)


def _config(model: str, size: int, speculative: SpeculativeConfig | None = None,
            cuda_graphs: bool = True) -> EngineConfig:
    return EngineConfig(model=model, device="cuda", tensor_parallel_size=size,
                        speculative=speculative or SpeculativeConfig(), cuda_graphs=cuda_graphs,
                        cache=CacheConfig(kv_cache_memory_bytes=1 << 30))


async def _answers(model: str, size: int, speculative: SpeculativeConfig, cuda_graphs: bool = True) -> list:
    from cupyspec.engine import AsyncEngine

    engine = await AsyncEngine.create(_config(model, size, speculative, cuda_graphs))
    params = SamplingParams(temperature=0.0, max_tokens=64, logprobs=2, ignore_eos=True)

    async def answer(prompt: str):
        tokens, entries = [], []
        async for out in engine.generate(prompt, params):
            tokens += [t for d in out.deltas for t in d.token_ids]
            entries += [e for d in out.deltas for e in d.logprobs or ()]
        return tokens, entries, b""

    try:
        return list(await asyncio.gather(*(answer(p) for p in PROMPTS)))
    finally:
        await engine.shutdown()


def _assert_a_new_group_serves(model: str) -> None:
    answers = asyncio.run(_answers(model, 2, SpeculativeConfig()))
    assert [len(tokens) for tokens, _, _ in answers] == [64] * len(PROMPTS)


def test_a_failing_rank_fails_the_requests_and_frees_the_group(two_gpus, random_model):
    """Rank 1 raising before it launches a graphed step leaves rank 0's graph waiting at a collective
    on its GPU: rank 0's communicator is aborted, the step fails, every request ends with the engine's
    error, shutdown frees the group once the graphs are gone, and a new group then serves."""
    from cupyspec.engine import AsyncEngine
    from cupyspec.errors import EngineClosedError

    model, _ = random_model

    async def main():
        engine = await AsyncEngine.create(_config(model, 2))

        def broken(inputs):
            raise RuntimeError("rank 1 failed")

        engine.runner.runners[1].launch = broken
        try:
            with pytest.raises(EngineClosedError, match="rank 1 failed"):
                async for _ in engine.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8)):
                    pass
        finally:
            await engine.shutdown()

    asyncio.run(main())
    _assert_a_new_group_serves(model)


def test_a_rank_failing_to_capture_its_graphs_fails_the_start(two_gpus, random_model, monkeypatch):
    """Rank 1 raising while the ranks capture their CUDA graphs: the engine's creation raises its
    error (the graphs already captured go before the communicators), and a new group then serves."""
    import cupy

    from cupyspec.engine import AsyncEngine
    from cupyspec.model.cuda_graphs import CudaGraphs

    model, _ = random_model
    capture = CudaGraphs._forward

    def failing_on_rank_1(self, bucket):
        if cupy.cuda.Device().id == 1 and self.graphs:
            raise RuntimeError("rank 1 failed to capture")
        capture(self, bucket)

    monkeypatch.setattr(CudaGraphs, "_forward", failing_on_rank_1)
    with pytest.raises(RuntimeError, match="rank 1 failed to capture"):
        asyncio.run(AsyncEngine.create(_config(model, 2)))
    monkeypatch.undo()
    _assert_a_new_group_serves(model)


@pytest.mark.parametrize("method,cuda_graphs", [(None, True), (None, False), ("mtp", True)])
def test_two_gpus_give_one_gpus_greedy_outputs(two_gpus, random_model, method, cuda_graphs):
    model, head = random_model
    speculative = SpeculativeConfig(method="mtp", model=head, num_model_steps=2, num_speculative_tokens=2,
                                    cost_aware_backoff=False, min_acceptance_rate=0.0) \
        if method == "mtp" else SpeculativeConfig()
    one = asyncio.run(_answers(model, 1, SpeculativeConfig()))
    two = asyncio.run(_answers(model, 2, speculative, cuda_graphs))
    gc.collect()  # what the engines left to the collector goes now, not in the next test's load
    assert_equal_up_to_near_ties([tokens for tokens, _, _ in two], one)
    for (tokens, entries, _), (want_tokens, want_entries, _) in zip(two, one):
        same = next((i for i, (a, b) in enumerate(zip(tokens, want_tokens)) if a != b), len(tokens))
        assert all(abs(a.logprob - b.logprob) < NEAR_TIE for a, b in zip(entries[:same], want_entries[:same]))
