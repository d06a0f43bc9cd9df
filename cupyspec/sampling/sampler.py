"""Batched token sampling with per-row penalties, temperature, top-k, top-p and min-p (NumPy or CuPy).

Order (as vLLM): logprobs from the raw logits; penalties; then greedy argmax, or temperature,
top-k, top-p, min-p, renormalization and an inverse-CDF pick with the row's own uniform draw.
A row's token depends only on its own logits, parameters and draw, never on the rest of the batch.
The pieces (penalized logits, the processed distribution in rank order, the inverse-CDF pick) are
public so that draft verification scores drafts against exactly the distribution sampling uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import numpy as np

from cupyspec.logprobs.logsoftmax_topk import logprobs_on_device, stable_argsort
from cupyspec.sampling.argmax import argmax_rows
from cupyspec.sampling.params import SamplingParams
from cupyspec.sampling.penalties import apply_penalties
from cupyspec.transfer import fetch_arrays, to_device


class SamplingRow(NamedTuple):
    """One logits row's parameters and inputs (a tuple: one is made per row and step)."""

    params: SamplingParams
    uniform: float  # the row's draw in [0, 1) from its request's generator; ignored when greedy
    prompt_token_ids: np.ndarray | None = None  # [P] int; needed when repetition_penalty != 1
    output_token_ids: np.ndarray | None = None  # [O] int; needed when any penalty is active


@dataclass
class SamplerOutput:
    """Host results of one sampling call."""

    token_ids: np.ndarray  # [R] int64
    logprobs: np.ndarray | None  # [R] f32, chosen token under log_softmax(raw logits); None if no row asks
    top_token_ids: np.ndarray | None  # [R, K] int64, K = the largest `logprobs` asked; rows take a prefix
    top_logprobs: np.ndarray | None  # [R, K] f32

    @classmethod
    def from_host(cls, arrays: list[np.ndarray]) -> SamplerOutput:
        """From the host copies of sample_on_device's arrays, in its order."""
        if len(arrays) == 1:
            return cls(arrays[0].astype(np.int64), None, None, None)
        tokens, chosen, top_ids, top_lps = arrays
        return cls(tokens.astype(np.int64), chosen.astype(np.float32), top_ids.astype(np.int64),
                   top_lps.astype(np.float32))


@dataclass(frozen=True)
class RankedProbs:
    """Processed distributions of S rows, each in its own rank order (most likely first)."""

    order: Any  # [S, V] int64 token ids by descending logit, ties by lower index
    weights: Any  # [S, V] float64 unnormalized probabilities in rank order; 0 for filtered tokens


def penalized_logits(xp: Any, logits: Any, rows: Sequence[SamplingRow]) -> Any:
    """logits [R, V] f32 with each row's penalties applied; a copy only when some row has any."""
    params = [r.params for r in rows]
    penalized = np.array([i for i, p in enumerate(params) if p.has_penalties], dtype=np.int64)
    if not penalized.size:
        return logits
    index = to_device(xp, penalized)
    x = logits.copy()
    x[index] = apply_penalties(xp, logits[index], [params[i] for i in penalized],
                               [rows[i].prompt_token_ids for i in penalized],
                               [rows[i].output_token_ids for i in penalized])
    return x


def drawn_rows(rows: Sequence[SamplingRow]) -> np.ndarray:
    """Host indices [S] int64 of the rows that draw at random (temperature > 0)."""
    return np.array([i for i, r in enumerate(rows) if not r.params.greedy], dtype=np.int64)


def row_uniforms(xp: Any, rows: Sequence[SamplingRow], index: np.ndarray) -> Any:
    """The draws [S, 1] float64 on the device of rows[index]; each must lie in [0, 1)."""
    uniforms = np.array([rows[i].uniform for i in index], dtype=np.float64)
    if ((uniforms < 0.0) | (uniforms >= 1.0)).any():
        raise ValueError("uniform must lie in [0, 1)")
    return to_device(xp, uniforms)[:, None]


