"""A request handed from a prefill engine to a decode engine: what the prefill side returns, the
blocks it holds until the decode side has read them (or a deadline passes), and the decode side's
fetch of them (engine/handoff_roles.py runs both sides)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from cupyspec.outputs import TokenLogprob
from cupyspec.sampling.params import SamplingParams
from cupyspec.spec_decode.proposers.base import Drafts
from cupyspec.transfer import array_module, fetch_arrays, to_device

# decode role: copies a prefill server's blocks (the first list) into ours (the second)
FetchBlocks = Callable[[list[int], list[int]], Awaitable[None]]


@dataclass(frozen=True)
class HeadDrafts:
    """An MTP head's drafts for a request's first decode step, made by the prefill server's head
    from the prompt's last hidden state and the first token, as one server's prefill step makes them."""

    token_ids: tuple[int, ...]  # [K]
    logprobs: tuple[float, ...]  # [K]: the head's logprob of each
    probs: bytes = b""  # [K, V] float32: q, where the request draws its drafts (empty: greedy, one-hot)

    @classmethod
    def of(cls, drafts: Drafts) -> HeadDrafts:
        """The wire form of a head's proposal (its q on the host)."""
        probs = b"" if drafts.probs is None else fetch_arrays(array_module(drafts.probs), [drafts.probs])[0].tobytes()
        return cls(tuple(drafts.token_ids.tolist()), tuple(np.asarray(drafts.logprobs, np.float64).tolist()), probs)

    def drafts(self, xp: Any) -> Drafts:
        """The proposal, its q on xp's device."""
        probs = np.frombuffer(self.probs, np.float32).reshape(len(self.token_ids), -1) if self.probs else None
        return Drafts(np.asarray(self.token_ids, np.int32), None if probs is None else to_device(xp, probs),
                      np.asarray(self.logprobs, np.float32))


@dataclass(frozen=True)
class PrefilledPrompt:
    """A prompt a prefill server ran: the first token it sampled and where the prompt's K/V is."""

    handoff_id: str  # names the held blocks in `release`
    token_id: int  # the first token, sampled with the decode server's sampling key
    logprob: TokenLogprob | None  # its record with the request's top logprobs, when the request asks
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None  # when the request asks (entry 0 is None)
    block_ids: tuple[int, ...]  # the prompt's K/V in the prefill server's pool, in position order
    drafts: HeadDrafts | None = None  # the MTP head's first drafts, where the prefill server has a head


def first_token_only(params: SamplingParams) -> SamplingParams:
    """The request's sampling of its first token alone: one choice, one token, no stop. Logprobs come
    as records (the decode server renders them as the request asks)."""
    return replace(params, n=1, max_tokens=1, stop=(), stop_token_ids=(), ignore_eos=True,
                   include_draft_logprobs=False, render_logprobs=False)


class HeldPrompts:
    """The K/V blocks held for decode servers, by handoff id; each is released by `release` or, if the
    decode server never reads it, once `hold_seconds` have passed."""

    def __init__(self, release_blocks: Callable[[Sequence[int]], None], hold_seconds: float) -> None:
        self._release_blocks, self.hold_seconds = release_blocks, hold_seconds
        self._held: dict[str, tuple[tuple[int, ...], asyncio.TimerHandle]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def add(self, handoff_id: str, block_ids: tuple[int, ...]) -> None:
        expiry = asyncio.get_running_loop().call_later(self.hold_seconds, self.release, handoff_id)
        self._held[handoff_id] = (block_ids, expiry)

    def release(self, handoff_id: str) -> bool:
        """Release a handoff's blocks; False when it is not held (released already, or expired)."""
        held = self._held.pop(handoff_id, None)
        if held is None:
            return False
        block_ids, expiry = held
        expiry.cancel()
        self._release_blocks(block_ids)
        return True

    def release_all(self) -> None:
        for handoff_id in list(self._held):
            self.release(handoff_id)
