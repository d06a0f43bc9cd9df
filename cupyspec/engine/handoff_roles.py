"""AsyncEngine's roles in prefill/decode disaggregation (cupyspec/disagg/): the prefill role runs a
prompt for a decode server and holds its K/V until read; the decode role continues a request from
its first token once the prompt's K/V has arrived in its pool."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import replace

from cupyspec.config import EngineConfig
from cupyspec.disagg.handoff import FetchBlocks, HeadDrafts, PrefilledPrompt, first_token_only
from cupyspec.engine.output_processor import RequestState
from cupyspec.engine.request_stream import RequestStream
from cupyspec.engine.step_outputs import SeqStepOutput
from cupyspec.errors import EngineClosedError
from cupyspec.sampling.params import SamplingParams
from cupyspec.scheduling.scheduler import ScheduledSeq, SchedulerOutput
from cupyspec.scheduling.sequence import Sequence
from cupyspec.spec_decode.speculative_config import RequestSpeculation, SpeculativeConfig

log = logging.getLogger("cupyspec")

NOTIFICATION_POLL_SECONDS = 0.002  # prefill role: how often the decode servers' notifications are read


def drafting_rule(config: EngineConfig) -> SpeculativeConfig:
    """The drafter's rule: the configured one, but in the prefill role the fixed rule, so that an MTP
    head drafts for every prompt; the decode server's own rule decides whether its drafts are verified."""
    return replace(config.speculative, cost_aware_backoff=False) if config.role == "prefill" else config.speculative


