"""Continuous batching: which sequences run in the next step, and with how many tokens."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass
from typing import NamedTuple

from cupyspec.config import SchedulerConfig
from cupyspec.scheduling.block_manager import BlockManager
from cupyspec.scheduling.sequence import Sequence, SequenceStatus


class ScheduledSeq(NamedTuple):
    """One sequence's share of a step, captured when the step was formed (a tuple: one is made per
    sequence and step)."""

    seq: Sequence
    num_new_tokens: int  # tokens of seq.token_ids computed this step
    num_computed_before: int  # seq.num_computed_tokens when scheduled: the segment's start position
    num_tokens_before: int  # seq.num_tokens when scheduled
    num_lookahead_tokens: int = 0  # extra KV slots reserved past the sequence's tokens (drafts)

    @property
    def samples(self) -> bool:
        """The segment reaches the sequence's last token, so this step yields its next token."""
        return self.num_computed_before + self.num_new_tokens == self.num_tokens_before

    @property
    def token_ids(self) -> list[int]:
        return self.seq.tokens(self.num_computed_before, self.num_computed_before + self.num_new_tokens)


@dataclass(frozen=True)
class SchedulerOutput:
    """The batch of one step."""

    scheduled: tuple[ScheduledSeq, ...]
    preempted: tuple[Sequence, ...]  # back in the waiting queue, their KV freed
    finished: tuple[Sequence, ...] = ()  # ended by the scheduler (KV pool exhausted: "length")

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_lookahead_tokens for s in self.scheduled)


