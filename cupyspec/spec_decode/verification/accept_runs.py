"""Each request's run of accepted drafts, from the per-row outcome of its drafts' tests, or (greedy
rows) from whether each draft is its row's argmax: the CUDA kernels (cuda/accept_runs.cu) and their
NumPy twins.

Request b owns target rows first_row[b] .. first_row[b+1] - 1: one per draft, then its bonus row.
It keeps its drafts up to the first that failed and emits the token of the row where it stopped.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cupyspec.kernels import load_kernel
from cupyspec.sampling.argmax import argmax_rows
from cupyspec.transfer import to_device

THREADS = 128  # requests per block
ARGMAX_THREADS = 512  # greedy_runs: threads per row (at most ARGMAX_MAX_THREADS in cuda/argmax.cuh)


def accept_runs(xp: Any, passed: Any, emit_at: Any, first_row: Any) -> Any:
    """[2, B] int64: each request's accepted drafts, then its emitted token.

    passed [R] bool: the row's draft passed its test (ignored on bonus rows, which always stop);
    emit_at [R] int64: the token emitted when a request stops at the row; first_row [B+1] int64.
    All on xp's device.
    """
    num_seqs = len(first_row) - 1
    if xp is np:
        stops = passed.astype(bool)  # a copy: inverted below
        np.logical_not(stops, out=stops)
        stops[first_row[1:] - 1] = True
        stop_rows = np.flatnonzero(stops)  # ascending; each request's bonus row among them
        stop = stop_rows[np.searchsorted(stop_rows, first_row[:-1])]  # [B] the first stop of each request
        return np.stack([stop - first_row[:-1], emit_at[stop]]).astype(np.int64)
    out = xp.empty((2, num_seqs), dtype=np.int64)
    if num_seqs:
        load_kernel("accept_runs", "accept_runs")(
            (-(-num_seqs // THREADS),), (THREADS,),
            (xp.ascontiguousarray(passed, dtype=np.bool_), xp.ascontiguousarray(emit_at, dtype=np.int64),
             xp.ascontiguousarray(first_row, dtype=np.int64), np.int32(num_seqs), out))
    return out


def greedy_runs(xp: Any, logits: Any, drafts: Any, num_drafts: np.ndarray) -> Any:
    """accept_runs for rows that all pick greedily: a draft passes when it is its row's argmax, and a
    request emits the argmax of the row where it stops.

    logits [R, V] f32 on xp's device, R = sum(num_drafts + 1); drafts [B, K] int64 (anything past
    num_drafts[b]) on the host or the device, num_drafts [B] int64 on the host. On a GPU one kernel
    (cuda/accept_runs.cu) takes every row's argmax and the runs; these lines are its twin.
    """
    batch, max_drafts = drafts.shape
    if xp is np:
        tokens = argmax_rows(np, logits)  # [R]
        first_row = np.concatenate([[0], np.cumsum(num_drafts + 1)])  # [B+1]
        padded = np.concatenate([drafts, np.zeros((batch, 1), np.int64)], axis=1)  # [B, K+1]
        row_draft = padded[np.arange(max_drafts + 1) <= num_drafts[:, None]]  # [R] (bonus rows: anything)
        return accept_runs(np, tokens == row_draft, tokens, first_row)
    num_rows = logits.shape[0]
    out = xp.empty(2 * batch + num_rows + 1, dtype=np.int64)  # runs [2, B], each row's argmax [R], a counter
    if batch:
        runtime = xp.cuda.runtime
        runtime.memsetAsync(out.data.ptr + 8 * (2 * batch + num_rows), 0, 8, xp.cuda.get_current_stream().ptr)
        if isinstance(drafts, np.ndarray):  # one upload
            drafts_then_counts = to_device(xp, np.concatenate([drafts.ravel(), num_drafts]))
        else:
            drafts_then_counts = xp.concatenate([drafts.ravel().astype(np.int64), to_device(xp, num_drafts)])
        load_kernel("accept_runs", "greedy_runs")(
            (num_rows,), (ARGMAX_THREADS,),
            (xp.ascontiguousarray(logits, dtype=np.float32), np.int64(logits.shape[1]), drafts_then_counts,
             np.int32(batch), np.int32(max_drafts), out))
    return out[:2 * batch].reshape(2, batch)
