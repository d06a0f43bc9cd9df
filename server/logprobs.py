"""Logprobs from the engine's records: legacy completions lists, for emitted tokens and for
proposed drafts, and chat `content` entries of proposed drafts (the chat entries of emitted tokens
come rendered by the engine: cupyspec/logprobs/logprob_json.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import msgspec

from cupyspec.logprobs.logprob_json import MIN_LOGPROB
from cupyspec.outputs import DraftLogprob, TokenLogprob
from cupyspec.server.protocol import ChatDraftTokenLogprob, CompletionDraftLogprobs, CompletionLogprobs, TopLogprob
from cupyspec.text.token_text import TokenText

L = TypeVar("L", bound=CompletionLogprobs)


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


def completion_draft_logprobs(texts: TokenText, drafts: Sequence[DraftLogprob], offsets: Sequence[int],
                              model_drafts: bool = False) -> CompletionDraftLogprobs:
    """Legacy logprobs of one delta's drafts. `offsets` are the `text_offsets` of the delta's
    emitted tokens: draft j sits where the delta's j-th token does (for a delta of one step, the
    token emitted at the draft's position), a draft past the emitted tokens at their end.
    model_drafts: a draft model (MTP) proposes: each delta lists its logprobs (None where it did not
    make the draft)."""
    result = CompletionDraftLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[],
                                     accepted=[d.accepted for d in drafts])
    if model_drafts:
        result.draft_token_logprobs = [None if d.draft_logprob is None else clamp(d.draft_logprob) for d in drafts]
    text_offset = [offsets[min(j, len(offsets) - 1)] for j in range(len(drafts))]
    return _fill_completion(result, texts, [d.token_id for d in drafts], drafts, text_offset)


_OPTIONAL = {kind: {name for name, default in zip(kind.__struct_fields__[-len(kind.__struct_defaults__):],
                                                 kind.__struct_defaults__) if default is msgspec.UNSET}
             for kind in (CompletionLogprobs, CompletionDraftLogprobs)}  # the fields a piece may leave out


def merge_completion_logprobs(parts: Sequence[L], kind: type[L]) -> L:
    """Consecutive pieces of one choice's logprobs (or draft logprobs) joined into one; an optional
    list that some pieces leave out is None for their tokens there."""
    merged = {}
    for name in kind.__struct_fields__:
        lists = [getattr(p, name) for p in parts]
        if not any(x is not msgspec.UNSET for x in lists) and name in _OPTIONAL[kind]:
            continue
        merged[name] = [x for p, values in zip(parts, lists)
                        for x in (values if values is not msgspec.UNSET else [None] * len(p.tokens))]
    return kind(**merged)


def _chat_fields(texts: TokenText, entry: DraftLogprob) -> tuple[str, float, list[int], list[TopLogprob]]:
    """ChatTokenLogprob's fields, in order (positional: the server makes one per draft)."""
    entry_of, top = texts.entry, []
    for token_id, logprob in zip(entry.top_ids, entry.top_logprobs):
        text, raw = entry_of(token_id)
        top.append(TopLogprob(text, clamp(logprob), raw))
    text, raw = entry_of(entry.token_id)
    return text, clamp(entry.logprob), raw, top


def chat_draft_logprobs(texts: TokenText, drafts: Sequence[DraftLogprob]) -> list[ChatDraftTokenLogprob]:
    """Chat `draft_logprobs.content` entries: the `logprobs.content` form plus `accepted`."""
    return [ChatDraftTokenLogprob(*_chat_fields(texts, d), accepted=d.accepted,
                                  draft_logprob=msgspec.UNSET if d.draft_logprob is None else clamp(d.draft_logprob))
            for d in drafts]
