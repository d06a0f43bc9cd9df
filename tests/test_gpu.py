"""GPU path against the NumPy path: the attention kernel against its twin, the model, golden outputs."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from golden import GOLDEN_PROMPTS, generate_greedy

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("query_lens", [[1], [1, 1, 1], [7, 1, 4, 1, 33], [300], [1] * 256, [6] * 17])
def test_paged_attention_kernel_matches_twin(query_lens):
    import cupy

    from cupyspec.model.attention import paged_attention, paged_attention_cuda

    rng = np.random.default_rng(len(query_lens) * 100 + sum(query_lens))
    heads, kv_heads, dim, block_size, num_blocks = 9, 3, 64, 16, 16384
    batch_ids, positions, tables = [], [], np.zeros((len(query_lens), 64), dtype=np.int32)
    free = rng.permutation(num_blocks)
    for b, n in enumerate(query_lens):
        context = int(rng.integers(0, 700))  # cached positions before this segment
        kv_len = context + n
        blocks = -(-kv_len // block_size)
        tables[b, :blocks], free = free[:blocks], free[blocks:]
        batch_ids += [b] * n
        positions += list(range(context, kv_len))
    batch_ids, positions = np.array(batch_ids, np.int32), np.array(positions, np.int32)
    q = rng.standard_normal((len(positions), heads, dim)).astype(np.float16)
    k = rng.standard_normal((num_blocks, block_size, kv_heads, dim)).astype(np.float16)
    v = rng.standard_normal((num_blocks, block_size, kv_heads, dim)).astype(np.float16)
    want = paged_attention(np, q, k, v, tables, batch_ids, positions, 0.125).astype(np.float32)
    got = paged_attention_cuda(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), cupy.asarray(tables),
                               cupy.asarray(batch_ids), cupy.asarray(positions), 0.125).get().astype(np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3)


def test_cupy_logits_match_numpy_logits(default_model_path):
    from cupyspec.backend import select_backend
    from cupyspec.batch import Segment, build_flat_batch
    from cupyspec.loader import load_model
    from cupyspec.model.kv_arrays import KVCacheArrays
    from cupyspec.model.llama import LlamaModel

    loaded = load_model(default_model_path)
    tokens = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8)
    logits = {}
    for device in ("cpu", "cuda"):
        backend = select_backend(device)
        model = LlamaModel(loaded.config, loaded.weights, backend)
        kv = KVCacheArrays(backend.xp, loaded.config, 64, 16, backend.dtype)
        batch = build_flat_batch([Segment(tokens, 0, list(range(64)))], 16)
        logits[device] = backend.to_host(model.compute_logits(model.forward(batch, kv)))
    cpu, gpu = logits["cpu"], logits["cuda"]
    error = np.linalg.norm(gpu - cpu) / np.linalg.norm(cpu)
    assert error < 2e-2, error
    agree = (gpu.argmax(-1) == cpu.argmax(-1)).mean()
    assert agree > 0.95, agree


def test_greedy_golden_outputs_on_the_gpu(default_model_path):
    outputs = asyncio.run(generate_greedy(default_model_path, "cuda", [p for p, _ in GOLDEN_PROMPTS]))
    for (prompt, expected), got in zip(GOLDEN_PROMPTS, outputs):
        assert got == expected, prompt
