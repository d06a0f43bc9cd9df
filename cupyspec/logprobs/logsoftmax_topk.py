"""Log-softmax logprobs of chosen tokens and the top-k alternatives, for NumPy and CuPy alike."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np


def stable_argsort(xp: Any, values: Any) -> Any:
    """Ascending argsort along the last axis that keeps equal values in index order.

    CuPy's sort is always stable and, depending on the version, refuses a `kind` argument.
    """
    return np.argsort(values, axis=-1, kind="stable") if xp is np else values.argsort(axis=-1)


def top_k_indices(xp: Any, values: Any, k: int) -> Any:
    """Indices [R, k] of the k largest entries of each row of values [R, V], largest first.

    Ties are broken by the lower index (also at the k-th place), without sorting the rows.
    """
    rows, vocab = values.shape
    if k == 0:
        return xp.zeros((rows, 0), dtype=xp.int64)
    kth = -xp.partition(-values, k - 1, axis=1)[:, k - 1:k]  # [R, 1] the k-th largest value
    greater = values > kth  # [R, V]
    equal = values == kth  # [R, V]
    missing = k - greater.sum(axis=1, keepdims=True)  # [R, 1] how many ties at the k-th value to take
    chosen = greater | (equal & (xp.cumsum(equal, axis=1) <= missing))  # [R, V] exactly k per row
    slot = xp.where(chosen, xp.cumsum(chosen, axis=1) - 1, k)  # [R, V] column k collects the rest
    ids = xp.empty((rows, k + 1), dtype=xp.int64)
    ids[xp.arange(rows)[:, None], slot] = xp.arange(vocab, dtype=xp.int64)[None, :]
    ids = ids[:, :k]  # [R, k] ascending index order
    order = stable_argsort(xp, -xp.take_along_axis(values, ids, axis=1))  # [R, k]
    return xp.take_along_axis(ids, order, axis=1)


def log_normalizers(xp: Any, x: Any) -> tuple[Any, Any]:
    """Per-row (peak [R, 1] f32, log_total [R, 1] f64) of logits x [R, V] f32, so that
    log_softmax(x)[r, t] = f32(f64(x[r, t] - peak[r]) - log_total[r])."""
    peak = x.max(axis=1, keepdims=True)  # [R, 1]
    log_total = xp.log(xp.exp(x - peak).sum(axis=1, keepdims=True, dtype=xp.float64))  # [R, 1] f64
    return peak, log_total


def logprobs_at(xp: Any, x: Any, peak: Any, log_total: Any, ids: Any) -> Any:
    """log_softmax(x) at ids [R, c] -> [R, c] f32, from log_normalizers' outputs."""
    return ((xp.take_along_axis(x, ids, axis=1) - peak).astype(xp.float64) - log_total).astype(xp.float32)


def _check_logits(logits: Any, k: int) -> None:
    if logits.ndim != 2:
        raise ValueError(f"logits must be 2-D [R, V], got shape {logits.shape}")
    if not 0 <= k <= logits.shape[1]:
        raise ValueError(f"k must lie in [0, {logits.shape[1]}] (the vocabulary size), got {k}")


KERNEL_MAX_K = 20  # cuda/logsoftmax_topk.cu keeps at most this many candidates per thread ...
KERNEL_SMALL_K = 8  # ... and as few as this in its other kernel, for k up to it
KERNEL_THREADS = 1024  # THREADS in cuda/logsoftmax_topk.cu
NULL_POINTER = np.int64(0)  # a kernel argument that passes a null pointer


class DeviceRows(NamedTuple):
    """Row indices (int64) already on the device, by address: a CuPy view of them would cost the host
    microseconds on every step."""

    address: int
    count: int


