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
from cupyspec.model.device_tokens import DeviceTokens
from cupyspec.sampling.argmax import argmax_rows
from cupyspec.transfer import to_device

THREADS = 128  # requests per block
POLICIES = ("normal", "accept_all", "reject_all")  # greedy_runs' policy argument, by index
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


def greedy_runs(xp: Any, logits: Any, drafts: np.ndarray, num_drafts: np.ndarray,
                tokens: DeviceTokens | None = None, accept_policy: str = "normal") -> Any:
    """accept_runs for rows that all pick greedily: a draft passes when it is its row's argmax (every
    draft under accept_all, none under reject_all), and a request emits the argmax of the row where
    it stops.

    logits [R, V] f32 on xp's device, R = sum(num_drafts + 1); drafts [B, K] int64 (anything past
    num_drafts[b]) and num_drafts [B] int64 on the host. A draft ~n < 0 is a placeholder for
    tokens.slots[n]; with `tokens`, each request's emitted token and accepted drafts go there too
    (DeviceTokens.put_verdict). Returns [2B + B*K] int64 on the device: the runs [2, B], then the
    drafts [B, K] with their placeholders resolved. On a GPU one kernel (cuda/accept_runs.cu) does
    all of it after one upload; these lines are its twin.
    """
    batch, max_drafts = drafts.shape
    if xp is np:
        resolved = drafts.copy()
        if tokens is not None:
            placeholder = (drafts < 0) & (np.arange(max_drafts) < num_drafts[:, None])
            resolved[placeholder] = tokens.slots[~drafts[placeholder]]
        argmax = argmax_rows(np, logits)  # [R]
        first_row = np.concatenate([[0], np.cumsum(num_drafts + 1)])  # [B+1]
        padded = np.concatenate([resolved, np.zeros((batch, 1), np.int64)], axis=1)  # [B, K+1]
        row_draft = padded[np.arange(max_drafts + 1) <= num_drafts[:, None]]  # [R] (bonus rows: anything)
        passed = argmax == row_draft  # [R]
        if accept_policy != "normal":
            passed[:] = accept_policy == "accept_all"
        runs = accept_runs(np, passed, argmax, first_row)
        if tokens is not None:
            tokens.put_verdict(runs)
        return np.concatenate([runs.ravel(), resolved.ravel()])
    num_rows = logits.shape[0]
    out = xp.empty(2 * batch + batch * max_drafts + num_rows + 1, dtype=np.int64)  # see the kernel
    if batch:
        runtime = xp.cuda.runtime
        counter = 8 * (len(out) - 1)
        runtime.memsetAsync(out.data.ptr + counter, 0, 8, xp.cuda.get_current_stream().ptr)
        slots, accepted, width = (out, out, 0) if tokens is None else (tokens.slots, tokens.accepted, tokens.width)
        load_kernel("accept_runs", "greedy_runs")(
            (num_rows,), (ARGMAX_THREADS,),
            (xp.ascontiguousarray(logits, dtype=np.float32), np.int64(logits.shape[1]),
             to_device(xp, np.concatenate([drafts.ravel(), num_drafts])), np.int32(batch), np.int32(max_drafts),
             slots, accepted, np.int32(width), np.int32(tokens is not None), np.int32(POLICIES.index(accept_policy)),
             out))
    return out[:batch * (2 + max_drafts)]
