"""What an engine step costs, learned online:
seconds = fixed + per row + per sequence + per drafting sequence + per synchronous drafting step.

The engine reports, for each step, the wall time since the step before (scheduling, forward pass,
sampling or verification, output processing, and any wait for the step before to drain: everything
the loop spends per step) with its rows, its sequences, how many of them asked for drafts, and
whether drafting made the step give up overlap scheduling (a draft-free step is launched before
the host has the tokens of the step before; a drafting step waits for them, since the proposers
read every token). An exponentially weighted least-squares fit of those five terms gives the
back-off rule (`cupyspec/spec/policy.py`) the price of a draft row, of a sequence that drafts at
all, and of a step that drafts, on this machine, model and load.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DECAY = 0.97  # weight kept by past steps at each new one (about 30 steps of memory)
MIN_STEPS = 16  # steps observed before the fit is used
REFIT_STEPS = 4  # the fit is brought up to date when asked, at most every this many steps
OUTLIER_FACTOR = 3.0  # once fitted, a step counts as at most this many times its predicted time


@dataclass(frozen=True)
class StepCost:
    """Seconds per step: fixed + per_row * rows + per_seq * sequences + per_drafting_seq * drafting
    + per_synced_step * synced (1 for a step that gave up overlap scheduling to draft, else 0)."""

    fixed: float
    per_row: float
    per_seq: float
    per_drafting_seq: float
    per_synced_step: float = 0.0

    def seconds(self, rows: float, seqs: float, drafting: float = 0, synced: bool = False) -> float:
        return (self.fixed + self.per_row * rows + self.per_seq * seqs + self.per_drafting_seq * drafting
                + self.per_synced_step * synced)


class StepCostModel:
    """Exponentially weighted least squares over the steps observed so far."""

    def __init__(self) -> None:
        self._gram = np.zeros((5, 5))  # [5, 5] weighted sum of x x^T
        self._moment = np.zeros(5)  # [5] weighted sum of x * seconds
        self._recent: list[tuple[float, float, float, float, float, float]] = []  # observations not folded in yet
        self.num_steps = 0
        self._fit: StepCost | None = None
        self._fitted_at = 0  # num_steps when _fit was computed

    def observe(self, rows: int, seqs: int, drafting: int, synced: bool, seconds: float) -> None:
        """One step's wall time; a step far slower than predicted (a kernel compiled on first use, a
        garbage collection) is capped, so that one hiccup does not stop speculation for long."""
        if self._fit is not None:
            seconds = min(seconds, OUTLIER_FACTOR * self._fit.seconds(rows, seqs, drafting, synced))
        self._recent.append((1.0, rows, seqs, drafting, float(synced), seconds))
        self.num_steps += 1

    def fit(self) -> StepCost | None:
        """The estimate (terms clipped at 0) as of at most REFIT_STEPS - 1 steps ago, or None before
        MIN_STEPS steps."""
        if self.num_steps >= MIN_STEPS and (self._fit is None or self.num_steps - self._fitted_at >= REFIT_STEPS):
            self._fold()
            # minimum-norm solution: a term that has not varied (no drafts yet) gets no share
            terms = np.linalg.lstsq(self._gram, self._moment, rcond=1e-9)[0]
            self._fit, self._fitted_at = StepCost(*np.maximum(terms, 0.0).tolist()), self.num_steps
        return self._fit

    def _fold(self) -> None:
        """Add the recent observations to the weighted sums, each decayed by the steps after it."""
        recent = np.array(self._recent)  # [K, 6]: x (5 terms), seconds
        self._recent.clear()
        weights = DECAY ** np.arange(len(recent) - 1, -1, -1)  # [K]
        x, seconds = recent[:, :5], recent[:, 5]
        self._gram = DECAY ** len(recent) * self._gram + (x * weights[:, None]).T @ x
        self._moment = DECAY ** len(recent) * self._moment + (x * (weights * seconds)[:, None]).sum(axis=0)
