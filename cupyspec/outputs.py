"""What the engine yields to its callers: per-choice deltas with text, tokens and logprobs."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

from cupyspec.logprobs.logprob_json import LogprobsJSON
from cupyspec.spec_decode.stats import SpecStats

T = TypeVar("T")


def _top_pairs(entry: TokenLogprob | DraftLogprob) -> tuple[tuple[int, float], ...]:
    """(token_id, logprob) of each top alternative, most likely first."""
    return tuple(zip(entry.top_ids, entry.top_logprobs))


class TokenLogprob(NamedTuple):
    """One token's logprob under the model's own distribution, with the top alternatives (as many as
    asked, most likely first). A tuple: the engine makes one per emitted token."""

    token_id: int
    logprob: float
    top_ids: Sequence[int]
    top_logprobs: Sequence[float]  # [len(top_ids)]

    top = property(_top_pairs)


class DraftLogprob(NamedTuple):
    """A proposed draft token: the target model's logprob for it at its position (with the top
    alternatives there, as TokenLogprob), the verdict, and the draft model's own logprob of it
    (an MTP head's; None for model-free drafts)."""

    token_id: int
    logprob: float
    top_ids: Sequence[int]
    top_logprobs: Sequence[float]  # [len(top_ids)]
    accepted: bool
    draft_logprob: float | None = None

    top = property(_top_pairs)


@dataclass(frozen=True)
class CompletionDelta:
    """What one choice produced since the previous delta."""

    index: int  # choice index, 0..n-1
    text: str  # new text; never ends inside a UTF-8 character or a possible stop string
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None  # one per token in token_ids, when asked for
    finish_reason: str | None = None  # None while running; "stop", "length" or "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    draft_logprobs: tuple[DraftLogprob, ...] | None = None  # drafts proposed for this delta, when asked for
    logprobs_json: LogprobsJSON | None = None  # instead of `logprobs`, with SamplingParams.render_logprobs

    def __init__(self, index: int, text: str, token_ids: tuple[int, ...], logprobs: tuple[TokenLogprob, ...] | None,
                 finish_reason: str | None = None, stop_reason: str | int | None = None,
                 draft_logprobs: tuple[DraftLogprob, ...] | None = None,
                 logprobs_json: LogprobsJSON | None = None) -> None:
        # The engine makes one per choice and step: fill the frozen fields directly, without the
        # generated __init__'s object.__setattr__ per field.
        self.__dict__.update(index=index, text=text, token_ids=token_ids, logprobs=logprobs,
                             finish_reason=finish_reason, stop_reason=stop_reason, draft_logprobs=draft_logprobs,
                             logprobs_json=logprobs_json)

    @classmethod
    def concat(cls, parts: Sequence[CompletionDelta]) -> CompletionDelta:
        """One choice's successive deltas as one: texts, tokens and logprobs joined, the last one's finish."""
        last = parts[-1]
        rendered = [p.logprobs_json for p in parts if p.logprobs_json is not None]
        return cls(last.index, "".join(p.text for p in parts), tuple(t for p in parts for t in p.token_ids),
                   _concat_optional([p.logprobs for p in parts]), last.finish_reason, last.stop_reason,
                   _concat_optional([p.draft_logprobs for p in parts]),
                   LogprobsJSON.concat(rendered) if rendered else None)


def _concat_optional(parts: list[tuple[T, ...] | None]) -> tuple[T, ...] | None:
    """The parts joined, skipping None; None when every part is None."""
    present = [p for p in parts if p is not None]
    return tuple(itertools.chain.from_iterable(present)) if present else None


def merge_deltas(deltas: Sequence[CompletionDelta]) -> tuple[CompletionDelta, ...]:
    """One delta per choice, in the order the choices first moved; a choice's deltas concatenated."""
    if len(deltas) == 1 or len({d.index for d in deltas}) == len(deltas):
        return tuple(deltas)
    by_choice: dict[int, list[CompletionDelta]] = {}
    for delta in deltas:
        by_choice.setdefault(delta.index, []).append(delta)
    return tuple(parts[0] if len(parts) == 1 else CompletionDelta.concat(parts) for parts in by_choice.values())


@dataclass(frozen=True)
class SpeculateMetrics:
    """What speculation did for one request (all choices together)."""

    num_steps: int  # decode steps through the verifier
    num_draft_tokens: int
    num_accepted_tokens: int  # accepted drafts
    num_emitted_tokens: int  # accepted drafts plus bonus tokens
    acceptance_rate: float  # accepted / drafted
    mean_acceptance_length: float  # emitted tokens / steps
    accepted_per_position: tuple[int, ...]  # accepted drafts at each draft position

    @classmethod
    def from_stats(cls, stats: SpecStats) -> SpeculateMetrics:
        return cls(stats.num_steps, stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_emitted_tokens,
                   stats.acceptance_rate,
                   stats.mean_acceptance_length, tuple(stats.accepted_per_position))


@dataclass(frozen=True)
class RequestOutput:
    """One update of a request: deltas of the choices that moved."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    deltas: tuple[CompletionDelta, ...]
    num_prompt_tokens: int
    num_output_tokens: int  # emitted so far, all choices together
    finished: bool  # every choice has finished
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None  # first update only; entry 0 is None
    speculate_metrics: SpeculateMetrics | None = None  # the final update, when the engine speculates

    def __init__(self, request_id: str, prompt_token_ids: tuple[int, ...], deltas: tuple[CompletionDelta, ...],
                 num_prompt_tokens: int, num_output_tokens: int, finished: bool,
                 prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None,
                 speculate_metrics: SpeculateMetrics | None = None) -> None:
        # One per request and step, filled directly as CompletionDelta is.
        self.__dict__.update(request_id=request_id, prompt_token_ids=prompt_token_ids, deltas=deltas,
                             num_prompt_tokens=num_prompt_tokens, num_output_tokens=num_output_tokens,
                             finished=finished, prompt_logprobs=prompt_logprobs, speculate_metrics=speculate_metrics)