def rank_probs(xp: Any, logits: Any, params: Sequence[SamplingParams]) -> RankedProbs:
    """Each row's distribution after temperature, top-k, top-p and min-p, from (penalized) logits [S, V]."""
    vocab = logits.shape[1]

    def column(values: list[float], dtype: Any) -> Any:  # host list -> [S, 1] on the device
        return to_device(xp, np.array(values, dtype=dtype))[:, None]

    temperature = column([p.temperature for p in params], np.float64)
    top_k = column([p.top_k if p.top_k > 0 else vocab for p in params], np.int64)
    top_p = column([p.top_p for p in params], np.float64)
    min_p = column([p.min_p for p in params], np.float64)

    order = stable_argsort(xp, -logits)  # [S, V] descending, ties by lower index
    ranked = xp.take_along_axis(logits, order, axis=1)  # [S, V]
    # float64 from here: a float32 cumsum over a large vocabulary drifts by more than a tail token's
    # probability, which would make the pick depend on the summation order of the device
    probs = xp.exp((ranked - ranked[:, :1]).astype(xp.float64) / temperature)  # [S, V] unnormalized, first is 1
    keep = xp.arange(vocab)[None, :] < top_k  # [S, V]
    probs = xp.where(keep, probs, 0.0)
    cum = xp.cumsum(probs, axis=1)  # [S, V]
    before = (cum - probs) / cum[:, -1:]  # [S, V] probability mass ranked strictly above each token
    keep &= (before < top_p) | (top_p >= 1.0)
    keep &= probs >= min_p * probs[:, :1]
    return RankedProbs(order, xp.where(keep, probs, 0.0))


def inverse_cdf(xp: Any, weights: Any, uniforms: Any) -> Any:
    """Column [S] int64 picked in each row of weights [S, V] (>= 0, some > 0) by uniforms [S, 1] in [0, 1).

    The first column whose cumulative weight exceeds u * total; rounding can never pick a zero weight.
    """
    vocab = weights.shape[1]
    cum = xp.cumsum(weights, axis=1)  # [S, V]
    last = xp.where(weights > 0, xp.arange(vocab)[None, :], 0).max(axis=1, keepdims=True)  # [S, 1]
    pick = xp.minimum((cum <= uniforms * cum[:, -1:]).sum(axis=1, keepdims=True), last)  # [S, 1]
    return pick[:, 0].astype(xp.int64)


def pick_tokens(xp: Any, x: Any, rows: Sequence[SamplingRow], drawn: np.ndarray) -> tuple[Any, RankedProbs | None]:
    """Tokens [R] int64 that sampling takes from penalized logits x [R, V], and the drawn rows' distributions.

    Greedy rows take the argmax (ties to the lowest index); the rows `drawn` (host indices of all
    non-greedy rows, in any order) an inverse-CDF pick with their uniform; their RankedProbs come
    back in that order (None when no row draws).
    """
    tokens = argmax_rows(xp, x)  # [R] greedy; ties to the lowest index
    if not drawn.size:
        return tokens, None
    uniforms = row_uniforms(xp, rows, drawn)  # [S, 1]
    index = to_device(xp, drawn)
    ranked = rank_probs(xp, x[index], [rows[i].params for i in drawn])
    picks = inverse_cdf(xp, ranked.weights, uniforms)  # [S] ranks
    tokens[index] = xp.take_along_axis(ranked.order, picks[:, None], axis=1)[:, 0]
    return tokens, ranked


def sample_on_device(xp: Any, logits: Any, rows: Sequence[SamplingRow]) -> list[Any]:
    """Pick one token per row of logits [R, V] f32; no host synchronization.

    Device arrays: [tokens [R] int64], followed, when any row asks for logprobs, by the chosen
    tokens' logprobs [R] f32, top ids [R, K] int64 and top logprobs [R, K] f32.
    """
    tokens = sample_tokens_on_device(xp, logits, rows)
    asked = max_logprobs(rows)
    return [tokens] if asked is None else [tokens, *logprobs_on_device(xp, logits, tokens, asked)]


def sample_tokens_on_device(xp: Any, logits: Any, rows: Sequence[SamplingRow]) -> Any:
    """sample_on_device's tokens [R] int64 alone."""
    if logits.ndim != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must have shape [len(rows)={len(rows)}, V], got {logits.shape}")
    logits = logits.astype(xp.float32, copy=False)
    return pick_tokens(xp, penalized_logits(xp, logits, rows), rows, drawn_rows(rows))[0]


def max_logprobs(rows: Sequence[SamplingRow]) -> int | None:
    """The most top logprobs a row asks for (K of sample_on_device's arrays); None: no row asks."""
    return max((r.params.logprobs for r in rows if r.params.logprobs is not None), default=None)


def sample(xp: Any, logits: Any, rows: Sequence[SamplingRow]) -> SamplerOutput:
    """Pick one token per row of logits [R, V] f32 (on xp's device); one device-to-host transfer."""
    return SamplerOutput.from_host(fetch_arrays(xp, sample_on_device(xp, logits, rows)))
