"""Incremental detokenization of one output sequence, with stop tokens, stop strings and length limits."""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Protocol

from cupyspec.sampling.params import SamplingParams


class TokenBytes(Protocol):
    """What the detokenizer needs from a tokenizer."""

    def token_bytes(self, token_id: int) -> bytes: ...

    def is_special(self, token_id: int) -> bool: ...


@dataclass(frozen=True)
class DetokenizedDelta:
    """The outcome of one add(): new text and whether (and why) the sequence finished."""

    text: str  # safe to emit: whole characters, never a possible beginning of a stop string
    num_tokens_accepted: int  # leading tokens of the call that count as output; the rest follow a stop
    finish_reason: str | None = None  # "stop" or "length"
    stop_reason: str | int | None = None  # the stop string or stop token id; None for eos and length


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
        self._params = params
        self._eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self._stop_ids = frozenset(params.stop_token_ids)
        self._stops = params.stop
        self._stop_prefixes = frozenset(s[:i] for s in params.stop for i in range(1, len(s)))
        self._longest_prefix = max((len(s) - 1 for s in params.stop), default=0)
        self._max_output_tokens = max_output_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""  # decoded text not yet emitted: it may begin a stop string
        self.num_output_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, token_ids: list[int]) -> DetokenizedDelta:
        """Process new tokens in order, stopping at the first stop condition."""
        if self.finished:
            raise RuntimeError("add() called on a finished sequence")
        pieces: list[str] = []
        for accepted, token in enumerate(token_ids, start=1):
            self.num_output_tokens += 1
            if token in self._eos:
                return self._finish(pieces, accepted, "stop", None)
            if token in self._stop_ids:
                return self._finish(pieces, accepted, "stop", token)
            if not (self._params.skip_special_tokens and self._tokenizer.is_special(token)):
                text = self._decoder.decode(self._tokenizer.token_bytes(token))
                if text and self._consume(text, pieces):
                    return DetokenizedDelta("".join(pieces), accepted, self.finish_reason, self.stop_reason)
            if self.num_output_tokens >= self._max_output_tokens:
                return self._finish(pieces, accepted, "length", None)
        return DetokenizedDelta("".join(pieces), len(token_ids))

    def flush(self) -> str:
        """The text still held back, for a sequence ended from outside (abort)."""
        text, self._held = self._held + self._decoder.decode(b"", final=True), ""
        return text

    def _consume(self, text: str, pieces: list[str]) -> bool:
        """Append decoded text to the held text; emit what is safe. True when a stop string ended it."""
        if not self._stops:
            pieces.append(text)
            return False
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
