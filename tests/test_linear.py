"""The matrix-product kernels of cuda/gemm.cu against float64 products, padded batches, and the twin;
products added to the residual stream."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

from cupyspec.model import linear as linear_module
from cupyspec.model.linear import GEMV_MAX_ROWS, KERNEL_MAX_ROWS, add_linear, linear

gpu = pytest.mark.gpu

ROWS = [1, 2, 3, 7, 8, 9, 16, 17, 33, 64, 100, 256, 511, 512, 600]
# (N, K, out dtype): SmolLM2-135M's qkv, o, gate_up, down, LM head; small and odd shapes (K % 32 == 8)
SHAPES = [(960, 576, np.float16), (576, 576, np.float16), (3072, 576, np.float16), (576, 1536, np.float16),
          (100, 64, np.float16), (131, 200, np.float16), (131, 200, np.float32), (49152, 576, np.float32)]


def _normal(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> Any:
    import cupy

    values = cupy.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    return (values * np.float32(scale)).astype(np.float16)


@functools.cache
def _weights(n: int, k: int) -> Any:
    """w [N, K] fp16 with outputs of about unit size for unit inputs."""
    return _normal((n, k), seed=n * 7 + k, scale=k ** -0.5)


def test_twin_is_the_plain_product() -> None:
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((5, 24)).astype(np.float32), rng.standard_normal((7, 24)).astype(np.float32)
    np.testing.assert_array_equal(linear(np, x, w), x @ w.T)
    x16, w16 = x.astype(np.float16), w.astype(np.float16)
    got = linear(np, x16, w16, np.float32)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, (x16 @ w16.T).astype(np.float32))
    out = np.empty((5, 7), np.float32)
    assert linear(np, x, w, out=out) is out
    np.testing.assert_array_equal(out, x @ w.T)
    residual = rng.standard_normal((5, 7)).astype(np.float32)
    want = residual + x @ w.T
    add_linear(np, residual, x, w)
    np.testing.assert_array_equal(residual, want)


@gpu
@pytest.mark.parametrize("n,k,out_dtype", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_kernels_match_float64(rows: int, n: int, k: int, out_dtype: Any) -> None:
    import cupy

    x, w = _normal((rows, k), seed=rows), _weights(n, k)
    got = linear(cupy, x, w, out_dtype)
    assert got.shape == (rows, n) and got.dtype == out_dtype
    want = x.astype(np.float64) @ w.astype(np.float64).T  # [rows, n], exact products of the fp16 inputs
    # fp16 output: its rounding (2^-11 relative); fp32 output: fp32 sums (cuBLAS above KERNEL_MAX_ROWS
    # rounds to fp16 first)
    tol = 1e-4 if out_dtype == np.float32 and rows <= KERNEL_MAX_ROWS else 2e-3
    cupy.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)


@gpu
@pytest.mark.parametrize("n,k,out_dtype", [(960, 576, np.float16), (576, 1536, np.float16),
                                           (131, 200, np.float16), (49152, 576, np.float32)])
@pytest.mark.parametrize("rows,batch", [(1, 8), (3, 8), (7, 8), (1, 2), (9, 64), (40, 64), (9, 256), (40, 256),
                                        (9, 512), (40, 512), (100, 512), (256, 512)])
def test_padded_rows_are_bit_identical(rows: int, batch: int, n: int, k: int, out_dtype: Any) -> None:
    import cupy

    assert (rows <= GEMV_MAX_ROWS) == (batch <= GEMV_MAX_ROWS)  # one kernel family
    x, w = _normal((batch, k), seed=batch + rows), _weights(n, k)  # rows.. are the other requests / padding
    alone = linear(cupy, x[:rows], w, out_dtype)
    padded = linear(cupy, x, w, out_dtype)[:rows]
    cupy.testing.assert_array_equal(alone, padded)


@gpu
@pytest.mark.parametrize("n,k,out_dtype", [(131, 200, np.float16), (3072, 576, np.float16),
                                           (576, 1536, np.float16), (49152, 576, np.float32)])
def test_tile_shapes_give_the_same_bits(monkeypatch: pytest.MonkeyPatch, n: int, k: int, out_dtype: Any) -> None:
    import cupy

    x, w = _normal((150, k), seed=150), _weights(n, k)
    results = []
    for tile in linear_module._TILES:
        monkeypatch.setattr(linear_module, "_pick_tile", lambda m, cols, sm_count, tile=tile: tile)
        results.append(linear(cupy, x, w, out_dtype))
    for result in results[1:]:
        cupy.testing.assert_array_equal(result, results[0])


@gpu
@pytest.mark.parametrize("rows", [1, 8, 64, 512])
def test_kernels_run_in_a_cuda_graph(rows: int) -> None:
    import cupy

    x, w = _normal((rows, 576), seed=rows), _weights(49152, 576)
    want = linear(cupy, x, w, np.float32)  # also compiles the kernel and sets its attributes
    out = cupy.zeros_like(want)
    cupy.cuda.Device().synchronize()  # the capturing stream does not wait for the default stream
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        linear(cupy, x, w, np.float32, out=out)
        graph = stream.end_capture()
    graph.launch(stream=stream)
    stream.synchronize()
    cupy.testing.assert_array_equal(out, want)


@gpu
@pytest.mark.parametrize("n,k", [(576, 576), (576, 1536), (131, 200)])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 64, 300, 512, 600])
def test_add_linear_adds_the_rounded_product(rows: int, n: int, k: int) -> None:
    """The epilogue adds the fp16 product that linear returns, in fp32: the same bits."""
    import cupy

    x, w = _normal((rows, k), seed=rows), _weights(n, k)
    residual = cupy.random.default_rng(rows).standard_normal((rows, n), dtype=np.float32)
    want = residual + linear(cupy, x, w).astype(np.float32)
    add_linear(cupy, residual, x, w)
    cupy.testing.assert_array_equal(residual, want)
