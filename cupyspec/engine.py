"""The asyncio engine: requests in, streamed outputs out; one background task runs the steps."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np
from jinja2 import TemplateError

from cupyspec.backend import Backend, select_backend
from cupyspec.config import EngineConfig
from cupyspec.detokenizer import IncrementalDetokenizer
from cupyspec.errors import EngineClosedError, EngineOverloadedError, InvalidRequestError
from cupyspec.kv_cache import BlockManager
from cupyspec.loader import LoadedModel, load_model
from cupyspec.loader.tokenizer import Tokenizer
from cupyspec.metrics import EngineMetrics
from cupyspec.model.kv_arrays import KVCacheArrays
from cupyspec.model.llama import LlamaModel
from cupyspec.outputs import CompletionDelta, RequestOutput, TokenLogprob
from cupyspec.runner import ModelRunner, StepResult
from cupyspec.sampling.params import SamplingParams
from cupyspec.scheduler import Scheduler, SchedulerOutput
from cupyspec.sequence import Sequence

log = logging.getLogger("cupyspec")

CPU_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load."""

    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_used_kv_blocks: int  # blocks held by requests (cached-but-free prefix blocks not counted)


@dataclass(eq=False)
class _Request:
    """A request's choices, their detokenizers and the queue its caller reads."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]
    queue: asyncio.Queue
    arrival_time: float
    first_token_time: float | None = None
    num_output_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    finished: bool = False
    pending: list[CompletionDelta] = field(default_factory=list)


def _kv_cache_blocks(config: EngineConfig, backend: Backend, bytes_per_block: int) -> int:
    budget = config.cache.kv_cache_memory_bytes
    if budget is None:
        if backend.is_cuda:
            free, _total = backend.xp.cuda.runtime.memGetInfo()
            budget = int(free * config.cache.gpu_memory_utilization)
        else:
            budget = CPU_KV_CACHE_BYTES
    num_blocks = budget // bytes_per_block
    if num_blocks < 2:
        raise ValueError(f"the KV cache budget of {budget} bytes holds fewer than 2 blocks "
                         f"of {bytes_per_block} bytes; raise the KV memory budget")
    return int(num_blocks)


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
        block_size = config.cache.block_size
        num_blocks = _kv_cache_blocks(config, backend,
                                      KVCacheArrays.bytes_per_block(loaded.config, block_size, backend.dtype))
        kv = KVCacheArrays(backend.xp, loaded.config, num_blocks, block_size, backend.dtype)
        self.block_manager = BlockManager(num_blocks, block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len)
        self.runner = ModelRunner(model, kv, backend)
        self.metrics = EngineMetrics(self.model_name)
        self._requests: dict[str, _Request] = {}
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
        loaded = await asyncio.to_thread(load_model, config.model)
        engine = await asyncio.to_thread(cls, config, loaded, backend)
        engine._loop_task = asyncio.create_task(engine._run_loop(), name="cupyspec-engine")
        return engine

    # ---------------------------------------------------------------- requests

    async def chat(self, messages: list[dict], params: SamplingParams,
                   request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Render the chat template over `messages`, then stream as `generate` does."""
        if not messages:
            raise InvalidRequestError("messages must not be empty", "messages")
        try:
            prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except (ValueError, TemplateError) as exc:
            raise InvalidRequestError(f"the chat template rejected the messages: {exc}", "messages") from None
        outputs = self.generate(prompt, params, request_id)
        try:
            async for output in outputs:
                yield output
        finally:
            await outputs.aclose()

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Bad input raises before the first yield."""
        request = self._add_request(prompt, params, request_id or uuid.uuid4().hex)
        try:
            while True:
                output = await request.queue.get()
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
        if request_id in self._requests:
            self._aborts.add(request_id)
            self._wake.set()

    def _add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str) -> _Request:
        if self._closed:
            raise EngineClosedError("the engine is shutting down")
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate_prompt(token_ids, params)
        if self.scheduler.num_waiting + params.n > self.config.scheduler.max_waiting_requests:
            raise EngineOverloadedError("the server is overloaded: too many waiting requests; retry later")
        max_total = len(token_ids) + (params.max_tokens or self.max_model_len - len(token_ids))
        now = time.monotonic()
        seqs = [Sequence(request_id=request_id, choice_index=i, prompt_token_ids=list(token_ids), params=params,
                         max_total_tokens=max_total, arrival_time=now, rng=self._choice_rng(params, i))
                for i in range(params.n)]
        request = _Request(
            request_id=request_id, prompt_token_ids=token_ids, params=params, seqs=seqs,
            detokenizers=[IncrementalDetokenizer(self.tokenizer, params, self.model_config.eos_token_ids,
                                                 max_total - len(token_ids)) for _ in seqs],
            queue=asyncio.Queue(), arrival_time=now,
            prompt_logprobs=[None] * len(token_ids) if params.prompt_logprobs is not None else None,
        )
        self._requests[request_id] = request
        for seq in seqs:
            self.scheduler.add(seq)
        self.metrics.on_request_arrived()
        self._wake.set()
        return request

    def _validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})", "prompt")
        total = len(token_ids) + (params.max_tokens or 1)
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request asks for "
                f"{total} ({len(token_ids)} in the prompt, {params.max_tokens or 1} to generate)", "max_tokens")
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if total > capacity:
            raise InvalidRequestError(f"the request needs {total} tokens of KV cache; the pool holds {capacity}",
                                      "max_tokens")

    def _choice_rng(self, params: SamplingParams, choice_index: int) -> np.random.Generator:
        if params.seed is None:
            return np.random.default_rng(self._rng.integers(1 << 62))
        return np.random.default_rng([params.seed, choice_index])

    # ---------------------------------------------------------------- the loop

    async def _run_loop(self) -> None:
        try:
            while True:
                self._apply_aborts()
                if not self.scheduler.has_work:
                    if self._closed:
                        return
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                sched = self.scheduler.schedule()
                self._finish_ended_by_scheduler(sched.finished)
                if not sched.scheduled:
                    await asyncio.sleep(0)
                    continue
                inputs = self.runner.prepare(sched)
                result = await asyncio.to_thread(self.runner.run, inputs)
                self._postprocess(sched, result)
        except Exception as exc:  # a bug or a device failure: fail every request, refuse new ones
            log.exception("engine step failed")
            self._closed = True
            for request in list(self._requests.values()):
                request.queue.put_nowait(EngineClosedError(f"the engine failed: {exc}"))
            self._requests.clear()

    def _apply_aborts(self) -> None:
        while self._aborts:
            request = self._requests.get(self._aborts.pop())
            if request is None:
                continue
            for seq in request.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, "abort")
                    self._close_choice(request, seq, "abort")
            self._emit(request)

    def _finish_ended_by_scheduler(self, seqs: tuple[Sequence, ...]) -> None:
        """Sequences the scheduler ended (the KV pool cannot hold them) finish with "length"."""
        for seq in seqs:
            request = self._requests.get(seq.request_id)
            if request is not None:
                self._close_choice(request, seq, "length")
                self._emit(request)

    @staticmethod
    def _close_choice(request: _Request, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        detok = request.detokenizers[seq.choice_index]
        request.pending.append(CompletionDelta(seq.choice_index, detok.flush(), (), None, reason))

    def _postprocess(self, sched: SchedulerOutput, result: StepResult) -> None:
        """Account the step's tokens, detokenize, apply stops and wake the callers."""
        self.scheduler.update_after_step(sched)
        now = time.monotonic()
        touched: dict[str, _Request] = {}
        for item, token, logprob, prompt_lps in zip(sched.scheduled, result.token_ids, result.logprobs,
                                                    result.prompt_logprobs):
            seq = item.seq
            request = self._requests.get(seq.request_id)
            if request is None or seq.is_finished:
                continue
            if request.prompt_logprobs is not None:
                for position, lp in prompt_lps:
                    request.prompt_logprobs[position] = lp
            if token is None:
                continue
            seq.output_token_ids.append(token)
            delta = request.detokenizers[seq.choice_index].add([token])
            request.num_output_tokens += 1
            self.metrics.on_generation_tokens(1)
            if request.first_token_time is None:
                request.first_token_time = now
                self.metrics.observe_ttft(now - request.arrival_time)
            finish, stop_reason = delta.finish_reason, delta.stop_reason
            if finish is not None:
                self.scheduler.finish(seq, finish)
                seq.finish_reason, seq.stop_reason = finish, stop_reason
            wants_logprobs = seq.params.logprobs is not None
            request.pending.append(CompletionDelta(seq.choice_index, delta.text, (token,),
                                                   (logprob,) if wants_logprobs else None, finish, stop_reason))
            touched[request.request_id] = request
        for request in touched.values():
            self._emit(request)

    def _emit(self, request: _Request) -> None:
        """Send the pending deltas of a request as one RequestOutput."""
        finished = all(seq.is_finished for seq in request.seqs)
        prompt_lps = None
        if request.prompt_logprobs is not None and not request.prompt_logprobs_sent and request.pending:
            prompt_lps, request.prompt_logprobs_sent = tuple(request.prompt_logprobs), True
        request.queue.put_nowait(RequestOutput(
            request_id=request.request_id, prompt_token_ids=tuple(request.prompt_token_ids),
            deltas=tuple(request.pending), num_prompt_tokens=len(request.prompt_token_ids),
            num_output_tokens=request.num_output_tokens, finished=finished, prompt_logprobs=prompt_lps))
        request.pending = []
        if finished:
            request.finished = True
            del self._requests[request.request_id]
            self._on_request_finished(request)

    def _on_request_finished(self, request: _Request) -> None:
        now = time.monotonic()
        self.metrics.on_prompt_tokens(len(request.prompt_token_ids))
        self.metrics.observe_e2e_latency(now - request.arrival_time)
        if request.first_token_time is not None and request.num_output_tokens > 1:
            per_choice = request.num_output_tokens / len(request.seqs)
            if per_choice > 1:
                self.metrics.observe_time_per_output_token((now - request.first_token_time) / (per_choice - 1))
        for seq in request.seqs:
            self.metrics.on_request_finished(seq.finish_reason or "abort")

    # ---------------------------------------------------------------- state

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
        while self._requests and time.monotonic() < deadline and not self._loop_task.done():
            await asyncio.sleep(0.05)
        self._aborts.update(self._requests)
        self._wake.set()
        try:
            await asyncio.wait_for(self._loop_task, timeout=max(5.0, timeout))
        except asyncio.TimeoutError:
            self._loop_task.cancel()
