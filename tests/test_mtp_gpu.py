"""MTP on the GPU, with a random head of the default model's shape: the head's logits agree with its
NumPy twin, and the engine's greedy outputs with MTP equal those without, up to near-ties."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from golden import GOLDEN_PROMPTS
from test_cuda_graphs import KV_CACHE_BYTES, assert_equal_up_to_near_ties
from tiny_models import TinySpec, random_head_weights, write_head_file

from cupyspec.config import CacheConfig, EngineConfig
from cupyspec.engine import AsyncEngine
from cupyspec.sampling.params import SamplingParams
from cupyspec.spec_decode.speculative_config import SpeculativeConfig

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def head_path(default_model_path, tmp_path_factory) -> str:
    from cupyspec.loader import load_model

    c = load_model(default_model_path).config
    spec = TinySpec(hidden=c.hidden_size, heads=c.num_heads, kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                    ffn=c.intermediate_size)
    return str(write_head_file(tmp_path_factory.mktemp("mtp") / "head.safetensors", random_head_weights(spec)))


def test_the_heads_logits_on_the_gpu_match_its_numpy_twin(default_model_path, head_path):
    from cupyspec.backend import select_backend
    from cupyspec.loader import load_model
    from cupyspec.model.batch import DeviceBatch, Segment, build_flat_batch
    from cupyspec.model.kv_arrays import KVCacheArrays
    from cupyspec.model.llama import LlamaModel
    from cupyspec.model.mtp import MTPHead, load_head_weights

    loaded = load_model(default_model_path)
    tokens = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8)
    logits = {}
    for device in ("cpu", "cuda"):
        backend = select_backend(device)
        model = LlamaModel(loaded.config, loaded.weights, backend)
        head = MTPHead(model, load_head_weights(head_path, loaded.config))
        kv = KVCacheArrays(backend.xp, loaded.config, 64, 16, backend.dtype, extra_layers=1)
        batch = build_flat_batch([Segment(tokens, 0, list(range(64)))], 16)
        hidden = model.forward_residual(DeviceBatch.of(backend.xp, batch), kv)
        head_batch = build_flat_batch([Segment(tokens[1:], 0, list(range(64)))], 16)
        residual = head.step(hidden[:-1], DeviceBatch.of(backend.xp, head_batch), kv)
        logits[device] = backend.to_host(head.logits(residual))
    cpu, gpu = logits["cpu"], logits["cuda"]
    assert np.linalg.norm(gpu - cpu) / np.linalg.norm(cpu) < 2e-2
    assert (gpu.argmax(-1) == cpu.argmax(-1)).mean() > 0.9


async def _answers(model_path: str, speculative: SpeculativeConfig, logprobs: int | None) -> list:
    engine = await AsyncEngine.create(EngineConfig(model=model_path, device="cuda", speculative=speculative,
                                                   cache=CacheConfig(kv_cache_memory_bytes=KV_CACHE_BYTES)))
    params = SamplingParams(temperature=0.0, max_tokens=64, logprobs=logprobs)

    async def answer(prompt: str):
        tokens, entries = [], []
        async for out in engine.chat([{"role": "user", "content": prompt}], params):
            tokens += [t for d in out.deltas for t in d.token_ids]
            entries += [e for d in out.deltas for e in d.logprobs or ()]
        return tokens, entries, b""

    try:
        return list(await asyncio.gather(*(answer(p) for p, _ in GOLDEN_PROMPTS)))
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("steps", [1, 3])
def test_greedy_outputs_with_mtp_equal_those_without_up_to_near_ties(default_model_path, head_path, steps):
    plain = asyncio.run(_answers(default_model_path, SpeculativeConfig(), logprobs=2))
    mtp = asyncio.run(_answers(default_model_path, SpeculativeConfig(
        method="mtp", model=head_path, num_model_steps=steps, num_speculative_tokens=steps,
        cost_aware_backoff=False, min_acceptance_rate=0.0), logprobs=None))
    assert_equal_up_to_near_ties([tokens for tokens, _, _ in mtp], plain)


async def _proposals(model_path: str, head_path: str, cuda_graphs: bool) -> tuple[list, list]:
    """Each golden prompt's greedy tokens with MTP drafting on every step, and every proposal's drafts
    with the tokens the sequence held then."""
    from test_mtp_engine import record_drafts

    speculative = SpeculativeConfig(method="mtp", model=head_path, num_model_steps=3, num_speculative_tokens=3,
                                    cost_aware_backoff=False, min_acceptance_rate=0.0)
    engine = await AsyncEngine.create(EngineConfig(model=model_path, device="cuda", cuda_graphs=cuda_graphs,
                                                   speculative=speculative,
                                                   cache=CacheConfig(kv_cache_memory_bytes=KV_CACHE_BYTES)))
    records = record_drafts(engine)
    params = SamplingParams(temperature=0.0, max_tokens=48)

    async def answer(prompt: str) -> list[int]:
        tokens = []
        async for out in engine.chat([{"role": "user", "content": prompt}], params):
            tokens += [t for d in out.deltas for t in d.token_ids]
        return tokens

    try:
        answers = list(await asyncio.gather(*(answer(p) for p, _ in GOLDEN_PROMPTS)))
    finally:
        await engine.shutdown()
    return answers, sorted((length, drafts) for _, length, drafts in records)


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_graphed_mtp_steps_draft_and_emit_as_eager_ones(default_model_path, head_path, tmp_path, draft_vocab):
    """The head's catch-up inside the forward graphs and its drafting graphs give the eager steps'
    drafts and tokens, bit for bit, over the whole vocabulary and over a draft vocabulary."""
    if draft_vocab:
        from test_mtp_engine import with_draft_vocab

        from cupyspec.loader import load_model

        head_path, vocab = with_draft_vocab(head_path, tmp_path, load_model(default_model_path).config.vocab_size)
    eager = asyncio.run(_proposals(default_model_path, head_path, cuda_graphs=False))
    graphed = asyncio.run(_proposals(default_model_path, head_path, cuda_graphs=True))
    assert len(eager[1]) > 50
    assert graphed == eager
    if draft_vocab:
        assert np.isin([d for _, drafts in eager[1] for d in drafts], vocab).all()


def test_the_draft_sampler_on_the_gpu_matches_its_numpy_twin():
    import cupy

    from cupyspec.spec_decode.proposers.mtp import DraftSampling, draw_drafts

    rng = np.random.default_rng(11)
    rows, vocab = 24, 49152
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    params = tuple(SamplingParams(temperature=float(t), top_p=float(p), top_k=int(k), min_p=float(m))
                   for t, p, k, m in zip(rng.uniform(0.3, 1.5, rows), rng.uniform(0.5, 1.0, rows),
                                         rng.choice([0, 5, 50], rows), rng.choice([0.0, 0.05], rows)))
    sampling = DraftSampling(np.arange(rows), params, rng.integers(0, 2**63, rows).astype(np.uint64))
    positions = rng.integers(0, 4000, rows)
    results = []
    for xp in (np, cupy):
        picks, lps = xp.zeros(rows, np.int64), xp.zeros(rows, np.float32)
        q = draw_drafts(xp, xp.asarray(logits), xp.asarray(positions), sampling, picks, lps)
        results.append([cupy.asnumpy(a) for a in (picks, lps, q)])
    (cpu_picks, cpu_lps, cpu_q), (gpu_picks, gpu_lps, gpu_q) = results
    np.testing.assert_array_equal(gpu_picks, cpu_picks)
    np.testing.assert_allclose(gpu_lps, cpu_lps, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gpu_q, cpu_q, atol=1e-6)


def test_sampled_requests_draft_alike_with_and_without_graphs(default_model_path, head_path):
    """Seeded sampled requests: their drafts are drawn eagerly after a graphed forward pass, as after
    an eager one, and the tokens are the same."""
    async def answers(cuda_graphs: bool) -> list:
        speculative = SpeculativeConfig(method="mtp", model=head_path, num_model_steps=2, num_speculative_tokens=2,
                                        cost_aware_backoff=False, min_acceptance_rate=0.0)
        engine = await AsyncEngine.create(EngineConfig(model=default_model_path, device="cuda", cuda_graphs=cuda_graphs,
                                                       speculative=speculative,
                                                       cache=CacheConfig(kv_cache_memory_bytes=KV_CACHE_BYTES)))

        async def answer(prompt: str, seed: int) -> list[int]:
            params = SamplingParams(temperature=0.8, top_p=0.95, top_k=40, seed=seed, max_tokens=32)
            tokens = []
            async for out in engine.chat([{"role": "user", "content": prompt}], params):
                tokens += [t for d in out.deltas for t in d.token_ids]
            return tokens

        try:
            return list(await asyncio.gather(*(answer(p, i) for i, (p, _) in enumerate(GOLDEN_PROMPTS))))
        finally:
            await engine.shutdown()

    assert asyncio.run(answers(True)) == asyncio.run(answers(False))


def test_the_heads_input_kernel_matches_its_twin(default_model_path, head_path):
    """cuda/mtp_input.cu (embedding with placeholders, both norms, the concatenation) against the
    NumPy lines it stands for."""
    import cupy

    from cupyspec.backend import select_backend
    from cupyspec.loader import load_model
    from cupyspec.model.batch import DeviceBatch
    from cupyspec.model.llama import LlamaModel
    from cupyspec.model.mtp import MTPHead, load_head_weights

    loaded = load_model(default_model_path)
    rng = np.random.default_rng(5)
    rows, hidden = 37, loaded.config.hidden_size
    previous = rng.integers(0, loaded.config.vocab_size, 8).astype(np.int32)
    ids = rng.integers(0, loaded.config.vocab_size, rows).astype(np.int32)
    ids[::5] = ~rng.integers(0, 8, len(ids[::5]))  # placeholders for previous[n]
    h = (rng.standard_normal((rows, hidden)) * 3).astype(np.float32)
    joined = {}
    for device in ("cpu", "cuda"):
        backend = select_backend(device)
        xp = backend.xp
        head = MTPHead(LlamaModel(loaded.config, loaded.weights, backend), load_head_weights(head_path, loaded.config))
        batch = DeviceBatch(xp.asarray(ids), None, None, None, None, xp.asarray(previous))
        joined[device] = cupy.asnumpy(head._input_rows(xp.asarray(h), batch)).astype(np.float32)
    np.testing.assert_allclose(joined["cuda"], joined["cpu"], rtol=1e-2, atol=1e-2)
