"""The asyncio engine: requests in, streamed outputs out; one background task runs the steps."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
from jinja2 import TemplateError

from cupyspec.backend import Backend, limit_cpu_threads, select_backend
from cupyspec.config import EngineConfig
from cupyspec.engine.admission import check_request
from cupyspec.engine.output_processor import OutputProcessor, RequestState
from cupyspec.engine.runner import LaunchedStep, ModelRunner, SeqStepOutput
from cupyspec.engine.step_inputs import StepInputs
from cupyspec.engine.warm_up import run_warm_up
from cupyspec.engine.worker import InlineSteps, StepThread
from cupyspec.errors import EngineClosedError, EngineOverloadedError, InvalidRequestError
from cupyspec.loader import LoadedModel, load_model
from cupyspec.metrics import EngineMetrics
from cupyspec.model.kv_arrays import KVCacheArrays, kv_cache_blocks
from cupyspec.model.linear import KERNEL_MAX_ROWS
from cupyspec.model.llama import LlamaModel
from cupyspec.outputs import RequestOutput
from cupyspec.sampling.params import SamplingParams
from cupyspec.sampling.uniforms import sampling_key
from cupyspec.scheduling.block_manager import BlockManager
from cupyspec.scheduling.scheduler import Scheduler, SchedulerOutput
from cupyspec.scheduling.sequence import Sequence
from cupyspec.spec_decode.backoff.step_cost import StepShape
from cupyspec.spec_decode.drafter import Drafter
from cupyspec.spec_decode.proposers.factory import make_proposer, mtp_proposer
from cupyspec.spec_decode.proposers.mtp import MTPProposer, make_mtp_drafting
from cupyspec.spec_decode.speculative_config import RequestSpeculation
from cupyspec.spec_decode.stats import SpecStats
from cupyspec.text.detokenizer import IncrementalDetokenizer
from cupyspec.text.tokenizer import Tokenizer

log = logging.getLogger("cupyspec")

IDLE_SLICE_SECONDS = 0.005  # deferred proposer work done between checks for new requests, when idle


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load."""

    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_used_kv_blocks: int  # blocks held by requests (cached-but-free prefix blocks not counted)


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


