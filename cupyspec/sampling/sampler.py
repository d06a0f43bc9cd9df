"""Batched token sampling with per-row penalties, temperature, top-k, top-p and min-p (NumPy or CuPy).

Order (as vLLM): logprobs from the raw logits; penalties; then greedy argmax, or temperature,
top-k, top-p, min-p, renormalization and an inverse-CDF pick with the row's own uniform draw.
A row's token depends only on its own logits, parameters and draw, never on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cupyspec.sampling.logprobs import fetch_columns, logprobs_on_device, stable_argsort
from cupyspec.sampling.params import SamplingParams
from cupyspec.sampling.penalties import apply_penalties


@dataclass(frozen=True)
class SamplingRow:
    """One logits row's parameters and inputs."""

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


def _sample_random(xp: Any, logits: Any, params: list[SamplingParams], uniforms: np.ndarray) -> Any:
    """Tokens [S] int64 drawn from logits [S, V] with each row's temperature, top-k/p, min-p and uniform."""
    rows, vocab = logits.shape

    def column(values: list[float], dtype: Any) -> Any:  # host list -> [S, 1] on the device
        return xp.asarray(np.array(values, dtype=dtype))[:, None]

    temperature = column([p.temperature for p in params], np.float64)
    top_k = column([p.top_k if p.top_k > 0 else vocab for p in params], np.int64)
    top_p = column([p.top_p for p in params], np.float64)
    min_p = column([p.min_p for p in params], np.float64)
    u = column(list(uniforms), np.float64)

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
    probs = xp.where(keep, probs, 0.0)
    cum = xp.cumsum(probs, axis=1)  # [S, V]
    last = (keep & (probs > 0)).sum(axis=1, keepdims=True) - 1  # [S, 1] last drawable rank
    pick = xp.minimum((cum <= u * cum[:, -1:]).sum(axis=1, keepdims=True), last)  # [S, 1]
    return xp.take_along_axis(order, pick, axis=1)[:, 0].astype(xp.int64)


def sample(xp: Any, logits: Any, rows: list[SamplingRow]) -> SamplerOutput:
    """Pick one token per row of logits [R, V] f32 (on xp's device); one device-to-host transfer."""
    if logits.ndim != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must have shape [len(rows)={len(rows)}, V], got {logits.shape}")
    logits = logits.astype(xp.float32, copy=False)
    params = [r.params for r in rows]
    asked = [p.logprobs for p in params if p.logprobs is not None]

    x = logits
    penalized = np.array([i for i, p in enumerate(params) if p.has_penalties], dtype=np.int64)
    if penalized.size:
        index = xp.asarray(penalized)
        x = logits.copy()
        x[index] = apply_penalties(xp, logits[index], [params[i] for i in penalized],
                                   [rows[i].prompt_token_ids for i in penalized],
                                   [rows[i].output_token_ids for i in penalized])

    tokens = x.argmax(axis=1).astype(xp.int64)  # [R] greedy; ties to the lowest index
    drawn = np.array([i for i, p in enumerate(params) if not p.greedy], dtype=np.int64)
    if drawn.size:
        uniforms = np.array([rows[i].uniform for i in drawn], dtype=np.float64)
        if ((uniforms < 0.0) | (uniforms >= 1.0)).any():
            raise ValueError("uniform must lie in [0, 1)")
        index = xp.asarray(drawn)
        tokens[index] = _sample_random(xp, x[index], [params[i] for i in drawn], uniforms)

    if not asked:
        return SamplerOutput(fetch_columns(xp, [tokens[:, None]])[0][:, 0].astype(np.int64), None, None, None)
    chosen, top_ids, top_lps = logprobs_on_device(xp, logits, tokens, max(asked))
    host = fetch_columns(xp, [tokens[:, None], chosen[:, None], top_ids, top_lps])
    return SamplerOutput(host[0][:, 0].astype(np.int64), host[1][:, 0].astype(np.float32),
                         host[2].astype(np.int64), host[3].astype(np.float32))
