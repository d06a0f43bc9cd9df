"""A step's logprob work, replayed as CUDA graphs.

A step's logprob work is a dozen calls into CuPy and the CUDA runtime: uploads, the top-k, gather
and render launches and their allocations, events, the copies to the host. Their host time, the
same at one request as at many, delays the forming of the next step. Over the static logits of the
forward pass's graphs (cupyspec/model/cuda_graphs.py, where the rows of a step that also runs
prompts are too) the work of one step shape is captured once, with the copy of its results into
pinned memory of its own:

- a verifying step's (shape: its requests B, padded, and the top logprobs; the layout holds
  B * (K + 1) rows and B * K draft slots, K the most drafts a request may verify, `LayoutShape`) writes
  its requests' fields, with the address of its verdict, into pinned memory of the graph's and
  launches the graph, which uploads them, expands them into the layout
  (cupyspec/logprobs/layout.py) and runs after verification on the step's stream
  (verification is not in it, so a side stream would have nothing to overlap). Rows past the
  step's read no logits and score nothing, requests past its own ask nothing, so that a few shapes
  serve every step;
- a plain step's (shape: its requests, padded, and the top logprobs) writes each request's row of
  the static logits and the entries it asks into pinned memory of the graph's, copies the sampled
  tokens into a static buffer and launches the graph, which brings the tokens with their logprobs.

Each shape has two graphs, used in turn, each lent to the HostTransfer of its results until the
host has read them: one still lent is not launched again, and a step that finds both lent runs
the eager path. The graphs' work ends on the GPU while the host forms the next step: the verdict's
copy to the host is queued before it.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from cupyspec.logprobs.accept_gather import RowLogprobs, gather_size, launch_gather
from cupyspec.logprobs.layout import LayoutShape, RequestWants, UploadedLayout, expand_on_device
from cupyspec.logprobs.logprob_json import LogprobRenderer
from cupyspec.logprobs.logsoftmax_topk import KERNEL_MAX_K, DeviceRows, launch_top_logprobs
from cupyspec.transfer import HostTransfer

log = logging.getLogger("cupyspec")

GRAPHS_CACHED = 64  # step shapes captured at most (further shapes run eagerly)
SMALL_SIZES = 16  # sizes up to this are padded to a power of two, larger ones to a multiple of it
Fields = tuple[tuple[tuple[int, ...], type], ...]  # (shape, dtype) of each array in a buffer, in order


class LentGraphs:
    """Device work that fills a buffer of results, and the copy of that buffer into pinned memory,
    captured as two CUDA graphs used in turn; each lent to the HostTransfer of its results until the
    host has read them (or dropped them). A graph may start with an upload of inputs from pinned
    memory of its own (`staged`), which the host fills before it launches the graph."""

    def __init__(self, xp: Any, work: Callable[[], None], results: Any,
                 host_arrays: Callable[[np.ndarray], list[np.ndarray]], inputs: Any | None = None) -> None:
        """work(): queues the work on the current stream; results: the device array it fills;
        host_arrays(a host copy of results): the arrays a launch's HostTransfer hands out; inputs:
        a device array uploaded first, from `staged(slot)`, or None."""
        import cupyx

        self._xp, self._work, self._results, self._inputs = xp, work, results, inputs
        self._host = [cupyx.empty_pinned(results.shape, results.dtype) for _ in range(2)]
        self._host_arrays = [host_arrays(host) for host in self._host]
        self._staged = [cupyx.empty_pinned(inputs.shape, inputs.dtype) for _ in range(2)] if inputs is not None else []
        self._events = [xp.cuda.Event(disable_timing=True) for _ in range(2)]  # made once: creating one costs host time
        self._graphs: list[Any] = []
        self._lent: list[weakref.ref | None] = [None, None]  # the HostTransfer of each graph's results

    def free_slot(self) -> int | None:
        """A graph whose results the host has read (or nobody will), or None."""
        for slot, lent in enumerate(self._lent):
            transfer = lent() if lent is not None else None
            if transfer is None or transfer.read:
                return slot
        return None

    def staged(self, slot: int) -> np.ndarray:
        """The pinned inputs that graph `slot` uploads first (free slots only: a lent graph may not have
        uploaded them yet)."""
        return self._staged[slot]

    def _replay(self, slot: int, skip: int = 0) -> HostTransfer:
        """Queue graph `slot` (a free one) on the current stream; the HostTransfer of its results, each
        host array without its first `skip` rows."""
        stream = self._xp.cuda.get_current_stream()
        if not self._graphs:  # first use: the work once as it is (kernels loaded), then captured
            self._run(slot)
            for each in range(2):
                stream.begin_capture()
                self._run(each)
                self._graphs.append(stream.end_capture())
        else:
            self._graphs[slot].launch(stream)
        arrays = self._host_arrays[slot]
        transfer = HostTransfer.queued(self._xp, [a[skip:] for a in arrays] if skip else list(arrays),
                                       self._events[slot])
        self._lent[slot] = weakref.ref(transfer)
        return transfer

    def _run(self, slot: int) -> None:
        runtime, stream = self._xp.cuda.runtime, self._xp.cuda.get_current_stream().ptr
        if self._inputs is not None:
            staged = self._staged[slot]
            runtime.memcpyAsync(self._inputs.data.ptr, staged.ctypes.data, staged.nbytes, runtime.memcpyHostToDevice,
                                stream)
        self._work()
        host = self._host[slot]
        runtime.memcpyAsync(host.ctypes.data, self._results.data.ptr, host.nbytes, runtime.memcpyDeviceToHost, stream)


class VerifyingStepGraph(LentGraphs):
    """A verifying step shape's static buffers and its graphs: the upload of the requests' fields,
    their expansion into the layout, top-k, gather (and render). The gather reads the verdict where
    the layout's tail says (`RequestWants.packed`)."""

    def __init__(self, xp: Any, logits: Any, shape: LayoutShape, k: int, renderer: LogprobRenderer | None) -> None:
        """logits [R, V] f32: the static logits; shape: its layout's sizes, at least its steps'."""
        rows_size = RowLogprobs.size(shape.num_rows, k)
        # [packed | the rows' logprobs | the gather's buffer]
        workspace = xp.empty(shape.packed_size + rows_size + gather_size(UploadedLayout(None, *shape), k, renderer),
                             dtype=xp.int64)
        self.on_device = UploadedLayout(workspace[:shape.packed_size], *shape)
        gathered = workspace[shape.packed_size + rows_size:]

        def work() -> None:
            expand_on_device(xp, self.on_device)
            rows = RowLogprobs.compute(xp, logits, self.on_device.row_target, k,
                                       workspace.data.ptr + 8 * shape.packed_size)
            launch_gather(xp, logits, rows, self.on_device, None, gathered.data.ptr, renderer)

        super().__init__(xp, work, gathered, lambda host: [host], self.on_device.packed)
        self._shape = shape
        self._verdicts: list[Any] = [None, None]  # each graph's verdict, kept until the graph is launched again
        self._wants: list[RequestWants | None] = [None, None]  # the wants in each graph's staged inputs

    def launch(self, slot: int, wants: RequestWants, drafts: np.ndarray, num_drafts: np.ndarray,
               first_row: np.ndarray, runs: Any) -> HostTransfer:
        """Queue graph `slot` on the current stream for a step whose requests ask `wants`, with drafts
        [B, K], num_drafts [B], the static logits' row of each one's first draft first_row [B] and
        verdict runs [2, B] int64 (on the device); the host copy of its GatheredLogprobs buffer (of
        the graph's shape, `on_device`)."""
        runs = self._verdicts[slot] = self._xp.ascontiguousarray(runs, dtype=self._xp.int64)
        staged = self.staged(slot)
        if self._wants[slot] is not wants:  # else this graph's last step had the same requests: their wants are there
            wants.pack_wants(self._shape, staged)
            self._wants[slot] = wants
        RequestWants.pack_step(self._shape, drafts, num_drafts, first_row, runs.data.ptr, staged)
        return self._replay(slot)


