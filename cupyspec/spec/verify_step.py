"""A speculative step's verification together with its logprobs, in two host transfers.

On the GPU the log-softmax of the candidate rows runs on a second CUDA stream while the main
stream verifies; the fused accept-and-gather kernel joins them (cupyspec/spec/accept_gather.py).
Without a side stream (the CPU, or overlap turned off) the same work runs in sequence.
`launch_verify` queues all of it and the transfers, without waiting: first the verdict's, which
the engine needs to form the next step, then the logprobs', which it needs only to deliver this
one. `PendingVerdict.result` waits.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from cupyspec.outputs import DraftLogprob, TokenLogprob
from cupyspec.spec.accept_gather import (GatheredLogprobs, LogprobLayout, RowLogprobs, accept_and_gather,
                                         gathered_on_host)
from cupyspec.spec.verify import VerifyInput, verify_on_device
from cupyspec.transfer import HostTransfer

LAYOUTS_CACHED = 64  # logprob layouts kept (`_layout`)


@dataclass(frozen=True)
class LogprobRequests:
    """Per request [B]: how many top logprobs it wants (None: no token logprobs), and draft logprobs."""

    top_logprobs: tuple[int | None, ...]
    include_drafts: tuple[bool, ...]

    @property
    def any(self) -> bool:
        return any(k is not None for k in self.top_logprobs) or any(self.include_drafts)


@dataclass(frozen=True)
class StepVerdict:
    """Host results: each request's accepted drafts and emitted token, and its token and draft
    logprobs (or None)."""

    num_accepted: list[int]  # [B] drafts before the first rejection
    emitted: list[int]  # [B] the bonus or correction token after them
    token_logprobs: tuple[tuple[TokenLogprob, ...] | None, ...]  # [B]
    draft_logprobs: tuple[tuple[DraftLogprob, ...] | None, ...]  # [B]


class PendingVerdict:
    """A verification on its way to the host: the verdict in a transfer of its own, then the logprobs
    in another, so that the verdict, which the next step needs, does not wait for them."""

    def __init__(self, num_seqs: int, runs: HostTransfer, logprobs: HostTransfer | None = None,
                 records: Callable[[np.ndarray], tuple[tuple, tuple]] | None = None) -> None:
        """records: the host records (token logprobs, draft logprobs) [B] each from the logprobs' buffer."""
        self._runs, self._logprobs, self._records = runs, logprobs, records
        self._none = ((None,) * num_seqs,) * 2  # (token logprobs, draft logprobs): none asked, or not yet

    def done(self) -> bool:
        """Whether the verdict is on the host (`result(logprobs=False)` would not wait)."""
        return self._runs.done()

    def result(self, logprobs: bool = True) -> StepVerdict:
        """The verdict, and the logprobs unless `logprobs` is False (then None each, until `logprobs()`)."""
        num_accepted, emitted = self._runs.result()[0].tolist()
        token_lps, draft_lps = self.logprobs() if logprobs else self._none
        return StepVerdict(num_accepted, emitted, token_lps, draft_lps)

    def logprobs(self) -> tuple[tuple[tuple[TokenLogprob, ...] | None, ...],
                                tuple[tuple[DraftLogprob, ...] | None, ...]]:
        """Per request [B], its token logprobs and its draft logprobs (None where not asked); waits for them."""
        if self._logprobs is None:
            return self._none
        return self._records(self._logprobs.result()[0])


def launch_verify(xp: Any, logits: Any, inp: VerifyInput, wanted: LogprobRequests, strategy: str,
                  accept_policy: str, side_stream: Any | None = None) -> PendingVerdict:
    """Verify drafts of target logits [R, V] f32 and gather the logprobs `wanted` asks for, on the
    device, their host copies started (the verdict's first); nothing waits for the device.

    side_stream: a CUDA stream for the log-softmax, overlapping verification; None runs in sequence.
    """
    if not wanted.any:
        runs = verify_on_device(xp, logits, inp, strategy, accept_policy).runs  # [2, B]
        return PendingVerdict(len(inp.num_drafts), HostTransfer(xp, [runs]))
    layout, wants_tokens, wants_drafts = _layout(wanted, inp.num_drafts.tobytes())
    k = max((k or 0) for k in wanted.top_logprobs)
    if side_stream is None:
        runs = verify_on_device(xp, logits, inp, strategy, accept_policy).runs  # [2, B]
        verdict = HostTransfer(xp, [runs])
        on_device = layout.upload(xp, inp.draft_token_ids, inp.num_drafts)
        rows = RowLogprobs.compute(xp, logits, on_device.row_target, k)
    else:
        main_stream = xp.cuda.get_current_stream()
        side_stream.wait_event(main_stream.record(xp.cuda.Event(disable_timing=True)))  # the logits are ready
        runs = verify_on_device(xp, logits, inp, strategy, accept_policy).runs  # [2, B]
        verdict = HostTransfer(xp, [runs])
        with side_stream:
            on_device = layout.upload(xp, inp.draft_token_ids, inp.num_drafts)
            rows = RowLogprobs.compute(xp, logits, on_device.row_target, k)
            rows_ready = side_stream.record(xp.cuda.Event(disable_timing=True))
        main_stream.wait_event(rows_ready)
    buffer = accept_and_gather(xp, logits, rows, on_device, runs)

    def records(host_buffer: np.ndarray) -> tuple[tuple, tuple]:
        host = gathered_on_host(host_buffer, on_device, k)
        return (_token_logprobs(host, wants_tokens, wanted.top_logprobs),
                _draft_logprobs(host, layout, inp, wants_drafts, wanted.top_logprobs))

    return PendingVerdict(len(inp.num_drafts), verdict, HostTransfer(xp, [buffer]), records)


