"""The asyncio engine: requests in, streamed outputs out; one background task runs the steps."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import numpy as np
from jinja2 import TemplateError

from cupyspec.backend import Backend, limit_cpu_threads, select_backend
from cupyspec.config import EngineConfig
from cupyspec.disagg.handoff import HeldPrompts
from cupyspec.disagg.kv_transfer import KVTransferAgent
from cupyspec.disagg.prefill_client import PrefillServers
from cupyspec.engine.admission import check_request
from cupyspec.engine.build_runner import build_runner
from cupyspec.engine.handoff_roles import HandoffRoles, drafting_rule
from cupyspec.engine.output_processor import OutputProcessor, RequestState
from cupyspec.engine.request_stream import RequestStream
from cupyspec.engine.step_loop import StepLoop
from cupyspec.engine.warm_up import run_warm_up
from cupyspec.errors import EngineClosedError, EngineOverloadedError, InvalidRequestError
from cupyspec.loader import LoadedModel, load_model
from cupyspec.metrics import EngineMetrics
from cupyspec.model.cuda_graphs import LOGIT_ROWS
from cupyspec.model.linear import KERNEL_MAX_ROWS
from cupyspec.sampling.params import SamplingParams
from cupyspec.sampling.uniforms import sampling_key
from cupyspec.scheduling.block_manager import BlockManager
from cupyspec.scheduling.scheduler import Scheduler
from cupyspec.scheduling.sequence import Sequence
from cupyspec.spec_decode.drafter import Drafter
from cupyspec.spec_decode.proposers.factory import make_proposer, mtp_proposer
from cupyspec.spec_decode.speculative_config import RequestSpeculation
from cupyspec.spec_decode.stats import SpecStats
from cupyspec.text.detokenizer import IncrementalDetokenizer
from cupyspec.text.tokenizer import Tokenizer

log = logging.getLogger("cupyspec")



@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load."""

    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_used_kv_blocks: int  # blocks held by requests (cached-but-free prefix blocks not counted)


