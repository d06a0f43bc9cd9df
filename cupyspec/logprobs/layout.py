"""Which target rows of a verifying step get logprobs, and where their results go: the layout.

Only requests that asked for logprobs or draft logprobs have rows: request b's rows j = 0..num_drafts[b],
row j scoring draft j (the last one the bonus or correction token). On the device the layout and
the drafts travel as one int64 array, `UploadedLayout.packed`:

    row_target [L] | row_seq [L] | row_pos [L] | wants_tokens [B] | draft_offset [B+1] | drafts [B, K] |
    num_drafts [B] | render_k [B] | wants_drafts [B] | first_row [B] | the verdict's device address |
    the verdict's B

where first_row[b] is the row of the logits that scores request b's first draft. A CUDA graph's
layout has a shape of its own, larger than its steps' (`LayoutShape`): rows past a step's read no
logits and score nothing (row_target PAD_ROW, row_pos PAD_POSITION), requests past its own ask
nothing. The host then writes only the requests' fields (`RequestWants.packed`), and
cuda/logprob_layout.cu expands them into the rows and draft offsets on the device
(`expand_on_device`; its twin: `LogprobLayout.build`), so that the host's work per step does not
grow with the rows.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from cupyspec.kernels import load_kernel
from cupyspec.logprobs.logsoftmax_topk import DeviceRows
from cupyspec.spec_decode.verification.verify import PLACEHOLDER_TOKEN_ID
from cupyspec.transfer import to_device

PAD_ROW = -1  # row_target of a padding row: no row of the logits (the top-k skips it)
PAD_POSITION = 1 << 62  # row_pos of a padding row: past every request's drafts, so it scores nothing
EXPAND_THREADS = 256  # one block; cuda/logprob_layout.cu scans with at most 1024


class LayoutShape(NamedTuple):
    """The sizes of an uploaded layout: B requests, L rows, K drafts a request at most, D draft slots."""

    num_seqs: int  # B
    num_rows: int  # L
    max_drafts: int  # K
    num_draft_slots: int  # D

    @property
    def packed_size(self) -> int:
        """int64 elements of UploadedLayout.packed: the request fields, then the verdict's two."""
        return _request_fields(self).first_row + self.num_seqs + 2


class LayoutArrays(NamedTuple):
    """A layout with the drafts, as arrays of one library (views of `UploadedLayout.packed`)."""

    row_target: Any  # [L]
    row_seq: Any  # [L]
    row_pos: Any  # [L]
    wants_tokens: Any  # [B]
    draft_offset: Any  # [B+1]
    drafts: Any  # [B, K]
    num_drafts: Any  # [B]


@dataclass(frozen=True)
class UploadedLayout:
    """A layout and the drafts on the device (or, NumPy, on the host): `packed` of `shape`, which the
    kernels take whole (each view CuPy makes costs the host microseconds)."""

    packed: Any  # [LayoutShape.packed_size] int64
    num_seqs: int  # B
    num_rows: int  # L
    max_drafts: int  # K
    num_draft_slots: int  # D

    @property
    def row_target(self) -> Any:  # [L]: it comes first
        return self.packed[:self.num_rows] if isinstance(self.packed, np.ndarray) else \
            DeviceRows(self.packed.data.ptr, self.num_rows)

    @property
    def shape(self) -> LayoutShape:
        return LayoutShape(self.num_seqs, self.num_rows, self.max_drafts, self.num_draft_slots)

    @property
    def render_k(self) -> Any:  # [B]; on a GPU its device address
        at = _request_fields(self.shape).render_k
        return self.packed[at:at + self.num_seqs] if isinstance(self.packed, np.ndarray) else \
            self.packed.data.ptr + 8 * at

    def arrays(self) -> LayoutArrays:
        rows, fields, packed = self.num_rows, _request_fields(self.shape), self.packed
        return LayoutArrays(packed[:rows], packed[rows:2 * rows], packed[2 * rows:3 * rows],
                            packed[fields.wants_tokens:fields.draft_offset], packed[fields.draft_offset:fields.drafts],
                            packed[fields.drafts:fields.num_drafts].reshape(self.num_seqs, self.max_drafts),
                            packed[fields.num_drafts:fields.render_k])


