"""Before each step: ask the proposer for drafts, within the back-off rule's limits."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np

from cupyspec.sequence import Sequence
from cupyspec.spec.policy import draft_limits
from cupyspec.spec.proposer import DraftRequest, Proposer
from cupyspec.spec.step_cost import StepCostModel
from cupyspec.speculative_config import SpeculativeConfig


class Drafter:
    """Sets `draft_token_ids` on the running sequences; the scheduler reserves KV slots for them."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config, self.proposer = config, proposer
        self.step_cost = StepCostModel()  # what rows and drafting sequences cost, for the back-off rule

    def observe_step(self, rows: int, seqs: int, drafting: int, seconds: float) -> None:
        """One engine step's wall time, with its rows, sequences and how many of them drafted."""
        self.step_cost.observe(rows, seqs, drafting, seconds)

    def prepare(self, running: Seq[Sequence]) -> None:
        cost = self.step_cost.fit() if self.config.cost_aware_backoff else None
        limits = draft_limits(running, self.config, cost)
        asking = [seq for seq in running if limits.get(seq.seq_id, 0) > 0]
        for seq in running:
            seq.draft_token_ids = []
        if not asking:
            return
        requests = [DraftRequest(seq.seq_id, seq.request_id, np.asarray(seq.token_ids, dtype=np.int32),
                                 seq.num_prompt_tokens, limits[seq.seq_id]) for seq in asking]
        for seq, drafts in zip(asking, self.proposer.propose(requests)):
            seq.draft_token_ids = drafts.token_ids[:limits[seq.seq_id]].tolist()

    def on_sequence_finished(self, seq: Sequence) -> None:
        self.proposer.on_sequence_finished(seq.seq_id, seq.request_id, np.asarray(seq.token_ids, dtype=np.int32),
                                           seq.num_prompt_tokens)
