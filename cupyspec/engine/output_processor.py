"""From step results to what callers see: detokenize, apply stops, emit per-request deltas."""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass, field

from cupyspec.engine.request_stream import OutputChannel
from cupyspec.engine.step_outputs import SeqStepOutput
from cupyspec.logprobs.logprob_json import LogprobsJSON
from cupyspec.metrics import EngineMetrics
from cupyspec.outputs import CompletionDelta, DraftLogprob, RequestOutput, SpeculateMetrics, TokenLogprob, merge_deltas
from cupyspec.sampling.params import SamplingParams
from cupyspec.scheduling.scheduler import Scheduler, SchedulerOutput
from cupyspec.scheduling.sequence import Sequence
from cupyspec.spec_decode.stats import SpecStats
from cupyspec.text.detokenizer import IncrementalDetokenizer


@dataclass(eq=False)
class RequestState:
    """A request's choices, their detokenizers and the channel its caller reads."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]
    arrival_time: float
    speculative: bool  # the engine speculates: the final output carries speculate_metrics
    channel: OutputChannel = field(default_factory=OutputChannel)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    first_token_time: float | None = None
    num_output_tokens: int = 0
    num_sent_tokens: int = 0  # output tokens delivered to the caller
    prompt_logprobs_sent: bool = False
    choice_ended: bool = False  # a choice finished since the last delivery
    finished: bool = False
    pending: list[CompletionDelta] = field(default_factory=list)

    def due(self, stream_interval: int) -> bool:
        """Whether to deliver now: the first tokens, a choice that ended, or `stream_interval` tokens held."""
        return (self.choice_ended or not self.num_sent_tokens
                or self.num_output_tokens - self.num_sent_tokens >= stream_interval)

    @property
    def all_choices_finished(self) -> bool:
        for seq in self.seqs:
            if not seq.is_finished:
                return False
        return True


class OutputProcessor:
    """Owns the live requests; the engine loop feeds it each step's results.

    A request's outputs go to its caller every `stream_interval` output tokens (all its choices
    together), and at once for its first tokens and whenever a choice ends; a delivery holds one
    delta per choice that moved.
    """

    def __init__(self, scheduler: Scheduler, metrics: EngineMetrics,
                 on_sequence_finished: Callable[[Sequence], None], stream_interval: int = 1) -> None:
        self.scheduler, self.metrics = scheduler, metrics
        self.on_sequence_finished = on_sequence_finished
        self.stream_interval = stream_interval
        self.requests: dict[str, RequestState] = {}
        self.num_penalized = 0  # live requests with penalties, which read their output tokens on the host
        self.num_verified_on_host = 0  # live requests whose verification reads their drafts on the host

    def add(self, request: RequestState, queued: bool = True) -> None:
        """Track a request; queued: its sequences wait in the scheduler (else the caller places them)."""
        self.requests[request.request_id] = request
        for seq in request.seqs if queued else ():
            self.scheduler.add(seq)
        self.num_penalized += request.seqs[0].params.has_penalties
        self.num_verified_on_host += _verified_on_host(request.seqs[0].params)
        self.metrics.on_request_arrived()

    @staticmethod
    def hold_places(sched: SchedulerOutput, owners: tuple[int, ...], placeholders: Sequence_[int],
                    num_drafts: Sequence_[int]) -> None:
        """Append to each sampling sequence s of a launched step, scheduled at owners[s], the
        placeholder id of the token the step emits for it, which is still on the device
        (cupyspec/model/device_tokens.py); num_drafts[s]: the drafts the step verifies for it, which
        may come before that token. process_step(held=True) puts the tokens there."""
        for s, i in enumerate(owners):
            seq = sched.scheduled[i].seq
            seq.output_token_ids.append(placeholders[s])
            seq.num_held_drafts += num_drafts[s]

    def place_tokens(self, sched: SchedulerOutput, outputs: list[SeqStepOutput]) -> bool:
        """Append each sequence's emitted tokens ahead of process_step(placed=True), which detokenizes
        them, cuts them at a stop string and delivers them: so that the next step can be formed and
        launched first. Not when a stop token or the length limit ends a sequence in this step (the
        next step would carry it for nothing): then it places nothing and returns False."""
        pairs = [(item.seq, out.token_ids) for item, out in zip(sched.scheduled, outputs)
                 if out.token_ids and not item.seq.is_finished and item.seq.request_id in self.requests]
        for seq, token_ids in pairs:
            if self.requests[seq.request_id].detokenizers[seq.choice_index].may_end_within(token_ids):
                return False
        for seq, token_ids in pairs:
            seq.output_token_ids.extend(token_ids)
            seq.num_placed_tokens = len(token_ids)
        return True

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
            request.channel.put(error)
        self.requests.clear()
        self.num_penalized = self.num_verified_on_host = 0

    def process_step(self, sched: SchedulerOutput, outputs: list[SeqStepOutput], placed: bool = False,
                     held: bool = False) -> None:
        """Append the emitted tokens, stop where a stop condition says, and deliver what is due.

        placed: the step's tokens are in the sequences' outputs already (`place_tokens`); held: each
        sequence's first placeholder (`hold_places`) stands for them. A stop cuts them there.
        """
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        num_generated = 0
        for item, out in zip(sched.scheduled, outputs):
            if not (out.token_ids or out.prompt_logprobs):  # a prefill chunk: nothing to record
                continue
            seq = item.seq
            request = self.requests.get(seq.request_id)
            if request is None or seq.is_finished:
                continue
            for position, lp in out.prompt_logprobs:
                request.prompt_logprobs[position] = lp
            if out.token_ids:
                place = None  # where the step's tokens go: (index, entries they replace); None: appended
                if held:
                    place = seq.first_held_place, 1
                    seq.num_held_drafts -= out.num_drafts
                elif placed:
                    place = item.num_tokens_before - seq.num_prompt_tokens, len(out.token_ids)
                num_generated += self._append(request, seq, out, item.num_computed_before >= seq.num_prompt_tokens, now,
                                              place)
                touched[seq.request_id] = request
        self.metrics.on_generation_tokens(num_generated)
        for request in touched.values():
            if request.due(self.stream_interval):
                self._emit(request)

    def _append(self, request: RequestState, seq: Sequence, out: SeqStepOutput, is_decode: bool, now: float,
                place: tuple[int, int] | None) -> int:
        """Add a step's tokens to a choice, up to a stop; the number kept. place: the index in its
        output tokens where the step's tokens (or their placeholder) were put and how many entries
        they take there, or None to append."""
        delta = request.detokenizers[seq.choice_index].add(out.token_ids)
        kept = out.token_ids[:delta.num_tokens_accepted]  # a stop inside an accepted run cuts it
        if place is None:
            seq.output_token_ids.extend(kept)
        else:
            index, entries = place
            seq.output_token_ids[index:index + entries] = kept
            seq.num_placed_tokens = 0
        if is_decode and request.speculative:
            seq.spec.record(out.accepted, len(kept))
        request.num_output_tokens += len(kept)
        if request.first_token_time is None:
            request.first_token_time = now
            self.metrics.observe_ttft(now - request.arrival_time)
        params = seq.params
        logprobs = out.logprobs[:len(kept)] if out.logprobs is not None else None
        rendered = out.logprobs_json.head(len(kept)) if out.logprobs_json is not None else None
        drafts = (out.draft_logprobs or ()) if params.include_draft_logprobs else None
        if delta.finish_reason is not None:
            self._close(request, seq, delta.finish_reason, delta.text, kept, logprobs, delta.stop_reason, drafts,
                        rendered)
        else:
            request.pending.append(CompletionDelta(seq.choice_index, delta.text, kept, logprobs, None, None, drafts,
                                                   rendered))
        return len(kept)

    def _close(self, request: RequestState, seq: Sequence, reason: str, text: str, tokens: tuple[int, ...] = (),
               logprobs: tuple[TokenLogprob, ...] | None = None, stop_reason: str | int | None = None,
               draft_logprobs: tuple[DraftLogprob, ...] | None = None, logprobs_json: LogprobsJSON | None = None,
               ) -> None:
        self.scheduler.finish(seq, reason)
        seq.stop_reason = stop_reason
        while seq.awaits_token:  # places held for tokens it will not get
            seq.output_token_ids.pop()
        seq.num_held_drafts = 0
        request.pending.append(CompletionDelta(seq.choice_index, text, tokens, logprobs, reason, stop_reason,
                                               draft_logprobs, logprobs_json))
        request.choice_ended = True
        self.on_sequence_finished(seq)

    def _emit(self, request: RequestState) -> None:
        """Deliver the pending deltas of a request as one RequestOutput."""
        finished = request.all_choices_finished
        prompt_lps = None
        if request.prompt_logprobs is not None and not request.prompt_logprobs_sent and request.pending:
            prompt_lps, request.prompt_logprobs_sent = tuple(request.prompt_logprobs), True
        spec = None
        if finished and request.speculative:
            total = SpecStats()
            for seq in request.seqs:
                total.add(seq.spec)
            spec = SpeculateMetrics.from_stats(total)
        request.channel.put(RequestOutput(
            request.request_id, request.prompt_token_ids, merge_deltas(request.pending),
            len(request.prompt_token_ids), request.num_output_tokens, finished, prompt_lps, spec))
        request.pending.clear()
        request.num_sent_tokens = request.num_output_tokens
        request.choice_ended = False
        if finished:
            request.finished = True
            del self.requests[request.request_id]
            self.num_penalized -= request.seqs[0].params.has_penalties
            self.num_verified_on_host -= _verified_on_host(request.seqs[0].params)
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


def _verified_on_host(params: SamplingParams) -> bool:
    """Whether verifying a request's drafts reads them on the host: it samples at random (the draft
    tests), or asks for logprobs (their layout); only greedy rows verify drafts still on the device."""
    return not params.greedy or params.logprobs is not None or params.include_draft_logprobs