class Scheduler:
    """FCFS continuous batching with chunked prefill, prefix caching and preemption by recompute.

    Running sequences are served first, in arrival order; when KV blocks run out the latest
    arrival is preempted. Waiting sequences are then admitted in order while slots, tokens
    and blocks last; the head of the queue is never skipped.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 head_lookahead: int = 0, graph_rows: int = 0, graph_logit_rows: int = 0) -> None:
        """head_lookahead: KV slots reserved past each sampling segment, within the context length,
        for the positions an MTP head's drafting steps write. graph_rows: the most rows a step may
        have and still replay a CUDA graph (0: no graphs); graph_logit_rows: the most rows of logits
        it may ask for (0: any); see `_fit_graph`."""
        if max_model_len < 1:
            raise ValueError("max_model_len must be at least 1")
        self.head_lookahead, self.graph_rows, self.graph_logit_rows = head_lookahead, graph_rows, graph_logit_rows
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # arrival order
        # decode role: sequences whose prompt's K/V is on its way (`receiving`), then here (`arrived`,
        # each running once a slot is free, ahead of the waiting ones)
        self.receiving: list[Sequence] = []
        self.arrived: deque[Sequence] = deque()
        self.num_preemptions = 0

    @property
    def max_tokens_per_seq(self) -> int:
        """The most positions one sequence's KV can ever occupy: the whole pool."""
        return self.block_manager.num_blocks * self.block_manager.block_size

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.arrived)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence behind every waiting one."""
        if seq.status is not SequenceStatus.WAITING or seq.block_ids or seq.num_computed_tokens:
            raise ValueError("only a new, waiting sequence without KV can be added")
        limit = min(self.max_tokens_per_seq, self.max_model_len)
        if not 1 <= seq.num_tokens <= limit:
            raise ValueError(f"prompt_token_ids must hold 1 to {limit} tokens, not {seq.num_tokens}")
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq`: free its KV and drop it from the queues. Finishing twice does nothing."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq in self.receiving:  # its blocks are being written: `end_transfer` frees them
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
            return
        else:
            self.arrived.remove(seq)
        if seq.keep_prompt_kv and reason != "abort" and seq.num_computed_tokens >= seq.num_prompt_tokens:
            bm = self.block_manager
            seq.kept_blocks = bm.hold(seq.block_ids[:bm.blocks_for(seq.num_prompt_tokens)])
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort(self, seq: Sequence) -> None:
        self.finish(seq, "abort")

    def reserve_prefilled(self, seq: Sequence) -> int | None:
        """Decode role: blocks for the prompt of a new sequence whose K/V a prefill server computed (its
        first token in its output): the cached prefix's, and fresh ones for the rest, which the
        transfer fills from the returned index of `seq.block_ids` on; None when the pool is short."""
        if seq.status is not SequenceStatus.WAITING or seq.block_ids:
            raise ValueError("only a new sequence without KV can receive its prompt's")
        self.block_manager.allocate_for_prefill(seq)
        if not self.block_manager.ensure_slots(seq, seq.num_prompt_tokens - seq.num_computed_tokens):
            self.block_manager.cancel_prefill(seq)
            return None
        seq.status = SequenceStatus.RECEIVING
        self.receiving.append(seq)
        return seq.num_computed_tokens // self.block_manager.block_size

    def end_transfer(self, seq: Sequence, ok: bool) -> None:
        """The transfer into the blocks of `seq` has ended: on success it runs from its first token on
        (once a slot is free); else, or if it finished meanwhile, its blocks are freed, and a failed
        one waits to be computed here from its first token (`add`)."""
        self.receiving.remove(seq)
        if ok and not seq.is_finished:
            seq.num_computed_tokens = seq.num_prompt_tokens
            self.block_manager.commit(seq)
            self.arrived.append(seq)
            return
        self.block_manager.free(seq)
        if not seq.is_finished:
            seq.status = SequenceStatus.WAITING
            self.waiting.append(seq)

    def admit_arrived(self) -> None:
        """Sequences whose prompt's K/V has arrived join the running ones while there is room: before
        the drafter plans a step (and at `schedule`), so that they draft in their first step here as
        a sequence prefilled here does in its second."""
        while self.arrived and len(self.running) < self.config.max_num_seqs:
            seq = self.arrived.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)

    def num_lookahead_tokens(self, seq: Sequence) -> int:
        """KV slots to reserve past the last token of a sequence that samples: its drafts."""
        return len(seq.draft_token_ids)

    def schedule(self) -> SchedulerOutput:
        """Form the next step's batch within the token budget, the sequence limit and the KV pool."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        finished: list[Sequence] = []

        self.admit_arrived()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_tokens + seq.num_held_drafts >= seq.max_total_tokens:
                i += 1  # its last tokens are still on the device, and may be its last ones
                continue
            item = self._try_schedule(seq, budget)
            while item is None:
                if len(self.running) == 1:  # alone and still short: the pool cannot hold it
                    if not (seq.awaits_token or seq.num_placed_tokens):  # (else it ends once they are in)
                        self.finish(seq, "length")
                        finished.append(seq)
                    break
                victim = self.running.pop()  # the latest arrival
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
                item = self._try_schedule(seq, budget)
            if item is None:
                if seq.status is SequenceStatus.RUNNING:  # it waits for its last token
                    i += 1
                continue  # else `seq` left the running list
            scheduled.append(item)
            budget -= item.num_new_tokens + item.num_lookahead_tokens
            i += 1

        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            if seq.awaits_token:  # preempted with a step in flight: its tokens are not all known yet
                break
            self.block_manager.allocate_for_prefill(seq)
            item = self._try_schedule(seq, budget)
            if item is None:  # short of blocks: the head waits, nobody overtakes it
                self.block_manager.cancel_prefill(seq)
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(item)
            budget -= item.num_new_tokens + item.num_lookahead_tokens

        return SchedulerOutput(self._fit_graph(scheduled), tuple(preempted), tuple(finished))

    def _fit_graph(self, scheduled: list[ScheduledSeq]) -> tuple[ScheduledSeq, ...]:
        """The step with fewer drafts where its tokens fit a CUDA graph and its drafts would push it
        past, in rows or in rows of logits (one a sequence at most, and one a draft): an eager step
        costs the host the launches of every kernel, more than verifying the drafts gains. Each
        sequence keeps up to a common number of drafts, the first ones one more while rows are left;
        the KV slots reserved for the others stay with their sequences."""
        drafts = [item.num_lookahead_tokens for item in scheduled]
        room = self.graph_rows - sum(item.num_new_tokens for item in scheduled)
        if self.graph_logit_rows:
            room = min(room, self.graph_logit_rows - len(scheduled))
        if not self.graph_rows or room < 0 or sum(drafts) <= room:
            return tuple(scheduled)
        kept = 0  # drafts each sequence keeps, at most
        while sum(min(d, kept + 1) for d in drafts) <= room:
            kept += 1
        spare = room - sum(min(d, kept) for d in drafts)
        fitted = []
        for item, d in zip(scheduled, drafts):
            k = min(d, kept + (d > kept and spare > 0))
            spare -= k > kept
            fitted.append(item if k == d else item._replace(num_lookahead_tokens=k))
        return tuple(fitted)

    def on_launched(self, output: SchedulerOutput) -> None:
        """The step is on the device: count its segments as computed (later steps queue behind them)."""
        for item in output.scheduled:
            seq = item.seq
            if seq.num_computed_tokens != item.num_computed_before:
                raise RuntimeError(f"sequence {seq.seq_id} changed progress before its step was launched")
            seq.num_computed_tokens += item.num_new_tokens

    def update_after_step(self, output: SchedulerOutput, num_accepted_drafts: Sequence_[int] = ()) -> None:
        """Count the step's accepted drafts as computed and cache the blocks the step filled.

        `num_accepted_drafts[i]` (aligned with output.scheduled; default 0) counts the drafts of
        sequence i whose K/V stay: the engine has appended them to the sequence's tokens. The K/V
        of rejected drafts is dropped: whole blocks past the computed tokens go back to the pool.
        Sequences that finished, or were preempted, since the step was formed are left alone.
        """
        for i, item in enumerate(output.scheduled):
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if num_accepted_drafts:
                seq.num_computed_tokens += num_accepted_drafts[i]
            if item.num_lookahead_tokens and not seq.awaits_token:  # (else a step in flight writes past it)
                self.block_manager.truncate(seq, seq.num_computed_tokens)
            self.block_manager.commit(seq)

    def check_invariants(self) -> None:
        """Raise AssertionError if the queues or the KV books are inconsistent."""
        if len(self.running) > self.config.max_num_seqs:
            raise AssertionError("more running sequences than max_num_seqs")
        if any(s.status is not SequenceStatus.RUNNING for s in self.running):
            raise AssertionError("a non-running sequence is in the running list")
        if any(s.status is not SequenceStatus.WAITING or s.block_ids for s in self.waiting):
            raise AssertionError("a waiting sequence is not waiting or holds KV blocks")
        self.block_manager.check_invariants([*self.running, *self.receiving, *self.arrived])

    def _try_schedule(self, seq: Sequence, budget: int) -> ScheduledSeq | None:
        """Reserve KV for the next segment of `seq` within `budget` tokens; None if blocks are short."""
        num_tokens = seq.num_tokens
        num_uncomputed = num_tokens - seq.num_computed_tokens
        if num_uncomputed < 1:
            raise RuntimeError(f"sequence {seq.seq_id} has no token to compute")
        num_new = min(num_uncomputed, budget)
        lookahead = head_slots = 0
        held = seq.num_held_drafts  # drafts a step in flight may still accept: this segment's positions move on
        if num_new == num_uncomputed:
            room = min(budget - num_new, self.max_model_len - num_tokens - held)
            lookahead = max(0, min(self.num_lookahead_tokens(seq), room))
            head_slots = max(0, min(self.head_lookahead, self.max_model_len - num_tokens - held - lookahead))
        if not self.block_manager.ensure_slots(seq, num_new + held + lookahead + head_slots):
            return None
        return ScheduledSeq(seq, num_new, seq.num_computed_tokens, num_tokens, lookahead)

    def _preempt(self, seq: Sequence) -> None:
        """Free the KV of `seq` and put it at the head of the queue; it is recomputed later."""
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
