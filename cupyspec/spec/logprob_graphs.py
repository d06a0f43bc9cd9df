"""The logprob work of a verifying step of one request, replayed as a CUDA graph.

At one request a verifying step's logprob work is a dozen calls into CuPy and the CUDA runtime:
the layout's upload, the top-k, gather and render launches and their allocations, the side
stream's events, the copy to the host. On the H100's host that took 0.2-0.3 ms a step, paid before
the host could form the next step. Over the static logits of the forward pass's graphs
(cupyspec/model/cuda_graphs.py) the work of one step shape (the logprobs asked and the drafts
verified) is captured once; a step then uploads its layout into a static buffer, copies the
verdict beside it and launches the graph, which copies its results into pinned memory of its own.

Each shape has two graphs, used in turn, and each is lent to the step whose results it holds until
the host has read them (`PendingVerdict.logprobs`): one still lent is not launched again, and a
step that finds both lent runs the eager path. The graph runs after verification on the step's
stream (verification is not in it, so a side stream would have nothing to overlap): at one request
its 70-80 µs of GPU work end while the host forms the next step.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from cupyspec.sampling.logprob_json import LogprobRenderer
from cupyspec.spec.accept_gather import LogprobLayout, RowLogprobs, UploadedLayout, gather_size, launch_gather
from cupyspec.transfer import HostTransfer

GRAPH_MAX_SEQS = 1  # steps that verify up to this many requests replay graphs
GRAPHS_CACHED = 32  # step shapes captured at most (further shapes run eagerly)


class LogprobGraph:
    """One step shape's static buffers and its two captured graphs."""

    def __init__(self, xp: Any, logits: Any, layout: LogprobLayout, drafts: np.ndarray, k: int,
                 renderer: LogprobRenderer | None) -> None:
        """logits [R, V] f32: the static logits; drafts [B, K]: a step's drafts (their shape counts)."""
        import cupyx

        self._xp, self._logits, self._layout, self._k, self._renderer = xp, logits, layout, k, renderer
        num_seqs = len(drafts)
        packed_size = len(layout.flat) + drafts.size + 2 * num_seqs  # UploadedLayout.packed
        rows_size = RowLogprobs.size(layout.num_rows, k)
        self._gather_size = gather_size(layout.uploaded(None, drafts), k, renderer)
        # [packed | runs [2, B] | the rows' logprobs | the gather's buffer]
        self._workspace = xp.empty(packed_size + 2 * num_seqs + rows_size + self._gather_size, dtype=xp.int64)
        self.on_device: UploadedLayout = layout.uploaded(self._workspace[:packed_size], drafts)
        self._runs = self._workspace[packed_size:packed_size + 2 * num_seqs].reshape(2, num_seqs)
        self._rows_at = self._runs.data.ptr + self._runs.nbytes
        self._gather_at = self._rows_at + 8 * rows_size
        self._host = [cupyx.empty_pinned(self._gather_size, np.int64) for _ in range(2)]
        self._graphs: list[Any] = []
        self._leases: list[weakref.ref | None] = [None, None]  # the step whose results each graph holds

    def free_slot(self) -> int | None:
        """A graph whose results the host has read (or nobody will), or None."""
        for slot, lease in enumerate(self._leases):
            pending = lease() if lease is not None else None
            if pending is None or pending.logprobs_read:
                return slot
        return None

    def launch(self, slot: int, drafts: np.ndarray, num_drafts: np.ndarray, runs: Any) -> HostTransfer:
        """Queue graph `slot` on the current stream for a step's drafts [B, K], num_drafts [B] and
        verdict runs [2, B] int64 (on the device); the host copy of its GatheredLogprobs buffer."""
        xp = self._xp
        stream, runtime = xp.cuda.get_current_stream(), xp.cuda.runtime
        packed = self._layout.packed(drafts, num_drafts)  # from pageable memory: staged before the call returns
        runtime.memcpyAsync(self.on_device.packed.data.ptr, packed.ctypes.data, packed.nbytes,
                            runtime.memcpyHostToDevice, stream.ptr)
        runs = xp.ascontiguousarray(runs, dtype=xp.int64)
        runtime.memcpyAsync(self._runs.data.ptr, runs.data.ptr, runs.nbytes, runtime.memcpyDeviceToDevice, stream.ptr)
        if not self._graphs:  # first use: the work once as it is (kernels loaded), then captured
            self._work(self._host[slot])
            for host in self._host:
                stream.begin_capture()
                self._work(host)
                self._graphs.append(stream.end_capture())
        else:
            self._graphs[slot].launch(stream)
        return HostTransfer.queued(xp, [self._host[slot]])

    def lend(self, slot: int, pending: Any) -> None:
        """Graph `slot`'s results are `pending`'s (a PendingVerdict) until it has read them."""
        self._leases[slot] = weakref.ref(pending)

    def _work(self, host: np.ndarray) -> None:
        """Top-k, gather (and render) into the workspace, and the copy into `host`, on the current stream."""
        xp = self._xp
        rows = RowLogprobs.compute(xp, self._logits, self.on_device.row_target, self._k, self._rows_at)
        launch_gather(xp, self._logits, rows, self.on_device, self._runs, self._gather_at, self._renderer)
        runtime = xp.cuda.runtime
        runtime.memcpyAsync(host.ctypes.data, self._gather_at, host.nbytes, runtime.memcpyDeviceToHost,
                            xp.cuda.get_current_stream().ptr)


class LogprobGraphs:
    """The captured graphs of each step shape, over one static logits buffer."""

    def __init__(self, xp: Any, static_logits: Any) -> None:
        """static_logits [rows, V] f32: the buffer the forward pass's graphs write their logits to."""
        self._xp, self._base = xp, static_logits.data.ptr
        self._graphs: dict[tuple, LogprobGraph] = {}

    def find(self, logits: Any, shape: tuple, layout: LogprobLayout, drafts: np.ndarray, k: int,
             renderer: LogprobRenderer | None) -> LogprobGraph | None:
        """The graph of a step of `shape` (hashable: the logprobs asked and the drafts' counts) over
        logits [R, V] f32, made on first use; None when the step is not one to replay (too many
        requests, logits not the static buffer's, or too many shapes kept already)."""
        if len(drafts) > GRAPH_MAX_SEQS or logits.data.ptr != self._base:
            return None
        key = (shape, logits.shape, renderer is not None)
        graph = self._graphs.get(key)
        if graph is None and len(self._graphs) < GRAPHS_CACHED:
            graph = self._graphs[key] = LogprobGraph(self._xp, logits, layout, drafts, k, renderer)
        return graph
