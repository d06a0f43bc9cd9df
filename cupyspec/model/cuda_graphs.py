"""CUDA graphs of the forward pass and the logits, one per token-count bucket, captured once.

A step of T rows runs as the graph of the smallest bucket of at least T rows. Its inputs go into
one static device buffer in one asynchronous copy from pinned host memory (two of them, used in turn:
with overlap scheduling the host stages step N+1 while the copies of step N may still be queued,
and it has waited for step N-1 by then); rows T.. of the bucket are padding (token 0 at position
0, written to the KV cache's scratch block, which no request owns); the logits of every row land in
one static buffer. Buckets past EVERY_ROW_MAX rows (steps that prefill prompts) compute the logits
of the rows the step asks for only, at most LOGIT_ROWS of them, which the inputs list. Python then
launches one graph instead of some 150 kernels, captured with programmatic dependent launch: a
kernel starts streaming its weights while the one before it finishes.

Every kernel of the forward pass computes a row the same way whatever else is in the batch, and
the matrix-product kernel family (gemv, with its fused norm, SwiGLU and RoPE steps, or tiles) and
the attention kernel's CTA size depend on the row count only through buckets that the graph
boundaries respect (`linear.GEMV_MAX_ROWS` and `attention.FEW_ROWS` are buckets), so a graphed step
returns the logits the eager step returns, bit for bit (`linear.KERNEL_MAX_ROWS` is the largest
bucket: no graph holds a step that the eager forward pass gives to cuBLAS).

With an MTP head, each graph first moves on the positions of the rows whose sequences' last verdict
was still on the device when the step was formed (cupyspec/model/positions.py), then also runs the
head's catch-up over the step's rows (its K/V, from the staged token after each row) and keeps the
target's pre-norm hidden states of every row in a static buffer, which the head's drafting graphs
read (cupyspec/spec_decode/proposers/mtp_graphs.py). The staged token fields have one column past
the largest bucket, always padding: the row a drafting graph's padding entries read.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from cupyspec.kernels import programmatic_launches
from cupyspec.model.batch import DeviceBatch, FlatBatch
from cupyspec.model.kv_arrays import KVCacheArrays
from cupyspec.model.linear import KERNEL_MAX_ROWS
from cupyspec.model.llama import LlamaModel
from cupyspec.model.positions import shift_positions

log = logging.getLogger("cupyspec")

EVERY_ROW_MAX = 512  # the largest bucket whose graph computes the logits of every row
LOGIT_ROWS = EVERY_ROW_MAX  # the rows a larger bucket's graph computes the logits of
# Row counts with a graph of their own; GEMV_MAX_ROWS and attention.FEW_ROWS must be among them.
BUCKETS = (1, 2, 4, 8, *range(16, EVERY_ROW_MAX + 1, 16), *range(EVERY_ROW_MAX + 128, KERNEL_MAX_ROWS + 1, 128))

TOKEN_FIELDS = 4  # rows of the staged token arrays: input ids, positions, batch ids, KV slots
LOGIT_ROW = 4  # then the rows whose logits a bucket past EVERY_ROW_MAX computes, in order (LOGIT_ROWS of them)
NEXT_IDS, SHIFT_FROM = 5, 6  # with an MTP head: the token after each row, and where its position's shift is


class GraphLogits(NamedTuple):
    """A replayed step's logits: a view of the static buffer, valid until the next replay."""

    logits: Any  # [T, V] f32 of every row, or [R, V] of the rows asked for, in that order
    every_row: bool

CatchUp = Callable[[Any, DeviceBatch, Any, KVCacheArrays], None]  # MTPDrafting.catch_up


