"""Speculation counters of one sequence, summed per request for `speculate_metrics`."""

from __future__ import annotations

from dataclasses import dataclass, field

ACCEPTANCE_DECAY = 0.7  # weight kept by a sequence's past steps in its recent acceptance estimate


@dataclass
class SpecStats:
    """Verify steps, drafts and accepted drafts; `accepted_per_position[j]` counts draft j accepted."""

    num_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    # verified drafts that decided a step: the accepted ones and each step's first rejected one
    num_tested_tokens: int = 0
    num_proposals: int = 0  # times the proposer was asked for drafts
    num_hits: int = 0  # of those, times it proposed at least one
    # Recent per-draft acceptance, for the back-off rule: drafts accepted over drafts tested (the
    # accepted ones and the first rejected one of each step), weighted towards recent steps; one
    # accepted test as the prior.
    recent_accepted: float = 1.0
    recent_tested: float = 1.0
    # Recent share of the proposer's answers that held any draft, weighted the same way; one hit as the prior.
    recent_found: float = 1.0
    recent_asked: float = 1.0

    @classmethod
    def expecting(cls, acceptance: float, hit_rate: float) -> SpecStats:
        """Fresh counters whose recent estimates start, with the weight of one observation, at these."""
        return cls(recent_accepted=acceptance, recent_found=hit_rate)

    def record(self, accepted: tuple[bool, ...], num_emitted: int) -> None:
        """A decode step: its drafts' verdicts (empty: it drafted none) and the tokens it emitted."""
        self.num_steps += 1
        self.num_emitted_tokens += num_emitted
        if not accepted:
            return
        num_accepted = accepted.index(False) if False in accepted else len(accepted)
        self.num_draft_tokens += len(accepted)
        self.num_accepted_tokens += num_accepted
        self.num_tested_tokens += num_accepted + (num_accepted < len(accepted))
        if len(self.accepted_per_position) < len(accepted):
            self.accepted_per_position += [0] * (len(accepted) - len(self.accepted_per_position))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1
        self.learn(num_accepted, len(accepted))

    def learn(self, num_accepted: int, num_drafts: int) -> None:
        """Update the recent acceptance with a run of `num_drafts` drafts whose first `num_accepted`
        held (verified, or scored against the tokens emitted since: a shadow probe)."""
        tested = num_accepted + (num_accepted < num_drafts)
        self.recent_accepted = ACCEPTANCE_DECAY * self.recent_accepted + num_accepted
        self.recent_tested = ACCEPTANCE_DECAY * self.recent_tested + tested

    def record_proposal(self, found: bool) -> None:
        """The proposer was asked for drafts; `found`: it proposed at least one."""
        self.num_proposals += 1
        self.num_hits += found
        self.recent_found = ACCEPTANCE_DECAY * self.recent_found + found
        self.recent_asked = ACCEPTANCE_DECAY * self.recent_asked + 1.0

    def add(self, other: SpecStats) -> None:
        self.num_steps += other.num_steps
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_emitted_tokens += other.num_emitted_tokens
        self.num_tested_tokens += other.num_tested_tokens
        self.num_proposals += other.num_proposals
        self.num_hits += other.num_hits
        longer = max(len(self.accepted_per_position), len(other.accepted_per_position))
        self.accepted_per_position = [
            (self.accepted_per_position[j] if j < len(self.accepted_per_position) else 0)
            + (other.accepted_per_position[j] if j < len(other.accepted_per_position) else 0) for j in range(longer)]

    @property
    def draft_acceptance(self) -> float:
        """The recent probability that a draft is accepted once the drafts before it are."""
        return self.recent_accepted / self.recent_tested

    @property
    def proposal_hit_rate(self) -> float:
        """The recent probability that asking the proposer yields drafts at all."""
        return self.recent_found / self.recent_asked

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return self.num_emitted_tokens / self.num_steps if self.num_steps else 0.0
