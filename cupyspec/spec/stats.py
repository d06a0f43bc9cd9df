"""Speculation counters of one sequence, summed per request for `speculate_metrics`."""

from __future__ import annotations

from dataclasses import dataclass, field

ACCEPTANCE_EMA_WEIGHT = 0.3  # weight of the newest step in a sequence's acceptance average


@dataclass
class SpecStats:
    """Verify steps, drafts and accepted drafts; `accepted_per_position[j]` counts draft j accepted."""

    num_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    acceptance_ema: float = 1.0  # recent acceptance rate, for the back-off rule
    steps_since_draft: int = 0

    def record(self, accepted: tuple[bool, ...], num_emitted: int) -> None:
        self.num_steps += 1
        self.num_emitted_tokens += num_emitted
        if not accepted:
            self.steps_since_draft += 1
            return
        self.steps_since_draft = 0
        num_accepted = accepted.index(False) if False in accepted else len(accepted)
        self.num_draft_tokens += len(accepted)
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < len(accepted):
            self.accepted_per_position += [0] * (len(accepted) - len(self.accepted_per_position))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1
        rate = num_accepted / len(accepted)
        self.acceptance_ema += ACCEPTANCE_EMA_WEIGHT * (rate - self.acceptance_ema)

    def add(self, other: SpecStats) -> None:
        self.num_steps += other.num_steps
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_emitted_tokens += other.num_emitted_tokens
        longer = max(len(self.accepted_per_position), len(other.accepted_per_position))
        self.accepted_per_position = [
            (self.accepted_per_position[j] if j < len(self.accepted_per_position) else 0)
            + (other.accepted_per_position[j] if j < len(other.accepted_per_position) else 0) for j in range(longer)]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return self.num_emitted_tokens / self.num_steps if self.num_steps else 0.0
