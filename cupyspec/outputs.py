"""What the engine yields to its callers: per-choice deltas with text, tokens and logprobs."""

from __future__ import annotations

from dataclasses import dataclass

from cupyspec.spec.stats import SpecStats


@dataclass(frozen=True)
class TokenLogprob:
    """One token's logprob under the model's own distribution, with the top alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token_id, logprob), most likely first; as many as asked


@dataclass(frozen=True)
class DraftLogprob(TokenLogprob):
    """A proposed draft token: the target model's logprob for it at its position, and the verdict."""

    accepted: bool


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