class PlainStepGraph(LentGraphs):
    """A plain step shape's graphs: the sampled tokens' logprobs and top k (and entries) of `rows`
    rows of the static logits, copied to the host with the tokens, as sample_on_device's arrays (and
    the render's). A step of n <= rows requests fills the last n rows: the padding comes first and
    asks for no entries, so its render ends at byte 0 and the last n rows' results read as an n-row
    step's, render included."""

    def __init__(self, xp: Any, logits: Any, rows: int, k: int, renderer: LogprobRenderer | None) -> None:
        """logits [R_all, V] f32: the static logits; rows: the padded requests of the steps it serves."""
        fields: Fields = (((rows,), np.int64), ((rows,), np.float32), ((rows, k), np.int64), ((rows, k), np.float32))
        if renderer is not None:
            fields += (((renderer.rendered_size(rows, k),), np.int64),)
        results = xp.zeros(sum(_words(*field) for field in fields), dtype=xp.int64)  # padding: token 0
        self._tokens, lps, top_ids, top_lps, *rendered = _carve(results, fields)
        inputs = xp.zeros(2 * rows, dtype=xp.int64)  # [each request's row of the logits | its render_k], staged
        row_of, render_k = inputs[:rows], inputs[rows:]

        def work() -> None:
            launch_top_logprobs(logits, DeviceRows(row_of.data.ptr, rows), rows, k, None, None, top_ids, top_lps,
                                self._tokens, lps)
            if renderer is not None:
                renderer.render_into(rendered[0].data.ptr, self._tokens, lps, top_ids, top_lps, k, render_k, rows,
                                     rows)

        super().__init__(xp, work, results, lambda host: _carve(host, fields), inputs)
        self._rows = rows
        for slot in range(2):  # the padding reads row 0 of the logits (its entries are not rendered: `launch`)
            self.staged(slot)[:rows] = 0

    def launch(self, slot: int, tokens: Any, rows: np.ndarray, render_k: np.ndarray) -> HostTransfer:
        """Queue graph `slot` on the current stream for a step of n requests: their sampled tokens [n]
        int64 (on the device), row of the static logits rows [n] and render_k [n] (as
        LogprobRequests.render_k); the HostTransfer of their [tokens, logprobs, top ids, top logprobs
        (, entries)]."""
        padding, staged = self._rows - len(rows), self.staged(slot)
        staged[padding:self._rows] = rows
        staged[self._rows:self._rows + padding] = -1  # rows that served a larger step before may not render
        staged[self._rows + padding:] = render_k
        runtime = self._xp.cuda.runtime
        runtime.memcpyAsync(self._tokens.data.ptr + 8 * padding, tokens.data.ptr, 8 * len(rows),
                            runtime.memcpyDeviceToDevice, self._xp.cuda.get_current_stream().ptr)
        return self._replay(slot, padding)


