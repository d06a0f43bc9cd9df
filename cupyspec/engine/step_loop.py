"""The engine's one background task: each turn schedules and launches a step, then finishes the step
launched before it, whose outputs are detokenized and delivered while the new step runs.

The step before is the one pending object handed from each turn to the next (`PendingStep`). With
overlap scheduling the new step is formed before the host has the pending step's tokens, which the
device feeds to it (cupyspec/model/device_tokens.py); otherwise the pending step's tokens go into
its sequences first (`place`), and their delivery waits for the next launch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import numpy as np

from cupyspec.config import EngineConfig
from cupyspec.engine.output_processor import OutputProcessor
from cupyspec.engine.runner import LaunchedStep, ModelRunner
from cupyspec.engine.step_inputs import StepInputs
from cupyspec.engine.step_outputs import SeqStepOutput
from cupyspec.engine.worker import InlineSteps, StepThread
from cupyspec.errors import EngineClosedError
from cupyspec.scheduling.scheduler import Scheduler, SchedulerOutput
from cupyspec.spec_decode.backoff.step_cost import StepShape
from cupyspec.spec_decode.drafter import Drafter
from cupyspec.spec_decode.proposers.mtp import MTPProposer

log = logging.getLogger("cupyspec")

IDLE_SLICE_SECONDS = 0.005  # deferred proposer work done between checks for new requests, when idle


@dataclass(eq=False)
class PendingStep:
    """A launched step, handed from one turn of the loop to the next until its outputs are delivered.

    Overlapped (`held`): the next step is formed before the host has its tokens, which placeholders
    hold the places of; it is in flight until collected. Otherwise its tokens go into its sequences
    as soon as they are on the host (`_place`), the next step is formed from them, and they are
    detokenized and delivered after that step's launch (`_deliver_placed`).
    """

    sched: SchedulerOutput
    launched: LaunchedStep
    held: bool
    outputs: list[SeqStepOutput] | None = None  # once collected (a placed step's without its logprobs)


def _in_flight(step: PendingStep | None) -> bool:
    """A step whose tokens the host has not seen yet."""
    return step is not None and step.outputs is None



class StepLoop:
    """Runs the engine's steps over its scheduler, runner, output processor and drafter until closed;
    takes aborts and wakes up for new requests."""

    def __init__(self, config: EngineConfig, scheduler: Scheduler, runner: ModelRunner, outputs: OutputProcessor,
                 drafter: Drafter | None, on_gpu: bool) -> None:
        """on_gpu: steps run on the event loop (InlineSteps), else on a thread of their own."""
        self.config, self.scheduler, self.runner, self.outputs = config, scheduler, runner, outputs
        self.drafter, self.on_gpu = drafter, on_gpu
        self.aborts: set[str] = set()  # request ids to abort at the next turn
        self.wake = asyncio.Event()  # set when a request, an abort or shutdown comes
        self.closed = False
        self._emitted = 0  # tokens collected since the drafter last observed a turn

    def abort(self, request_id: str) -> None:
        self.aborts.add(request_id)
        self.wake.set()

    def close(self) -> None:
        """Take no more requests; the loop ends once it has nothing left to run."""
        self.closed = True
        self.wake.set()

    async def run(self) -> None:
        """Each turn schedules and launches a step, then finishes the step before it (`pending`): its
        outputs are detokenized and delivered while the new step runs on the device. With overlap
        scheduling a step is formed before the host has the pending step's tokens, which the device
        feeds to it (runner.py), unless it verifies drafts that a host-side proposer made (those read
        every token on the host); an MTP head's drafts stay on the device (`_drafts_on_device`)."""
        steps = InlineSteps() if self.on_gpu else StepThread("cupyspec-step")
        mark = time.perf_counter()  # when the last step was launched (or the loop woke up)
        pending: PendingStep | None = None  # launched, its outputs not yet delivered
        try:
            while True:
                pending = await self._settle(steps, pending)
                if not self.scheduler.has_work:
                    if self._may_end():
                        return
                    await self._idle()
                    mark = time.perf_counter()
                    continue
                sched, pending = await self._schedule(steps, pending)
                if not sched.scheduled:  # every running sequence waits for its last token
                    if pending is None:
                        await asyncio.sleep(0)
                    else:
                        await self._finish(steps, pending)
                        pending = None
                    continue
                pending, shape = await self._launch(steps, sched, pending)
                if self.drafter is not None:
                    self.drafter.after_step(self.scheduler.running)
                    now = time.perf_counter()
                    self.drafter.observe_step(shape, now - mark, self._emitted)
                    mark, self._emitted = now, 0
        except Exception as exc:  # a bug or a device failure: fail every request, refuse new ones
            log.exception("engine step failed")
            self.closed = True
            self.outputs.fail_all(EngineClosedError(f"the engine failed: {exc}"))
        finally:
            steps.close()

    async def _settle(self, steps: InlineSteps | StepThread, pending: PendingStep | None) -> PendingStep | None:
        """Before a step is formed: aborts applied (a placed step delivered first), and the pending step
        finished unless a step may overlap it; with nothing to run, every output delivered."""
        if self.aborts:
            pending = self._deliver_placed(pending)
        while self.aborts:
            self.outputs.abort(self.aborts.pop())
        if _in_flight(pending) and not (self._can_overlap() and self.scheduler.has_work):
            await self._finish(steps, pending)
            pending = None
        return pending if self.scheduler.has_work else self._deliver_placed(pending)

    async def _schedule(self, steps: InlineSteps | StepThread,
                        pending: PendingStep | None) -> tuple[SchedulerOutput, PendingStep | None]:
        """Plan and propose drafts, then schedule: the step's batch, and what is still pending. Drafts
        that a host-side proposer makes need the pending step's tokens: it is finished first (the
        plan stands)."""
        self.scheduler.admit_arrived()
        limits = self.drafter.plan(self.scheduler.running) if self.drafter is not None else {}
        if any(limits.values()) and _in_flight(pending) and not self._drafts_on_device():
            await self._finish(steps, pending)
            pending = None
        if self.drafter is not None:
            self.drafter.propose(self.scheduler.running, limits)
        sched = self.scheduler.schedule()
        if sched.finished or not sched.scheduled:
            pending = self._deliver_placed(pending)
        self.outputs.finish_ended_by_scheduler(sched.finished)
        return sched, pending

    async def _launch(self, steps: InlineSteps | StepThread, sched: SchedulerOutput,
                      pending: PendingStep | None) -> tuple[PendingStep | None, StepShape]:
        """Launch the step, deliver the outputs of the one before meanwhile, then take the new step's
        tokens if the next step needs them on the host. Returns what is pending, and the step's shape."""
        inputs = self.runner.prepare(sched, self.drafter is None or self.drafter.drafts_ahead)
        drafting = int(np.count_nonzero(inputs.num_drafts))  # sequences whose drafts the step verifies
        held = self._can_overlap() and (not drafting or self._drafts_on_device())
        refilled = held and not _in_flight(pending)  # no step ran before it on the device
        launching = steps.run(self.runner.launch, inputs)  # on a GPU queued at once, else computing
        self.scheduler.on_launched(sched)
        if held:  # the places of its tokens in its sequences
            emitted = [self.runner.tokens.emitted(s) for s in range(len(inputs.owners))]
            self.outputs.hold_places(sched, inputs.owners, emitted, inputs.num_drafts.tolist())
        if self.runner.mtp is not None:
            self._launched_mtp(inputs, held)
        pending = self._deliver_placed(pending)  # meanwhile, the outputs of the step before
        if self.drafter is not None:
            self.drafter.learn_step_costs()  # ... and the step costs observed
        step = PendingStep(sched, await launching, held)
        if pending is not None:
            await self._finish(steps, pending)
        kept, placed = 0, step
        if not held:  # the next step is formed from its tokens
            placed = await self._place(steps, step)
            if drafting:
                kept = sum(map(sum, (out.accepted for out in step.outputs)))
        return placed, StepShape(sched.num_tokens, drafting, int(inputs.num_drafts.sum()), refilled, kept,
                                 len(sched.scheduled), inputs.draft_ahead and not drafting)

    async def _place(self, steps: InlineSteps | StepThread, step: PendingStep) -> PendingStep | None:
        """Collect a step that was not overlapped and put its tokens in its sequences ahead of their
        delivery (the step stays pending); or, when a stop may end a sequence in it, process it whole
        now (the next step would carry that sequence for nothing). Then the scheduler's books."""
        step.outputs = await self._collect(steps, step.launched, logprobs=False)
        placed = self.outputs.place_tokens(step.sched, step.outputs)
        if not placed:
            self.outputs.process_step(step.sched, self.runner.add_logprobs(step.launched, step.outputs))
        self.scheduler.update_after_step(step.sched, [max(0, len(out.token_ids) - 1) for out in step.outputs])
        return step if placed else None

    def _deliver_placed(self, step: PendingStep | None) -> PendingStep | None:
        """Detokenize, stop and deliver a placed step's outputs, with their logprobs; a step in flight
        stays pending."""
        if step is None or step.outputs is None:
            return step
        self.outputs.process_step(step.sched, self.runner.add_logprobs(step.launched, step.outputs), placed=True)
        return None

    async def _finish(self, steps: InlineSteps | StepThread, step: PendingStep) -> None:
        """Deliver a pending step's outputs: an overlapped one's into the places held for them once
        collected, then the scheduler's books; a placed one's as `_deliver_placed`."""
        if step.outputs is None:
            step.outputs = await self._collect(steps, step.launched)
            self.outputs.process_step(step.sched, step.outputs, held=True)
            self.scheduler.update_after_step(step.sched, [max(0, len(out.token_ids) - 1) for out in step.outputs])
        else:
            self._deliver_placed(step)

    async def _collect(self, steps: InlineSteps | StepThread, launched: LaunchedStep,
                       logprobs: bool = True) -> list[SeqStepOutput]:
        """A launched step's outputs, once the device has them on the host (see ModelRunner.collect)."""
        await steps.until(launched.ready)
        outputs = await steps.run(self.runner.collect, launched, logprobs)
        if self.drafter is not None:  # for its goodput check
            self._emitted += sum(len(out.token_ids) for out in outputs)
        return outputs

    async def _idle(self) -> None:
        """Nothing to run: do the proposer's deferred work a slice at a time, then wait for a request."""
        def has_news() -> bool:  # a request, an abort or shutdown
            return bool(self.scheduler.has_work or self.aborts or self._may_end())

        while not has_news() and self.drafter is not None and self.drafter.catch_up(IDLE_SLICE_SECONDS):
            await asyncio.sleep(0)
        if not has_news():
            self.wake.clear()
            await self.wake.wait()

    def _may_end(self) -> bool:
        """Closed, with no live request's prompt K/V on its way from a prefill server (it runs here next)."""
        return self.closed and all(seq.is_finished for seq in self.scheduler.receiving)

    def _launched_mtp(self, inputs: StepInputs, held: bool) -> None:
        """Tell the MTP proposer of a launched step: whether the head drafts in it, and the placeholder
        ids of its drafts while it is overlapped."""
        drafting = inputs.draft_ahead
        placeholders = self.runner.tokens.drafts(len(inputs.owners)) if held and drafting else None
        self.runner.mtp.proposer.launched(inputs.seq_ids, inputs, drafting, placeholders)

    def _drafts_on_device(self) -> bool:
        """Whether a step may verify drafts before the host has the step in flight's tokens: an MTP
        head alone proposes (its drafts stay on the device), and every live request's verification
        can read them there (greedy, no logprobs)."""
        return (self.drafter is not None and isinstance(self.drafter.proposer, MTPProposer)
                and not self.outputs.num_verified_on_host)

    def _can_overlap(self) -> bool:
        """Whether a draft-free step may be formed before the host has the tokens of the one in flight:
        not while penalties need every token on the host."""
        return self.config.overlap_scheduling and not self.outputs.num_penalized
