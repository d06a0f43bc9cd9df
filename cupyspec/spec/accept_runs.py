"""Each request's run of accepted drafts, from the per-row outcome of its drafts' tests, or (greedy
rows) from whether each draft is the token its row emits: the CUDA kernels (cuda/accept_runs.cu)
and their NumPy twins.

Request b owns target rows first_row[b] .. first_row[b+1] - 1: one per draft, then its bonus row.
It keeps its drafts up to the first that failed and emits the token of the row where it stopped.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cupyspec.kernels import load_kernel

THREADS = 128  # requests per block


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


def accept_matching_runs(xp: Any, emit_at: Any, drafts_then_bounds: Any) -> Any:
    """accept_runs where a draft passes when it is the token its row emits (a greedy row's argmax).

    emit_at [R] int64; drafts_then_bounds [R + B + 1] int64: the draft each row scores (anything on
    bonus rows), then first_row. Both on xp's device; one upload brings the second.
    """
    num_rows = len(emit_at)
    if xp is np:
        row_draft, first_row = drafts_then_bounds[:num_rows], drafts_then_bounds[num_rows:]
        return accept_runs(np, emit_at == row_draft, emit_at, first_row)
    num_seqs = len(drafts_then_bounds) - num_rows - 1
    out = xp.empty((2, num_seqs), dtype=np.int64)
    if num_seqs:
        load_kernel("accept_runs", "accept_matching_runs")(
            (-(-num_seqs // THREADS),), (THREADS,),
            (xp.ascontiguousarray(emit_at, dtype=np.int64), xp.ascontiguousarray(drafts_then_bounds, dtype=np.int64),
             np.int32(num_rows), np.int32(num_seqs), out))
    return out
