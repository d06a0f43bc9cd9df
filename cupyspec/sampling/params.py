"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from cupyspec.errors import InvalidRequestError

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Defaults follow the OpenAI API."""

    n: int = 1
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's logprob and the top k
    prompt_logprobs: int | None = None  # same, for the prompt tokens (completions `echo`)
    include_draft_logprobs: bool = False  # each proposed draft's target logprob (top `logprobs` alternatives)
    render_logprobs: bool = False  # with `logprobs`: as chat JSON entries (CompletionDelta.logprobs_json), not records
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        def need(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidRequestError(f"{param} {message}", param)

        need(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1")
        need(self.n <= 128, "n", "must be at most 128")
        need(self.temperature >= 0.0, "temperature", "must be >= 0")
        need(0.0 < self.top_p <= 1.0, "top_p", "must lie in (0, 1]")
        need(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "must be -1, 0 (off) or a positive integer")
        need(0.0 <= self.min_p <= 1.0, "min_p", "must lie in [0, 1]")
        need(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
             "max_tokens", "must be an integer >= 1")
        need(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must lie in [-2, 2]")
        need(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must lie in [-2, 2]")
        need(self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            need(value is None or (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS), name,
                 f"must be an integer from 0 to {MAX_LOGPROBS}")
        need(isinstance(self.include_draft_logprobs, bool), "include_draft_logprobs", "must be a boolean")
        need(isinstance(self.render_logprobs, bool), "render_logprobs", "must be a boolean")
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        need(len(self.stop) <= 16, "stop", "may hold at most 16 strings")

    @cached_property  # read per row and step; the instance is frozen, so computed once
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @cached_property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
