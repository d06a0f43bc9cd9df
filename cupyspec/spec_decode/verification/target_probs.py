"""What the target says at each verified row: the distribution non-speculative sampling would use.

Penalties, temperature, top-k, top-p and min-p come from the sampler itself, so a draft is scored
against exactly what plain decoding would have drawn from. Greedy rows are one-hot at the argmax
of their penalized logits and are never sorted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from cupyspec.sampling.sampler import (
    RankedProbs,
    SamplingRow,
    drawn_rows,
    inverse_cdf,
    penalized_logits,
    pick_tokens,
    row_uniforms,
)
from cupyspec.transfer import to_device


@dataclass(frozen=True)
class DraftLayout:
    """Where the D drafts of a batch sit among its target rows (host arrays)."""

    rows: np.ndarray  # [D] int64: the target row that scores each draft
    request: np.ndarray  # [D] int64: its request b
    position: np.ndarray  # [D] int64: its index j among the request's drafts
    tokens: np.ndarray  # [D] int64: the draft token

    @classmethod
    def of(cls, draft_token_ids: np.ndarray, num_drafts: np.ndarray) -> DraftLayout:
        """Request b owns rows first[b] .. first[b] + num_drafts[b]; the last one scores the bonus token."""
        first = np.cumsum(num_drafts + 1) - (num_drafts + 1)  # [B]
        request = np.repeat(np.arange(len(num_drafts), dtype=np.int64), num_drafts)  # [D]
        position = np.arange(len(request), dtype=np.int64) - np.repeat(np.cumsum(num_drafts) - num_drafts, num_drafts)
        return cls(first[request] + position, request, position, draft_token_ids[request, position])


@dataclass(frozen=True)
class TargetRows:
    """The target's processed distributions over all R rows (device arrays unless noted)."""

    logits: Any  # [R, V] f32 penalized logits
    tokens: Any  # [R] int64: the token non-speculative sampling picks (argmax on greedy rows)
    drawn_drafts: np.ndarray  # [Sd] int64 host: the drafts (indices into D) whose rows draw at random
    ranked: RankedProbs | None  # rows: those Sd draft rows first, then the drawn bonus rows


def score_rows(xp: Any, logits: Any, rows: Sequence[SamplingRow], layout: DraftLayout) -> TargetRows:
    """Penalize, rank and sample every row of logits [R, V] with its own parameters and uniform."""
    num_rows = logits.shape[0]
    x = penalized_logits(xp, logits, rows)
    drawn = drawn_rows(rows)  # [S]
    draft_of_row = np.full(num_rows, -1, dtype=np.int64)  # [R] draft index, -1 on bonus rows
    draft_of_row[layout.rows] = np.arange(len(layout.rows))
    on_draft = draft_of_row[drawn] >= 0
    drawn = np.concatenate([drawn[on_draft], drawn[~on_draft]])
    tokens, ranked = pick_tokens(xp, x, rows, drawn)
    return TargetRows(x, tokens, draft_of_row[drawn[:int(on_draft.sum())]], ranked)


def draft_scores(xp: Any, target: TargetRows, layout: DraftLayout, draft_probs: Any | None,
                 rows: Sequence[SamplingRow], with_residual: bool) -> tuple[Any, Any | None]:
    """(p(d) [D] f64 of each draft under its row's target distribution, residual picks [D] int64 or None).

    The residual pick is the correction token after a rejection: drawn by inverse CDF in the row's
    rank order with the row's uniform from max(0, p - q), q the draft distribution (one-hot at d
    when draft_probs [B, K, V] is None); p itself when the residual vanishes. A greedy row's p is
    one-hot at its argmax, so its p(d) is [d == argmax] and its residual pick is the argmax.
    """
    draft = to_device(xp, layout.tokens)  # [D]
    token_at = target.tokens[to_device(xp, layout.rows)]  # [D]
    p_draft = (draft == token_at).astype(xp.float64)  # [D], right for greedy rows
    residual_pick = token_at.copy() if with_residual else None  # [D]
    count = len(target.drawn_drafts)
    if not count:
        return p_draft, residual_pick
    at = to_device(xp, target.drawn_drafts)  # [Sd]
    order = target.ranked.order[:count]  # [Sd, V]
    weights = target.ranked.weights[:count]  # [Sd, V]
    p = weights / weights.sum(axis=1, keepdims=True)  # [Sd, V] in rank order
    hit = order == draft[at][:, None]  # [Sd, V]: the draft's rank
    p_draft[at] = xp.where(hit, p, 0.0).sum(axis=1)
    if with_residual:
        if draft_probs is None:
            q = hit.astype(xp.float64)  # [Sd, V]
        else:
            index = target.drawn_drafts
            drawn = draft_probs[to_device(xp, layout.request[index]), to_device(xp, layout.position[index])]  # [Sd, V]
            q = xp.take_along_axis(drawn.astype(xp.float64), order, axis=1)  # [Sd, V] in rank order
        residual = xp.maximum(p - q, 0.0)  # [Sd, V]
        residual = xp.where(residual.sum(axis=1, keepdims=True) > 0, residual, p)
        ranks = inverse_cdf(xp, residual, row_uniforms(xp, rows, layout.rows[target.drawn_drafts]))  # [Sd]
        residual_pick[at] = xp.take_along_axis(order, ranks[:, None], axis=1)[:, 0]
    return p_draft, residual_pick
