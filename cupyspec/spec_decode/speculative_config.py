"""`--speculative-config`: FastDeploy's keys, parsed from JSON and validated at start-up."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from cupyspec.errors import InvalidRequestError
from cupyspec.model.quantized import check_method

METHODS = ("naive", "ngram", "suffix", "mtp")
VERIFY_STRATEGIES = ("rejection", "greedy", "target_match", "topp")
ACCEPT_POLICIES = ("normal", "accept_all", "reject_all")
MTP_STRATEGIES = ("default", "with_ngram")
MAX_SPECULATIVE_TOKENS = 8


def _is_int(value: Any) -> bool:
    """An integer, and not a boolean (JSON's `true` parses to a Python int subclass)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings. `method=None` means no speculation."""

    method: str | None = None
    num_speculative_tokens: int = 0
    num_model_steps: int = 1
    model: str | None = None  # MTP weights; None: the head shipped for the served model
    quantization: str | None = None  # the MTP head's: wint8 or wint4; None: the target's
    verify_strategy: str = "rejection"
    accept_policy: str = "normal"
    mtp_strategy: str = "default"
    ngram_min: int = 1  # smallest n-gram the ngram proposer matches
    ngram_max: int = 4  # largest n-gram, tried first
    suffix_decoding_max_tree_depth: int = 64
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    max_draft_tokens_per_step: int = 256  # drafts in one step, all sequences together (back-off)
    min_acceptance_rate: float = 0.1  # a sequence accepting less stops drafting, probing now and then
    cost_aware_backoff: bool = True  # weigh each draft's chance against the learned cost of a step (policy.py)

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"speculative config: {message}")

        need(self.method is None or self.method in METHODS,
             f"method must be one of {', '.join(METHODS)}, not {self.method!r}")
        need(_is_int(self.num_speculative_tokens) and 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
             f"num_speculative_tokens must be an integer from 0 to {MAX_SPECULATIVE_TOKENS}, "
             f"not {self.num_speculative_tokens!r}")
        if self.method == "naive":
            object.__setattr__(self, "num_speculative_tokens", 0)
        need(_is_int(self.num_model_steps) and self.num_model_steps >= 1,
             f"num_model_steps must be a positive integer, not {self.num_model_steps!r}")
        need(self.method != "mtp" or self.num_speculative_tokens >= self.num_model_steps,
             "num_speculative_tokens must be at least num_model_steps")
        object.__setattr__(self, "quantization", check_method(self.quantization, "speculative config: quantization"))
        need(self.verify_strategy in VERIFY_STRATEGIES,
             f"verify_strategy must be one of {', '.join(VERIFY_STRATEGIES)}, not {self.verify_strategy!r}")
        need(self.accept_policy in ACCEPT_POLICIES,
             f"accept_policy must be one of {', '.join(ACCEPT_POLICIES)}, not {self.accept_policy!r}")
        need(self.mtp_strategy in MTP_STRATEGIES,
             f"mtp_strategy must be one of {', '.join(MTP_STRATEGIES)}, not {self.mtp_strategy!r}")
        need(_is_int(self.ngram_min) and _is_int(self.ngram_max) and 1 <= self.ngram_min <= self.ngram_max,
             "ngram_min and ngram_max must be integers with 1 <= ngram_min <= ngram_max, "
             f"not {self.ngram_min!r} and {self.ngram_max!r}")
        need(_is_int(self.suffix_decoding_max_tree_depth) and self.suffix_decoding_max_tree_depth >= 1,
             f"suffix_decoding_max_tree_depth must be a positive integer, not {self.suffix_decoding_max_tree_depth!r}")
        need(_is_int(self.suffix_decoding_max_cached_requests) and self.suffix_decoding_max_cached_requests >= -1,
             "suffix_decoding_max_cached_requests must be an integer >= -1 (-1: unbounded), "
             f"not {self.suffix_decoding_max_cached_requests!r}")
        need(_is_number(self.suffix_decoding_max_spec_factor) and self.suffix_decoding_max_spec_factor > 0,
             f"suffix_decoding_max_spec_factor must be a positive number, not {self.suffix_decoding_max_spec_factor!r}")
        need(_is_number(self.suffix_decoding_min_token_prob) and 0 <= self.suffix_decoding_min_token_prob <= 1,
             f"suffix_decoding_min_token_prob must be a number in [0, 1], not {self.suffix_decoding_min_token_prob!r}")
        need(_is_int(self.max_draft_tokens_per_step) and self.max_draft_tokens_per_step >= 0,
             f"max_draft_tokens_per_step must be a non-negative integer, not {self.max_draft_tokens_per_step!r}")
        need(_is_number(self.min_acceptance_rate) and 0 <= self.min_acceptance_rate <= 1,
             f"min_acceptance_rate must be a number in [0, 1], not {self.min_acceptance_rate!r}")
        need(isinstance(self.cost_aware_backoff, bool),
             f"cost_aware_backoff must be true or false, not {self.cost_aware_backoff!r}")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @classmethod
    def from_json(cls, text: str | None) -> SpeculativeConfig:
        """Parse `--speculative-config`; unknown keys and bad values raise ValueError."""
        if not text:
            return cls()
        try:
            data: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative config is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("speculative config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"speculative config: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        if data.get("method") is None:
            raise ValueError("speculative config: 'method' is required")
        return cls(**data)


@dataclass(frozen=True)
class RequestSpeculation:
    """A request's own speculation setting (body field `speculative`): fewer drafts, or none."""

    num_speculative_tokens: int | None = None  # None: the server's number; 0: no speculation

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if k is not None and (not _is_int(k) or k < 0):
            raise InvalidRequestError("speculative.num_speculative_tokens must be a non-negative integer",
                                      "speculative.num_speculative_tokens")

    def drafts_within(self, config: SpeculativeConfig) -> int:
        """Drafts per step for this request; asking for more than the server allows is an error."""
        allowed = config.num_speculative_tokens if config.enabled else 0
        if self.num_speculative_tokens is None:
            return allowed
        if self.num_speculative_tokens > allowed:
            raise InvalidRequestError(
                f"speculative.num_speculative_tokens may be at most {allowed}, the server's setting",
                "speculative.num_speculative_tokens")
        return self.num_speculative_tokens