@functools.lru_cache(maxsize=LAYOUTS_CACHED)
def _layout(wanted: LogprobRequests, num_drafts: bytes) -> tuple[LogprobLayout, np.ndarray, np.ndarray]:
    """The logprob layout of a step whose requests ask `wanted` and verify num_drafts (int64 bytes)
    drafts each, with the wants [B] bool of tokens and of drafts; read-only. Made once per such
    step: at one sequence most steps repeat the step before, and building it took some 80 µs of
    NumPy calls on the H100's host (the launch of a verifying step is on the host's critical path)."""
    counts = np.frombuffer(num_drafts, dtype=np.int64)  # [B]
    wants_tokens = np.array([k is not None for k in wanted.top_logprobs])
    wants_drafts = np.array(wanted.include_drafts)
    first_row = np.concatenate([[0], np.cumsum(counts + 1)]).astype(np.int64)  # [B+1]
    layout = LogprobLayout.build(first_row, counts, wants_tokens, wants_drafts)
    for array in (wants_tokens, wants_drafts, *(getattr(layout, f.name) for f in dataclasses.fields(layout))):
        array.flags.writeable = False
    return layout, wants_tokens, wants_drafts


def verify_with_logprobs(xp: Any, logits: Any, inp: VerifyInput, wanted: LogprobRequests, strategy: str,
                         accept_policy: str, side_stream: Any | None = None) -> StepVerdict:
    """launch_verify, waited for."""
    return launch_verify(xp, logits, inp, wanted, strategy, accept_policy, side_stream).result()


def _first(rows: list[list], k: int) -> list[list]:
    """Each row's first k entries."""
    return [row[:k] for row in rows]


def _token_logprobs(host: GatheredLogprobs, wants: np.ndarray,
                    top_k: tuple[int | None, ...]) -> tuple[tuple[TokenLogprob, ...] | None, ...]:
    """Per request [B], its emitted tokens' logprobs (None where not asked)."""
    if not wants.any():
        return (None,) * len(wants)
    cu = host.cu_batch_token_offset.tolist()
    ids, lps = host.token_ids.tolist(), host.token_lps.tolist()
    top_ids, top_lps = host.token_top_ids.tolist(), host.token_top_lps.tolist()
    out: list[tuple[TokenLogprob, ...] | None] = []
    for b, want in enumerate(wants.tolist()):
        lo, hi = cu[b], cu[b + 1]
        k = top_k[b] or 0
        out.append(tuple(map(TokenLogprob, ids[lo:hi], lps[lo:hi], _first(top_ids[lo:hi], k),
                             _first(top_lps[lo:hi], k))) if want else None)
    return tuple(out)


def _draft_logprobs(host: GatheredLogprobs, layout: LogprobLayout, inp: VerifyInput, wants: np.ndarray,
                    top_k: tuple[int | None, ...]) -> tuple[tuple[DraftLogprob, ...] | None, ...]:
    """Per request [B], its proposed drafts' logprobs and verdicts (None where not asked)."""
    if not wants.any():
        return (None,) * len(wants)
    offsets, num_drafts, num_accepted = layout.draft_offset.tolist(), inp.num_drafts.tolist(), host.runs[0].tolist()
    lps, top_ids, top_lps = host.draft_lps.tolist(), host.draft_top_ids.tolist(), host.draft_top_lps.tolist()
    out: list[tuple[DraftLogprob, ...] | None] = []
    for b, want in enumerate(wants.tolist()):
        if not want:
            out.append(None)
            continue
        lo, n, k = offsets[b], num_drafts[b], top_k[b] or 0
        out.append(tuple(map(DraftLogprob, inp.draft_token_ids[b, :n].tolist(), lps[lo:lo + n],
                             _first(top_ids[lo:lo + n], k), _first(top_lps[lo:lo + n], k),
                             [j < num_accepted[b] for j in range(n)])))
    return tuple(out)
