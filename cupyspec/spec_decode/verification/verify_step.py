"""A speculative step's verification together with its logprobs, in two host transfers.

On the GPU the log-softmax of the candidate rows runs on a second CUDA stream while the main
stream verifies; the fused accept-and-gather kernel joins them (cupyspec/logprobs/accept_gather.py).
Without a side stream (the CPU, or overlap turned off) the same work runs in sequence, and so does
a step over the forward graphs' logits, whose logprob work is replayed as a CUDA graph
(cupyspec/logprobs/graphs.py): there the graph's one launch costs the host less than the overlap's
calls would.
`launch_verify` queues all of it and the transfers, without waiting: first the verdict's, which
the engine needs to form the next step, then the logprobs', which it needs only to deliver this
one. `PendingVerdict.result` waits.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat
from typing import Any, NamedTuple, TypeVar

import numpy as np

from cupyspec.logprobs.accept_gather import (
    GatheredLogprobs,
    RowLogprobs,
    accept_and_gather,
    emitted_rows,
    gathered_on_host,
    rendered_on_host,
)
from cupyspec.logprobs.graphs import LogprobGraphs
from cupyspec.logprobs.layout import LogprobLayout, RequestWants, draft_offsets
from cupyspec.logprobs.logprob_json import LogprobRenderer, LogprobsJSON
from cupyspec.outputs import DraftLogprob, TokenLogprob
from cupyspec.spec_decode.verification.verify import VerifyInput, verify_on_device
from cupyspec.transfer import HostTransfer

T = TypeVar("T", bound=tuple)

LAYOUTS_CACHED = 64  # logprob layouts kept (`_layout`)
Wants = tuple[bool, ...]  # [B]: per request, whether it asked for something


@dataclass(frozen=True)
class LogprobRequests:
    """Per request [B]: how many top logprobs it wants (None: no token logprobs), draft logprobs,
    and whether its token logprobs come rendered as chat JSON entries instead of records (default: none)."""

    top_logprobs: tuple[int | None, ...]
    include_drafts: tuple[bool, ...]
    rendered: tuple[bool, ...] = ()  # [B] or empty

    # each read a few times a step: worked out once (a frozen dataclass lets cached_property write its __dict__)
    @functools.cached_property
    def any(self) -> bool:
        return any(k is not None for k in self.top_logprobs) or any(self.include_drafts)

    @functools.cached_property
    def max_top_logprobs(self) -> int:
        return max((k or 0) for k in self.top_logprobs)

    @functools.cached_property
    def renders(self) -> bool:
        """Whether some request's token logprobs come rendered."""
        return any(r and k is not None for k, r in zip(self.top_logprobs, self.rendered))

    @functools.cached_property
    def render_k(self) -> np.ndarray:
        """[B] int64: the top logprobs of each request whose entries are rendered, else -1 (read-only)."""
        rendered = self.rendered or (False,) * len(self.top_logprobs)
        render_k = np.array([(k or 0) if r and k is not None else -1 for k, r in zip(self.top_logprobs, rendered)],
                            dtype=np.int64)
        render_k.flags.writeable = False
        return render_k


class StepLogprobs(NamedTuple):
    """Per request [B], None where not asked: its token logprob records, or its rendered token
    entries, and its draft logprob records."""

    tokens: tuple[tuple[TokenLogprob, ...] | None, ...]
    rendered: tuple[LogprobsJSON | None, ...]
    drafts: tuple[tuple[DraftLogprob, ...] | None, ...]

    @classmethod
    def none(cls, num_seqs: int) -> StepLogprobs:
        return cls(*((None,) * num_seqs,) * 3)


@dataclass(frozen=True)
class StepVerdict:
    """Host results: each request's accepted drafts and emitted token, and its logprobs."""

    num_accepted: list[int]  # [B] drafts before the first rejection
    emitted: list[int]  # [B] the bonus or correction token after them
    logprobs: StepLogprobs
    drafts: np.ndarray | None = None  # [B, K] the drafts, when they were on the device only


