"""The draft proposers' interface: sequence contexts in, draft tokens (and optional draft probabilities) out."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class DraftRequest:
    """One sequence's context for drafting. `token_ids` is converted to int32 if needed."""

    seq_id: int  # one choice of a request; stable across steps
    request_id: str
    token_ids: np.ndarray  # [N] int32: prompt + output so far; the last one is the token just emitted
    num_prompt_tokens: int
    max_drafts: int  # propose at most this many (0: nothing)

    def __post_init__(self) -> None:
        ids = np.asarray(self.token_ids)
        if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
            raise ValueError(f"token_ids must be a non-empty 1-D integer array, got shape {ids.shape} {ids.dtype}")
        if ids.dtype != np.int32:
            ids = ids.astype(np.int32)
        object.__setattr__(self, "token_ids", ids)
        if not 0 <= self.num_prompt_tokens <= ids.size:
            raise ValueError(f"num_prompt_tokens must lie in [0, {ids.size}], got {self.num_prompt_tokens}")
        if self.max_drafts < 0:
            raise ValueError(f"max_drafts must be >= 0, got {self.max_drafts}")


@dataclass(frozen=True)
class Drafts:
    """Draft tokens for one sequence and, optionally, the distributions they were drawn from and
    the draft model's logprob of each.

    `probs is None` means a one-hot draft distribution on each token (model-free proposers, and a
    draft model's greedy drafts).
    """

    token_ids: np.ndarray  # [k] int32
    probs: Any | None = None  # [k, V] float32 (host, or the model's device), or None: one-hot on token_ids
    logprobs: np.ndarray | None = None  # [k] float32: the draft model's own logprobs (an MTP head's), NaN where none

    def __post_init__(self) -> None:
        ids = self.token_ids
        if not isinstance(ids, np.ndarray) or ids.dtype != np.int32:
            ids = np.asarray(ids)
            if ids.dtype.kind not in "iu" and ids.size:
                raise ValueError(f"token_ids must hold integers, got {ids.dtype}")
            ids = ids.astype(np.int32)
            object.__setattr__(self, "token_ids", ids)
        if ids.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {ids.shape}")
        if self.probs is not None:
            probs = self.probs
            if not hasattr(probs, "__cuda_array_interface__"):
                probs = np.asarray(probs, dtype=np.float32)
            if probs.ndim != 2 or probs.shape[0] != ids.size or probs.dtype != np.float32:
                raise ValueError(f"probs must be float32 of shape [{ids.size}, V], got {probs.dtype} {probs.shape}")
            object.__setattr__(self, "probs", probs)
        if self.logprobs is not None and np.shape(self.logprobs) != (ids.size,):
            raise ValueError(f"logprobs must have shape [{ids.size}], got {np.shape(self.logprobs)}")

    def __len__(self) -> int:
        return int(self.token_ids.size)

    def first(self, count: int) -> Drafts:
        """The first `count` drafts."""
        if count >= len(self):
            return self
        cut = (None if a is None else a[:count] for a in (self.probs, self.logprobs))
        return Drafts(self.token_ids[:count], *cut)


def unseen_tokens(seen: Sequence[int], token_ids: np.ndarray) -> list[int] | None:
    """The tokens of `token_ids` past the `seen` ones, if `token_ids` continues them; None if not
    (shorter, or a different token where the seen ones end): state built on `seen` is stale.
    Checks only the last seen token: a sequence's tokens only grow, so that tells a new sequence
    from a continued one."""
    num_seen = len(seen)
    if token_ids.size < num_seen or (num_seen and token_ids[num_seen - 1] != seen[-1]):
        return None
    return token_ids[num_seen:].tolist()


_EMPTY = np.zeros(0, dtype=np.int32)
_EMPTY.flags.writeable = False
NO_DRAFTS = Drafts(_EMPTY)  # the empty proposal (immutable, shared)


class Proposer(abc.ABC):
    """Proposes draft tokens for a batch of sequences; runs on the CPU between target steps."""

    method: str
    # True if the proposer keeps per-sequence state that assumes a sequence's token_ids only grow
    # between calls; such a proposer cannot extend another proposer's tentative drafts.
    tracks_sequences: bool = False
    # True if a sequence's drafts are made on the device in the step before they are asked for, and
    # only when that step drafts ahead (an MTP head): an empty answer then says the head did not
    # run, not that it found nothing, and does not count against the sequence's hit rate (`answered`).
    drafts_ahead: bool = False

    @abc.abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> list[Drafts]:
        """One `Drafts` per request, in order, each with at most `max_drafts` tokens."""

    def answered(self, num_drafts: int) -> bool:
        """Whether a proposal of num_drafts drafts counts in the sequence's hit rate: any, but an empty
        one of a proposer that drafts ahead (its drafts were not made)."""
        return num_drafts > 0 or not self.drafts_ahead

    def has_drafts(self) -> bool:
        """Whether some sequence may get drafts now: a proposer that drafts ahead has none after steps
        in which it did not draft, and shadow probes would ask it for nothing."""
        return True

    def wants_drafts_ahead(self) -> bool:
        """Whether a proposer that drafts ahead needs the step being formed to draft for the next one,
        as its last proposals suggest (the drafter asks right after them)."""
        return self.drafts_ahead

    def on_sequence_finished(self, seq_id: int, request_id: str, token_ids: np.ndarray, num_prompt_tokens: int) -> None:
        """Called once when a sequence finishes or is aborted; `token_ids` is its prompt + output.
        Bookkeeping that can wait (caching the output for later requests) may be left to `catch_up`."""

    def catch_up(self, seconds: float | None = None) -> bool:
        """Do deferred bookkeeping for about `seconds` (None: all of it); whether some is left.
        The engine calls it when the host has time to spare."""
        return False


class NaiveProposer(Proposer):
    """Never proposes: the speculative code path with zero drafts (a test and baseline mode)."""

    method = "naive"

    def propose(self, requests: Sequence[DraftRequest]) -> list[Drafts]:
        return [NO_DRAFTS] * len(requests)