class CudaGraphs:
    """The captured graphs of `model` over `kv`, and the static buffers they read and write."""

    def __init__(self, model: LlamaModel, kv: KVCacheArrays, stream: Any, max_tokens: int, max_model_len: int,
                 previous_tokens: Any, catch_up: CatchUp | None = None, accepted: Any | None = None) -> None:
        """previous_tokens [N] int32: the device buffer where placeholder input ids ~n find their tokens.
        catch_up: an MTP head's catch-up, run over every step's rows; accepted [S] int32: the drafts
        the step before accepted per sequence, by which rows move on (with an MTP head)."""
        import cupy
        import cupyx

        self.model, self.kv, self.stream, self.previous_tokens = model, kv, stream, previous_tokens
        self.catch_up, self.accepted = catch_up, accepted
        self.buckets = tuple(b for b in BUCKETS if b <= max_tokens)
        if not self.buckets:
            raise ValueError(f"no CUDA graph bucket holds at most {max_tokens} rows")
        rows = self.buckets[-1]
        width = -(-max_model_len // kv.block_size)  # block-table columns: the longest sequence's blocks
        self.padding_row = rows  # the block-table row of padding tokens, and the always-padding token column
        self.fields = LOGIT_ROW + 1 + 2 * (catch_up is not None)
        # the inputs: the token fields [fields, rows + 1], then the block tables [rows + 1, width], flat
        self.tokens_size, self.width = self.fields * (rows + 1), width
        size = self.tokens_size + (rows + 1) * width
        self.host_inputs = [cupyx.empty_pinned(size, np.int32) for _ in range(2)]
        self.host_views = [self._split(host) for host in self.host_inputs]  # (token fields, tables) of each
        for staged, _ in self.host_views:
            self._pad(staged, rows, rows + 1)
            staged[LOGIT_ROW] = 0  # row 0 until a large step lists its own (the captures read them too)
        self._host_pointers = [host.ctypes.data for host in self.host_inputs]
        self._runtime = cupy.cuda.runtime
        self._turn = 0  # the pinned buffer the next step stages its inputs in
        self.inputs = cupy.zeros(size, np.int32)
        self.tokens, self.tables = self._split(self.inputs)  # [fields, rows + 1], [rows + 1, width] on the device
        self.tables[self.padding_row] = kv.scratch_block
        self.logits = cupy.empty((min(rows, LOGIT_ROWS), model.config.vocab_size), np.float32)  # [rows or R, V]
        # [rows + 1, H] fp32: the target's pre-norm hidden states, with an MTP head; the last row is 0
        self.residual = cupy.zeros((rows + 1, model.config.hidden_size), np.float32) if catch_up else None
        self.pool = cupy.cuda.MemoryPool()  # the graphs' own activations, never handed to eager code
        self.graphs: dict[int, Any] = {}
        with cupy.cuda.using_allocator(self.pool.malloc), stream:
            staged, _ = self.host_views[0]
            self._pad(staged, 0, rows)
            self.tokens.set(staged, stream=stream)
            for bucket in reversed(self.buckets):  # largest first: smaller ones reuse its memory
                self._forward(bucket)  # warm-up: compiles kernels, fills the pool outside capture
                stream.begin_capture()
                with programmatic_launches():  # each kernel may overlap the one before (kernels.py)
                    self._forward(bucket)
                self.graphs[bucket] = stream.end_capture()
                self.graphs[bucket].upload(stream)
        stream.synchronize()
        log.info("captured %d CUDA graphs for steps of up to %d rows (%.0f MiB of activations)",
                 len(self.graphs), rows, self.pool.total_bytes() / 2**20)

    def close(self) -> None:
        """Destroy the graphs (CUDA frees one still running when it ends); the buffers stay."""
        self.graphs.clear()

    def _forward(self, bucket: int) -> None:
        ids, positions, batch_ids, slots = (self.tokens[f, :bucket] for f in range(TOKEN_FIELDS))
        if self.catch_up is not None:
            shift_positions(self.model.backend.xp, positions, slots, batch_ids, self.tables,
                            self.tokens[SHIFT_FROM, :bucket], self.accepted, self.kv.block_size)
        batch = DeviceBatch(ids, positions, batch_ids, slots, self.tables, self.previous_tokens)
        residual = self.model.forward_residual(batch, self.kv)  # [bucket, H] fp32
        if self.catch_up is not None:
            self.catch_up(residual, batch, self.tokens[NEXT_IDS, :bucket], self.kv)
            self.residual[:bucket] = residual
        if bucket > EVERY_ROW_MAX:  # rows are a row's own: gathered first, they come out with the same bits
            residual = residual[self.tokens[LOGIT_ROW, :LOGIT_ROWS]]  # [R, H]
        self.model.compute_logits(self.model.final_normed(residual), out=self.logits[:len(residual)])

    def _split(self, inputs: Any) -> tuple[Any, Any]:
        """Views of a flat inputs buffer: the token fields [fields, rows + 1] and the block tables
        [rows + 1, width]."""
        return (inputs[:self.tokens_size].reshape(self.fields, -1),
                inputs[self.tokens_size:].reshape(-1, self.width))

    def _pad(self, staged: np.ndarray, start: int, stop: int) -> None:
        """Columns start..stop of the staged tokens [fields, rows + 1] become padding."""
        staged[:, start:stop] = 0
        staged[2, start:stop] = self.padding_row
        staged[3, start:stop] = self.kv.scratch_block * self.kv.block_size
        if self.catch_up is not None:
            staged[SHIFT_FROM, start:stop] = -1

    def run(self, batch: FlatBatch, next_ids: np.ndarray | None = None, shift_from: np.ndarray | None = None,
            logit_rows: tuple[np.ndarray, ...] = ()) -> GraphLogits | None:
        """The logits of every row of `batch`, or of the rows `logit_rows` lists (their concatenation,
        in order) where its bucket is past EVERY_ROW_MAX; None when no graph holds the batch (more rows
        than the largest, or more than LOGIT_ROWS rows of logits asked of a large one). With an MTP
        head: next_ids [T] int32 the token after each row, for its catch-up, and shift_from [T] int32
        the sequence whose accepted drafts each row's position moves on by (-1 or None: none)."""
        num_tokens, num_seqs = batch.num_tokens, batch.num_seqs
        index = bisect.bisect_left(self.buckets, num_tokens)
        if index == len(self.buckets) or batch.block_tables.shape[1] > self.tables.shape[1]:
            return None
        bucket = self.buckets[index]
        gathered = bucket > EVERY_ROW_MAX  # its graph computes the logits of the asked rows only
        asked = sum(map(len, logit_rows)) if gathered else 0
        if asked > LOGIT_ROWS:
            return None
        turn, self._turn = self._turn, self._turn ^ 1
        staged, tables = self.host_views[turn]
        staged[0, :num_tokens] = batch.input_ids
        staged[1, :num_tokens] = batch.positions
        staged[2, :num_tokens] = batch.batch_id_per_token
        staged[3, :num_tokens] = batch.slot_mapping
        if self.catch_up is not None:
            staged[NEXT_IDS, :num_tokens] = next_ids
            staged[SHIFT_FROM, :num_tokens] = -1 if shift_from is None else shift_from
        if num_tokens < bucket:
            self._pad(staged, num_tokens, bucket)
        if gathered:
            staged[LOGIT_ROW, :asked] = np.concatenate(logit_rows) if logit_rows else ()
            staged[LOGIT_ROW, asked:LOGIT_ROWS] = 0
        tables[:num_seqs, :batch.block_tables.shape[1]] = batch.block_tables
        end = self.tokens_size + num_seqs * self.width  # the token fields and the batch's block tables
        runtime = self._runtime  # one raw copy: a CuPy slice and set costs the host more
        runtime.memcpyAsync(self.inputs.data.ptr, self._host_pointers[turn], end * self.inputs.itemsize,
                            runtime.memcpyHostToDevice, self.stream.ptr)
        self.graphs[bucket].launch(self.stream)
        if gathered:
            return GraphLogits(self.logits[:asked], every_row=False)
        return GraphLogits(self.logits[:num_tokens], every_row=True)
