"""Fused accept-and-gather of logprobs under speculation: the CUDA kernel and its NumPy twin.

The log-softmax of every candidate row (the normalizers and the top-k, `RowLogprobs`) does not
depend on which drafts are accepted, so it runs beside verification. Once the verdict is in, one
kernel computes `cu_batch_token_offset`, each request's offset into the compact list of emitted
tokens, and gathers the logprob and top-k of every emitted token and of every proposed draft.
Only requests that asked for logprobs or draft logprobs have rows here (cupyspec/logprobs/layout.py).
The host uploads the layout and the drafts in one copy and brings every result, the verdict included,
back in one.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from cupyspec.kernels import load_kernel
from cupyspec.logprobs.layout import LayoutArrays, UploadedLayout
from cupyspec.logprobs.logprob_json import LogprobRenderer
from cupyspec.logprobs.logsoftmax_topk import KERNEL_MAX_K, NULL_POINTER, launch_top_logprobs, top_logprobs_on_device
from cupyspec.spec_decode.verification.verify import PLACEHOLDER_TOKEN_ID

THREADS = 256  # one block; cuda/accept_gather.cu scans with at most 1024
RENDERED_FIELDS = ("token_ids", "token_lps", "token_top_ids", "token_top_lps")  # GatheredLogprobs' rows to render


@dataclass(frozen=True)
class RowLogprobs:
    """log_softmax of the layout's rows, on the device: normalizers and top-k. Arrays; from `compute`
    on a GPU, their device addresses in one allocation (each CuPy array made costs the host
    microseconds, and a verifying step's launch is on its critical path)."""

    peak: Any  # [L] f32
    log_total: Any  # [L] f64
    top_ids: Any  # [L, k] int64
    top_lps: Any  # [L, k] f32
    k: int
    memory: Any = None  # the allocation the addresses point into

    @classmethod
    def compute(cls, xp: Any, logits: Any, row_target: Any, k: int, at: int | None = None) -> RowLogprobs:
        """logits [R, V] f32: the target rows; row_target [L] int64 (UploadedLayout.row_target: on a
        GPU, DeviceRows). at: on a GPU, where to write (a device address of `size(L, k)` int64;
        None: a new allocation)."""
        if xp is np:
            return cls(*top_logprobs_on_device(xp, logits, k, row_target), k)
        if k > KERNEL_MAX_K:
            raise ValueError(f"the top-k kernel gives at most {KERNEL_MAX_K} top logprobs, not {k}")
        count, memory = row_target.count, None
        if at is None:
            memory = xp.empty(cls.size(count, k), dtype=xp.int64)
            at = memory.data.ptr
        top_ids = at  # then log_total [L] f64, top_lps [L, k] f32, peak [L] f32
        log_total = top_ids + 8 * count * k
        top_lps = log_total + 8 * count
        peak = top_lps + 4 * count * k
        launch_top_logprobs(logits, row_target, count, k, peak, log_total, top_ids, top_lps)
        return cls(peak, log_total, top_ids, top_lps, k, memory)

    @staticmethod
    def size(count: int, k: int) -> int:
        """int64 elements that `compute` writes on a GPU for count rows."""
        return count * (k + 1) + (count * (k + 1) + 1) // 2


class GatheredLogprobs:
    """The gather's outputs, views of one int64 buffer: the int64 arrays first, then the float32
    ones two to an element. Token slots past cu_batch_token_offset[B] hold PLACEHOLDER_TOKEN_ID and
    zeros, draft slots past the layout's draft_offset[B] zeros. Each view is made when first read: a
    step reads a few, and each costs the host microseconds."""

    FIELDS = ("runs", "cu_batch_token_offset", "token_ids", "token_top_ids", "draft_top_ids",
              "token_lps", "token_top_lps", "draft_lps", "draft_top_lps")  # in buffer order
    runs: Any  # [2, B] int64: verification's num_accepted, then emitted tokens (copied)
    cu_batch_token_offset: Any  # [B+1] int64
    token_ids: Any  # [L] int64: emitted tokens of the requests that asked, request by request
    token_top_ids: Any  # [L, k] int64
    draft_top_ids: Any  # [D, k] int64
    token_lps: Any  # [L] f32
    token_top_lps: Any  # [L, k] f32
    draft_lps: Any  # [D] f32: proposed drafts of the requests that asked, request by request
    draft_top_lps: Any  # [D, k] f32

    def __init__(self, buffer: Any, num_seqs: int, rows: int, slots: int, k: int) -> None:
        self._buffer, self._shapes = buffer, _shapes(num_seqs, rows, slots, k)

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def buffer_size(num_seqs: int, rows: int, slots: int, k: int) -> int:
        """int64 elements of the buffer (computed once per shape: read twice a step)."""
        ints, floats = _shapes(num_seqs, rows, slots, k)
        return sum(map(math.prod, ints)) + (sum(map(math.prod, floats)) + 1) // 2

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def byte_offsets(num_seqs: int, rows: int, slots: int, k: int) -> tuple[int, ...]:
        """Where each field starts in the buffer, in bytes, in FIELDS order (computed once per shape)."""
        ints, floats = _shapes(num_seqs, rows, slots, k)
        int_bytes = [8 * math.prod(shape) for shape in ints]
        float_bytes = [4 * math.prod(shape) for shape in floats]
        return tuple(itertools.accumulate(int_bytes[:-1], initial=0)) + tuple(
            itertools.accumulate(float_bytes[:-1], initial=sum(int_bytes)))

    def __getattr__(self, name: str) -> Any:  # a field not read yet
        if name not in self.FIELDS:
            raise AttributeError(name)
        ints, floats = self._shapes
        index = self.FIELDS.index(name)
        if index < len(ints):
            flat, shapes = self._buffer, ints
        else:
            flat, shapes, index = self._buffer[sum(map(math.prod, ints)):].view(np.float32), floats, index - len(ints)
        at = sum(map(math.prod, shapes[:index]))
        view = self.__dict__[name] = flat[at:at + math.prod(shapes[index])].reshape(shapes[index])
        return view


def _shapes(num_seqs: int, rows: int, slots: int, k: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """Shapes of GatheredLogprobs' int64 arrays, then of its float32 ones, in field order."""
    return ([(2, num_seqs), (num_seqs + 1,), (rows,), (rows, k), (slots, k)],
            [(rows,), (rows, k), (slots,), (slots, k)])


def _gather_numpy(logits: np.ndarray, rows: RowLogprobs, layout: LayoutArrays, runs: np.ndarray,
                  out: GatheredLogprobs) -> None:
    """The twin of accept_gather_logprobs, writing into `out`; runs [2, B'] (B' <= B: requests past
    B' ask nothing and accept no drafts)."""
    out.runs[0], out.runs[1] = 0, PLACEHOLDER_TOKEN_ID
    out.runs[:, :runs.shape[1]] = runs
    num_accepted, emitted = out.runs
    emitting = layout.wants_tokens.astype(bool) * (num_accepted + 1)  # [B]
    out.cu_batch_token_offset[0] = 0
    out.cu_batch_token_offset[1:] = np.cumsum(emitting)
    total = int(out.cu_batch_token_offset[-1])
    out.token_ids[total:] = PLACEHOLDER_TOKEN_ID
    for unused in (out.token_top_ids, out.token_lps, out.token_top_lps):
        unused[total:] = 0
    for unused in (out.draft_lps, out.draft_top_ids, out.draft_top_lps):
        unused[layout.draft_offset[-1]:] = 0
    seq, pos = layout.row_seq, layout.row_pos  # [L]
    accepted = num_accepted[seq]  # [L]
    padded = np.concatenate([layout.drafts, np.zeros((len(layout.drafts), 1), np.int64)], axis=1)  # [B, K+1]
    row_draft = padded[seq, np.minimum(pos, padded.shape[1] - 1)]  # [L] the draft the row scores (0 on the last row)

    def logprob(r: np.ndarray, token: np.ndarray) -> np.ndarray:
        x = logits[layout.row_target[r], token]
        return ((x - rows.peak[r]).astype(np.float64) - rows.log_total[r]).astype(np.float32)

    r = np.flatnonzero(layout.wants_tokens[seq].astype(bool) & (pos <= accepted))  # rows that emit
    slot = out.cu_batch_token_offset[seq[r]] + pos[r]
    out.token_ids[slot] = np.where(pos[r] < accepted[r], row_draft[r], emitted[seq[r]])
    out.token_lps[slot] = logprob(r, out.token_ids[slot])
    out.token_top_ids[slot], out.token_top_lps[slot] = rows.top_ids[r], rows.top_lps[r]
    has_slots = layout.draft_offset[1:] > layout.draft_offset[:-1]  # [B]
    r = np.flatnonzero(has_slots[seq] & (pos < layout.num_drafts[seq]))  # rows that score a reported draft
    slot = layout.draft_offset[seq[r]] + pos[r]
    out.draft_lps[slot] = logprob(r, row_draft[r])
    out.draft_top_ids[slot], out.draft_top_lps[slot] = rows.top_ids[r], rows.top_lps[r]


def accept_and_gather(xp: Any, logits: Any, rows: RowLogprobs, layout: UploadedLayout, runs: Any,
                      renderer: LogprobRenderer | None = None) -> Any:
    """The buffer of GatheredLogprobs: offsets and logprobs of emitted tokens and drafts, from logits
    [R, V] f32 and runs [2, B] int64 (verification's verdict: num_accepted, then the emitted token),
    all on the device. `gathered_on_host` reads its host copy. With a renderer, the buffer goes on
    with the chat JSON entries of the emitted tokens of the requests whose layout render_k >= 0
    (LogprobRenderer.render's output, written by a second kernel; `rendered_on_host` reads it)."""
    k = rows.k
    size = GatheredLogprobs.buffer_size(layout.num_seqs, layout.num_rows, layout.num_draft_slots, k)
    if xp is np:
        buffer = np.empty(size, dtype=np.int64)
        out = GatheredLogprobs(buffer, layout.num_seqs, layout.num_rows, layout.num_draft_slots, k)
        _gather_numpy(logits, rows, layout.arrays(), runs, out)
        if renderer is None:
            return buffer
        return np.concatenate([buffer, renderer.render(np, *emitted_rows(out, layout.render_k, k))])
    buffer = xp.empty(gather_size(layout, k, renderer), dtype=xp.int64)
    launch_gather(xp, logits, rows, layout, runs, buffer.data.ptr, renderer)
    return buffer


def gather_size(layout: UploadedLayout, k: int, renderer: LogprobRenderer | None = None) -> int:
    """int64 elements of accept_and_gather's buffer."""
    size = GatheredLogprobs.buffer_size(layout.num_seqs, layout.num_rows, layout.num_draft_slots, k)
    return size + (renderer.rendered_size(layout.num_rows, k) if renderer is not None else 0)


def launch_gather(xp: Any, logits: Any, rows: RowLogprobs, layout: UploadedLayout, runs: Any, buffer: int,
                  renderer: LogprobRenderer | None = None) -> None:
    """accept_and_gather on a GPU into gather_size(layout, k, renderer) int64 at the device address
    `buffer`, on the current stream: one kernel, and one more for the entries. runs None: the
    verdict's address is in the layout (`RequestWants.packed`)."""
    if not layout.num_seqs:
        return
    k = rows.k
    load_kernel("accept_gather", "accept_gather_logprobs")((1,), (THREADS,), (  # writes every element
        xp.ascontiguousarray(logits, dtype=xp.float32), np.int64(logits.shape[1]), layout.packed,
        np.int32(layout.num_seqs), np.int32(layout.num_rows), np.int32(layout.max_drafts),
        np.int32(layout.num_draft_slots), *(np.uint64(a) if isinstance(a, int) else a for a in (
            rows.peak, rows.log_total, rows.top_ids, rows.top_lps)), np.int32(k),
        NULL_POINTER if runs is None else xp.ascontiguousarray(runs, dtype=xp.int64), np.uint64(buffer)))
    if renderer is not None:  # the emitted tokens' entries, from the gathered fields, by address
        shape = (layout.num_seqs, layout.num_rows, layout.num_draft_slots, k)
        *rows_at, cu_at = _rendered_fields_at(*shape)
        renderer.render_into(buffer + 8 * GatheredLogprobs.buffer_size(*shape), *(buffer + at for at in rows_at), k,
                             layout.render_k, layout.num_seqs, layout.num_rows, buffer + cu_at)


@functools.lru_cache(maxsize=256)
def _rendered_fields_at(num_seqs: int, rows: int, slots: int, k: int) -> tuple[int, ...]:
    """Byte offsets in the buffer of RENDERED_FIELDS, then of cu_batch_token_offset (once per shape)."""
    at = dict(zip(GatheredLogprobs.FIELDS, GatheredLogprobs.byte_offsets(num_seqs, rows, slots, k)))
    return tuple(at[f] for f in (*RENDERED_FIELDS, "cu_batch_token_offset"))


def emitted_rows(out: GatheredLogprobs, render_k: np.ndarray, k: int) -> tuple:
    """LogprobRenderer.render's arguments (from token_ids on) for the emitted tokens gathered in `out`,
    with render_k [B]: the twin of the kernel's render."""
    return (*(getattr(out, f) for f in RENDERED_FIELDS), k, render_k, len(render_k), len(out.token_ids),
            out.cu_batch_token_offset)


def rendered_on_host(host: np.ndarray, layout: UploadedLayout, k: int) -> np.ndarray:
    """The rendered entries in the host copy of accept_and_gather's buffer (LogprobRenderer.render's output)."""
    return host[GatheredLogprobs.buffer_size(layout.num_seqs, layout.num_rows, layout.num_draft_slots, k):]


def gathered_on_host(host: np.ndarray, layout: UploadedLayout, k: int) -> GatheredLogprobs:
    """The host copy of accept_and_gather's buffer as GatheredLogprobs."""
    return GatheredLogprobs(host, layout.num_seqs, layout.num_rows, layout.num_draft_slots, k)