def _top_logprobs_cuda(logits: Any, rows: Any | None, k: int, chosen_ids: Any | None = None) -> tuple[Any, ...]:
    """With chosen_ids [R]: (their logprobs [R] f32, top ids, top logprobs) of every row; else (peak,
    log_total, top ids, top logprobs) of the rows picked by `rows` (None: all). One kernel launch."""
    import cupy as cp

    if isinstance(rows, DeviceRows):
        count = rows.count
    elif rows is not None:
        count, rows = len(rows), cp.ascontiguousarray(rows, dtype=cp.int64)
    else:
        count = logits.shape[0]
    top_ids, top_lps = cp.empty((count, k), cp.int64), cp.empty((count, k), cp.float32)
    if chosen_ids is None:
        chosen_lps, peak, log_total = None, cp.empty(count, cp.float32), cp.empty(count, cp.float64)
    else:
        chosen_lps, peak, log_total = cp.empty(count, cp.float32), None, None
    launch_top_logprobs(logits, rows, count, k, peak, log_total, top_ids, top_lps, chosen_ids, chosen_lps)
    return (peak, log_total, top_ids, top_lps) if chosen_ids is None else (chosen_lps, top_ids, top_lps)


def launch_top_logprobs(logits: Any, rows: Any | None, count: int, k: int, peak: Any, log_total: Any, top_ids: Any,
                        top_lps: Any, chosen_ids: Any | None = None, chosen_lps: Any | None = None) -> None:
    """On a GPU, cuda/logsoftmax_topk.cu over `count` rows of logits [R_all, V] (rows: DeviceRows, a
    CuPy int64 array or None for all; a negative row is skipped, its outputs left unwritten), into
    the given outputs: CuPy arrays or device addresses (int; None: not wanted). k <= KERNEL_MAX_K."""
    import cupy as cp

    from cupyspec.kernels import load_kernel

    if not count:
        return
    if isinstance(rows, DeviceRows):
        rows = rows.address
    load_kernel("logsoftmax_topk", "logsoftmax_top8" if k <= KERNEL_SMALL_K else "logsoftmax_top20")(
        (count,), (KERNEL_THREADS,), tuple(NULL_POINTER if a is None else np.uint64(a) if isinstance(a, int) else a
                                           for a in (cp.ascontiguousarray(logits, dtype=cp.float32),
                                                     np.int64(logits.shape[1]), rows, np.int32(k), chosen_ids,
                                                     chosen_lps, peak, log_total, top_ids, top_lps)))


def top_logprobs_on_device(xp: Any, logits: Any, k: int, rows: Any | None = None) -> tuple[Any, Any, Any, Any]:
    """Device arrays (peak [R] f32, log_total [R] f64, top ids [R, k] int64, top logprobs [R, k] f32)
    of log_softmax over the rows of logits [R_all, V] picked by rows [R] (default: all rows; on a GPU
    also DeviceRows; a negative row's outputs are unspecified: a layout's padding).
    The normalizers give any other token's logprob later (`logprobs_at`). On a GPU this is one
    kernel, cuda/logsoftmax_topk.cu, with these lines as its twin."""
    _check_logits(logits, k)
    if xp is not np and k <= KERNEL_MAX_K:
        return _top_logprobs_cuda(logits, rows, k)
    x = (logits if rows is None else logits[xp.asarray(rows)]).astype(xp.float32, copy=False)  # [R, V]
    peak, log_total = log_normalizers(xp, x)
    top_ids = top_k_indices(xp, x, k)  # [R, k]
    return peak[:, 0], log_total[:, 0], top_ids, logprobs_at(xp, x, peak, log_total, top_ids)


def logprobs_on_device(xp: Any, logits: Any, token_ids: Any, k: int) -> tuple[Any, Any, Any]:
    """Device arrays (logprob [R] f32, top ids [R, k] int64, top logprobs [R, k] f32) of log_softmax(logits).

    logits [R, V]; token_ids [R] are the tokens whose logprobs are wanted.
    """
    _check_logits(logits, k)
    token_ids = xp.asarray(token_ids, dtype=xp.int64).reshape(-1)  # [R]
    if token_ids.shape[0] != logits.shape[0]:
        raise ValueError(f"token_ids has {token_ids.shape[0]} entries for {logits.shape[0]} logits rows")
    if xp is not np and k <= KERNEL_MAX_K:  # one kernel, the chosen tokens' logprobs included
        return _top_logprobs_cuda(logits, None, k, token_ids)
    peak, log_total, top_ids, top_lps = top_logprobs_on_device(xp, logits, k)
    x = logits.astype(xp.float32, copy=False)
    return logprobs_at(xp, x, peak[:, None], log_total[:, None], token_ids[:, None])[:, 0], top_ids, top_lps

