"""A speculative step's verification together with its logprobs, with one host transfer.

On the GPU the log-softmax of the candidate rows runs on a second CUDA stream while the main
stream verifies; the fused accept-and-gather kernel joins them (cupyspec/spec/accept_gather.py).
Without a side stream (the CPU, or overlap turned off) the same work runs in sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cupyspec.outputs import DraftLogprob, TokenLogprob
from cupyspec.spec.accept_gather import LogprobLayout, RowLogprobs, accept_and_gather, fetch_gathered
from cupyspec.spec.verify import VerifyInput, VerifyOutput, verify_on_device


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
    """Host results: the verification and, per request, its token and draft logprobs (or None)."""

    verify: VerifyOutput
    token_logprobs: tuple[tuple[TokenLogprob, ...] | None, ...]  # [B]
    draft_logprobs: tuple[tuple[DraftLogprob, ...] | None, ...]  # [B]


def _pairs(ids: np.ndarray, lps: np.ndarray, k: int) -> tuple[tuple[int, float], ...]:
    return tuple(zip(ids[:k].astype(np.int64).tolist(), lps[:k].astype(np.float32).tolist()))


def verify_with_logprobs(xp: Any, logits: Any, inp: VerifyInput, wanted: LogprobRequests, strategy: str,
                         accept_policy: str, side_stream: Any | None = None) -> StepVerdict:
    """Verify drafts of target logits [R, V] f32 and gather the logprobs `wanted` asks for.

    side_stream: a CUDA stream for the log-softmax, overlapping verification; None runs in sequence.
    """
    batch = len(inp.num_drafts)
    if not wanted.any:
        verdict = verify_on_device(xp, logits, inp, strategy, accept_policy).to_host(xp, inp)
        return StepVerdict(verdict, (None,) * batch, (None,) * batch)
    wants_tokens = np.array([k is not None for k in wanted.top_logprobs])
    wants_drafts = np.array(wanted.include_drafts)
    first_row = np.concatenate([[0], np.cumsum(inp.num_drafts + 1)]).astype(np.int64)  # [B+1]
    layout = LogprobLayout.build(first_row, inp.num_drafts, wants_tokens, wants_drafts)
    k = max((k or 0) for k in wanted.top_logprobs)
    if side_stream is None:
        rows = RowLogprobs.compute(xp, logits, layout, k)
        device_verdict = verify_on_device(xp, logits, inp, strategy, accept_policy)
    else:
        main_stream = xp.cuda.get_current_stream()
        side_stream.wait_event(main_stream.record())  # the logits are ready
        with side_stream:
            rows = RowLogprobs.compute(xp, logits, layout, k)
            rows_ready = side_stream.record()
        device_verdict = verify_on_device(xp, logits, inp, strategy, accept_policy)
        main_stream.wait_event(rows_ready)
    gathered = accept_and_gather(xp, logits, rows, layout, inp.draft_token_ids, inp.num_drafts,
                                 device_verdict.num_accepted, device_verdict.emitted)
    (num_accepted, emitted, cu, token_ids, token_lps, token_top_ids, token_top_lps,
     draft_lps, draft_top_ids, draft_top_lps) = fetch_gathered(xp, gathered, device_verdict.num_accepted,
                                                               device_verdict.emitted)
    verdict = VerifyOutput.of(inp, num_accepted.astype(np.int64), emitted.astype(np.int64))
    token_logprobs: list[tuple[TokenLogprob, ...] | None] = []
    draft_logprobs: list[tuple[DraftLogprob, ...] | None] = []
    for b in range(batch):
        top_k = wanted.top_logprobs[b] or 0
        lo, hi = int(cu[b]), int(cu[b + 1])
        token_logprobs.append(tuple(
            TokenLogprob(int(token_ids[i]), float(np.float32(token_lps[i])), _pairs(token_top_ids[i], token_top_lps[i], top_k))
            for i in range(lo, hi)) if wants_tokens[b] else None)
        lo = int(layout.draft_offset[b])
        draft_logprobs.append(tuple(
            DraftLogprob(int(inp.draft_token_ids[b, j]), float(np.float32(draft_lps[lo + j])),
                         _pairs(draft_top_ids[lo + j], draft_top_lps[lo + j], top_k), bool(j < num_accepted[b]))
            for j in range(int(inp.num_drafts[b]))) if wants_drafts[b] else None)
    return StepVerdict(verdict, tuple(token_logprobs), tuple(draft_logprobs))
