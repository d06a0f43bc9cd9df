"""Start-up warm-up: a few requests through every step path, so that no real request waits for a
kernel compiled (or a memory pool grown) on first use.

On a GPU each CUDA and CuPy kernel compiles the first time it runs, some 0.1 to 1 s apiece: greedy
and random sampling, top-k/top-p/min-p, penalties, logprobs, prompt logprobs, and under
speculation verification with and without logprobs. The warm-up sends requests that use them
all, with a stand-in proposer that always drafts (the real one never sees them), then forgets
them: metrics and the learned step costs start afresh (`AsyncEngine.create` resets them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from cupyspec.sampling.params import SamplingParams
from cupyspec.spec.proposer import DraftRequest, Drafts, Proposer

if TYPE_CHECKING:
    from cupyspec.engine import AsyncEngine

PROMPT_TOKENS = 48
MAX_TOKENS = 6

WARM_UP_REQUESTS = (
    SamplingParams(temperature=0.0, seed=0, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, top_k=20, min_p=0.01, n=2, seed=0, max_tokens=MAX_TOKENS,
                   ignore_eos=True, logprobs=2, prompt_logprobs=1, include_draft_logprobs=True),
    SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                   seed=0, max_tokens=MAX_TOKENS, ignore_eos=True),
)


class RepeatLastProposer(Proposer):
    """Drafts its last token again, as many times as allowed: drafts on every step, for the warm-up."""

    method = "repeat-last"

    def propose(self, requests: Sequence[DraftRequest]) -> list[Drafts]:
        return [Drafts(np.full(r.max_drafts, r.token_ids[-1], dtype=np.int32)) for r in requests]


async def warm_up(engine: AsyncEngine) -> None:
    """Run WARM_UP_REQUESTS together (through verification too, when the engine speculates), then
    the first alone (overlap scheduling stops while a penalized request runs)."""
    drafter = engine.drafter
    if drafter is not None:
        proposer, drafter.proposer = drafter.proposer, RepeatLastProposer()
    vocab = engine.model_config.vocab_size
    room = min(engine.max_model_len, engine.block_manager.num_blocks * engine.block_manager.block_size)
    prompt_tokens = min(PROMPT_TOKENS, room // 2)
    max_tokens = min(MAX_TOKENS, room - prompt_tokens)
    requests = [replace(params, max_tokens=max_tokens) for params in WARM_UP_REQUESTS]
    prompts = [[(7 + 13 * i + j) % vocab for j in range(prompt_tokens)] for i in range(len(requests))]

    async def finish(prompt: list[int], params: SamplingParams, request_id: str) -> None:
        async for _ in engine.generate(prompt, params, request_id):
            pass

    try:
        await asyncio.gather(*(finish(prompt, params, f"warm-up-{i}")
                               for i, (prompt, params) in enumerate(zip(prompts, requests))))
        await finish(prompts[0], requests[0], "warm-up-alone")
    finally:
        if drafter is not None:
            drafter.proposer = proposer
