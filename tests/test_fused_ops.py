"""The fused decoder kernels (cuda/rms_norm.cu, rope_cache.cu, swiglu.cu, embedding.cu, the fused gemv
kernels of gemm.cu) against their NumPy twins; fused gemv steps against their separate kernels, bit for bit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from cupyspec.model.embedding import embed_tokens
from cupyspec.model.fused import norm_gate_up_swiglu, norm_qkv_rope, rms_norm, rope_and_cache, swiglu
from cupyspec.model.linear import GEMV_MAX_ROWS, linear

pytestmark = pytest.mark.gpu

EPS = 1e-5
NUM_POSITIONS = 64  # rows of the RoPE tables
NUM_BLOCKS, BLOCK_SIZE = 64, 16  # KV caches


def _rope_tables(rng: np.random.Generator, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [NUM_POSITIONS, D/2] fp32 of random angles."""
    angles = rng.uniform(0, 6.3, (NUM_POSITIONS, head_dim // 2))
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


@pytest.mark.parametrize("tokens,hidden", [(1, 576), (37, 576), (300, 896), (5, 100)])
def test_rms_norm_kernel_matches_twin(tokens: int, hidden: int) -> None:
    import cupy

    rng = np.random.default_rng(tokens + hidden)
    residual = rng.standard_normal((tokens, hidden)).astype(np.float32) * 3
    weight = rng.standard_normal(hidden).astype(np.float32)
    want = rms_norm(np, residual, weight, EPS, np.float16)
    got = rms_norm(cupy, cupy.asarray(residual), cupy.asarray(weight), EPS, np.float16)
    np.testing.assert_allclose(got.get().astype(np.float32), want.astype(np.float32), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("tokens,hidden", [(1, 576), (300, 896), (7, 6)])
def test_embedding_kernel_takes_placeholders_from_the_previous_tokens_as_the_twin(tokens: int, hidden: int) -> None:
    import cupy

    rng = np.random.default_rng(tokens)
    table = rng.standard_normal((1000, hidden)).astype(np.float16)  # [V, H]
    previous = rng.integers(0, 1000, 256).astype(np.int32)  # [S]
    ids = rng.integers(0, 1000, tokens).astype(np.int32)  # [T]
    ids[::3] = ~rng.integers(0, 256, len(ids[::3]))  # placeholders ~s: previous[s]
    want = embed_tokens(np, table, ids, previous)
    got = embed_tokens(cupy, *map(cupy.asarray, (table, ids, previous)))
    np.testing.assert_array_equal(got.get(), want)


@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 9, 3, 64), (70, 9, 3, 64), (5, 14, 2, 128)])
def test_rope_and_cache_kernel_gives_the_twins_bits(tokens: int, heads: int, kv_heads: int, head_dim: int) -> None:
    import cupy

    rng = np.random.default_rng(tokens * heads)
    qkv = rng.standard_normal((tokens, (heads + 2 * kv_heads) * head_dim)).astype(np.float16)
    cos, sin = _rope_tables(rng, head_dim)
    positions = rng.integers(0, NUM_POSITIONS, tokens).astype(np.int32)
    slots = rng.permutation(NUM_BLOCKS * BLOCK_SIZE)[:tokens].astype(np.int64)
    caches = [np.zeros((NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim), np.float16) for _ in range(2)]
    want_q = rope_and_cache(np, qkv, cos, sin, positions, slots, caches[0], caches[1])
    device_caches = [cupy.zeros_like(cupy.asarray(c)) for c in caches]
    got_q = rope_and_cache(cupy, *(cupy.asarray(a) for a in (qkv, cos, sin, positions, slots)), *device_caches)
    np.testing.assert_array_equal(got_q.get(), want_q)  # same fp32 operations, no fused multiply-add
    np.testing.assert_array_equal(device_caches[0].get(), caches[0])
    np.testing.assert_array_equal(device_caches[1].get(), caches[1])


@pytest.mark.parametrize("tokens,width", [(1, 1536), (33, 1536), (4, 100)])
def test_swiglu_kernel_matches_twin(tokens: int, width: int) -> None:
    import cupy

    gate_up = (np.random.default_rng(width).standard_normal((tokens, 2 * width)) * 4).astype(np.float16)
    want = swiglu(np, gate_up)
    got = swiglu(cupy, cupy.asarray(gate_up)).get()
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-3, atol=1e-3)


# ---------------------------------------------------------------- the fused gemv steps (M <= GEMV_MAX_ROWS)


def _norm_inputs(rng: np.random.Generator, rows: int, hidden: int, out_rows: int) -> tuple[np.ndarray, ...]:
    """residual [rows, H] fp32, norm weight [H] fp32, w [out_rows, H] fp16 with outputs of about unit size."""
    residual = rng.standard_normal((rows, hidden)).astype(np.float32) * 3
    norm_weight = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    w = (rng.standard_normal((out_rows, hidden)) * hidden ** -0.5).astype(np.float16)
    return residual, norm_weight, w


QKV_SHAPES = [(576, 9, 3, 64, False), (896, 14, 2, 128, True), (64, 4, 2, 16, True)]  # (H, Hq, Hkv, D, bias)