class AsyncEngine:
    """Embed in any asyncio program:

        engine = await AsyncEngine.create(EngineConfig())
        async for out in engine.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=32)):
            print(out.deltas[0].text if out.deltas else "", end="")
        await engine.shutdown()
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel, backend: Backend) -> None:
        self.config, self.backend = config, backend
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        self.model_name = config.served_model_name or config.model
        context = loaded.config.max_position_embeddings
        requested = config.scheduler.max_model_len
        if requested is not None and requested > context:
            raise ValueError(f"max_model_len {requested} exceeds the model's context length {context}")
        self.max_model_len = requested or context
        model = LlamaModel(loaded.config, loaded.weights, backend)
        proposer = make_proposer(config.speculative)
        mtp = make_mtp_drafting(config.speculative, model, mtp_proposer(proposer), self.max_model_len, config.model)
        heads = int(mtp is not None)  # an MTP head's K/V is one more layer of the pool
        block_size = config.cache.block_size
        num_blocks = kv_cache_blocks(config.cache, backend,
                                     KVCacheArrays.bytes_per_block(loaded.config, block_size, backend.dtype, heads))
        kv = KVCacheArrays(backend.xp, loaded.config, num_blocks, block_size, backend.dtype, heads)
        self.block_manager = BlockManager(num_blocks, block_size, config.cache.enable_prefix_caching, bool(heads))
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len,
                                   config.speculative.num_model_steps - 1 if heads else 0)
        graph_tokens = min(KERNEL_MAX_ROWS, config.scheduler.max_num_batched_tokens) if config.cuda_graphs else 0
        self.runner = ModelRunner(model, kv, backend, config.speculative, config.overlap_logprobs, graph_tokens,
                                  self.max_model_len, config.scheduler.max_num_seqs, self.tokenizer, mtp)
        self.drafter = Drafter(config.speculative, proposer) if proposer is not None else None
        self.metrics = EngineMetrics(self.model_name)
        self.outputs = OutputProcessor(self.scheduler, self.metrics, self._on_sequence_finished, config.stream_interval)
        self._aborts: set[str] = set()
        self._rng = np.random.default_rng(config.seed)
        self._wake = asyncio.Event()
        self._closed = False
        self._loop_task: asyncio.Task | None = None
        log.info("engine ready: %s on %s, %d KV blocks of %d tokens, max_model_len %d",
                 self.model_name, backend.device, num_blocks, block_size, self.max_model_len)

    @classmethod
    async def create(cls, config: EngineConfig) -> AsyncEngine:
        """Load the model (in a worker thread) and start the step loop."""
        backend = select_backend(config.device)
        if not backend.is_cuda:
            limit_cpu_threads(config.cpu_threads)
        loaded = await asyncio.to_thread(load_model, config.model)
        engine = await asyncio.to_thread(cls, config, loaded, backend)
        engine._loop_task = asyncio.create_task(engine._run_loop(), name="cupyspec-engine")
        if config.warm_up if config.warm_up is not None else backend.is_cuda:
            started = time.perf_counter()
            await engine.warm_up()
            engine._forget_warm_up()
            log.info("warmed up in %.1f s", time.perf_counter() - started)
        return engine

    async def warm_up(self) -> None:
        """Run the warm-up requests (`cupyspec/engine/warm_up.py`) through every step path."""
        room = min(self.max_model_len, self.block_manager.num_blocks * self.block_manager.block_size)
        await run_warm_up(self.generate, self.drafter, self.model_config.vocab_size, room,
                          self.config.scheduler.max_num_batched_tokens)

    def _forget_warm_up(self) -> None:
        """Metrics, learned step costs and the probe schedule start afresh after the warm-up."""
        self.metrics = self.outputs.metrics = EngineMetrics(self.model_name)
        if self.drafter is not None:
            self.drafter = Drafter(self.config.speculative, self.drafter.proposer)

    # ---------------------------------------------------------------- requests

    async def chat(self, messages: list[dict], params: SamplingParams, request_id: str | None = None,
                   speculation: RequestSpeculation | None = None) -> AsyncIterator[RequestOutput]:
        """Render the chat template over `messages`, then stream as `generate` does."""
        if not messages:
            raise InvalidRequestError("messages must not be empty", "messages")
        try:
            prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except (ValueError, TemplateError) as exc:
            raise InvalidRequestError(f"the chat template rejected the messages: {exc}", "messages") from None
        outputs = self.generate(prompt, params, request_id, speculation)
        try:
            async for output in outputs:
                yield output
        finally:
            await outputs.aclose()

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       speculation: RequestSpeculation | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Bad input raises before the first yield."""
        request = self._add_request(prompt, params, request_id or uuid.uuid4().hex, speculation)
        channel = request.channel
        try:
            while True:
                output = channel.take()
                if output is None:
                    await channel.ready()
                    continue
                if isinstance(output, BaseException):
                    raise output
                yield output
                if output.finished:
                    return
        finally:
            if not request.finished:
                self._aborts.add(request.request_id)
                self._wake.set()

    async def abort(self, request_id: str) -> None:
        """Stop a request; its choices finish with reason "abort" and free their KV blocks."""
        if request_id in self.outputs.requests:
            self._aborts.add(request_id)
            self._wake.set()

    def _add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                     speculation: RequestSpeculation | None) -> RequestState:
        if self._closed:
            raise EngineClosedError("the engine is shutting down")
        if request_id in self.outputs.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_request(token_ids, params, self.model_config.vocab_size, self.max_model_len,
                      self.block_manager.num_blocks * self.block_manager.block_size)
        if self.scheduler.num_waiting + params.n > self.config.scheduler.max_waiting_requests:
            raise EngineOverloadedError("the server is overloaded: too many waiting requests; retry later")
        max_output = params.max_tokens or self.max_model_len - len(token_ids)
        max_drafts = (speculation or RequestSpeculation()).drafts_within(self.config.speculative)
        now = time.monotonic()
        seqs = [Sequence(request_id=request_id, choice_index=i, prompt_token_ids=list(token_ids), params=params,
                         max_total_tokens=len(token_ids) + max_output, arrival_time=now,
                         sampling_key=self._sampling_key(params, i), max_drafts=max_drafts,
                         spec=self.drafter.new_stats() if self.drafter is not None else SpecStats())
                for i in range(params.n)]
        request = RequestState(
            request_id=request_id, prompt_token_ids=tuple(token_ids), seqs=seqs,
            detokenizers=[IncrementalDetokenizer(self.tokenizer, params, self.model_config.eos_token_ids, max_output)
                          for _ in seqs],
            arrival_time=now, speculative=self.config.speculative.enabled,
            prompt_logprobs=[None] * len(token_ids) if params.prompt_logprobs is not None else None,
        )
        self.outputs.add(request)
        self._wake.set()
        return request

    def _sampling_key(self, params: SamplingParams, choice_index: int) -> int:
        seed = int(self._rng.integers(1 << 62)) if params.seed is None else params.seed
        return sampling_key(seed, choice_index)

    # ---------------------------------------------------------------- the loop

    async def _run_loop(self) -> None:
        """Each turn schedules and launches a step, then finishes the step before it (`pending`): its
        outputs are detokenized and delivered while the new step runs on the device. With overlap
        scheduling a step is formed before the host has the pending step's tokens, which the device
        feeds to it (runner.py), unless it verifies drafts that a host-side proposer made (those read
        every token on the host); an MTP head's drafts stay on the device (`_drafts_on_device`)."""
        steps = InlineSteps() if self.backend.is_cuda else StepThread("cupyspec-step")
        mark = time.perf_counter()  # when the last step was launched (or the loop woke up)
        pending: PendingStep | None = None  # launched, its outputs not yet delivered
        try:
            while True:
                pending = await self._settle(steps, pending)
                if not self.scheduler.has_work:
                    if self._closed:
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
                    self.drafter.observe_step(shape, now - mark)
                    mark = now
        except Exception as exc:  # a bug or a device failure: fail every request, refuse new ones
            log.exception("engine step failed")
            self._closed = True
            self.outputs.fail_all(EngineClosedError(f"the engine failed: {exc}"))
        finally:
            steps.close()

    async def _settle(self, steps: InlineSteps | StepThread, pending: PendingStep | None) -> PendingStep | None:
        """Before a step is formed: aborts applied (a placed step delivered first), and the pending step
        finished unless a step may overlap it; with nothing to run, every output delivered."""
        if self._aborts:
            pending = self._deliver_placed(pending)
        while self._aborts:
            self.outputs.abort(self._aborts.pop())
        if _in_flight(pending) and not (self._can_overlap() and self.scheduler.has_work):
            await self._finish(steps, pending)
            pending = None
        return pending if self.scheduler.has_work else self._deliver_placed(pending)

    async def _schedule(self, steps: InlineSteps | StepThread,
                        pending: PendingStep | None) -> tuple[SchedulerOutput, PendingStep | None]:
        """Plan and propose drafts, then schedule: the step's batch, and what is still pending. Drafts
        that a host-side proposer makes need the pending step's tokens: it is finished first (the
        plan stands)."""
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
        inputs = self.runner.prepare(sched)
        drafting = int(np.count_nonzero(inputs.num_drafts))  # sequences whose drafts the step verifies
        held = self._can_overlap() and (not drafting or self._drafts_on_device())
        refilled = held and not _in_flight(pending)  # no step ran before it on the device
        launching = steps.run(self.runner.launch, inputs)  # on a GPU queued at once, else computing
        self.scheduler.on_launched(sched)
        if held:
            self._hold_places(sched, inputs)
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
                               len(sched.scheduled))

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
        return await steps.run(self.runner.collect, launched, logprobs)

    async def _idle(self) -> None:
        """Nothing to run: do the proposer's deferred work a slice at a time, then wait for a request."""
        def has_news() -> bool:  # a request, an abort or shutdown
            return bool(self.scheduler.has_work or self._aborts or self._closed)

        while not has_news() and self.drafter is not None and self.drafter.catch_up(IDLE_SLICE_SECONDS):
            await asyncio.sleep(0)
        if not has_news():
            self._wake.clear()
            await self._wake.wait()

    def _hold_places(self, sched: SchedulerOutput, inputs: StepInputs) -> None:
        """An overlapped step's places in its sequences, and its MTP drafts' in the proposer's."""
        tokens, owners = self.runner.tokens, inputs.owners
        self.outputs.hold_places(sched, owners, [tokens.emitted(s) for s in range(len(owners))],
                                 inputs.num_drafts.tolist())
        if self.runner.mtp is not None:
            steps = self.runner.mtp.num_model_steps
            self.runner.mtp.proposer.hold(inputs.seq_ids, [tokens.drafts(s, steps) for s in range(len(owners))],
                                          inputs)

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

    def _on_sequence_finished(self, seq: Sequence) -> None:
        if self.drafter is not None:
            self.drafter.on_sequence_finished(seq)

    # ---------------------------------------------------------------- state

    @property
    def drafts_with_model(self) -> bool:
        """Drafts come from a draft model (an MTP head), whose own logprobs their records carry."""
        return self.runner.mtp is not None

    @property
    def is_serving(self) -> bool:
        """Takes requests: not shut down, and the step loop has not failed."""
        return not self._closed and self._loop_task is not None and not self._loop_task.done()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(self.scheduler.num_running, self.scheduler.num_waiting, bm.num_blocks,
                           bm.num_free_blocks, bm.num_used_blocks)

    def metrics_text(self) -> str:
        return self.metrics.render(self.stats())

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Refuse new requests, let running ones finish for up to `timeout` s, abort the rest."""
        self._closed = True
        self._wake.set()
        if self._loop_task is None:
            return
        deadline = time.monotonic() + timeout
        while self.outputs.requests and time.monotonic() < deadline and not self._loop_task.done():
            await asyncio.sleep(0.05)
        self._aborts.update(self.outputs.requests)
        self._wake.set()
        try:
            await asyncio.wait_for(self._loop_task, timeout=max(5.0, timeout))
        except asyncio.TimeoutError:
            self._loop_task.cancel()
