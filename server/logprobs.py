"""Logprobs in the two OpenAI formats: legacy completions lists and chat `content` entries,
for emitted tokens and for proposed drafts (the same entries plus `accepted`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

from cupyspec.outputs import DraftLogprob, TokenLogprob
from cupyspec.server.protocol import (ChatDraftTokenLogprob, ChatTokenLogprob, CompletionDraftLogprobs,
                                      CompletionLogprobs, TopLogprob)

# JSON has no -inf; a token the model rules out gets this floor, as vLLM reports it.
MIN_LOGPROB = -9999.0

L = TypeVar("L", bound=CompletionLogprobs)


class TokenBytes(Protocol):
    def token_bytes(self, token_id: int) -> bytes: ...


class TokenText:
    """Token ids to their display strings and raw bytes, cached (the vocabulary is bounded)."""

    def __init__(self, tokenizer: TokenBytes) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def entry(self, token_id: int) -> tuple[str, list[int]]:
        """(text, bytes) of the token; the bytes list is shared: do not change it."""
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
        return self.entry(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return self.entry(token_id)[1]


def clamp(logprob: float) -> float:
    return logprob if logprob > MIN_LOGPROB else MIN_LOGPROB  # also maps -inf


def text_offsets(texts: TokenText, token_ids: Sequence[int], offset: int) -> list[int]:
    """Where each token starts in the choice's text when the first starts at character `offset`,
    then where the last ends: len(token_ids) + 1 offsets."""
    offsets = [offset]
    for token_id in token_ids:
        offsets.append(offsets[-1] + len(texts.text(token_id)))
    return offsets


def _fill_completion(result: L, texts: TokenText, token_ids: Sequence[int],
                     logprobs: Sequence[TokenLogprob | None], text_offset: Sequence[int]) -> L:
    """Append the tokens to `result`. A None entry (the first prompt token) has no logprob.
    `top_logprobs` maps the top tokens and the chosen one to their logprobs."""
    for token_id, entry, offset in zip(token_ids, logprobs, text_offset, strict=True):
        token = texts.text(token_id)
        result.tokens.append(token)
        result.text_offset.append(offset)
        if entry is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        top = {texts.text(t): clamp(lp) for t, lp in zip(entry.top_ids, entry.top_logprobs)}
        top.setdefault(token, clamp(entry.logprob))
        result.token_logprobs.append(clamp(entry.logprob))
        result.top_logprobs.append(top)
    return result


def completion_logprobs(texts: TokenText, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None],
                        offset: int) -> tuple[CompletionLogprobs, int]:
    """Legacy logprobs of `token_ids` whose text starts at character `offset` of the choice;
    returns them and the offset after the last token."""
    offsets = text_offsets(texts, token_ids, offset)
    result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    return _fill_completion(result, texts, token_ids, logprobs, offsets[:-1]), offsets[-1]


def completion_draft_logprobs(texts: TokenText, drafts: Sequence[DraftLogprob],
                              offsets: Sequence[int]) -> CompletionDraftLogprobs:
    """Legacy logprobs of one delta's drafts. `offsets` are the `text_offsets` of the delta's
    emitted tokens: draft j sits where the delta's j-th token does (for a delta of one step, the
    token emitted at the draft's position), a draft past the emitted tokens at their end."""
    result = CompletionDraftLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[],
                                     accepted=[d.accepted for d in drafts])
    text_offset = [offsets[min(j, len(offsets) - 1)] for j in range(len(drafts))]
    return _fill_completion(result, texts, [d.token_id for d in drafts], drafts, text_offset)


def merge_completion_logprobs(parts: Sequence[L], kind: type[L]) -> L:
    """Consecutive pieces of one choice's logprobs (or draft logprobs) joined into one."""
    return kind(**{name: [x for p in parts for x in getattr(p, name)] for name in kind.__struct_fields__})


def _chat_fields(texts: TokenText, entry: TokenLogprob) -> tuple[str, float, list[int], list[TopLogprob]]:
    """ChatTokenLogprob's fields, in order (positional: the server renders one per emitted token)."""
    entry_of, top = texts.entry, []
    for token_id, logprob in zip(entry.top_ids, entry.top_logprobs):
        text, raw = entry_of(token_id)
        top.append(TopLogprob(text, clamp(logprob), raw))
    text, raw = entry_of(entry.token_id)
    return text, clamp(entry.logprob), raw, top


def chat_logprobs(texts: TokenText, logprobs: Sequence[TokenLogprob]) -> list[ChatTokenLogprob]:
    """Chat `logprobs.content` entries: each token with its bytes and the top alternatives."""
    return [ChatTokenLogprob(*_chat_fields(texts, entry)) for entry in logprobs]


def chat_draft_logprobs(texts: TokenText, drafts: Sequence[DraftLogprob]) -> list[ChatDraftTokenLogprob]:
    """Chat `draft_logprobs.content` entries: the `logprobs.content` form plus `accepted`."""
    return [ChatDraftTokenLogprob(*_chat_fields(texts, d), accepted=d.accepted) for d in drafts]
