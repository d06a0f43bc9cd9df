"""Incremental detokenization of one output sequence, with stop tokens, stop strings and length limits."""

from __future__ import annotations

import codecs
import weakref
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from cupyspec.sampling.params import SamplingParams


class TokenBytes(Protocol):
    """What the detokenizer needs from a tokenizer."""

    def token_bytes(self, token_id: int) -> bytes: ...

    def is_special(self, token_id: int) -> bool: ...


class DetokenizedDelta(NamedTuple):
    """The outcome of one add(): new text and whether (and why) the sequence finished."""

    text: str  # safe to emit: whole characters, never a possible beginning of a stop string
    num_tokens_accepted: int  # leading tokens of the call that count as output; the rest follow a stop
    finish_reason: str | None = None  # "stop" or "length"
    stop_reason: str | int | None = None  # the stop string or stop token id; None for eos and length


_TOKEN_TEXTS: weakref.WeakKeyDictionary[TokenBytes, dict[int, str]] = weakref.WeakKeyDictionary()


def _token_texts(tokenizer: TokenBytes) -> dict[int, str]:
    """The shared cache of a tokenizer's tokens that decode to whole characters on their own."""
    try:
        return _TOKEN_TEXTS.setdefault(tokenizer, {})
    except TypeError:  # not weakly referenceable: a cache for this detokenizer alone
        return {}


class IncrementalDetokenizer:
    """Turns a sequence's output tokens into text deltas and decides when it stops.

    Each add() costs O(new bytes + stop strings' length), independent of the text so far.
    Stop strings are found on the decoded text across token boundaries, at the earliest
    position where one completes, so the result does not depend on how the text was split.
    """

    def __init__(self, tokenizer: TokenBytes, params: SamplingParams, eos_token_ids: tuple[int, ...],
                 max_output_tokens: int) -> None:
        if not isinstance(max_output_tokens, int) or max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be an integer >= 1, got {max_output_tokens!r}")
        self._tokenizer = tokenizer
        self._texts = _token_texts(tokenizer)
        self._params = params
        self._eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self._ends = self._eos | frozenset(params.stop_token_ids)  # tokens that stop the sequence
        self._skip_special = params.skip_special_tokens
        self._stops = params.stop
        self._stop_prefixes = frozenset(s[:i] for s in params.stop for i in range(1, len(s)))
        self._longest_prefix = max((len(s) - 1 for s in params.stop), default=0)
        self._max_output_tokens = max_output_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._partial = False  # the decoder holds the first bytes of a character
        self._held = ""  # decoded text not yet emitted: it may begin a stop string
        self.num_output_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def may_end_within(self, token_ids: Sequence[int]) -> bool:
        """Whether these next tokens end the sequence by a stop token or its length (stop strings aside)."""
        return (self.num_output_tokens + len(token_ids) >= self._max_output_tokens
                or not self._ends.isdisjoint(token_ids))

    def add(self, token_ids: Sequence[int]) -> DetokenizedDelta:
        """Process new tokens in order, stopping at the first stop condition."""
        if self.finish_reason is not None:
            raise RuntimeError("add() called on a finished sequence")
        pieces: list[str] = []
        for accepted, token in enumerate(token_ids, start=1):
            self.num_output_tokens += 1
            if token in self._ends:
                return self._finish(pieces, accepted, "stop", None if token in self._eos else token)
            if not (self._skip_special and self._tokenizer.is_special(token)):
                text = self._text(token)
                if self._stops:
                    if text and self._consume(text, pieces):
                        return DetokenizedDelta("".join(pieces), accepted, self.finish_reason, self.stop_reason)
                elif text:
                    pieces.append(text)
            if self.num_output_tokens >= self._max_output_tokens:
                return self._finish(pieces, accepted, "length", None)
        return DetokenizedDelta("".join(pieces), len(token_ids))

    def _text(self, token: int) -> str:
        """The text a token completes: cached for a token of whole characters met between characters."""
        if not self._partial:
            text = self._texts.get(token)
            if text is not None:
                return text
        raw = self._tokenizer.token_bytes(token)
        if not self._partial:
            try:
                text = self._texts[token] = raw.decode("utf-8")
                return text
            except UnicodeDecodeError:
                pass
        text = self._decoder.decode(raw)
        self._partial = bool(self._decoder.getstate()[0])
        return text

    def flush(self) -> str:
        """The text still held back, for a sequence ended from outside (abort)."""
        text, self._held = self._held + self._decoder.decode(b"", final=True), ""
        self._partial = False
        return text

    def _consume(self, text: str, pieces: list[str]) -> bool:
        """Append decoded text to the held text; emit what is safe. True when a stop string ended it."""
        buffer = self._held + text  # the held part holds no whole stop string
        best: tuple[int, int, str] | None = None  # (end, start, stop string) of the first completed
        for stop in self._stops:
            start = buffer.find(stop, max(0, len(self._held) - len(stop) + 1))
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        if best is not None:
            end, start, stop = best
            pieces.append(buffer[:end if self._params.include_stop_str_in_output else start])
            self._held = ""
            self.finish_reason, self.stop_reason = "stop", stop
            return True
        hold = next((n for n in range(min(len(buffer), self._longest_prefix), 0, -1)
                     if buffer[-n:] in self._stop_prefixes), 0)
        pieces.append(buffer[:len(buffer) - hold])
        self._held = buffer[len(buffer) - hold:]
        return False

    def _finish(self, pieces: list[str], accepted: int, reason: str, stop_reason: int | None) -> DetokenizedDelta:
        pieces.append(self.flush())
        self.finish_reason, self.stop_reason = reason, stop_reason
        return DetokenizedDelta("".join(pieces), accepted, reason, stop_reason)
