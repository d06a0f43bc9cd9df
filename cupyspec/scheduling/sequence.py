"""A sequence: one choice of one request, with its tokens, KV blocks and progress."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from cupyspec.sampling.params import SamplingParams
from cupyspec.spec_decode.proposers.base import Drafts
from cupyspec.spec_decode.stats import SpecStats

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not started, or preempted (its KV freed; recomputed when resumed)
    RUNNING = "running"
    RECEIVING = "receiving"  # its prompt's K/V comes from a prefill server (Scheduler.reserve_prefilled)
    FINISHED = "finished"


_FINISHED = SequenceStatus.FINISHED  # a module global reads faster than an enum member (CPython 3.11)


@dataclass(eq=False)
class Sequence:
    """Mutable state of one generated choice. Owned by the scheduler; the engine appends tokens."""

    request_id: str
    choice_index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_tokens: int  # prompt + the most output tokens allowed
    arrival_time: float
    sampling_key: int  # 64-bit key of this choice's random draws (cupyspec.sampling.uniforms)
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_ids: list[int] = field(default_factory=list)  # KV blocks, in position order
    num_preemptions: int = 0
    max_drafts: int = 0  # this choice's cap on draft tokens per step (0: no speculation)
    draft_token_ids: list[int] = field(default_factory=list)  # proposed for the next step
    proposal: Drafts | None = None  # their distributions and draft-model logprobs, when a draft model made them
    num_placed_tokens: int = 0  # its last output tokens, taken ahead of their delivery (OutputProcessor.place_tokens)
    num_held_drafts: int = 0  # drafts verified by its steps in flight: positions past its held places may move on
    spec: SpecStats = field(default_factory=SpecStats)
    # prefill role: its prompt's K/V blocks outlive it (`kept_blocks`), held for a decode server to read,
    # with the MTP head's drafts for the decode server's first step
    keep_prompt_kv: bool = False
    kept_blocks: tuple[int, ...] = ()
    kept_drafts: Drafts | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, stop: int) -> list[int]:
        """token_ids[start:stop], without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:stop - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - num_prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is _FINISHED

    @property
    def awaits_token(self) -> bool:
        """Its last token is a placeholder: sampled by a step whose results the host has not seen."""
        return bool(self.output_token_ids) and self.output_token_ids[-1] < 0

    @property
    def first_held_place(self) -> int:
        """The index in output_token_ids of its first placeholder (of the oldest step in flight), or
        their length: placeholders are its last tokens, and steps come back in order."""
        out = self.output_token_ids
        place = len(out)
        while place and out[place - 1] < 0:
            place -= 1
        return place

    @property
    def num_known_tokens(self) -> int:
        """Its tokens before the first held place."""
        return self.num_prompt_tokens + self.first_held_place

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs are still to be computed (they need every prompt row's logits)."""
        return self.params.prompt_logprobs is not None and not self.output_token_ids
