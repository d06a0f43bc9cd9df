"""The fused decoder kernels (cuda/rms_norm.cu, rope_cache.cu, swiglu.cu) against their NumPy twins."""

from __future__ import annotations

import numpy as np
import pytest

from cupyspec.model.fused import add_rms_norm, rope_and_cache, swiglu

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("tokens,hidden", [(1, 576), (37, 576), (300, 896), (5, 100)])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(tokens: int, hidden: int, with_delta: bool) -> None:
    import cupy

    rng = np.random.default_rng(tokens + hidden)
    residual = rng.standard_normal((tokens, hidden)).astype(np.float32) * 3
    delta = rng.standard_normal((tokens, hidden)).astype(np.float16) if with_delta else None
    weight = rng.standard_normal(hidden).astype(np.float32)
    want_residual = residual.copy()
    want = add_rms_norm(np, want_residual, delta, weight, 1e-5, np.float16)
    got_residual = cupy.asarray(residual)
    got = add_rms_norm(cupy, got_residual, None if delta is None else cupy.asarray(delta), cupy.asarray(weight),
                       1e-5, np.float16)
    np.testing.assert_array_equal(got_residual.get(), want_residual)  # the add is exact
    np.testing.assert_allclose(got.get().astype(np.float32), want.astype(np.float32), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 9, 3, 64), (70, 9, 3, 64), (5, 14, 2, 128)])
def test_rope_and_cache(tokens: int, heads: int, kv_heads: int, head_dim: int) -> None:
    import cupy

    rng = np.random.default_rng(tokens * heads)
    num_slots = 64 * 16
    qkv = rng.standard_normal((tokens, (heads + 2 * kv_heads) * head_dim)).astype(np.float16)
    angles = rng.uniform(0, 6.3, (tokens, head_dim // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    slots = rng.permutation(num_slots)[:tokens].astype(np.int64)
    caches = [np.zeros((64, 16, kv_heads, head_dim), np.float16) for _ in range(2)]
    want_q = rope_and_cache(np, qkv, cos, sin, slots, caches[0], caches[1], heads, kv_heads)
    device_caches = [cupy.zeros_like(cupy.asarray(c)) for c in caches]
    got_q = rope_and_cache(cupy, cupy.asarray(qkv), cupy.asarray(cos), cupy.asarray(sin), cupy.asarray(slots),
                           device_caches[0], device_caches[1], heads, kv_heads)
    np.testing.assert_array_equal(got_q.get(), want_q)  # same fp32 operations, no fused multiply-add
    np.testing.assert_array_equal(device_caches[0].get(), caches[0])
    np.testing.assert_array_equal(device_caches[1].get(), caches[1])


@pytest.mark.parametrize("tokens,width", [(1, 1536), (33, 1536), (4, 100)])
def test_swiglu(tokens: int, width: int) -> None:
    import cupy

    gate_up = (np.random.default_rng(width).standard_normal((tokens, 2 * width)) * 4).astype(np.float16)
    want = swiglu(np, gate_up)
    got = swiglu(cupy, cupy.asarray(gate_up)).get()
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-3, atol=1e-3)
