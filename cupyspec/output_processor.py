"""From step results to what callers see: detokenize, apply stops, emit per-request deltas."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cupyspec.detokenizer import IncrementalDetokenizer
from cupyspec.metrics import EngineMetrics
from cupyspec.outputs import CompletionDelta, DraftLogprob, RequestOutput, SpeculateMetrics, TokenLogprob
from cupyspec.runner import SeqStepOutput
from cupyspec.scheduler import Scheduler, SchedulerOutput
from cupyspec.sequence import Sequence
from cupyspec.spec.stats import SpecStats


@dataclass(eq=False)
class RequestState:
    """A request's choices, their detokenizers and the queue its caller reads."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]
    arrival_time: float
    speculative: bool  # the engine speculates: the final output carries speculate_metrics
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    first_token_time: float | None = None
    num_output_tokens: int = 0
    prompt_logprobs_sent: bool = False
    finished: bool = False
    pending: list[CompletionDelta] = field(default_factory=list)


class OutputProcessor:
    """Owns the live requests; the engine loop feeds it each step's results."""

    def __init__(self, scheduler: Scheduler, metrics: EngineMetrics,
                 on_sequence_finished: Callable[[Sequence], None]) -> None:
        self.scheduler, self.metrics = scheduler, metrics
        self.on_sequence_finished = on_sequence_finished
        self.requests: dict[str, RequestState] = {}

    def add(self, request: RequestState) -> None:
        self.requests[request.request_id] = request
        for seq in request.seqs:
            self.scheduler.add(seq)
        self.metrics.on_request_arrived()

    def abort(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.is_finished:
                self._close(request, seq, "abort", request.detokenizers[seq.choice_index].flush())
        self._emit(request)

    def finish_ended_by_scheduler(self, seqs: tuple[Sequence, ...]) -> None:
        """Sequences the scheduler ended (the KV pool cannot hold them) finish with "length"."""
        for seq in seqs:
            request = self.requests.get(seq.request_id)
            if request is not None:
                request.pending.append(CompletionDelta(seq.choice_index, request.detokenizers[seq.choice_index].flush(),
                                                       (), None, "length"))
                self.on_sequence_finished(seq)
                self._emit(request)

    def fail_all(self, error: BaseException) -> None:
        for request in self.requests.values():
            request.queue.put_nowait(error)
        self.requests.clear()

    def process_step(self, sched: SchedulerOutput, outputs: list[SeqStepOutput]) -> None:
        """Append the emitted tokens, stop where a stop condition says, then advance the scheduler."""
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        accepted_drafts = []
        for item, out in zip(sched.scheduled, outputs):
            seq = item.seq
            request = self.requests.get(seq.request_id)
            accepted_drafts.append(max(0, len(out.token_ids) - 1))
            if request is None or seq.is_finished:
                continue
            if request.prompt_logprobs is not None:
                for position, lp in out.prompt_logprobs:
                    request.prompt_logprobs[position] = lp
            if out.token_ids:
                self._append(request, seq, out, is_decode=item.num_computed_before >= seq.num_prompt_tokens, now=now)
                touched[request.request_id] = request
        self.scheduler.update_after_step(sched, accepted_drafts)
        for request in touched.values():
            self._emit(request)

    def _append(self, request: RequestState, seq: Sequence, out: SeqStepOutput, is_decode: bool, now: float) -> None:
        detok = request.detokenizers[seq.choice_index]
        delta = detok.add(list(out.token_ids))
        kept = out.token_ids[:delta.num_tokens_accepted]  # a stop inside an accepted run cuts it
        seq.output_token_ids.extend(kept)
        if is_decode and request.speculative:
            seq.spec.record(out.accepted, len(kept))
        request.num_output_tokens += len(kept)
        self.metrics.on_generation_tokens(len(kept))
        if request.first_token_time is None:
            request.first_token_time = now
            self.metrics.observe_ttft(now - request.arrival_time)
        logprobs = out.logprobs[:len(kept)] if seq.params.logprobs is not None else None
        drafts = (out.draft_logprobs or ()) if seq.params.include_draft_logprobs else None
        if delta.finish_reason is not None:
            self._close(request, seq, delta.finish_reason, delta.text, kept, logprobs, delta.stop_reason, drafts)
        else:
            request.pending.append(CompletionDelta(seq.choice_index, delta.text, kept, logprobs, draft_logprobs=drafts))

    def _close(self, request: RequestState, seq: Sequence, reason: str, text: str, tokens: tuple[int, ...] = (),
               logprobs: tuple[TokenLogprob, ...] | None = None, stop_reason: str | int | None = None,
               draft_logprobs: tuple[DraftLogprob, ...] | None = None) -> None:
        self.scheduler.finish(seq, reason)
        seq.stop_reason = stop_reason
        request.pending.append(CompletionDelta(seq.choice_index, text, tokens, logprobs, reason, stop_reason,
                                               draft_logprobs))
        self.on_sequence_finished(seq)

    def _emit(self, request: RequestState) -> None:
        """Send the pending deltas of a request as one RequestOutput."""
        finished = all(seq.is_finished for seq in request.seqs)
        prompt_lps = None
        if request.prompt_logprobs is not None and not request.prompt_logprobs_sent and request.pending:
            prompt_lps, request.prompt_logprobs_sent = tuple(request.prompt_logprobs), True
        spec = None
        if finished and request.speculative:
            total = SpecStats()
            for seq in request.seqs:
                total.add(seq.spec)
            spec = SpeculateMetrics.from_stats(total)
        request.queue.put_nowait(RequestOutput(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            deltas=tuple(request.pending), num_prompt_tokens=len(request.prompt_token_ids),
            num_output_tokens=request.num_output_tokens, finished=finished, prompt_logprobs=prompt_lps,
            speculate_metrics=spec))
        request.pending = []
        if finished:
            request.finished = True
            del self.requests[request.request_id]
            self._account_finished(request, spec)

    def _account_finished(self, request: RequestState, spec: SpeculateMetrics | None) -> None:
        now = time.monotonic()
        self.metrics.on_prompt_tokens(len(request.prompt_token_ids))
        self.metrics.observe_e2e_latency(now - request.arrival_time)
        per_choice = request.num_output_tokens / len(request.seqs)
        if request.first_token_time is not None and per_choice > 1:
            self.metrics.observe_time_per_output_token((now - request.first_token_time) / (per_choice - 1))
        for seq in request.seqs:
            self.metrics.on_request_finished(seq.finish_reason or "abort")
        if spec is not None:
            self.metrics.on_speculation(spec)