class HandoffRoles:
    """Mixed into AsyncEngine, whose request intake (`_add_request`, `_prompt_ids`, `_sampling_key`),
    scheduler, output processor, step loop, held prompts, KV agent and prefill servers these methods use."""

    async def prefill(self, prompt: list[int], params: SamplingParams, sampling_key: int) -> PrefilledPrompt:
        """Prefill role: run `prompt` and sample its first token as `generate` would with the choice's
        `sampling_key` (drawn by the decode server), keeping the prompt's K/V blocks for the decode
        server to read until `release_prefilled` (or the hold's deadline). InvalidRequestError as
        `generate`; EngineClosedError if the engine stops first. With an MTP head, its drafts for the
        decode server's first step come along, as this engine's next step would verify them."""
        request = self._add_request(prompt, first_token_only(params), uuid.uuid4().hex, None, (sampling_key,))
        seq = request.seqs[0]
        seq.keep_prompt_kv = True
        token_id, logprob, prompt_logprobs = None, None, None
        # aborted if the caller is cancelled first
        async with contextlib.aclosing(RequestStream.of(request, self.step_loop.abort)) as outputs:
            async for output in outputs:
                prompt_logprobs = output.prompt_logprobs or prompt_logprobs
                for delta in output.deltas:
                    token_id = delta.token_ids[0] if delta.token_ids else token_id
                    logprob = delta.logprobs[0] if delta.logprobs else logprob
        if token_id is None or not seq.kept_blocks:
            raise EngineClosedError("the prefill did not finish")
        drafts = HeadDrafts.of(seq.kept_drafts) if seq.kept_drafts is not None else None
        return PrefilledPrompt(request.request_id, token_id, logprob, prompt_logprobs, seq.kept_blocks, drafts)

    def generate_prefilled(self, prompt: list[int], params: SamplingParams, sampling_key: int,
                           prefilled: PrefilledPrompt, fetch: FetchBlocks, request_id: str | None = None,
                           speculation: RequestSpeculation | None = None) -> RequestStream:
        """Decode role: stream a one-choice request whose prompt a prefill server ran (`prefilled`, with
        `sampling_key`) as `generate` would. Its first token is delivered at once; meanwhile
        `await fetch(remote, local)` copies the prompt's K/V blocks this pool lacks (the prefill
        server's `remote` into ours `local`), then it decodes here. `fetch` is awaited once for every
        request, with no blocks where the first token ends it or the pool is short (the prefill server
        may let its blocks go); where the pool is short or the fetch fails, the prompt is computed
        here instead, with the same outputs."""
        return RequestStream(self._open_prefilled(prompt, params, sampling_key, prefilled, fetch, request_id,
                                                  speculation), self.step_loop.abort)

    async def _open_prefilled(self, prompt: list[int], params: SamplingParams, sampling_key: int,
                              prefilled: PrefilledPrompt, fetch: FetchBlocks, request_id: str | None,
                              speculation: RequestSpeculation | None) -> RequestState:
        try:
            if params.n != 1:
                raise ValueError("a prefilled request has one choice")
            if len(prefilled.block_ids) != self.block_manager.blocks_for(len(prompt)):
                raise ValueError("the prefill server's blocks do not hold this prompt in blocks of this size")
            request = self._add_request(prompt, params, request_id or uuid.uuid4().hex, speculation,
                                        (sampling_key,), queued=False)
        except Exception:
            with contextlib.suppress(Exception):  # the prefill server may let its blocks go
                await fetch([], [])
            raise
        seq = request.seqs[0]
        if prefilled.drafts is not None and self.runner.mtp is not None:
            self.runner.mtp.proposer.adopt(seq.seq_id, prefilled.drafts.drafts(self.backend.xp))
        first_block = self.scheduler.reserve_prefilled(seq)
        if first_block is None:
            self.scheduler.add(seq)  # the pool is short: computed here, from its first token on
        prompt_logprobs = tuple((i, lp) for i, lp in enumerate(prefilled.prompt_logprobs or ()) if lp is not None)
        record = prefilled.logprob
        rendered = params.render_logprobs and record is not None  # (chat's logprobs: rendered as JSON entries)
        first = SeqStepOutput((prefilled.token_id,), (record,) if record and not rendered else None,
                              prompt_logprobs=prompt_logprobs,
                              logprobs_json=self.runner.renderer.render_records([record]) if rendered else None)
        self.outputs.process_step(SchedulerOutput((ScheduledSeq(seq, seq.num_prompt_tokens, 0, seq.num_prompt_tokens),),
                                                  ()), [first])
        task = asyncio.create_task(self._receive(seq, fetch, prefilled.block_ids, first_block))
        self.handoff_tasks.add(task)  # (the loop keeps only a weak reference)
        task.add_done_callback(self.handoff_tasks.discard)
        return request

    async def _receive(self, seq: Sequence, fetch: FetchBlocks, remote: tuple[int, ...],
                       first_block: int | None) -> None:
        """Fetch a prefilled prompt's K/V into the blocks reserved for it from `first_block` on (none
        where none are reserved or its first token ended it), then let it run."""
        reserved = first_block is not None
        fetching = reserved and not seq.is_finished
        blocks = (list(remote[first_block:]), seq.block_ids[first_block:len(remote)]) if fetching else ([], [])
        ok, started = False, time.perf_counter()
        try:
            await fetch(*blocks)
            ok = True
        except Exception:  # noqa: BLE001 - the prompt is computed here instead
            log.warning("fetching the K/V of request %s failed; computing its prompt here", seq.request_id,
                        exc_info=True)
        if fetching:
            kv = self.runner.kv
            per_block = (kv.k.nbytes + kv.v.nbytes) // (kv.num_blocks + 1)
            self.metrics.on_kv_fetched(len(blocks[0]), len(blocks[0]) * per_block, time.perf_counter() - started, ok)
        if reserved:
            self.scheduler.end_transfer(seq, ok and fetching)
            self.step_loop.wake.set()

    async def hand_off(self, prompt: str | list[int], params: SamplingParams, request_id: str | None,
                       speculation: RequestSpeculation | None) -> RequestState:
        """Decode role: add a one-choice request once a prefill server (`prefill_servers`) has run its
        prompt, as `generate_prefilled` does."""
        token_ids = self._prompt_ids(prompt, params)
        key = self._sampling_key(params, 0)
        prefilled, fetch = await self.prefill_servers.prefill(token_ids, params, key)
        return await self._open_prefilled(token_ids, params, key, prefilled, fetch, request_id, speculation)

    async def release_read_prompts(self) -> None:
        """Prefill role: release each prompt a decode server has read (or let go), as the notifications
        naming its handoff arrive; runs until cancelled."""
        while True:
            for _, message in self.kv_agent.notifications():
                self.release_prefilled(message.decode())
            await asyncio.sleep(NOTIFICATION_POLL_SECONDS)

    def release_prefilled(self, handoff_id: str) -> bool:
        """Let a prefilled prompt's K/V blocks go; False when they are not held any more."""
        return self.held_prompts.release(handoff_id)