class LogprobStream:
    """A CUDA stream for the log-softmax of a verifying step beside its verification, and the two
    events that join it to the main stream, made once: recording an event again costs the host
    less than making a new one."""

    def __init__(self, cuda: Any) -> None:
        self.stream = cuda.Stream(non_blocking=True)
        self.logits_ready = cuda.Event(disable_timing=True)
        self.rows_ready = cuda.Event(disable_timing=True)


class PendingVerdict:
    """A verification on its way to the host: the verdict in a transfer of its own, then the logprobs
    in another, so that the verdict, which the next step needs, does not wait for them."""

    def __init__(self, runs_on_device: Any, runs: HostTransfer, logprobs: HostTransfer | None = None,
                 records: Callable[[list[np.ndarray]], StepLogprobs] | None = None) -> None:
        """runs_on_device [2, B] int64: each request's accepted drafts and emitted token, which device
        work after verification reads (an MTP head); records: the host records from the host copies
        of the logprobs' arrays."""
        num_seqs = runs_on_device.shape[1]
        self.runs_on_device = runs_on_device
        self._runs, self._logprobs, self._records = runs, logprobs, records
        self._none = StepLogprobs.none(num_seqs)  # none asked, or not yet
        self._read: StepLogprobs | None = None

    def done(self) -> bool:
        """Whether the verdict is on the host (`result(logprobs=False)` would not wait)."""
        return self._runs.done()

    def result(self, logprobs: bool = True) -> StepVerdict:
        """The verdict, and the logprobs unless `logprobs` is False (then None each, until `logprobs()`)."""
        host = self._runs.result()[0]  # the runs [2, B], or the runs then the drafts [2B + B*K] when placeholders
        num_seqs = self.runs_on_device.shape[1]
        num_accepted, emitted = host[:2 * num_seqs].reshape(2, num_seqs).tolist()
        drafts = host[2 * num_seqs:].reshape(num_seqs, -1) if host.ndim == 1 else None
        return StepVerdict(num_accepted, emitted, self.logprobs() if logprobs else self._none, drafts)

    def transfers(self) -> tuple[HostTransfer, ...]:
        """Its copies to the host: the verdict's, then the logprobs' when there are any."""
        return (self._runs,) if self._logprobs is None else (self._runs, self._logprobs)

    def logprobs(self) -> StepLogprobs:
        """Each request's logprobs; waits for them."""
        if self._logprobs is None:
            return self._none
        if self._read is None:
            self._read = self._records(self._logprobs.result())
        return self._read


