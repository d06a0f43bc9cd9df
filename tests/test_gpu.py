"""GPU path against the NumPy path: the attention kernel against its twin, the model, golden outputs."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from golden import GOLDEN_PROMPTS, generate_greedy

pytestmark = pytest.mark.gpu


# (query heads, KV heads, head_dim, block_size): the default model, a Qwen-like GQA, odd sizes, the tiny models
ATTENTION_SHAPES = [(9, 3, 64, 16), (14, 2, 128, 16), (8, 1, 96, 32), (4, 4, 32, 8), (4, 2, 16, 16)]


def attention_inputs(rng: np.random.Generator, segments: list[tuple[int, int]], heads: int, kv_heads: int,
                     dim: int, block_size: int, width: int) -> tuple[np.ndarray, ...]:
    """Host q [T, Hq, D], K/V caches, block_tables [B, width], batch_id_per_token [T] and positions [T]
    for segments of (new tokens, cached positions before them), their blocks scattered at random."""
    needed = [-(-(context + n) // block_size) for n, context in segments]
    free = rng.permutation(sum(needed) + 1)
    tables = np.zeros((len(segments), width), dtype=np.int32)
    batch_ids, positions = [], []
    for b, ((n, context), blocks) in enumerate(zip(segments, needed)):
        tables[b, :blocks], free = free[:blocks], free[blocks:]
        batch_ids += [b] * n
        positions += list(range(context, context + n))
    q = rng.standard_normal((len(positions), heads, dim)).astype(np.float16)
    k = rng.standard_normal((sum(needed) + 1, block_size, kv_heads, dim)).astype(np.float16)
    v = rng.standard_normal((sum(needed) + 1, block_size, kv_heads, dim)).astype(np.float16)
    return q, k, v, tables, np.array(batch_ids, np.int32), np.array(positions, np.int32)


def attention_on_device(*inputs: np.ndarray, scale: float) -> np.ndarray:
    """paged_attention_cuda on host (q, k_cache, v_cache, block_tables, batch_id_per_token, positions):
    the output [T, Hq, D] fp16 on the host."""
    import cupy

    from cupyspec.model.attention import paged_attention_cuda

    return paged_attention_cuda(*(cupy.asarray(np.ascontiguousarray(a)) for a in inputs), scale).get()


@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=lambda s: "{}-{}x{}-b{}".format(*s))
@pytest.mark.parametrize("query_lens,max_context", [
    ([1], 700), ([1, 1, 1], 700), ([7, 1, 4, 1, 33], 700), ([300], 700), ([1] * 256, 700), ([6] * 17, 700),
    ([1], 4000), ([1, 1, 1, 1], 4000), ([6] * 5, 4000), ([3, 1, 2048, 6], 4000)])
def test_paged_attention_kernel_matches_twin(query_lens, max_context, shape):
    from cupyspec.model.attention import paged_attention

    heads, kv_heads, dim, block_size = shape
    rng = np.random.default_rng(len(query_lens) * 100 + sum(query_lens) + max_context)
    contexts = [int(rng.integers(0, max_context - n + 1)) for n in query_lens]
    contexts[0] = max_context - query_lens[0]  # the longest context the case allows
    segments = list(zip(query_lens, contexts))
    inputs = attention_inputs(rng, segments, heads, kv_heads, dim, block_size, -(-max_context // block_size) + 3)
    scale = dim ** -0.5
    want = paged_attention(np, *inputs, scale).astype(np.float32)
    got = attention_on_device(*inputs, scale=scale).astype(np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3)


@pytest.mark.parametrize("shape", ATTENTION_SHAPES[:2], ids=lambda s: "{}-{}x{}-b{}".format(*s))
def test_paged_attention_rows_are_batch_independent(shape):
    """A row's output has the same bits in any launch whose CTAs have as many warps (8 up to FEW_ROWS
    rows, else 4): alone or beside other requests, in a batch padded with a wider block table,
    flash-decoding split or not, and whether a CTA takes it with its neighbours or alone."""
    from cupyspec.model.attention import FEW_ROWS, GROUPED_ABOVE, SPLIT_BELOW_CTAS

    heads, kv_heads, dim, block_size = shape
    rng = np.random.default_rng(7)
    segments = [(1, 3999), (6, 1020), (300, 0), (1, 10), (5, 250), (1, 255), (1, 256)]  # about partition_size's ends
    q, k, v, tables, batch_ids, positions = attention_inputs(rng, segments, heads, kv_heads, dim, block_size,
                                                             4000 // block_size + 1)
    scale = dim ** -0.5
    wide = np.zeros((len(segments) + 1, 8192 // block_size), dtype=np.int32)  # last row: padding (block 0)
    wide[:-1, : tables.shape[1]] = tables

    def padded(rows: np.ndarray, num_rows: int) -> np.ndarray:
        """`rows` of the batch, padded to num_rows rows with the wide block table: their outputs."""
        pad = num_rows - len(rows)
        out = attention_on_device(
            np.concatenate([q[rows], rng.standard_normal((pad, heads, dim)).astype(np.float16)]), k, v, wide,
            np.r_[batch_ids[rows], np.full(pad, len(segments), np.int32)],
            np.r_[positions[rows], np.zeros(pad, np.int32)], scale=scale)
        return out[:len(rows)].view(np.uint16)

    # 4 warps: every row together (not split); padded to 1024 rows (not split), where CTAs take groups
    # of rows; so padded behind one row more (the first request's, again), which moves every later row to
    # other groups or out of them; the short segments' rows padded to 32 (split)
    assert FEW_ROWS < 32 and 32 * kv_heads < SPLIT_BELOW_CTAS <= 1024 * kv_heads and GROUPED_ABOVE < 1024
    together = attention_on_device(q, k, v, tables, batch_ids, positions, scale=scale).view(np.uint16)
    every_row = np.arange(len(positions))
    assert len(positions) <= GROUPED_ABOVE
    assert np.array_equal(padded(every_row, 1024), together)
    assert np.array_equal(padded(np.r_[0, every_row], 1024)[1:], together)
    short = np.flatnonzero(np.isin(batch_ids, [b for b, (n, _) in enumerate(segments) if n < 300]))
    assert len(short) <= FEW_ROWS
    assert np.array_equal(padded(short, 32), together[short])

    # 8 warps: each short segment alone (split where its blocks span more than one partition), and
    # all of them padded to FEW_ROWS rows (split)
    together_short = padded(short, FEW_ROWS)
    for b, (n, _) in enumerate(segments):
        if n >= 300:
            continue
        mine = batch_ids == b
        blocks = -(-(positions[mine].max() + 1) // block_size)
        alone = attention_on_device(q[mine], k, v, tables[b : b + 1, :blocks], np.zeros(n, np.int32),
                                    positions[mine], scale=scale)
        assert np.array_equal(alone.view(np.uint16), together_short[batch_ids[short] == b]), segments[b]


def test_cupy_logits_match_numpy_logits(default_model_path):
    from cupyspec.backend import select_backend
    from cupyspec.loader import load_model
    from cupyspec.model.batch import DeviceBatch, Segment, build_flat_batch
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
        logits[device] = backend.to_host(model.compute_logits(model.forward(DeviceBatch.of(backend.xp, batch), kv)))
    cpu, gpu = logits["cpu"], logits["cuda"]
    error = np.linalg.norm(gpu - cpu) / np.linalg.norm(cpu)
    assert error < 2e-2, error
    agree = (gpu.argmax(-1) == cpu.argmax(-1)).mean()
    assert agree > 0.95, agree


def test_greedy_golden_outputs_on_the_gpu(default_model_path):
    outputs = asyncio.run(generate_greedy(default_model_path, "cuda", [p for p, _ in GOLDEN_PROMPTS]))
    for (prompt, expected), got in zip(GOLDEN_PROMPTS, outputs):
        assert got == expected, prompt
