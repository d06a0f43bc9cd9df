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

import msgspec
from aiohttp import web

from cupyspec.logprobs.logprob_json import LogprobsJSON
from cupyspec.outputs import CompletionDelta, RequestOutput
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
from cupyspec.server.streaming import UsageCounter, deliver, engine_streams, include_usage, write_sse

EMPTY_ENTRIES = LogprobsJSON(b"", ())


class ChatJob:
    """A chat request's outputs turned into OpenAI chat choices: streamed as chunks (`opening`,
    `chunks`, `closing`), or gathered (`add`) into one response."""

    def __init__(self, ctx: ServerContext, req: ChatCompletionRequest, n: int, request_id: str) -> None:
        self.ctx, self.req, self.n = ctx, req, n
        self.id = request_id
        self.created = int(time.time())
        self.usage = UsageCounter()
        self.spec = SpeculateMetricsSum(1)
        self._usage_chunk = include_usage(req.stream_options)
        self._texts: list[list[str]] = [[] for _ in range(n)]
        self._logprobs: list[list[LogprobsJSON]] = [[] for _ in range(n)]
        self._drafts: list[list[ChatDraftTokenLogprob]] = [[] for _ in range(n)]
        self._finals: list[CompletionDelta | None] = [None] * n

    def _logprobs_of(self, delta: CompletionDelta) -> LogprobsJSON | None:
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

    def _deltas(self, output: RequestOutput) -> list[tuple[CompletionDelta, bool]]:
        """Count the output, and return its deltas that carry something, each with whether it is the
        request's last."""
        self.usage.update(0, output)
        self.spec.update(output)
        moving = [d for d in output.deltas if d.text or d.token_ids or d.finish_reason or d.draft_logprobs]
        return [(delta, self.spec.complete and i == len(moving) - 1) for i, delta in enumerate(moving)]

    def _chunk(self, choices: list[ChatChunkChoice], usage: bool = False, last: bool = False) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, object="chat.completion.chunk", created=self.created,
                                   model=self.ctx.model_name, choices=choices,
                                   usage=self.usage.usage() if usage else None,
                                   speculate_metrics=self.spec.result() if last else None)

    def opening(self) -> list[ChatCompletionChunk]:
        """A role chunk per choice."""
        return [self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""),
                                             logprobs=None, finish_reason=None)])
                for index in range(self.n)]

    def chunks(self, index: int, output: RequestOutput) -> list[ChatCompletionChunk]:
        """A content chunk per delta that moved; the last of each choice has its finish reason, and
        the stream's last chunk carries speculate_metrics."""
        chunks = []
        for delta, last in self._deltas(output):
            content, drafts = self._logprobs_of(delta), self._draft_logprobs(delta)
            choice = ChatChunkChoice(
                index=delta.index, delta=ChatDelta(content=delta.text) if delta.text else ChatDelta(),
                logprobs=ChatLogprobs(msgspec.Raw(content.json())) if content is not None else None,
                finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
                draft_logprobs=ChatDraftLogprobs(drafts) if drafts is not None else msgspec.UNSET)
            chunks.append(self._chunk([choice], last=last and not self._usage_chunk))
        return chunks

    def closing(self) -> list[ChatCompletionChunk]:
        """The usage chunk, if asked for."""
        return [self._chunk([], usage=True, last=True)] if self._usage_chunk else []

    def add(self, index: int, output: RequestOutput) -> None:
        """Gather an output into the choices of `response`."""
        for delta, _last in self._deltas(output):
            self._texts[delta.index].append(delta.text)
            if self.req.logprobs:
                self._logprobs[delta.index].append(self._logprobs_of(delta))
            self._drafts[delta.index] += self._draft_logprobs(delta) or []
            self._finals[delta.index] = delta

    def response(self) -> ChatCompletionResponse:
        choices = [
            ChatChoice(index=i, message=AssistantMessage(role="assistant", content="".join(self._texts[i])),
                       logprobs=ChatLogprobs(msgspec.Raw(LogprobsJSON.concat(self._logprobs[i]).json()))
                       if self.req.logprobs else None,
                       finish_reason=final.finish_reason if final else None,
                       stop_reason=final.stop_reason if final else None,
                       draft_logprobs=ChatDraftLogprobs(self._drafts[i]) if self.req.include_draft_logprobs
                       else msgspec.UNSET)
            for i, final in enumerate(self._finals)
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
    job = ChatJob(ctx, req, params.n, request_id)
    async with engine_streams([ctx.engine.chat(messages, params, request_id, speculation=speculation)]) as streams:
        if req.stream:
            return await write_sse(request, job, streams)
        await deliver(streams, job.add)
    return json_response(job.response())
