"""The MTP head's drafting as CUDA graphs, one per bucket of sampling sequences.

A drafting graph runs right after the forward graph of its step and reads that graph's static
buffers (cupyspec/model/cuda_graphs.py): the target's hidden states, positions, batch ids and block
tables of the step's rows. Its own inputs are each sampling sequence's first target row (staged from
the host), and the accepted drafts and the emitted token after them (copied on the device from the
verdict, or the sampled tokens). Entries past the step's S sequences are padding: their row is the
forward graphs' padding column, whose block table is the KV cache's scratch block.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any

import numpy as np

from cupyspec.kernels import programmatic_launches
from cupyspec.model.cuda_graphs import BUCKETS, CudaGraphs
from cupyspec.spec_decode.proposers.mtp import MTPDrafting

log = logging.getLogger("cupyspec")


class DraftGraphs:
    """`MTPDrafting.draft` captured per bucket of sampling sequences, over `forward`'s static buffers."""

    def __init__(self, drafting: MTPDrafting, forward: CudaGraphs, max_num_seqs: int) -> None:
        import cupy
        import cupyx

        self.forward = forward
        rows = forward.padding_row  # the forward graphs' largest bucket, and their padding column
        self.buckets = tuple(b for b in BUCKETS if b <= rows)
        self.buckets = self.buckets[:bisect.bisect_left(self.buckets, max_num_seqs) + 1]
        size, steps = self.buckets[-1], drafting.num_model_steps
        self.padding = rows
        self.host_first_rows = [cupyx.empty_pinned(size, np.int32) for _ in range(2)]  # used in turn
        self._turn = 0
        self.first_rows = cupy.full(size, rows, np.int32)  # [size]: each sequence's first target row
        self.accepted = cupy.zeros(size, np.int32)  # [size]: its accepted drafts
        self.tokens = cupy.zeros(size, np.int32)  # [size]: the token emitted after them
        self.drafts = cupy.zeros((size, steps), np.int32)  # [size, steps]
        self.logprobs = cupy.zeros((size, steps), np.float32)  # [size, steps]: the head's logprob of each
        self.graphs: dict[int, Any] = {}
        stream = forward.stream
        with cupy.cuda.using_allocator(forward.pool.malloc), stream:
            for bucket in reversed(self.buckets):
                self._draft(drafting, bucket)  # warm-up outside capture, as the forward graphs'
                stream.begin_capture()
                with programmatic_launches():
                    self._draft(drafting, bucket)
                self.graphs[bucket] = stream.end_capture()
                self.graphs[bucket].upload(stream)
        stream.synchronize()
        log.info("captured %d MTP drafting graphs for up to %d sequences", len(self.graphs), size)

    def _draft(self, drafting: MTPDrafting, bucket: int) -> None:
        import cupy

        f = self.forward
        rows = cupy.minimum(self.first_rows[:bucket] + self.accepted[:bucket], self.padding)  # [bucket]
        positions, batch_ids = f.tokens[1][rows], f.tokens[2][rows]  # [bucket] each
        drafts, logprobs = drafting.draft(f.residual[rows], self.tokens[:bucket], positions, f.tables[batch_ids],
                                          f.previous_tokens, f.kv)
        self.drafts[:bucket] = drafts
        self.logprobs[:bucket] = logprobs

    def run(self, first_rows: np.ndarray, accepted: Any | None, tokens: Any) -> tuple[Any, Any]:
        """Drafts [S, steps] int32 and their head logprobs [S, steps] f32 (views of static buffers,
        valid until the next run) from S sequences' first target rows first_rows [S] (host) of the
        step the forward graphs ran last, their accepted drafts [S] (device; None: none) and the
        tokens emitted after them [S] (device). A step holds at most max_num_seqs sequences, and at
        most as many as the forward graphs' rows: the largest bucket holds them."""
        num_seqs = len(first_rows)
        bucket = self.buckets[bisect.bisect_left(self.buckets, num_seqs)]
        turn, self._turn = self._turn, self._turn ^ 1
        staged = self.host_first_rows[turn]
        staged[:num_seqs] = first_rows
        staged[num_seqs:bucket] = self.padding
        self.first_rows[:bucket].set(staged[:bucket], stream=self.forward.stream)
        if accepted is None:
            self.accepted[:num_seqs] = 0
        else:
            self.accepted[:num_seqs] = accepted
        self.tokens[:num_seqs] = tokens
        self.graphs[bucket].launch(self.forward.stream)
        return self.drafts[:num_seqs], self.logprobs[:num_seqs]
