"""Fused accept-and-gather of logprobs under speculation: the CUDA kernel and its NumPy twin.

The log-softmax of every candidate row (the normalizers and the top-k, `RowLogprobs`) does not
depend on which drafts are accepted, so it runs beside verification. Once the verdict is in, one
kernel computes `cu_batch_token_offset`, each request's offset into the compact list of emitted
tokens, and gathers the logprob and top-k of every emitted token and of every proposed draft.
Only requests that asked for logprobs or draft logprobs have rows here (`LogprobLayout`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cupyspec.kernels import load_kernel
from cupyspec.sampling.logprobs import top_logprobs_on_device
from cupyspec.transfer import fetch_arrays

THREADS = 256  # one block; cuda/accept_gather.cu scans with at most 1024


@dataclass(frozen=True)
class LogprobLayout:
    """Which target rows get logprobs, and where their results go (host arrays)."""

    row_target: np.ndarray  # [L] int64: row of the [R, V] target logits
    row_seq: np.ndarray  # [L] int32: request b of the row
    row_pos: np.ndarray  # [L] int32: the row's position j among b's rows (row j scores draft j)
    wants_tokens: np.ndarray  # [B] int32: 1 when b asked for logprobs of its emitted tokens
    draft_offset: np.ndarray  # [B+1] int64: b's drafts take slots draft_offset[b]:draft_offset[b+1]

    @classmethod
    def build(cls, first_row: np.ndarray, num_drafts: np.ndarray, wants_tokens: np.ndarray,
              wants_drafts: np.ndarray) -> LogprobLayout:
        """first_row [B+1] bounds of each request's target rows; num_drafts [B]; the wants [B] bool."""
        with_rows = np.flatnonzero(wants_tokens | wants_drafts)  # [B'] requests that get rows
        sizes = num_drafts[with_rows] + 1  # [B']
        row_seq = np.repeat(with_rows, sizes).astype(np.int32)  # [L]
        row_pos = (np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)).astype(np.int32)
        drafts_kept = np.where(wants_drafts, num_drafts, 0)  # [B]
        return cls(row_target=first_row[row_seq] + row_pos, row_seq=row_seq, row_pos=row_pos,
                   wants_tokens=wants_tokens.astype(np.int32),
                   draft_offset=np.concatenate([[0], np.cumsum(drafts_kept)]).astype(np.int64))

    @property
    def num_rows(self) -> int:
        return len(self.row_target)

    @property
    def num_draft_slots(self) -> int:
        return int(self.draft_offset[-1])


@dataclass(frozen=True)
class RowLogprobs:
    """log_softmax of the layout's rows, on the device: normalizers and top-k."""

    peak: Any  # [L] f32
    log_total: Any  # [L] f64
    top_ids: Any  # [L, k] int64
    top_lps: Any  # [L, k] f32

    @classmethod
    def compute(cls, xp: Any, logits: Any, layout: LogprobLayout, k: int) -> RowLogprobs:
        """logits [R, V] f32: the target rows."""
        return cls(*top_logprobs_on_device(xp, logits, k, layout.row_target))


@dataclass(frozen=True)
class GatheredLogprobs:
    """The kernel's outputs, on the device until `fetch`."""

    cu_batch_token_offset: Any  # [B+1] int64
    token_ids: Any  # [L] int64: emitted tokens of the requests that asked, request by request
    token_lps: Any  # [L] f32
    token_top_ids: Any  # [L, k] int64
    token_top_lps: Any  # [L, k] f32
    draft_lps: Any  # [D] f32: proposed drafts of the requests that asked, request by request
    draft_top_ids: Any  # [D, k] int64
    draft_top_lps: Any  # [D, k] f32


def _empty_outputs(xp: Any, layout: LogprobLayout, num_seqs: int, k: int) -> GatheredLogprobs:
    rows, slots = layout.num_rows, layout.num_draft_slots
    return GatheredLogprobs(
        xp.zeros(num_seqs + 1, xp.int64), xp.full(rows, -1, xp.int64), xp.zeros(rows, xp.float32),
        xp.zeros((rows, k), xp.int64), xp.zeros((rows, k), xp.float32),
        xp.zeros(slots, xp.float32), xp.zeros((slots, k), xp.int64), xp.zeros((slots, k), xp.float32))


