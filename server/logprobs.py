"""Logprobs in the two OpenAI formats: legacy completions lists and chat `content` entries."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from cupyspec.outputs import TokenLogprob
from cupyspec.server.protocol import ChatTokenLogprob, CompletionLogprobs, TopLogprob

# JSON has no -inf; a token the model rules out gets this floor, as vLLM reports it.
MIN_LOGPROB = -9999.0


class TokenBytes(Protocol):
    def token_bytes(self, token_id: int) -> bytes: ...


class TokenText:
    """Token ids to their display strings and raw bytes, cached (the vocabulary is bounded)."""

    def __init__(self, tokenizer: TokenBytes) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def _entry(self, token_id: int) -> tuple[str, list[int]]:
        entry = self._cache.get(token_id)
        if entry is None:
            raw = self._tokenizer.token_bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:  # part of a multi-byte character: show the bytes, like vLLM
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            entry = self._cache[token_id] = (text, list(raw))
        return entry

    def text(self, token_id: int) -> str:
        return self._entry(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return self._entry(token_id)[1]


def clamp(logprob: float) -> float:
    return logprob if logprob > MIN_LOGPROB else MIN_LOGPROB  # also maps -inf


def completion_logprobs(texts: TokenText, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None],
                        offset: int) -> tuple[CompletionLogprobs, int]:
    """Legacy logprobs of `token_ids` whose text starts at character `offset` of the choice;
    returns them and the offset after the last token. A None entry (the first prompt token) has
    no logprob. `top_logprobs` maps the top tokens and the chosen one to their logprobs."""
    result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for token_id, entry in zip(token_ids, logprobs, strict=True):
        token = texts.text(token_id)
        result.tokens.append(token)
        result.text_offset.append(offset)
        offset += len(token)
        if entry is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        top = {texts.text(t): clamp(lp) for t, lp in entry.top}
        top.setdefault(token, clamp(entry.logprob))
        result.token_logprobs.append(clamp(entry.logprob))
        result.top_logprobs.append(top)
    return result, offset


def merge_completion_logprobs(parts: Sequence[CompletionLogprobs]) -> CompletionLogprobs:
    """Consecutive pieces of one choice's logprobs joined into one."""
    return CompletionLogprobs(
        tokens=[t for p in parts for t in p.tokens],
        token_logprobs=[t for p in parts for t in p.token_logprobs],
        top_logprobs=[t for p in parts for t in p.top_logprobs],
        text_offset=[t for p in parts for t in p.text_offset],
    )


def chat_logprobs(texts: TokenText, logprobs: Sequence[TokenLogprob]) -> list[ChatTokenLogprob]:
    """Chat `logprobs.content` entries: each token with its bytes and the top alternatives."""
    return [
        ChatTokenLogprob(
            token=texts.text(entry.token_id), logprob=clamp(entry.logprob), bytes=texts.bytes(entry.token_id),
            top_logprobs=[TopLogprob(token=texts.text(t), logprob=clamp(lp), bytes=texts.bytes(t))
                          for t, lp in entry.top],
        )
        for entry in logprobs
    ]