def padded(size: int) -> int:
    """A size of a graph's step shape, padded: powers of two up to SMALL_SIZES, then its multiples
    (few shapes to capture, and at most SMALL_SIZES - 1 rows or requests of padding)."""
    if size <= 1:
        return size
    return min(1 << (size - 1).bit_length(), -(-size // SMALL_SIZES) * SMALL_SIZES)


def _words(shape: tuple[int, ...], dtype: type) -> int:
    """int64 elements that an array of shape and dtype takes in a buffer."""
    return -(-math.prod(shape) * np.dtype(dtype).itemsize // 8)


def _carve(buffer: Any, fields: Fields) -> list[Any]:
    """Views of an int64 buffer (NumPy or CuPy), one per field in turn, each from an 8-byte boundary."""
    views, at = [], 0
    for shape, dtype in fields:
        words = _words(shape, dtype)
        views.append(buffer[at:at + words].view(dtype)[:math.prod(shape)].reshape(shape))
        at += words
    return views


class LogprobGraphs:
    """The captured graphs of each step shape, over one static logits buffer."""

    def __init__(self, xp: Any, static_logits: Any, max_drafts: int) -> None:
        """static_logits [rows, V] f32: the buffer the forward pass's graphs write their logits to;
        max_drafts: the most drafts a request may verify (the server's num_speculative_tokens)."""
        self._xp, self._logits, self._max_drafts = xp, static_logits, max_drafts
        self._graphs: dict[tuple, VerifyingStepGraph | PlainStepGraph] = {}

    def find_verifying(self, num_seqs: int, max_drafts: int, k: int,
                       renderer: LogprobRenderer | None) -> VerifyingStepGraph | None:
        """The graph of verifying steps of num_seqs requests (padded, `padded`) with up to max_drafts
        drafts each over the static logits, made on first use; None when the step is not one to
        replay. Its layout holds every row and draft slot that a step of as many requests may have
        (the drafts of each up to the most a request may verify), so that the host counts neither
        and steps differ in shape by their requests only."""
        if k > KERNEL_MAX_K or max_drafts > self._max_drafts:
            return None
        b, drafts = padded(num_seqs), self._max_drafts
        shape = LayoutShape(b, b * (drafts + 1), drafts, b * drafts)
        return self._cached(("verifying", shape, k, renderer is not None),
                            lambda: VerifyingStepGraph(self._xp, self._logits, shape, k, renderer))

    def find_plain(self, num_seqs: int, k: int, renderer: LogprobRenderer | None) -> PlainStepGraph | None:
        """The graph of plain steps of num_seqs requests (padded, `padded`) over the static logits, asking
        top k logprobs (rendered where renderer); None when the step is not one to replay."""
        rows = padded(num_seqs)
        if k > KERNEL_MAX_K or rows > len(self._logits):
            return None
        return self._cached(("plain", rows, k, renderer is not None),
                            lambda: PlainStepGraph(self._xp, self._logits, rows, k, renderer))

    def _cached(self, key: tuple, make: Callable[[], Any]) -> Any:
        graph = self._graphs.get(key)
        if graph is None and len(self._graphs) < GRAPHS_CACHED:
            graph = self._graphs[key] = make()
            log.debug("logprob graphs for steps of shape %s", key)
            if len(self._graphs) == GRAPHS_CACHED:
                log.info("logprob graphs of %d step shapes captured: steps of other shapes run eagerly", GRAPHS_CACHED)
        return graph
