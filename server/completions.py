"""POST /v1/completions: one engine request per prompt; choice index = prompt index * n + choice.

With speculation on, `speculate_metrics` (summed over the prompts) is a top-level field of the
response, and of a stream's last chunk before `data: [DONE]` (the usage chunk if asked for, else
the chunk with the last finish reason).

With `include_draft_logprobs`, every choice (every chunk's choice) carries `draft_logprobs`: the
drafts proposed for its tokens, in the legacy format plus `accepted`; `text_offset` as described
in `completion_draft_logprobs`.
"""

from __future__ import annotations

import time
import uuid

import msgspec
from aiohttp import web

from cupyspec.outputs import CompletionDelta, DraftLogprob, RequestOutput, TokenLogprob
from cupyspec.server.context import ServerContext, decode_body, json_response
from cupyspec.server.logprobs import (
    completion_draft_logprobs,
    completion_logprobs,
    merge_completion_logprobs,
    text_offsets,
)
from cupyspec.server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionDraftLogprobs,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from cupyspec.server.sampling import Prompt, completion_params, completion_prompts
from cupyspec.server.speculation import SpeculateMetricsSum, request_speculation
from cupyspec.server.streaming import UsageCounter, deliver, engine_streams, include_usage, write_sse


class CompletionJob:
    """The engine requests of one completions call (one per prompt) turned into OpenAI choices:
    streamed as chunks (`chunks`, `closing`), or gathered (`add`) into one response."""

    def __init__(self, ctx: ServerContext, req: CompletionRequest, prompts: list[Prompt], n: int,
                 request_id: str) -> None:
        self.ctx, self.req, self.prompts, self.n = ctx, req, prompts, n
        self.id = request_id
        self.created = int(time.time())
        self.usage = UsageCounter()
        self.spec = SpeculateMetricsSum(len(prompts))
        self._usage_chunk = include_usage(req.stream_options)
        self._offsets: dict[int, int] = {}  # choice index -> characters of text so far (text_offset)
        self._echoed: set[int] = set()  # prompts whose echo was sent
        self._parts: dict[int, list[CompletionChoice]] = {i: [] for i in range(len(prompts) * n)}

    def _piece(self, index: int, text: str, token_ids: tuple[int, ...],
               logprobs: tuple[TokenLogprob | None, ...] | None, drafts: tuple[DraftLogprob, ...] | None = None,
               finish_reason: str | None = None, stop_reason: str | int | None = None) -> CompletionChoice:
        choice = CompletionChoice(index=index, text=text, logprobs=None, finish_reason=finish_reason,
                                  stop_reason=stop_reason)
        if self.req.logprobs is None and not self.req.include_draft_logprobs:
            return choice
        texts, start = self.ctx.token_text, self._offsets.get(index, 0)
        offsets = text_offsets(texts, token_ids, start)
        self._offsets[index] = offsets[-1]
        if self.req.logprobs is not None and logprobs is not None:
            choice.logprobs = completion_logprobs(texts, token_ids, logprobs, start)[0]
        if self.req.include_draft_logprobs:  # None: the engine proposed nothing (it does not speculate)
            choice.draft_logprobs = completion_draft_logprobs(texts, drafts or (), offsets,
                                                              self.ctx.engine.drafts_with_model)
        return choice

    def _echo(self, prompt_index: int, first: RequestOutput) -> list[CompletionChoice]:
        prompt = self.prompts[prompt_index]
        text = prompt if isinstance(prompt, str) else self.ctx.engine.tokenizer.decode(list(prompt))
        return [self._piece(prompt_index * self.n + i, text, first.prompt_token_ids, first.prompt_logprobs)
                for i in range(self.n)]

    def _delta(self, prompt_index: int, delta: CompletionDelta) -> CompletionChoice | None:
        if not (delta.text or delta.token_ids or delta.finish_reason or delta.draft_logprobs):
            return None
        return self._piece(prompt_index * self.n + delta.index, delta.text, delta.token_ids, delta.logprobs,
                           delta.draft_logprobs, delta.finish_reason, delta.stop_reason)

    def _pieces(self, prompt_index: int, output: RequestOutput) -> list[tuple[CompletionChoice, bool]]:
        """Count the output, and return its choice fragments (the echoed prompt first), each with
        whether it is the last of all."""
        self.usage.update(prompt_index, output)
        self.spec.update(output)
        pieces = []
        if self.req.echo and prompt_index not in self._echoed:
            self._echoed.add(prompt_index)
            pieces += [(piece, False) for piece in self._echo(prompt_index, output)]
        moving = [p for p in (self._delta(prompt_index, d) for d in output.deltas) if p is not None]
        return pieces + [(piece, self.spec.complete and i == len(moving) - 1) for i, piece in enumerate(moving)]

    def _chunk(self, choices: list[CompletionChoice], usage: bool = False, last: bool = False) -> CompletionChunk:
        return CompletionChunk(id=self.id, object="text_completion", created=self.created, model=self.ctx.model_name,
                               choices=choices, usage=self.usage.usage() if usage else None,
                               speculate_metrics=self.spec.result() if last else None)

    def opening(self) -> list[CompletionChunk]:
        return []

    def chunks(self, prompt_index: int, output: RequestOutput) -> list[CompletionChunk]:
        """One chunk per fragment; the stream's last carries speculate_metrics."""
        return [self._chunk([piece], last=last and not self._usage_chunk)
                for piece, last in self._pieces(prompt_index, output)]

    def closing(self) -> list[CompletionChunk]:
        """The usage chunk, if asked for."""
        return [self._chunk([], usage=True, last=True)] if self._usage_chunk else []

    def add(self, prompt_index: int, output: RequestOutput) -> None:
        """Gather an output into the choices of `response`."""
        for piece, _last in self._pieces(prompt_index, output):
            self._parts[piece.index].append(piece)

    def response(self) -> CompletionResponse:
        choices = []
        for index, pieces_of_choice in self._parts.items():
            logprobs: list[CompletionLogprobs] = [p.logprobs for p in pieces_of_choice if p.logprobs is not None]
            drafts = [p.draft_logprobs for p in pieces_of_choice
                      if isinstance(p.draft_logprobs, CompletionDraftLogprobs)]
            last = pieces_of_choice[-1] if pieces_of_choice else None
            choices.append(CompletionChoice(
                index=index, text="".join(p.text for p in pieces_of_choice),
                logprobs=merge_completion_logprobs(logprobs, CompletionLogprobs) if self.req.logprobs is not None
                else None,
                finish_reason=last.finish_reason if last else None, stop_reason=last.stop_reason if last else None,
                draft_logprobs=merge_completion_logprobs(drafts, CompletionDraftLogprobs)
                if self.req.include_draft_logprobs else msgspec.UNSET))
        return CompletionResponse(id=self.id, object="text_completion", created=self.created,
                                  model=self.ctx.model_name, choices=choices, usage=self.usage.usage(),
                                  speculate_metrics=self.spec.result())


async def handle_completions(request: web.Request) -> web.StreamResponse:
    ctx = ServerContext.of(request)
    req = await decode_body(request, CompletionRequest)
    ctx.check_model(req.model)
    prompts = completion_prompts(req)
    params = completion_params(req)
    speculation = request_speculation(req)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    job = CompletionJob(ctx, req, prompts, params.n, request_id)
    requests = [ctx.engine.generate(prompt, params, rid, speculation=speculation)
                for prompt, rid in zip(prompts, ids, strict=True)]
    async with engine_streams(requests) as streams:
        if req.stream:
            return await write_sse(request, job, streams)
        await deliver(streams, job.add)
    return json_response(job.response())