@dataclass(frozen=True, eq=False)
class RequestWants:
    """What each request of a step asks, as the layout's request fields: int64 [B] arrays (read-only;
    compared by identity)."""

    tokens: np.ndarray  # 1: logprobs of its emitted tokens
    drafts: np.ndarray  # 1: logprobs of its drafts
    render_k: np.ndarray  # top logprobs of its rendered entries (logprob_json.py); -1: none
    asks: np.ndarray  # 1: either, so it has rows

    @classmethod
    def of(cls, tokens: np.ndarray, drafts: np.ndarray, render_k: np.ndarray | None = None) -> RequestWants:
        """From the wants [B] bool; render_k [B] (default: no request's entries are rendered)."""
        asks = (tokens | drafts).astype(np.int64)
        fields = [tokens.astype(np.int64), drafts.astype(np.int64),
                  np.full(len(tokens), -1, np.int64) if render_k is None else render_k.astype(np.int64), asks]
        for field in fields:
            field.flags.writeable = False
        return cls(*fields)

    def packed(self, shape: LayoutShape, drafts: np.ndarray, num_drafts: np.ndarray, first_row: np.ndarray,
               verdict_at: int = 0, out: np.ndarray | None = None) -> np.ndarray:
        """UploadedLayout.packed's host array (into `out` if given) for a shape at least the step's,
        with the requests' fields written (`pack_wants`, `pack_step`). The rows and draft offsets
        are left as they are, for `expand_on_device` or `LogprobLayout.packed`."""
        out = np.empty(shape.packed_size, np.int64) if out is None else out
        self.pack_wants(shape, out)
        return self.pack_step(shape, drafts, num_drafts, first_row, verdict_at, out)

    def pack_wants(self, shape: LayoutShape, out: np.ndarray) -> None:
        """The wants into UploadedLayout.packed's host array `out` of a shape at least the step's:
        requests past B ask nothing."""
        b, live_b, fields = shape.num_seqs, len(self.tokens), _request_fields(shape)
        for field, at, fill in ((self.tokens, fields.wants_tokens, 0), (self.render_k, fields.render_k, -1),
                                (self.drafts, fields.wants_drafts, 0)):
            out[at:at + live_b], out[at + live_b:at + b] = field, fill

    @staticmethod
    def pack_step(shape: LayoutShape, drafts: np.ndarray, num_drafts: np.ndarray, first_row: np.ndarray,
                  verdict_at: int, out: np.ndarray) -> np.ndarray:
        """A step's fields into UploadedLayout.packed's host array `out` of a shape at least the
        step's: drafts [B, K], num_drafts [B], first_row [B] and the device address of the verdict
        runs [2, B], which the gather then reads instead of its argument (0: none). Requests past B
        have no drafts and no verdict."""
        b, k = shape.num_seqs, shape.max_drafts
        live_b, live_k, fields = len(drafts), drafts.shape[1], _request_fields(shape)
        table = out[fields.drafts:fields.drafts + b * k].reshape(b, k)  # [B, K]
        table[:live_b, :live_k] = drafts
        if live_k < k or live_b < b:  # skipped without padding: even an empty NumPy assignment costs host time
            table[:live_b, live_k:], table[live_b:] = PLACEHOLDER_TOKEN_ID, PLACEHOLDER_TOKEN_ID
        for field, at in ((num_drafts, fields.num_drafts), (first_row, fields.first_row)):
            out[at:at + live_b] = field
            if live_b < b:
                out[at + live_b:at + b] = 0
        out[-2:] = verdict_at, live_b
        return out


class _RequestFields(NamedTuple):
    """Where each request field starts in UploadedLayout.packed."""

    wants_tokens: int
    draft_offset: int
    drafts: int
    num_drafts: int
    render_k: int
    wants_drafts: int
    first_row: int


@functools.lru_cache(maxsize=256)
def _request_fields(shape: LayoutShape) -> _RequestFields:
    """The request fields' places in layouts of `shape` (worked out once per shape)."""
    b, rows, k, _ = shape
    starts = itertools.accumulate((3 * rows, b, b + 1, b * k, b, b, b))
    return _RequestFields(*starts)


