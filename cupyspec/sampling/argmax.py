"""Greedy picks: each row's argmax, ties to the lowest index (one kernel on a GPU)."""

from __future__ import annotations

from typing import Any

import numpy as np

from cupyspec.kernels import load_kernel, sm_count

THREADS = 512  # THREADS in cuda/argmax.cu
MIN_CHUNK = 2048  # columns a block scans at least, where argmax_logprobs splits a row


def _on_kernel(xp: Any, x: Any) -> bool:
    return xp is not np and x.dtype == np.float32 and x.ndim == 2 and bool(x.shape[1])


def argmax_rows(xp: Any, x: Any) -> Any:
    """[R] int64: the column of each row's largest value in x [R, V] (NaN largest; ties to the lowest
    column). CuPy float32 runs cuda/argmax.cu, a block per row instead of CuPy's generic reduction;
    `x.argmax(axis=1)` is its twin."""
    if not _on_kernel(xp, x):
        return x.argmax(axis=1).astype(np.int64, copy=False)
    out = xp.empty(x.shape[0], dtype=np.int64)
    if x.shape[0]:
        load_kernel("argmax", "argmax_rows")((x.shape[0],), (THREADS,),
                                             (xp.ascontiguousarray(x), np.int64(x.shape[1]), out))
    return out


def argmax_logprobs(xp: Any, x: Any) -> tuple[Any, Any]:
    """argmax_rows of logits x [R, V] f32, and each pick's log-softmax [R] f32: on a GPU one kernel,
    or, where the rows are too few to give every SM a block, a kernel over column chunks of
    MIN_CHUNK or more and one that merges them."""
    if not _on_kernel(xp, x):
        picks = argmax_rows(xp, x)
        best = xp.take_along_axis(x, picks[:, None], axis=1).astype(np.float64)  # [R, 1]
        return picks, (-xp.log(xp.exp(x - best).sum(axis=1))).astype(np.float32)
    rows, vocab = x.shape
    picks, logprobs = xp.empty(rows, dtype=np.int64), xp.empty(rows, dtype=np.float32)
    if not rows:
        return picks, logprobs
    x = xp.ascontiguousarray(x)
    chunks = min(sm_count(x.device.id) // rows, vocab // MIN_CHUNK)
    if chunks < 2:
        load_kernel("argmax", "argmax_logprob_rows")((rows,), (THREADS,), (x, np.int64(vocab), picks, logprobs))
        return picks, logprobs
    chunk = 4 * -(-vocab // (4 * chunks))  # a multiple of 4: each chunk's float4s stay aligned
    chunks = -(-vocab // chunk)
    value, index, total = (xp.empty((rows, chunks), dtype=t) for t in (np.float32, np.int64, np.float32))
    load_kernel("argmax", "argmax_logprob_partials")((chunks, rows), (THREADS,),
                                                     (x, np.int64(vocab), np.int64(chunk), value, index, total))
    load_kernel("argmax", "argmax_logprob_combine")((rows,), (32,),
                                                    (value, index, total, np.int32(chunks), picks, logprobs))
    return picks, logprobs
