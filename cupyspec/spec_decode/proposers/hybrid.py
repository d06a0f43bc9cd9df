"""MTP and ngram together (`"mtp_strategy": "with_ngram"`): the head's drafts, then ngram's after them,
as FastDeploy fills the slots past num_model_steps; but where the text copies its context, ngram's
drafts from the start."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cupyspec.spec_decode.proposers.base import DraftRequest, Drafts, Proposer
from cupyspec.spec_decode.proposers.chain import ChainProposer
from cupyspec.spec_decode.proposers.mtp import MTPProposer
from cupyspec.spec_decode.proposers.ngram import NgramProposer


class MTPWithNgram(Proposer):
    """Per sequence: where ngram finds an earlier occurrence that agrees with the context on at least
    `ngram.ngram_max` tokens (the text copies itself, and there ngram's drafts are the likelier: on
    code rewrites ngram alone accepts more than the head), ngram's drafts alone; elsewhere the head's
    first `num_model_steps`, continued by ngram (ChainProposer)."""

    method = "mtp+ngram"
    drafts_ahead = True  # an empty answer: the head did not run, and no copy was found

    def __init__(self, mtp: MTPProposer, ngram: NgramProposer, num_model_steps: int) -> None:
        self.first = mtp  # the head's proposer, as make_mtp_drafting finds it
        self.ngram = ngram
        self.chain = ChainProposer(mtp, ngram, num_model_steps)
        self._took_the_heads = True  # some request of the last call took the head's drafts

    def propose(self, requests: Sequence[DraftRequest]) -> list[Drafts]:
        copies = self.ngram.propose_copies(requests, self.ngram.ngram_max)
        rest = [i for i, drafts in enumerate(copies) if not len(drafts)]
        self._took_the_heads = bool(rest)
        out = list(copies)
        for i, drafts in zip(rest, self.chain.propose([requests[i] for i in rest]) if rest else ()):
            out[i] = drafts
        return out

    def wants_drafts_ahead(self) -> bool:
        """While every sequence copies its context, the head's drafts go unused: it need not draft."""
        return self._took_the_heads

    def on_sequence_finished(self, seq_id: int, request_id: str, token_ids: np.ndarray, num_prompt_tokens: int) -> None:
        self.chain.on_sequence_finished(seq_id, request_id, token_ids, num_prompt_tokens)

    def catch_up(self, seconds: float | None = None) -> bool:
        return self.chain.catch_up(seconds)