def _gather_numpy(logits: np.ndarray, rows: RowLogprobs, layout: LogprobLayout, drafts: np.ndarray,
                  num_drafts: np.ndarray, num_accepted: np.ndarray, emitted: np.ndarray,
                  out: GatheredLogprobs) -> None:
    """The twin of accept_gather_logprobs, writing into `out`."""
    emitting = layout.wants_tokens.astype(bool) * (num_accepted + 1)  # [B]
    out.cu_batch_token_offset[1:] = np.cumsum(emitting)
    seq, pos = layout.row_seq, layout.row_pos  # [L]
    accepted = num_accepted[seq]  # [L]
    padded = np.concatenate([drafts, np.zeros((len(drafts), 1), np.int64)], axis=1)  # [B, K+1]
    row_draft = padded[seq, pos]  # [L] the draft the row scores (0 on the last row)

    def logprob(r: np.ndarray, token: np.ndarray) -> np.ndarray:
        x = logits[layout.row_target[r], token]
        return ((x - rows.peak[r]).astype(np.float64) - rows.log_total[r]).astype(np.float32)

    r = np.flatnonzero(layout.wants_tokens[seq].astype(bool) & (pos <= accepted))  # rows that emit
    slot = out.cu_batch_token_offset[seq[r]] + pos[r]
    out.token_ids[slot] = np.where(pos[r] < accepted[r], row_draft[r], emitted[seq[r]])
    out.token_lps[slot] = logprob(r, out.token_ids[slot])
    out.token_top_ids[slot], out.token_top_lps[slot] = rows.top_ids[r], rows.top_lps[r]
    has_slots = layout.draft_offset[1:] > layout.draft_offset[:-1]  # [B]
    r = np.flatnonzero(has_slots[seq] & (pos < num_drafts[seq]))  # rows that score a reported draft
    slot = layout.draft_offset[seq[r]] + pos[r]
    out.draft_lps[slot] = logprob(r, row_draft[r])
    out.draft_top_ids[slot], out.draft_top_lps[slot] = rows.top_ids[r], rows.top_lps[r]


def _gather_cuda(logits: Any, rows: RowLogprobs, layout: LogprobLayout, drafts: Any, num_drafts: Any,
                 num_accepted: Any, emitted: Any, out: GatheredLogprobs) -> None:
    import cupy as cp

    kernel = load_kernel("accept_gather", "accept_gather_logprobs")
    k = rows.top_ids.shape[1]
    kernel((1,), (THREADS,), (
        cp.ascontiguousarray(logits, dtype=cp.float32), np.int64(logits.shape[1]),
        cp.asarray(layout.row_target), cp.asarray(layout.row_seq), cp.asarray(layout.row_pos),
        cp.ascontiguousarray(rows.peak), cp.ascontiguousarray(rows.log_total),
        cp.ascontiguousarray(rows.top_ids), cp.ascontiguousarray(rows.top_lps), np.int32(k),
        drafts, np.int32(drafts.shape[1]), num_drafts, num_accepted, emitted,
        cp.asarray(layout.wants_tokens), cp.asarray(layout.draft_offset),
        np.int32(len(num_drafts)), np.int32(layout.num_rows),
        out.cu_batch_token_offset, out.token_ids, out.token_lps, out.token_top_ids, out.token_top_lps,
        out.draft_lps, out.draft_top_ids, out.draft_top_lps))


def accept_and_gather(xp: Any, logits: Any, rows: RowLogprobs, layout: LogprobLayout, drafts: np.ndarray,
                      num_drafts: np.ndarray, num_accepted: Any, emitted: Any) -> GatheredLogprobs:
    """Offsets and logprobs of emitted tokens and drafts; logits [R, V] f32, drafts [B, K] and
    num_drafts [B] int64 (host), num_accepted and emitted [B] int64 (device, verification's verdict)."""
    num_seqs, k = len(num_drafts), rows.top_ids.shape[1]
    out = _empty_outputs(xp, layout, num_seqs, k)
    if num_seqs == 0:
        return out
    if xp is np:
        _gather_numpy(logits, rows, layout, drafts, num_drafts, num_accepted, emitted, out)
    else:
        _gather_cuda(logits, rows, layout, xp.asarray(drafts, dtype=xp.int64), xp.asarray(num_drafts, dtype=xp.int64),
                     num_accepted.astype(xp.int64, copy=False), emitted.astype(xp.int64, copy=False), out)
    return out


def fetch_gathered(xp: Any, out: GatheredLogprobs, num_accepted: Any, emitted: Any) -> list[np.ndarray]:
    """[num_accepted, emitted, then the fields of `out` in order] on the host, in one transfer."""
    return fetch_arrays(xp, [num_accepted, emitted, out.cu_batch_token_offset, out.token_ids, out.token_lps,
                             out.token_top_ids, out.token_top_lps, out.draft_lps, out.draft_top_ids,
                             out.draft_top_lps])
