"""The MTP head's drafting as CUDA graphs, one per bucket of sampling sequences.

A drafting graph runs right after the forward graph of its step and reads that graph's static
buffers (cupyspec/model/cuda_graphs.py): the target's hidden states, positions, batch ids and block
tables of the step's rows. Its own input is each sampling sequence's first target row, staged from
the host; the drafts it accepted and the token it emitted come from the device tokens
(cupyspec/model/device_tokens.py), where sampling or verification left them, and the drafts go
there too, for the next step. Entries past the step's S sequences are padding: their row is the
forward graphs' padding column, whose block table is the KV cache's scratch block.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any

import numpy as np

from cupyspec.kernels import programmatic_launches
from cupyspec.model.cuda_graphs import BUCKETS, CudaGraphs
from cupyspec.model.device_tokens import DeviceTokens
from cupyspec.spec_decode.proposers.mtp import Drafted, DraftSampling, MTPDrafting

log = logging.getLogger("cupyspec")


class DraftGraphs:
    """`MTPDrafting.draft` captured per bucket of sampling sequences, over `forward`'s static buffers."""

    def __init__(self, drafting: MTPDrafting, forward: CudaGraphs, max_num_seqs: int, tokens: DeviceTokens) -> None:
        """tokens: holds at least as many sequences as the largest bucket (DeviceTokens.capacity)."""
        import cupy
        import cupyx

        self.drafting, self.forward, self.device_tokens = drafting, forward, tokens
        rows = forward.padding_row  # the forward graphs' largest bucket, and their padding column
        self.buckets = tuple(b for b in BUCKETS if b <= rows)
        self.buckets = self.buckets[:bisect.bisect_left(self.buckets, max_num_seqs) + 1]
        size, steps = self.buckets[-1], drafting.num_model_steps
        if size > len(tokens.accepted):
            raise ValueError(f"the device tokens hold {len(tokens.accepted)} sequences, the drafting graphs {size}")
        self.padding = rows
        self.host_first_rows = [cupyx.empty_pinned(size, np.int32) for _ in range(2)]  # used in turn
        self._turn = 0
        self.first_rows = cupy.full(size, rows, np.int32)  # [size]: each sequence's first target row
        self.drafts = cupy.zeros((size, steps), np.int32)  # [size, steps]
        self.logprobs = cupy.zeros((size, steps), np.float32)  # [size, steps]: the head's logprob of each
        self.graphs: dict[int, Any] = {}  # bucket -> its drafting graph
        self.mend_graphs: dict[int, Any] = {}  # bucket -> its graph of `MTPDrafting.mend`
        stream = forward.stream
        with cupy.cuda.using_allocator(forward.pool.malloc), stream:
            for bucket in reversed(self.buckets):
                for graphs, work in ((self.graphs, self._draft), (self.mend_graphs, self._mend)):
                    work(bucket)  # warm-up outside capture, as the forward graphs'
                    stream.begin_capture()
                    with programmatic_launches():
                        work(bucket)
                    graphs[bucket] = stream.end_capture()
                    graphs[bucket].upload(stream)
        stream.synchronize()
        log.info("captured %d MTP drafting graphs for up to %d sequences", len(self.graphs), size)

    def close(self) -> None:
        """Destroy the graphs (CUDA frees one still running when it ends)."""
        self.graphs.clear()
        self.mend_graphs.clear()

    def _boundaries(self, count: int) -> tuple[Any, ...]:
        """`MTPDrafting.draft`'s inputs for the first `count` entries, from the static buffers."""
        import cupy

        f, tokens = self.forward, self.device_tokens
        rows = cupy.minimum(self.first_rows[:count] + tokens.accepted[:count], self.padding)  # [count]
        positions, batch_ids = f.tokens[1][rows], f.tokens[2][rows]  # [count] each
        return f.residual[rows], tokens.by_seq[:count, 0], positions, f.tables[batch_ids], f.previous_tokens, f.kv

    def _mend(self, bucket: int) -> None:
        self.drafting.mend(*self._boundaries(bucket))

    def _draft(self, bucket: int, sampling: DraftSampling | None = None) -> Drafted:
        drafted = self.drafting.draft(*self._boundaries(bucket), sampling)
        self.device_tokens.by_seq[:bucket, 1:] = drafted.tokens  # past the step's sequences: unread
        self.drafts[:bucket] = drafted.tokens
        self.logprobs[:bucket] = drafted.logprobs
        return drafted

    def run(self, first_rows: np.ndarray, sampling: DraftSampling | None = None) -> Drafted:
        """The drafts of S sequences from their first target rows first_rows [S] (host) in the step the
        forward graphs ran last, after its sampling or verification: greedy ones by a graph (views of
        static buffers, valid until the next run), else eagerly over the same inputs. A step holds at
        most max_num_seqs sequences, and at most as many as the forward graphs' rows: the largest
        bucket holds them."""
        num_seqs, bucket = len(first_rows), self._stage(first_rows)
        if sampling is not None:
            return self._draft(num_seqs, sampling)
        self.graphs[bucket].launch(self.forward.stream)
        return Drafted(self.drafts[:num_seqs], self.logprobs[:num_seqs])

    def mend(self, first_rows: np.ndarray) -> None:
        """`MTPDrafting.mend` at the S sequences' boundaries, from their first target rows first_rows
        [S] (host) in the step the forward graphs ran last, by a graph."""
        self.mend_graphs[self._stage(first_rows)].launch(self.forward.stream)

    def _stage(self, first_rows: np.ndarray) -> int:
        """Stage first_rows [S] (host) into the graphs' input, padded to its bucket; returns the bucket."""
        num_seqs = len(first_rows)
        bucket = self.buckets[bisect.bisect_left(self.buckets, num_seqs)]
        turn, self._turn = self._turn, self._turn ^ 1
        staged = self.host_first_rows[turn]
        staged[:num_seqs] = first_rows
        staged[num_seqs:bucket] = self.padding
        self.first_rows[:bucket].set(staged[:bucket], stream=self.forward.stream)
        return bucket
