"""POST /v1/chat/completions: one engine request with n choices."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from aiohttp import web

from cupyspec.outputs import CompletionDelta
from cupyspec.server.context import ServerContext, decode_body, json_response
from cupyspec.server.logprobs import chat_logprobs
from cupyspec.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                      ChatCompletionRequest, ChatCompletionResponse, ChatDelta, ChatLogprobs,
                                      ChatTokenLogprob)
from cupyspec.server.sampling import chat_messages, chat_params
from cupyspec.server.streaming import EngineStream, UsageCounter, engine_streams, merged, write_sse


class ChatJob:
    """A running chat request turned into OpenAI chat choices."""

    def __init__(self, ctx: ServerContext, req: ChatCompletionRequest, n: int, stream: EngineStream,
                 request_id: str) -> None:
        self.ctx, self.req, self.n, self.stream = ctx, req, n, stream
        self.id = request_id
        self.created = int(time.time())
        self.usage = UsageCounter()

    def _logprobs(self, delta: CompletionDelta) -> list[ChatTokenLogprob] | None:
        if not self.req.logprobs or delta.logprobs is None:
            return None
        return chat_logprobs(self.ctx.token_text, delta.logprobs)

    async def deltas(self) -> AsyncIterator[CompletionDelta]:
        async with aclosing(merged([self.stream])) as outputs:
            async for _, output in outputs:
                self.usage.update(0, output)
                for delta in output.deltas:
                    if delta.text or delta.token_ids or delta.finish_reason:
                        yield delta

    def _chunk(self, choices: list[ChatChunkChoice], usage: bool = False) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, object="chat.completion.chunk", created=self.created,
                                   model=self.ctx.model_name, choices=choices,
                                   usage=self.usage.usage() if usage else None)

    async def chunks(self) -> AsyncIterator[ChatCompletionChunk]:
        """A role chunk per choice, then content chunks; the last of each choice has its finish reason."""
        for index in range(self.n):
            role = ChatDelta(role="assistant", content="")
            yield self._chunk([ChatChunkChoice(index=index, delta=role, logprobs=None, finish_reason=None)])
        async with aclosing(self.deltas()) as deltas:
            async for delta in deltas:
                content = self._logprobs(delta)
                choice = ChatChunkChoice(
                    index=delta.index, delta=ChatDelta(content=delta.text) if delta.text else ChatDelta(),
                    logprobs=ChatLogprobs(content) if content is not None else None,
                    finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)
                yield self._chunk([choice])
        if self.req.stream_options is not None and self.req.stream_options.include_usage:
            yield self._chunk([], usage=True)

    async def response(self) -> ChatCompletionResponse:
        texts: list[list[str]] = [[] for _ in range(self.n)]
        logprobs: list[list[ChatTokenLogprob]] = [[] for _ in range(self.n)]
        finals: list[CompletionDelta | None] = [None] * self.n
        async with aclosing(self.deltas()) as deltas:
            async for delta in deltas:
                texts[delta.index].append(delta.text)
                logprobs[delta.index] += self._logprobs(delta) or []
                finals[delta.index] = delta
        choices = [
            ChatChoice(index=i, message=AssistantMessage(role="assistant", content="".join(texts[i])),
                       logprobs=ChatLogprobs(logprobs[i]) if self.req.logprobs else None,
                       finish_reason=final.finish_reason if final else None,
                       stop_reason=final.stop_reason if final else None)
            for i, final in enumerate(finals)
        ]
        return ChatCompletionResponse(id=self.id, object="chat.completion", created=self.created,
                                      model=self.ctx.model_name, choices=choices, usage=self.usage.usage())


async def handle_chat(request: web.Request) -> web.StreamResponse:
    ctx = ServerContext.of(request)
    req = await decode_body(request, ChatCompletionRequest)
    ctx.check_model(req.model)
    messages = chat_messages(req)
    params = chat_params(req)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    async with engine_streams(ctx.engine, [(ctx.engine.chat(messages, params, request_id), request_id)]) as streams:
        job = ChatJob(ctx, req, params.n, streams[0], request_id)
        if req.stream:
            return await write_sse(request, job.chunks())
        return json_response(await job.response())