def launch_verify(xp: Any, logits: Any, inp: VerifyInput, wanted: LogprobRequests, strategy: str,
                  accept_policy: str, side: LogprobStream | None = None, renderer: LogprobRenderer | None = None,
                  graphs: LogprobGraphs | None = None, static_rows: np.ndarray | None = None) -> PendingVerdict:
    """Verify drafts of target logits [R, V] f32 and gather the logprobs `wanted` asks for, on the
    device, their host copies started (the verdict's first); nothing waits for the device.

    side: the CUDA stream for the log-softmax, overlapping verification; None runs in sequence.
    renderer: renders the entries of the requests `wanted.rendered` names.
    graphs: the logprob work as CUDA graphs over the forward graphs' static logits, in sequence
    (cupyspec/logprobs/graphs.py), for steps whose logits are there too: static_rows [B] int64 then
    gives the row there of each request's first draft (logits may be a gather of the static rows:
    in a step that also runs prompts, only some rows pick tokens).
    """
    if not wanted.any:
        verdict = verify_on_device(xp, logits, inp, strategy, accept_policy)
        packed = verdict.runs if verdict.runs_and_drafts is None else verdict.runs_and_drafts
        return PendingVerdict(verdict.runs, HostTransfer(xp, [packed]))
    wants = _wants(wanted)
    k = wanted.max_top_logprobs
    renderer = renderer if any(wants.rendered) else None
    graph = graphs.find_verifying(len(inp.num_drafts), inp.draft_token_ids.shape[1], k, renderer) \
        if graphs is not None and static_rows is not None else None
    slot = graph.free_slot() if graph is not None else None
    overlap = side is not None and slot is None
    if overlap:  # the log-softmax starts once the logits are there, beside verification
        side.stream.wait_event(xp.cuda.get_current_stream().record(side.logits_ready))
    on_device = verify_on_device(xp, logits, inp, strategy, accept_policy)
    if on_device.runs_and_drafts is not None:
        raise ValueError("logprobs of drafts need them on the host")
    runs = on_device.runs  # [2, B]
    verdict = HostTransfer(xp, [runs])
    if slot is not None:
        on_device = graph.on_device
        logprobs = graph.launch(slot, wants.fields, inp.draft_token_ids, inp.num_drafts, static_rows, runs)
    else:
        main_stream = xp.cuda.get_current_stream() if overlap else None
        layout = _layout(wanted, inp.num_drafts.tobytes())
        with side.stream if overlap else contextlib.nullcontext():
            on_device = layout.upload(xp, inp.draft_token_ids, inp.num_drafts)
            rows = RowLogprobs.compute(xp, logits, on_device.row_target, k)
        if overlap:
            main_stream.wait_event(side.stream.record(side.rows_ready))
        logprobs = HostTransfer(xp, [accept_and_gather(xp, logits, rows, on_device, runs, renderer)])

    def records(host_arrays: list[np.ndarray]) -> StepLogprobs:
        host = gathered_on_host(host_arrays[0], on_device, k)
        return StepLogprobs(_token_logprobs(host, wants.records, wanted.top_logprobs),
                            _rendered_entries(renderer, host, on_device.num_rows, wants.fields.render_k, k,
                                              wants.rendered, rendered_on_host(host_arrays[0], on_device, k)),
                            _draft_logprobs(host, wants.fields.drafts, inp, wants.drafts, wanted.top_logprobs))

    return PendingVerdict(runs, verdict, logprobs, records)


class StepWants(NamedTuple):
    """What the requests of a step ask: the layout's request fields, and per request [B] whether it
    gets token records, draft records and rendered token entries."""

    fields: RequestWants
    records: Wants
    drafts: Wants
    rendered: Wants


@functools.lru_cache(maxsize=LAYOUTS_CACHED)
def _wants(wanted: LogprobRequests) -> StepWants:
    """What the requests of `wanted` ask; cached apart from `_layout`, because requests change less
    often than the drafts: under load `_layout` misses its cache, this does not."""
    tokens = np.array([k is not None for k in wanted.top_logprobs])
    drafts = np.array(wanted.include_drafts)
    rendered = wanted.render_k >= 0
    return StepWants(RequestWants.of(tokens, drafts, wanted.render_k),
                     *(tuple(w.tolist()) for w in (tokens & ~rendered, drafts, rendered)))


@functools.lru_cache(maxsize=LAYOUTS_CACHED)
def _layout(wanted: LogprobRequests, num_drafts: bytes) -> LogprobLayout:
    """The logprob layout of a step whose requests ask `wanted` and verify num_drafts (int64 bytes)
    drafts each; read-only. Made once per such step, since at one sequence most steps repeat the
    step before and the launch of a verifying step is on the host's critical path."""
    counts = np.frombuffer(num_drafts, dtype=np.int64)  # [B]
    first_row = np.cumsum(counts + 1) - (counts + 1)  # [B]
    layout = LogprobLayout.build(first_row, counts, _wants(wanted).fields)
    for array in (layout.row_target, layout.row_seq, layout.row_pos, layout.draft_offset, layout.first_row):
        array.flags.writeable = False
    return layout


