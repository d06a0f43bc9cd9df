"""Start-up warm-up: a few requests through every step path, so that no real request waits for a
kernel compiled (or a memory pool grown) on first use.

On a GPU each CUDA and CuPy kernel compiles the first time it runs: greedy and random sampling,
top-k/top-p/min-p, penalties, logprobs, prompt logprobs, and under speculation verification with
and without logprobs, and logprobs rendered as chat JSON (whose vocabulary table is built then).
The warm-up sends requests that use them all, with a stand-in proposer that always drafts (the
real one never sees them), then forgets them: metrics and the learned step costs start afresh
(`AsyncEngine.create` resets them). Last, a prompt of more rows than the matrix-product kernels
take, so that cuBLAS, which runs such products, makes its slow first call here too.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace

import numpy as np

from cupyspec.model.linear import KERNEL_MAX_ROWS
from cupyspec.sampling.params import SamplingParams
from cupyspec.spec_decode.drafter import Drafter
from cupyspec.spec_decode.proposers.base import DraftRequest, Drafts, Proposer

Generate = Callable[[list[int], SamplingParams, str], AsyncIterator]  # AsyncEngine.generate

PROMPT_TOKENS = 48
MAX_TOKENS = 6
LONG_PROMPT_TOKENS = KERNEL_MAX_ROWS + 1  # a prefill step past the kernels: cuBLAS

WARM_UP_REQUESTS = (
    SamplingParams(temperature=0.0, seed=0, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, top_k=20, min_p=0.01, n=2, seed=0, max_tokens=MAX_TOKENS,
                   ignore_eos=True, logprobs=2, prompt_logprobs=1, include_draft_logprobs=True),
    SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                   seed=0, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(temperature=0.0, seed=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5, render_logprobs=True),
)


class RepeatLastProposer(Proposer):
    """Drafts its last token again, as many times as allowed: drafts on every step, for the warm-up."""

    method = "repeat-last"

    def propose(self, requests: Sequence[DraftRequest]) -> list[Drafts]:
        return [Drafts(np.full(r.max_drafts, r.token_ids[-1], dtype=np.int32)) for r in requests]


async def run_warm_up(generate: Generate, drafter: Drafter | None, vocab_size: int, room: int,
                  max_num_batched_tokens: int) -> None:
    """Run WARM_UP_REQUESTS together through `generate` (through verification too, when `drafter`
    speculates), then the first alone (overlap scheduling stops while a penalized request runs), then a
    long prompt prefilled in one step, when steps of max_num_batched_tokens take it. room: the tokens a
    request may hold (the context length, or the KV pool's capacity if smaller)."""
    if drafter is not None:
        proposer, drafter.proposer = drafter.proposer, RepeatLastProposer()
    prompt_tokens = min(PROMPT_TOKENS, room // 2)
    max_tokens = min(MAX_TOKENS, room - prompt_tokens)
    requests = [replace(params, max_tokens=max_tokens) for params in WARM_UP_REQUESTS]
    prompts = [[(7 + 13 * i + j) % vocab_size for j in range(prompt_tokens)] for i in range(len(requests))]

    async def finish(prompt: list[int], params: SamplingParams, request_id: str) -> None:
        async for _ in generate(prompt, params, request_id):
            pass

    try:
        await asyncio.gather(*(finish(prompt, params, f"warm-up-{i}")
                               for i, (prompt, params) in enumerate(zip(prompts, requests))))
        await finish(prompts[0], requests[0], "warm-up-alone")
        if max_num_batched_tokens >= LONG_PROMPT_TOKENS and room > LONG_PROMPT_TOKENS:
            long_prompt = [(5 + 11 * j) % vocab_size for j in range(LONG_PROMPT_TOKENS)]
            await finish(long_prompt, replace(requests[0], max_tokens=1), "warm-up-long")
    finally:
        if drafter is not None:
            drafter.proposer = proposer