@dataclass(frozen=True)
class LogprobLayout:
    """The rows of a step's layout and its draft offsets (host arrays), with its requests' wants."""

    row_target: np.ndarray  # [L] int64: row of the [R, V] target logits
    row_seq: np.ndarray  # [L] int64: request b of the row
    row_pos: np.ndarray  # [L] int64: the row's position j among b's rows (row j scores draft j)
    draft_offset: np.ndarray  # [B+1] int64: b's drafts take slots draft_offset[b]:draft_offset[b+1]
    first_row: np.ndarray  # [B] int64: the row of b's first draft
    wants: RequestWants

    @classmethod
    def build(cls, first_row: np.ndarray, num_drafts: np.ndarray, wants: RequestWants) -> LogprobLayout:
        """first_row [B] int64: the row of each request's first draft (its target rows follow);
        num_drafts [B] int64."""
        with_rows = np.flatnonzero(wants.asks)  # [B'] requests that get rows
        sizes = num_drafts[with_rows] + 1  # [B']
        ends = np.cumsum(sizes)  # [B']
        row_seq = np.repeat(with_rows, sizes).astype(np.int64, copy=False)  # [L]
        row_pos = np.arange(ends[-1] if len(ends) else 0, dtype=np.int64) - np.repeat(ends - sizes, sizes)  # [L]
        return cls(first_row[row_seq] + row_pos, row_seq, row_pos, draft_offsets(num_drafts, wants.drafts), first_row,
                   wants)

    @property
    def num_rows(self) -> int:
        return len(self.row_target)

    def shape(self, drafts: np.ndarray) -> LayoutShape:
        """The layout's sizes with drafts [B, K]."""
        return LayoutShape(len(drafts), self.num_rows, drafts.shape[1], int(self.draft_offset[-1]))

    def upload(self, xp: Any, drafts: np.ndarray, num_drafts: np.ndarray) -> UploadedLayout:
        """The layout, drafts [B, K] and num_drafts [B] on the device, in one copy."""
        shape = self.shape(drafts)
        return UploadedLayout(to_device(xp, self.packed(shape, drafts, num_drafts)), *shape)

    def packed(self, shape: LayoutShape, drafts: np.ndarray, num_drafts: np.ndarray, verdict_at: int = 0,
               out: np.ndarray | None = None) -> np.ndarray:
        """RequestWants.packed with the rows and draft offsets written too: what `expand_on_device`
        makes of that on the device. Rows past the layout's score nothing."""
        out = self.wants.packed(shape, drafts, num_drafts, self.first_row, verdict_at, out)
        b, rows, _, _ = shape
        live_rows, live_b = self.num_rows, len(drafts)
        row_fields = out[:3 * rows].reshape(3, rows)  # row_target, row_seq, row_pos
        row_fields[0, :live_rows], row_fields[1, :live_rows], row_fields[2, :live_rows] = \
            self.row_target, self.row_seq, self.row_pos
        row_fields[0, live_rows:], row_fields[1, live_rows:], row_fields[2, live_rows:] = PAD_ROW, 0, PAD_POSITION
        at = _request_fields(shape).draft_offset
        out[at:at + live_b + 1], out[at + live_b + 1:at + b + 1] = self.draft_offset, self.draft_offset[-1]
        return out


def draft_offsets(num_drafts: np.ndarray, wants_drafts: np.ndarray) -> np.ndarray:
    """[B+1] int64: where each request's drafts start among the draft slots, then their end; only
    requests that asked for draft logprobs (wants_drafts [B]) take slots (num_drafts [B])."""
    offsets = np.zeros(len(num_drafts) + 1, np.int64)
    np.cumsum(num_drafts * wants_drafts, out=offsets[1:])
    return offsets


def expand_on_device(xp: Any, layout: UploadedLayout) -> None:
    """Write the rows and draft offsets of a layout whose request fields are on the device
    (RequestWants.packed's), on the current stream: one kernel, cuda/logprob_layout.cu."""
    load_kernel("logprob_layout", "expand_logprob_layout")((1,), (EXPAND_THREADS,), (
        layout.packed, np.int32(layout.num_seqs), np.int32(layout.num_rows), np.int32(layout.max_drafts)))