def _qkv_case(hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool) -> dict[str, Any]:
    """Host inputs of norm_qkv_rope for GEMV_MAX_ROWS rows at distinct cache slots."""
    rng = np.random.default_rng(hidden + heads)
    width = (heads + 2 * kv_heads) * head_dim
    residual, norm_weight, w = _norm_inputs(rng, GEMV_MAX_ROWS, hidden, width)
    cos, sin = _rope_tables(rng, head_dim)
    return {"residual": residual, "norm_weight": norm_weight, "w": w,
            "bias": rng.standard_normal(width).astype(np.float32) if bias else None, "cos": cos, "sin": sin,
            "positions": rng.integers(0, NUM_POSITIONS, GEMV_MAX_ROWS).astype(np.int32),
            "slots": rng.permutation(NUM_BLOCKS * BLOCK_SIZE)[:GEMV_MAX_ROWS].astype(np.int32),
            "cache_shape": (NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim)}


def _qkv_on_device(case: dict[str, Any], rows: int, fused: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q, k cache, v cache) on the host after the first `rows` rows: the fused gemv, or the separate
    kernels (rms_norm, gemv, bias, rope_cache)."""
    import cupy

    d = {k: cupy.asarray(v[:rows] if k in ("residual", "positions", "slots") else v)
         for k, v in case.items() if k != "cache_shape" and v is not None}
    bias = d.get("bias")
    k_cache, v_cache = (cupy.zeros(case["cache_shape"], np.float16) for _ in range(2))
    if fused:
        q = norm_qkv_rope(cupy, d["residual"], d["norm_weight"], EPS, d["w"], bias, d["cos"], d["sin"],
                          d["positions"], d["slots"], k_cache, v_cache)
    else:
        qkv = linear(cupy, rms_norm(cupy, d["residual"], d["norm_weight"], EPS, np.float16), d["w"])
        if bias is not None:
            qkv = (qkv.astype(np.float32) + bias).astype(np.float16)
        q = rope_and_cache(cupy, qkv, d["cos"], d["sin"], d["positions"], d["slots"], k_cache, v_cache)
    return q.get(), k_cache.get(), v_cache.get()


@pytest.mark.parametrize("shape", QKV_SHAPES, ids=str)
def test_norm_qkv_rope_matches_twin(shape: tuple) -> None:
    case = _qkv_case(*shape)
    caches = [np.zeros(case["cache_shape"], np.float32) for _ in range(2)]
    want = norm_qkv_rope(np, case["residual"], case["norm_weight"], EPS, case["w"].astype(np.float32), case["bias"],
                         case["cos"], case["sin"], case["positions"], case["slots"], *caches)
    got = _qkv_on_device(case, GEMV_MAX_ROWS, fused=True)
    for g, w in zip(got, (want, *caches)):
        np.testing.assert_allclose(g.astype(np.float32), w, rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("shape", QKV_SHAPES, ids=str)
def test_norm_qkv_rope_gives_the_bits_of_its_kernels(shape: tuple) -> None:
    case = _qkv_case(*shape)
    for rows in (1, 3, GEMV_MAX_ROWS):
        for fused, separate in zip(_qkv_on_device(case, rows, fused=True), _qkv_on_device(case, rows, fused=False)):
            np.testing.assert_array_equal(fused, separate)


@pytest.mark.parametrize("shape", QKV_SHAPES, ids=str)
def test_norm_qkv_rope_rows_are_batch_independent(shape: tuple) -> None:
    """A row's q and cache entries have the same bits alone as in a batch of up to GEMV_MAX_ROWS."""
    case = _qkv_case(*shape)
    q8, k8, v8 = _qkv_on_device(case, GEMV_MAX_ROWS, fused=True)
    slots = case["slots"]
    for rows in range(1, GEMV_MAX_ROWS):
        q, k, v = _qkv_on_device(case, rows, fused=True)
        np.testing.assert_array_equal(q, q8[:rows])
        for few, all_rows in ((k, k8), (v, v8)):
            np.testing.assert_array_equal(few.reshape(-1, *few.shape[2:])[slots[:rows]],
                                          all_rows.reshape(-1, *all_rows.shape[2:])[slots[:rows]])


MLP_SHAPES = [(576, 1536), (896, 4864), (64, 128)]  # (H, F)


def _mlp_on_device(residual: np.ndarray, norm_weight: np.ndarray, w: np.ndarray, fused: bool) -> np.ndarray:
    """swiglu(RMSNorm(residual) @ w.T) on the host: the fused gemv, or the separate kernels."""
    import cupy

    residual, norm_weight, w = (cupy.asarray(a) for a in (residual, norm_weight, w))
    if fused:
        return norm_gate_up_swiglu(cupy, residual, norm_weight, EPS, w).get()
    return swiglu(cupy, linear(cupy, rms_norm(cupy, residual, norm_weight, EPS, np.float16), w)).get()


@pytest.mark.parametrize("hidden,ffn", MLP_SHAPES)
def test_norm_gate_up_swiglu_matches_twin_and_its_separate_kernels(hidden: int, ffn: int) -> None:
    """Against the twin; the bits of the separate kernels; a row's bits alone and in a batch of 8."""
    residual, norm_weight, w = _norm_inputs(np.random.default_rng(hidden), GEMV_MAX_ROWS, hidden, 2 * ffn)
    want = norm_gate_up_swiglu(np, residual, norm_weight, EPS, w.astype(np.float32))
    got = _mlp_on_device(residual, norm_weight, w, fused=True)  # [8, F]
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=5e-3, atol=5e-3)
    for rows in range(1, GEMV_MAX_ROWS + 1):
        alone = _mlp_on_device(residual[:rows], norm_weight, w, fused=True)
        np.testing.assert_array_equal(alone, got[:rows])
        np.testing.assert_array_equal(alone, _mlp_on_device(residual[:rows], norm_weight, w, fused=False))