class AsyncEngine(HandoffRoles):
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
        proposer = make_proposer(config.speculative)
        mtp = mtp_proposer(proposer)
        graph_tokens = min(KERNEL_MAX_ROWS, config.scheduler.max_num_batched_tokens) if config.cuda_graphs else 0
        self.runner, num_blocks = build_runner(config, loaded, backend, mtp, self.max_model_len, graph_tokens)
        graphs = self.runner.graphs  # the scheduler fits a step's drafts to their largest bucket
        block_size = config.cache.block_size
        self.block_manager = BlockManager(num_blocks, block_size, config.cache.enable_prefix_caching, mtp is not None)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len,
                                   config.speculative.num_model_steps - 1 if mtp is not None else 0,
                                   graphs.buckets[-1] if graphs is not None else 0, LOGIT_ROWS)
        self.metrics = EngineMetrics(self.model_name)
        self.outputs = OutputProcessor(self.scheduler, self.metrics, self._on_sequence_finished, config.stream_interval)
        self.step_loop = StepLoop(config, self.scheduler, self.runner, self.outputs,
                                  Drafter(drafting_rule(config), proposer) if proposer is not None else None,
                                  backend.is_cuda)
        self._rng = np.random.default_rng(config.seed)
        self.held_prompts = HeldPrompts(self.block_manager.release, config.prefill_hold_seconds)
        self.handoff_tasks: set[asyncio.Task] = set()  # decode role: prompts' K/V being fetched
        self.kv_agent = (KVTransferAgent(f"cupyspec-{config.role}-{uuid.uuid4().hex[:12]}", self.runner.kv,
                                         config.quantization or np.dtype(backend.dtype).name)
                         if config.role != "both" else None)
        self.prefill_servers = (PrefillServers(config.prefill_urls, self.kv_agent, config.prefill_timeout_seconds)
                                if config.role == "decode" else None)
        self._release_task: asyncio.Task | None = None  # prefill role: releases the prompts decode servers read
        self._loop_task: asyncio.Task | None = None
        log.info("engine ready: %s on %s%s, weights %.3f GiB%s, %d KV blocks of %d tokens, max_model_len %d",
                 self.model_name, backend.device,
                 f" x{config.tensor_parallel_size}" if config.tensor_parallel_size > 1 else "",
                 self.runner.model.weight_bytes / 2**30, f" ({config.quantization})" if config.quantization else "",
                 num_blocks, block_size, self.max_model_len)

    @classmethod
    async def create(cls, config: EngineConfig) -> AsyncEngine:
        """Load the model (in a worker thread) and start the step loop."""
        backend = select_backend(config.device)
        if not backend.is_cuda:
            limit_cpu_threads(config.cpu_threads)
        loaded = await asyncio.to_thread(load_model, config.model)
        engine = await asyncio.to_thread(cls, config, loaded, backend)
        engine._loop_task = asyncio.create_task(engine.step_loop.run(), name="cupyspec-engine")
        if config.role == "prefill":
            engine._release_task = asyncio.create_task(engine.release_read_prompts(), name="cupyspec-release")
        if config.warm_up if config.warm_up is not None else backend.is_cuda:
            started = time.perf_counter()
            await engine.warm_up()
            engine._forget_warm_up()
            log.info("warmed up in %.1f s", time.perf_counter() - started)
        return engine

    async def warm_up(self) -> None:
        """Run the warm-up requests (`cupyspec/engine/warm_up.py`) through every step path, on this engine
        alone (a decode server warms up without its prefill servers)."""
        room = min(self.max_model_len, self.block_manager.num_blocks * self.block_manager.block_size)
        await run_warm_up(self._generate_here, self.drafter, self.model_config.vocab_size, room,
                          self.config.scheduler.max_num_batched_tokens)

    def _forget_warm_up(self) -> None:
        """Metrics, learned step costs and the probe schedule start afresh after the warm-up."""
        self.metrics = self.outputs.metrics = EngineMetrics(self.model_name)
        if self.drafter is not None:
            self.step_loop.drafter = Drafter(drafting_rule(self.config), self.drafter.proposer)

    @property
    def drafter(self) -> Drafter | None:
        """Who drafts and what (None: no speculation)."""
        return self.step_loop.drafter

    # ---------------------------------------------------------------- requests

    def chat(self, messages: list[dict], params: SamplingParams, request_id: str | None = None,
             speculation: RequestSpeculation | None = None) -> RequestStream:
        """Render the chat template over `messages`, then stream as `generate` does."""
        return RequestStream(self._open_chat(messages, params, request_id, speculation), self.step_loop.abort)

    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                 speculation: RequestSpeculation | None = None) -> RequestStream:
        """Stream a request's outputs. Bad input raises on the first `anext`."""
        return RequestStream(self._open(prompt, params, request_id, speculation), self.step_loop.abort)

    def _generate_here(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       speculation: RequestSpeculation | None = None) -> RequestStream:
        """`generate` on this engine alone, whatever its role."""
        return RequestStream(self._open(prompt, params, request_id, speculation, here=True), self.step_loop.abort)

    async def _open_chat(self, messages: list[dict], params: SamplingParams, request_id: str | None,
                         speculation: RequestSpeculation | None) -> RequestState:
        if not messages:
            raise InvalidRequestError("messages must not be empty", "messages")
        try:
            prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except (ValueError, TemplateError) as exc:
            raise InvalidRequestError(f"the chat template rejected the messages: {exc}", "messages") from None
        return await self._open(prompt, params, request_id, speculation)

    async def _open(self, prompt: str | list[int], params: SamplingParams, request_id: str | None,
                    speculation: RequestSpeculation | None, here: bool = False) -> RequestState:
        """Add the request (bad input raises): in the decode role, a one-choice request once a prefill
        server has run its prompt, unless `here`."""
        if self.prefill_servers is not None and params.n == 1 and not here:
            return await self.hand_off(prompt, params, request_id, speculation)
        return self._add_request(prompt, params, request_id or uuid.uuid4().hex, speculation)

    async def abort(self, request_id: str) -> None:
        """Stop a request; its choices finish with reason "abort" and free their KV blocks."""
        if request_id in self.outputs.requests:
            self.step_loop.abort(request_id)

    def _add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                     speculation: RequestSpeculation | None,
                     sampling_keys: tuple[int, ...] | None = None, queued: bool = True) -> RequestState:
        """sampling_keys: each choice's key (default: from the seed or the engine's generator);
        queued: its sequences wait in the scheduler (else the caller places them)."""
        if self.step_loop.closed:
            raise EngineClosedError("the engine is shutting down")
        if request_id in self.outputs.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        token_ids = self._prompt_ids(prompt, params)
        if self.scheduler.num_waiting + params.n > self.config.scheduler.max_waiting_requests:
            raise EngineOverloadedError("the server is overloaded: too many waiting requests; retry later")
        max_output = params.max_tokens or self.max_model_len - len(token_ids)
        max_drafts = (speculation or RequestSpeculation()).drafts_within(self.config.speculative)
        now = time.monotonic()
        seqs = [Sequence(request_id=request_id, choice_index=i, prompt_token_ids=list(token_ids), params=params,
                         max_total_tokens=len(token_ids) + max_output, arrival_time=now,
                         sampling_key=sampling_keys[i] if sampling_keys else self._sampling_key(params, i),
                         max_drafts=max_drafts,
                         spec=self.drafter.new_stats() if self.drafter is not None else SpecStats())
                for i in range(params.n)]
        request = RequestState(
            request_id=request_id, prompt_token_ids=tuple(token_ids), seqs=seqs,
            detokenizers=[IncrementalDetokenizer(self.tokenizer, params, self.model_config.eos_token_ids, max_output)
                          for _ in seqs],
            arrival_time=now, speculative=self.config.speculative.enabled,
            prompt_logprobs=[None] * len(token_ids) if params.prompt_logprobs is not None else None,
        )
        self.outputs.add(request, queued)
        self.step_loop.wake.set()
        return request

    def _prompt_ids(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids, checked with the request (InvalidRequestError)."""
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_request(token_ids, params, self.model_config.vocab_size, self.max_model_len,
                      self.block_manager.num_blocks * self.block_manager.block_size)
        return token_ids

    def _sampling_key(self, params: SamplingParams, choice_index: int) -> int:
        seed = int(self._rng.integers(1 << 62)) if params.seed is None else params.seed
        return sampling_key(seed, choice_index)

    def _on_sequence_finished(self, seq: Sequence) -> None:
        if seq.kept_blocks:  # held from now on, so that a prefill whose caller has left expires too
            self.held_prompts.add(seq.request_id, seq.kept_blocks)
            if self.runner.mtp is not None:
                seq.kept_drafts = self.runner.mtp.proposer.made_for(seq.seq_id)
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
        return not self.step_loop.closed and self._loop_task is not None and not self._loop_task.done()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(self.scheduler.num_running, self.scheduler.num_waiting, bm.num_blocks,
                           bm.num_free_blocks, bm.num_used_blocks)

    def metrics_text(self) -> str:
        self.metrics.held_prompts.set(len(self.held_prompts))
        return self.metrics.render(self.stats())

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Refuse new requests, let running ones finish for up to `timeout` s, abort the rest."""
        self.step_loop.close()
        if self._loop_task is None:
            return
        deadline = time.monotonic() + timeout
        while self.outputs.requests and time.monotonic() < deadline and not self._loop_task.done():
            await asyncio.sleep(0.05)
        for request_id in list(self.outputs.requests):
            self.step_loop.abort(request_id)
        try:
            await asyncio.wait_for(self._loop_task, timeout=max(5.0, timeout))
        except asyncio.TimeoutError:
            self._loop_task.cancel()
        if self.outputs.requests:  # the loop ended before them (it failed, or was cancelled)
            self.outputs.fail_all(EngineClosedError("the engine shut down"))
        if self._release_task is not None:
            self._release_task.cancel()
        if self.prefill_servers is not None:
            await self.prefill_servers.close()
        self.held_prompts.release_all()
        if self.kv_agent is not None:
            self.kv_agent.close()
        self.runner.close()
