"""Matrix products x @ w.T with weights in the [out, in] layout: our kernels on a GPU, NumPy's elsewhere.

CuPy refuses cuBLAS during stream capture, so the products of the steps that CUDA graphs hold run
the kernels of `cuda/gemm.cu`: a tensor-core gemv streaming the weights for up to GEMV_MAX_ROWS
rows, tensor-core tiles up to KERNEL_MAX_ROWS rows; above that (prefill steps larger than any
graph) cuBLAS. Within a kernel family a row's result depends on that row and the weights only,
never on the batch it is in or the tile shape picked for it, so batches padded to fixed sizes give
bit-identical rows.
Products with fp32 output (the logits) always take the tiles, so a row's logits are the same
whether they come with every row of a step or with the few rows that sample. Products into the
residual stream (`add_linear`) add in the kernels' epilogue; cupyspec/model/fused.py runs the gemv
kernels that fuse RMSNorm, SwiGLU and RoPE around a product. Packed weights (QuantizedWeight) stay
packed in the gemv (cuda/gemv_packed.cu); products of more rows dequantize them first.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from cupyspec.kernels import load_kernel, sm_count
from cupyspec.model.quantized import QuantizedWeight, dequantize

GEMV_MAX_ROWS = 8  # rows up to which the gemv kernel runs
KERNEL_MAX_ROWS = 2048  # above this, cuBLAS (x @ w.T) runs instead: steps larger than any CUDA graph

GEMV_THREADS = 384  # GEMV_WARPS * 32 in cuda/gemm.cu
GEMV_ROWS = 16  # weight rows per gemv block (GEMV_ROWS in cuda/gemm.cu)
STATIC_SHARED_LIMIT = 48 * 1024  # dynamic shared memory above this needs the function attribute


@dataclass(frozen=True)
class _Tile:
    """One gemm_tc instantiation of cuda/gemm.cu (its GEMM_TC lines hold the same numbers)."""

    rows: int  # BM
    cols: int  # BN
    depth: int  # BK
    threads: int
    stages: int

    @property
    def function(self) -> str:
        return f"gemm_tc_{self.rows}x{self.cols}"

    @property
    def shared_bytes(self) -> int:
        return self.stages * (self.rows + self.cols) * (self.depth + 8) * 2  # padded fp16 rows

    def blocks(self, m: int, n: int) -> int:
        return -(-m // self.rows) * -(-n // self.cols)


_TILES = (_Tile(128, 192, 32, 256, 4), _Tile(128, 96, 32, 128, 4), _Tile(64, 96, 32, 128, 4),
          _Tile(32, 64, 64, 128, 4))  # largest first


def _pick_tile(m: int, n: int, sm_count: int) -> _Tile:
    """The largest tile that fills its first row block at least half and still gives every SM a block;
    else the smallest. All tiles give the same bits, so this is about speed only."""
    for tile in _TILES[:-1]:
        if 2 * m > tile.rows and tile.blocks(m, n) >= sm_count:
            return tile
    return _TILES[-1]


@functools.cache
def _kernel(function: str, shared_bytes: int, device: int, source: str = "gemm") -> Any:
    """The kernel `function` of cuda/<source>.cu, allowed `shared_bytes` of dynamic shared memory on `device`."""
    kernel = load_kernel(source, function)
    if shared_bytes > STATIC_SHARED_LIMIT:
        kernel.max_dynamic_shared_size_bytes = shared_bytes  # set for the current device, once
    return kernel


def _aligned(xp: Any, a: Any) -> Any:
    """a as a C-contiguous array at a 16-byte boundary (the kernels read 16-byte chunks)."""
    a = xp.ascontiguousarray(a)
    return a.copy() if a.data.ptr % 16 else a


def _kernels_take(xp: Any, x: Any, w: Any) -> bool:
    """Whether cuda/gemm.cu runs x [M, K] @ w[N, K].T: CuPy fp16, K % 8 == 0, M <= KERNEL_MAX_ROWS."""
    return (xp is not np and x.dtype == np.float16 and w.dtype == np.float16 and x.shape[1] % 8 == 0
            and x.shape[0] <= KERNEL_MAX_ROWS)


def _unpacked(xp: Any, x: Any, w: Any, epilogue: str) -> Any:
    """w as the product of x [M, K] reads it: packed where the gemv takes it, else dequantized."""
    if isinstance(w, QuantizedWeight) and not (gemv_takes(xp, x.shape[0], w) and x.dtype == np.float16
                                               and epilogue != "f32"):
        return dequantize(xp, w)
    return w


def _product(xp: Any, x: Any, w: Any, target: Any, epilogue: str) -> None:
    """x [M, K] @ w[N, K].T into target [M, N] on our kernels: stored as fp16 ("f16") or fp32 ("f32"),
    or added to it in fp32 after rounding to fp16 ("add"); the gemv up to GEMV_MAX_ROWS rows (never
    for "f32"), else the tiles."""
    m, k = x.shape
    n = w.shape[0]
    if not (m and n):
        return
    if target.data.ptr % (2 * target.dtype.itemsize):  # the tiles store pairs of columns
        raise ValueError("the output must start at an even element")
    x = _aligned(xp, x)
    if m <= GEMV_MAX_ROWS and epilogue != "f32":
        launch_gemv(f"gemv_{epilogue}", w, (x, *weight_args(xp, w), target, np.int32(m), np.int32(n), np.int32(k)))
    else:
        w = _aligned(xp, w)
        tile = _pick_tile(m, n, sm_count(x.device.id))
        _kernel(f"{tile.function}_{epilogue}", tile.shared_bytes, x.device.id)(
            (-(-m // tile.rows), -(-n // tile.cols)), (tile.threads,), (x, w, target, np.int32(m), np.int32(n),
                                                                        np.int32(k)), shared_mem=tile.shared_bytes)


def linear(xp: Any, x: Any, w: Any, out_dtype: Any = None, out: Any | None = None) -> Any:
    """x [M, K] @ w[N, K].T -> [M, N] in out_dtype (default x.dtype), written into `out` when given.

    CuPy fp16 with fp16 or fp32 output and K % 8 == 0 runs cuda/gemm.cu up to KERNEL_MAX_ROWS rows;
    anything else is the plain product (the kernels' twin). `w` should be C-contiguous (else it is
    copied on every call), or packed (QuantizedWeight); `out`, C-contiguous [M, N] of out_dtype.
    """
    out_dtype = np.dtype(x.dtype if out_dtype is None else out_dtype)
    m, n = x.shape[0], w.shape[0]
    w = _unpacked(xp, x, w, "f16" if out_dtype == np.float16 else "f32")
    if out is not None and (out.shape != (m, n) or out.dtype != out_dtype or not out.flags.c_contiguous):
        raise ValueError(f"out must be a C-contiguous [{m}, {n}] {out_dtype} array, not {out.shape} {out.dtype}")
    if not (_kernels_take(xp, x, w) and out_dtype in (np.float16, np.float32)):
        result = (x @ w.T).astype(out_dtype, copy=False)  # [M, N]; cuBLAS for CuPy
        if out is None:
            return result
        out[...] = result
        return out
    if out is None:
        out = xp.empty((m, n), dtype=out_dtype)  # [M, N]
    _product(xp, x, w, out, "f16" if out_dtype == np.float16 else "f32")
    return out


def add_linear(xp: Any, residual: Any, x: Any, w: Any) -> None:
    """residual [M, N] fp32 += x [M, K] @ w[N, K].T rounded to x's dtype, in place (C-contiguous).

    Where cuda/gemm.cu takes the product, its epilogue adds; elsewhere the product is added (the twin).
    """
    if residual.shape != (x.shape[0], w.shape[0]) or residual.dtype != np.float32 or not residual.flags.c_contiguous:
        raise ValueError(f"residual must be a C-contiguous [{x.shape[0]}, {w.shape[0]}] float32 array")
    w = _unpacked(xp, x, w, "add")
    if _kernels_take(xp, x, w):
        _product(xp, x, w, residual, "add")
    else:
        residual += (x @ w.T).astype(x.dtype, copy=False)


def gemv_takes(xp: Any, rows: int, w: Any) -> bool:
    """Whether the gemv kernels run products of `rows` rows with w [N, K]: CuPy, rows <= GEMV_MAX_ROWS,
    fp16 weights with K % 8 == 0 or packed ones (the fused kernels of cupyspec/model/fused.py too)."""
    if xp is np or rows > GEMV_MAX_ROWS:
        return False
    if isinstance(w, QuantizedWeight):
        return w.dtype == np.float16
    return w.dtype == np.float16 and w.shape[1] % 8 == 0


def weight_args(xp: Any, w: Any) -> tuple[Any, Any]:
    """The gemv kernels' (w, scales) arguments: a packed matrix's two arrays, or an fp16 matrix twice
    (its kernels leave the scales unread)."""
    if isinstance(w, QuantizedWeight):
        return w.values, w.scales
    w = _aligned(xp, w)
    return w, w


def launch_gemv(function: str, w: Any, args: tuple) -> None:
    """The gemv kernel `function` over the rows of w [N, K], fp16 (cuda/gemm.cu) or packed
    (cuda/gemv_packed.cu, `function`_wint8 or _wint4): ceil(N / 16) blocks; args as weight_args gives w."""
    packed = isinstance(w, QuantizedWeight)
    device = (w.values if packed else w).device.id
    kernel = _kernel(f"{function}_{w.method}", 0, device, "gemv_packed") if packed else _kernel(function, 0, device)
    kernel((-(-w.shape[0] // GEMV_ROWS),), (GEMV_THREADS,), args)
