"""Greedy picks: each row's argmax, ties to the lowest index (one kernel on a GPU)."""

from __future__ import annotations

from typing import Any

import numpy as np

from cupyspec.kernels import load_kernel

THREADS = 512  # THREADS in cuda/argmax.cu


def argmax_rows(xp: Any, x: Any) -> Any:
    """[R] int64: the column of each row's largest value in x [R, V] (NaN largest; ties to the lowest
    column). CuPy float32 runs cuda/argmax.cu, a block per row instead of CuPy's generic reduction;
    `x.argmax(axis=1)` is its twin."""
    if xp is np or x.dtype != np.float32 or x.ndim != 2 or not x.shape[1]:
        return x.argmax(axis=1).astype(np.int64, copy=False)
    out = xp.empty(x.shape[0], dtype=np.int64)
    if x.shape[0]:
        load_kernel("argmax", "argmax_rows")((x.shape[0],), (THREADS,),
                                             (xp.ascontiguousarray(x), np.int64(x.shape[1]), out))
    return out
