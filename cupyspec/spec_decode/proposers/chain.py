"""Two proposers in a row: the second continues the first's drafts (FastDeploy's mtp_strategy "with_ngram")."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from cupyspec.spec_decode.proposers.base import DraftRequest, Drafts, Proposer
from cupyspec.transfer import array_module


class ChainProposer(Proposer):
    """Up to `first_count` drafts from `first`, then up to the rest of `max_drafts` from `second`, which sees
    the context followed by `first`'s drafts.

    Draft probabilities: when neither part has any, the result has none (one-hot). When one part has
    them, the other part's rows are filled in one-hot (that is the distribution a model-free proposer
    drafts from), on the same device, so every row keeps the distribution its token was drawn from.
    Draft-model logprobs likewise, NaN on the rows of a part without them.
    """

    def __init__(self, first: Proposer, second: Proposer, first_count: int) -> None:
        if not isinstance(first_count, int) or first_count < 0:
            raise ValueError(f"first_count must be a non-negative integer, got {first_count!r}")
        if second.tracks_sequences:
            raise ValueError(f"the second proposer ({second.method!r}) keeps per-sequence state and cannot "
                             "continue another proposer's tentative drafts")
        self.first, self.second, self.first_count = first, second, first_count
        self.method = f"{first.method}+{second.method}"
        self.tracks_sequences = first.tracks_sequences

    def propose(self, requests: Sequence[DraftRequest]) -> list[Drafts]:
        heads = self.first.propose(
            [dataclasses.replace(r, max_drafts=min(r.max_drafts, self.first_count)) for r in requests])
        rows = [i for i, (r, h) in enumerate(zip(requests, heads)) if r.max_drafts > len(h)]
        tails = self.second.propose([
            dataclasses.replace(requests[i], token_ids=np.concatenate([requests[i].token_ids, heads[i].token_ids]),
                                max_drafts=requests[i].max_drafts - len(heads[i]))
            for i in rows
        ]) if rows else []
        out = list(heads)
        for i, tail in zip(rows, tails):
            out[i] = _join(heads[i], tail)
        return out

    def on_sequence_finished(self, seq_id: int, request_id: str, token_ids: np.ndarray, num_prompt_tokens: int) -> None:
        self.first.on_sequence_finished(seq_id, request_id, token_ids, num_prompt_tokens)
        self.second.on_sequence_finished(seq_id, request_id, token_ids, num_prompt_tokens)

    def catch_up(self, seconds: float | None = None) -> bool:
        return self.first.catch_up(seconds) | self.second.catch_up(seconds)


def _join(head: Drafts, tail: Drafts) -> Drafts:
    if not len(tail):
        return head
    if not len(head):
        return tail
    token_ids = np.concatenate([head.token_ids, tail.token_ids])  # [k1 + k2]
    logprobs = None
    if head.logprobs is not None or tail.logprobs is not None:
        logprobs = np.concatenate([_logprobs(head), _logprobs(tail)]).astype(np.float32)  # [k1 + k2]
    if head.probs is None and tail.probs is None:
        return Drafts(token_ids, logprobs=logprobs)
    vocab = {d.probs.shape[1] for d in (head, tail) if d.probs is not None}
    if len(vocab) != 1:
        raise ValueError(f"chained proposers disagree on the vocabulary size: {sorted(vocab)}")
    xp = array_module(head.probs if head.probs is not None else tail.probs)
    return Drafts(token_ids, xp.concatenate([_rows(xp, head, *vocab), _rows(xp, tail, *vocab)]), logprobs)


def _logprobs(drafts: Drafts) -> np.ndarray:
    """[k]: the draft model's logprobs, NaN where the proposer has none."""
    return drafts.logprobs if drafts.logprobs is not None else np.full(len(drafts), np.nan, np.float32)


def _rows(xp: Any, drafts: Drafts, vocab_size: int) -> Any:
    """[k, V] float32 on xp's device: the draft distributions, one-hot where the proposer gave none."""
    if drafts.probs is not None:
        return drafts.probs
    rows = xp.zeros((len(drafts), vocab_size), dtype=np.float32)
    rows[xp.arange(len(drafts)), xp.asarray(drafts.token_ids)] = 1.0
    return rows