def _records(kind: type[T], *columns: list) -> tuple[T, ...]:
    """kind(*fields) for each row of the columns, made in C by `tuple.__new__`, which costs less
    than calling the named tuple (the engine makes one per emitted token and per draft)."""
    return tuple(map(tuple.__new__, repeat(kind), zip(*columns)))


def _top_rows(top_ids: list[list], top_lps: list[list], lo: int, hi: int, k: int) -> tuple[list, list]:
    """Rows lo..hi of the top ids and logprobs (lists of rows), each row's first k entries."""
    ids, lps = top_ids[lo:hi], top_lps[lo:hi]
    if ids and len(ids[0]) != k:
        return [row[:k] for row in ids], [row[:k] for row in lps]
    return ids, lps


def _token_logprobs(host: GatheredLogprobs, wants: Wants,
                    top_k: tuple[int | None, ...]) -> tuple[tuple[TokenLogprob, ...] | None, ...]:
    """Per request [B], its emitted tokens' logprobs (None where not asked)."""
    if not any(wants):
        return (None,) * len(wants)
    cu = host.cu_batch_token_offset.tolist()
    rows = cu[-1]  # the buffer holds a row per verified position; the emitted ones come first
    ids, lps = host.token_ids[:rows].tolist(), host.token_lps[:rows].tolist()
    top_ids, top_lps = host.token_top_ids[:rows].tolist(), host.token_top_lps[:rows].tolist()
    out: list[tuple[TokenLogprob, ...] | None] = []
    for b, want in enumerate(wants):
        lo, hi = cu[b], cu[b + 1]
        out.append(_records(TokenLogprob, ids[lo:hi], lps[lo:hi], *_top_rows(top_ids, top_lps, lo, hi, top_k[b] or 0))
                   if want else None)
    return tuple(out)


def _rendered_entries(renderer: LogprobRenderer | None, host: GatheredLogprobs, num_rows: int, render_k: np.ndarray,
                      k: int, rendered: Wants, entries: np.ndarray) -> tuple[LogprobsJSON | None, ...]:
    """Per request [B], its rendered token entries (None where not asked); entries: the host copy
    of the render (LogprobRenderer.render's output) of num_rows rows, render_k [B] as LogprobLayout's."""
    if not any(rendered):
        return (None,) * len(rendered)
    cu = host.cu_batch_token_offset.tolist()

    bounds = [rows if r else None for rows, r in zip(zip(cu, cu[1:]), rendered)]
    return tuple(renderer.entries(entries, num_rows, bounds, lambda: emitted_rows(host, render_k, k)))


def _draft_logprobs(host: GatheredLogprobs, wants_fields: np.ndarray, inp: VerifyInput, wants: Wants,
                    top_k: tuple[int | None, ...]) -> tuple[tuple[DraftLogprob, ...] | None, ...]:
    """Per request [B], its proposed drafts' logprobs and verdicts (None where not asked); wants_fields
    [B] int64: RequestWants.drafts."""
    if not any(wants):
        return (None,) * len(wants)
    num_drafts, num_accepted = inp.num_drafts.tolist(), host.runs[0].tolist()
    offsets = draft_offsets(inp.num_drafts, wants_fields).tolist()
    lps, top_ids, top_lps = host.draft_lps.tolist(), host.draft_top_ids.tolist(), host.draft_top_lps.tolist()
    out: list[tuple[DraftLogprob, ...] | None] = []
    for b, want in enumerate(wants):
        if not want:
            out.append(None)
            continue
        lo, n = offsets[b], num_drafts[b]
        model_lps = ([None] * n if inp.draft_logprobs is None else
                     [None if lp != lp else lp for lp in inp.draft_logprobs[b, :n].tolist()])  # NaN: none
        out.append(_records(DraftLogprob, inp.draft_token_ids[b, :n].tolist(), lps[lo:lo + n],
                            *_top_rows(top_ids, top_lps, lo, lo + n, top_k[b] or 0),
                            [j < num_accepted[b] for j in range(n)], model_lps))
    return tuple(out)
