"""Before each step: decide who drafts (the back-off rule), then ask the proposer for drafts."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np

from cupyspec.sequence import Sequence
from cupyspec.spec.policy import PROBE_INTERVAL, draft_limits
from cupyspec.spec.proposer import DraftRequest, Proposer
from cupyspec.spec.step_cost import StepCostModel
from cupyspec.speculative_config import SpeculativeConfig


class Drafter:
    """Sets `draft_token_ids` on the running sequences; the scheduler reserves KV slots for them.

    `plan` reads no token, so the engine can decide whether a step drafts while the tokens of the
    step before are still on the device; `propose` needs them all on the host.
    """

    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config, self.proposer = config, proposer
        self.step_cost = StepCostModel()  # what rows and drafting cost, for the back-off rule
        self.num_steps = 0  # engine steps observed; every PROBE_INTERVAL-th one probes

    def observe_step(self, rows: int, seqs: int, drafting: int, synced: bool, seconds: float) -> None:
        """One engine step's wall time, with its rows, sequences, how many of them asked for drafts,
        and whether drafting made it give up overlap scheduling."""
        self.step_cost.observe(rows, seqs, drafting, synced, seconds)
        self.num_steps += 1

    def plan(self, running: Seq[Sequence], can_overlap: bool) -> dict[int, int]:
        """seq_id -> drafts to ask for this step (the back-off rule; see policy.py)."""
        cost = self.step_cost.fit() if self.config.cost_aware_backoff else None
        return draft_limits(running, self.config, cost, self.num_steps % PROBE_INTERVAL == 0, can_overlap)

    def propose(self, running: Seq[Sequence], limits: dict[int, int]) -> None:
        """Set each running sequence's drafts: up to limits[seq_id] from the proposer, else none."""
        asking = [seq for seq in running if limits.get(seq.seq_id, 0) > 0]
        for seq in running:
            seq.draft_token_ids = []
        if not asking:
            return
        requests = [DraftRequest(seq.seq_id, seq.request_id, np.asarray(seq.token_ids, dtype=np.int32),
                                 seq.num_prompt_tokens, limits[seq.seq_id]) for seq in asking]
        for seq, drafts in zip(asking, self.proposer.propose(requests)):
            seq.draft_token_ids = drafts.token_ids[:limits[seq.seq_id]].tolist()
            seq.spec.record_proposal(bool(seq.draft_token_ids))

    def on_sequence_finished(self, seq: Sequence) -> None:
        self.proposer.on_sequence_finished(seq.seq_id, seq.request_id, np.asarray(seq.token_ids, dtype=np.int32),
                                           seq.num_prompt_tokens)
