"""A step's results on the host turned into each scheduled sequence's output (`SeqStepOutput`):
the tokens it emitted, with their logprobs, draft verdicts and prompt logprobs where asked."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from cupyspec.engine.step_inputs import StepInputs
from cupyspec.logprobs.logprob_json import LogprobRenderer, LogprobsJSON
from cupyspec.outputs import DraftLogprob, TokenLogprob
from cupyspec.sampling.sampler import SamplerOutput
from cupyspec.spec_decode.verification.verify_step import StepVerdict


class SeqStepOutput(NamedTuple):
    """What one scheduled sequence got from the step (a tuple: one is made per sequence and step)."""

    token_ids: tuple[int, ...] = ()  # emitted tokens; empty for a prefill chunk that ends mid-prompt
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per emitted token, when asked
    num_drafts: int = 0
    accepted: tuple[bool, ...] = ()  # per draft
    draft_logprobs: tuple[DraftLogprob, ...] | None = None  # per draft, when asked
    prompt_logprobs: tuple[tuple[int, TokenLogprob], ...] = ()  # (prompt position, logprob)
    logprobs_json: LogprobsJSON | None = None  # one entry per emitted token, when asked rendered


def _token_logprob(token_id: int, logprob: float, top_ids: np.ndarray, top_lps: np.ndarray, k: int) -> TokenLogprob:
    """The logprob record of one token with its top k alternatives, from host arrays."""
    return TokenLogprob(int(token_id), float(logprob), top_ids[:k].tolist(), top_lps[:k].tolist())


def scattered(values: tuple, owners: tuple[int, ...], count: int) -> list:
    """values [S] of the sampling sequences at their scheduled indices owners [S], None elsewhere: [count]."""
    full = [None] * count
    for value, i in zip(values, owners):
        full[i] = value
    return full


def verified_outputs(step: StepVerdict, inputs: StepInputs) -> dict[int, SeqStepOutput]:
    """Each sampling sequence's tokens (and logprobs, when asked) from a speculative step's verdict:
    its accepted drafts, then the bonus or correction token."""
    drafts = (step.drafts if step.drafts is not None else inputs.drafts).tolist()  # whole arrays at once
    num_drafts = inputs.num_drafts.tolist()
    logprobs = step.logprobs
    outputs = {}
    for s, (n, emitted) in enumerate(zip(step.num_accepted, step.emitted)):
        outputs[s] = SeqStepOutput((*drafts[s][:n], emitted), logprobs.tokens[s], num_drafts[s],
                                   (True,) * n + (False,) * (num_drafts[s] - n), draft_logprobs=logprobs.drafts[s],
                                   logprobs_json=logprobs.rendered[s])
    return outputs


def sampled_outputs(out: SamplerOutput, rendered: list[np.ndarray], inputs: StepInputs,
                    renderer: LogprobRenderer | None) -> dict[int, SeqStepOutput]:
    """Each sampling sequence's one token (and its logprobs, when asked) from a plain step;
    rendered: [the host copy of the rendered entries], when a request asked for them."""
    token_ids = out.token_ids.tolist()
    wanted = inputs.logprobs.top_logprobs
    if out.logprobs is None:
        return {s: SeqStepOutput((token,)) for s, token in enumerate(token_ids)}
    entries = [None] * len(token_ids)
    if renderer is not None:
        render_k, rows = inputs.logprobs.render_k, len(token_ids)
        bounds = [(s, s + 1) if k >= 0 else None for s, k in enumerate(render_k.tolist())]  # a row each
        entries = renderer.entries(rendered[0], rows, bounds,
                                   lambda: (out.token_ids, out.logprobs, out.top_token_ids, out.top_logprobs,
                                            out.top_token_ids.shape[1], render_k, rows, rows))
    lps, top_ids, top_lps = out.logprobs.tolist(), out.top_token_ids.tolist(), out.top_logprobs.tolist()  # whole
    return {s: SeqStepOutput((token_ids[s],), None if k is None or entries[s] is not None else (
        TokenLogprob(token_ids[s], lps[s], top_ids[s][:k], top_lps[s][:k]),), logprobs_json=entries[s])
        for s, k in enumerate(wanted)}


def add_prompt_logprobs(host: list[np.ndarray], inputs: StepInputs, outputs: list[SeqStepOutput]) -> None:
    """Prompt logprobs from the host copies (logprob [P], top ids [P, K], top logprobs [P, K]) of the
    prompt rows, into each sequence's output."""
    lps, top_ids, top_lps = host[0].astype(np.float32), host[1].astype(np.int64), host[2].astype(np.float32)
    per_seq: dict[int, list[tuple[int, TokenLogprob]]] = {}
    for j, (i, position, k) in enumerate(inputs.prompt_owner):
        per_seq.setdefault(i, []).append(
            (position, _token_logprob(inputs.prompt_targets[j], lps[j], top_ids[j], top_lps[j], k)))
    for i, pairs in per_seq.items():
        outputs[i] = outputs[i]._replace(prompt_logprobs=tuple(pairs))
