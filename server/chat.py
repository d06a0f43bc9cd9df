"""POST /v1/chat/completions: one engine request with n choices.

With speculation on, `speculate_metrics` is a top-level field of the response, and of a
stream's last chunk before `data: [DONE]` (the usage chunk if asked for, else the chunk with
the last finish reason).

With `include_draft_logprobs`, every choice (every content chunk's choice) carries
`draft_logprobs.content`: the drafts proposed for its tokens, as `logprobs.content` entries plus
`accepted`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

import msgspec
from aiohttp import web

from cupyspec.logprobs.logprob_json import LogprobsJSON
from cupyspec.outputs import CompletionDelta
from cupyspec.server.context import ServerContext, decode_body, json_response
from cupyspec.server.logprobs import chat_draft_logprobs
from cupyspec.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatDraftLogprobs,
    ChatDraftTokenLogprob,
    ChatLogprobs,
)
from cupyspec.server.sampling import chat_messages, chat_params
from cupyspec.server.speculation import SpeculateMetricsSum, request_speculation
from cupyspec.server.streaming import EngineStream, UsageCounter, engine_streams, include_usage, merged, write_sse

EMPTY_ENTRIES = LogprobsJSON(b"", ())


class ChatJob:
    """A running chat request turned into OpenAI chat choices."""

    def __init__(self, ctx: ServerContext, req: ChatCompletionRequest, n: int, stream: EngineStream,
                 request_id: str) -> None:
        self.ctx, self.req, self.n, self.stream = ctx, req, n, stream
        self.id = request_id
        self.created = int(time.time())
        self.usage = UsageCounter()
        self.spec = SpeculateMetricsSum(1)

    def _logprobs(self, delta: CompletionDelta) -> LogprobsJSON | None:
        """The delta's `logprobs.content` entries, rendered by the engine (SamplingParams.render_logprobs)."""
        if not self.req.logprobs:
            return None
        if delta.logprobs_json is None and delta.token_ids:
            raise RuntimeError("the engine sent tokens without their rendered logprobs")
        return delta.logprobs_json or EMPTY_ENTRIES  # a delta without tokens: none

    def _draft_logprobs(self, delta: CompletionDelta) -> list[ChatDraftTokenLogprob] | None:
        if not self.req.include_draft_logprobs:
            return None
        # None: the engine proposed nothing (it does not speculate)
        return chat_draft_logprobs(self.ctx.token_text, delta.draft_logprobs or ())

    async def deltas(self) -> AsyncIterator[tuple[CompletionDelta, bool]]:
        """The deltas that carry something, each with whether it is the request's last."""
        async with aclosing(merged([self.stream])) as outputs:
            async for _, output in outputs:
                self.usage.update(0, output)
                self.spec.update(output)
                moving = [d for d in output.deltas if d.text or d.token_ids or d.finish_reason or d.draft_logprobs]
                for i, delta in enumerate(moving):
                    yield delta, self.spec.complete and i == len(moving) - 1

    def _chunk(self, choices: list[ChatChunkChoice], usage: bool = False, last: bool = False) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, object="chat.completion.chunk", created=self.created,
                                   model=self.ctx.model_name, choices=choices,
                                   usage=self.usage.usage() if usage else None,
                                   speculate_metrics=self.spec.result() if last else None)

    async def chunks(self) -> AsyncIterator[ChatCompletionChunk]:
        """A role chunk per choice, then content chunks; the last of each choice has its finish reason.
        The stream's last chunk carries speculate_metrics."""
        usage_chunk = include_usage(self.req.stream_options)
        for index in range(self.n):
            role = ChatDelta(role="assistant", content="")
            yield self._chunk([ChatChunkChoice(index=index, delta=role, logprobs=None, finish_reason=None)])
        async with aclosing(self.deltas()) as deltas:
            async for delta, last in deltas:
                content, drafts = self._logprobs(delta), self._draft_logprobs(delta)
                choice = ChatChunkChoice(
                    index=delta.index, delta=ChatDelta(content=delta.text) if delta.text else ChatDelta(),
                    logprobs=ChatLogprobs(msgspec.Raw(content.json())) if content is not None else None,
                    finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
                    draft_logprobs=ChatDraftLogprobs(drafts) if drafts is not None else msgspec.UNSET)
                yield self._chunk([choice], last=last and not usage_chunk)
        if usage_chunk:
            yield self._chunk([], usage=True, last=True)

    async def response(self) -> ChatCompletionResponse:
        texts: list[list[str]] = [[] for _ in range(self.n)]
        logprobs: list[list[LogprobsJSON]] = [[] for _ in range(self.n)]
        drafts: list[list[ChatDraftTokenLogprob]] = [[] for _ in range(self.n)]
        finals: list[CompletionDelta | None] = [None] * self.n
        async with aclosing(self.deltas()) as deltas:
            async for delta, _last in deltas:
                texts[delta.index].append(delta.text)
                if self.req.logprobs:
                    logprobs[delta.index].append(self._logprobs(delta))
                drafts[delta.index] += self._draft_logprobs(delta) or []
                finals[delta.index] = delta
        choices = [
            ChatChoice(index=i, message=AssistantMessage(role="assistant", content="".join(texts[i])),
                       logprobs=ChatLogprobs(msgspec.Raw(LogprobsJSON.concat(logprobs[i]).json()))
                       if self.req.logprobs else None,
                       finish_reason=final.finish_reason if final else None,
                       stop_reason=final.stop_reason if final else None,
                       draft_logprobs=ChatDraftLogprobs(drafts[i]) if self.req.include_draft_logprobs
                       else msgspec.UNSET)
            for i, final in enumerate(finals)
        ]
        return ChatCompletionResponse(id=self.id, object="chat.completion", created=self.created,
                                      model=self.ctx.model_name, choices=choices, usage=self.usage.usage(),
                                      speculate_metrics=self.spec.result())


async def handle_chat(request: web.Request) -> web.StreamResponse:
    ctx = ServerContext.of(request)
    req = await decode_body(request, ChatCompletionRequest)
    ctx.check_model(req.model)
    messages = chat_messages(req)
    params = chat_params(req)
    speculation = request_speculation(req)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    outputs = ctx.engine.chat(messages, params, request_id, speculation=speculation)
    async with engine_streams(ctx.engine, [(outputs, request_id)]) as streams:
        job = ChatJob(ctx, req, params.n, streams[0], request_id)
        if req.stream:
            return await write_sse(request, job.chunks())
        return json_response(await job.response())
