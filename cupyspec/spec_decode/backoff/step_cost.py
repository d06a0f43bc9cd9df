"""What engine steps cost, learned online, for the back-off rule (`cupyspec/spec_decode/backoff/policy.py`).

The engine reports each step's wall time since the step before (everything the loop spends per
step) with its shape (`StepShape`). Two exponentially weighted least-squares fits come out of them:

- a draft-free step: seconds = fixed + per_row * rows;
- what drafting adds to a step: seconds = per_drafting_step + per_draft_row * draft rows
  + per_drafting_seq * drafting sequences + per_kept_draft * kept drafts, measured against the
  first fit at the step's rows. `per_drafting_step` holds the host work that a drafting step, run
  one step at a time under overlap scheduling, cannot hide behind the device; `per_kept_draft` the
  host's work on each kept draft (detokenizing, stop checks, outputs), which would otherwise be
  charged to the draft rows. This fit is learned apart for each load band (LOAD_BANDS), because
  giving up overlap costs much where the host is the bottleneck (a large batch) and little at one
  sequence.

The row slopes are under a weak ridge, so that where rows do not vary (at one sequence nearly every
drafting step has the most drafts) the intercept takes the cost. The per-sequence slope is not:
while all drafting steps had as many drafting sequences, its minimum-norm share makes more of them
look dearer.

A step is a drafting one when it verifies drafts; one whose sequences got no drafts runs overlapped
and counts as draft-free, unless an MTP head drafted in it for the next step (`priming`): that is
no draft-free step's price, and is left out. A drafting step waits for the step in flight (the drain), and the
draft-free step after it is launched with none in flight (`refilled`). So what drafting adds is the
drafting step's wall time plus what the refilled step took more or less than a draft-free step of
its rows: where the device is the bottleneck the refilled step gives the drain back, where the host
is it does not. A refilled step is not taken as a draft-free step's price. Each fit has few terms,
which keeps it stable over the few dozen steps it remembers.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

PLAIN_DECAY = 0.9  # weight kept by past draft-free steps at each new one (about 10 steps of memory: follows the load)
DRAFTING_DECAY = 0.97  # likewise for drafting steps (about 30 of them)
MIN_PLAIN_STEPS = 8  # draft-free steps observed before the estimate is used
MIN_DRAFTING_STEPS = 6  # drafting steps, likewise
REFIT_STEPS = 4  # a fit is solved when asked, at most every this many of its observations, so few steps pay for it
RIDGE = 1e-3  # a row slope's penalty, per unit of observation weight (module docstring)
OUTLIER_FACTOR = 3.0  # once fitted, a step slower than this many times its predicted time is an outlier
MAX_OUTLIER_RUN = 8  # outliers in a row that are left out; past them the cost has changed, and is learned
PLAIN = -1  # the draft-free fit, beside the drafting fits of the load bands (`StepCostModel._outlier`)
LOAD_BANDS = (1, 4, 16, 64)  # upper bounds of the sequences of a load band but the last (module docstring)


def load_band(sequences: int) -> int:
    """The load band of a step of `sequences` sequences: 0 .. len(LOAD_BANDS)."""
    return bisect.bisect_left(LOAD_BANDS, sequences)


class StepShape(NamedTuple):
    """What an engine step's cost depends on (module docstring)."""

    rows: int  # rows of the forward pass, drafts included
    drafting: int = 0  # sequences whose drafts the step verifies (module docstring)
    draft_rows: int = 0  # rows that verify drafts
    refilled: bool = False  # a draft-free step launched with no step in flight, under overlap scheduling
    kept: int = 0  # drafts that verification accepted
    sequences: int = 1  # sequences in the step: its load band
    priming: bool = False  # verifies no drafts, but an MTP head drafted in it for the next step


@dataclass(frozen=True)
class StepCost:
    """A draft-free step's seconds, fixed + per_row * rows; and what drafting adds to a step."""

    fixed: float
    per_row: float
    per_drafting_step: float = 0.0
    per_draft_row: float = 0.0
    per_drafting_seq: float = 0.0
    per_kept_draft: float = 0.0

    def seconds(self, rows: float) -> float:
        """A draft-free step of `rows` rows."""
        return self.fixed + self.per_row * rows

    def drafting_seconds(self, draft_rows: float, drafting: float, kept: float = 0.0) -> float:
        """What drafting adds to a step, with `draft_rows` draft rows of `drafting` sequences, `kept` of them kept."""
        return (self.per_drafting_step + self.per_draft_row * draft_rows + self.per_drafting_seq * drafting
                + self.per_kept_draft * kept)


class _WeightedLeastSquares:
    """y = x . terms over observations weighted by decay ** (observations since), x[0] = 1; terms
    clipped at 0, those in `ridged` under a ridge (module docstring). Observations are kept as tuples
    and folded into the weighted sums only when the fit is solved, so observing costs the step loop
    a list append."""

    def __init__(self, decay: float, ridged: tuple[int, ...]) -> None:
        """ridged [T]: 1 for the terms under the ridge, 0 for the others (the intercept first)."""
        num_terms = len(ridged)
        self.decay = decay
        self.ridged = np.array(ridged, dtype=float)  # [T]
        self.gram = np.zeros((num_terms, num_terms))  # [T, T] weighted sum of x x^T
        self.moment = np.zeros(num_terms)  # [T] weighted sum of x * y
        self.count = 0
        self._pending: list[tuple[float, ...]] = []  # observations (x, then y) not folded in yet
        self._terms: np.ndarray | None = None  # [T] the last solution
        self._solved_at = 0  # count when solved

    def observe(self, x: tuple[float, ...], y: float) -> None:
        self._pending.append((*x, y))
        self.count += 1

    @property
    def last(self) -> np.ndarray | None:
        """The solution as of the last `terms` call, without solving anew."""
        return self._terms

    def terms(self, min_count: int) -> np.ndarray | None:
        """The solution, as of at most REFIT_STEPS - 1 observations ago; None before `min_count`.
        A ridged slope whose regressor does not vary gets nothing, the intercept takes its share;
        other terms that the steps cannot tell apart split it by minimum norm."""
        if self.count < min_count:
            return None
        if self._terms is None or self.count - self._solved_at >= REFIT_STEPS:
            self._fold()
            self._terms, self._solved_at = self._solve(), self.count
        return self._terms

    def _solve(self) -> np.ndarray:
        """[T] terms, none negative: while the fit gives some term a negative value, the most negative
        is set to 0 and the others are fitted again, so that they drop what it offset (clipping it
        alone would keep that in them)."""
        lhs = self.gram + np.diag(RIDGE * self.gram[0, 0] * self.ridged)  # gram[0, 0]: the observations' weight
        free = np.ones(len(self.moment), dtype=bool)  # [T] the terms still fitted
        while True:
            fitted = np.flatnonzero(free)
            solution = np.zeros(len(self.moment))
            if fitted.size:
                solution[fitted] = np.linalg.lstsq(lhs[np.ix_(fitted, fitted)], self.moment[fitted], rcond=1e-9)[0]
            if solution.min() >= 0.0:
                return solution
            free[solution.argmin()] = False

    def _fold(self) -> None:
        """Add the pending observations to the weighted sums, each decayed by the observations after it."""
        pending = np.array(self._pending)  # [K, T + 1]: x, y
        self._pending.clear()
        weights = self.decay ** np.arange(len(pending) - 1, -1, -1)  # [K]
        x, y = pending[:, :-1], pending[:, -1]
        self.gram = self.decay ** len(pending) * self.gram + (x * weights[:, None]).T @ x
        self.moment = self.decay ** len(pending) * self.moment + x.T @ (weights * y)


class StepCostModel:
    """The fits of the module docstring: one of draft-free steps, one of drafting per load band."""

    def __init__(self) -> None:
        self._plain = _WeightedLeastSquares(PLAIN_DECAY, (0, 1))  # (1, rows) -> seconds
        # per load band: (1, draft rows, drafting, kept) -> added seconds
        self._drafting = [_WeightedLeastSquares(DRAFTING_DECAY, (0, 1, 0, 0)) for _ in range(len(LOAD_BANDS) + 1)]
        self._open: tuple[int, tuple[float, ...], float] | None = None  # the last drafting step's load
        # band, x and added seconds, until the step after it shows whether it was refilled (module docstring)
        self._outlier_runs = [0] * (len(LOAD_BANDS) + 2)  # per fit (PLAIN last): its steps in a row far
        # slower than predicted (`_learn_one`)
        self._unlearned: list[tuple[StepShape, float]] = []  # observed steps that `learn` has not taken yet

    def observe(self, shape: StepShape, seconds: float) -> None:
        """One step's wall time, taken into the fits by the next `learn` (or `fit`)."""
        self._unlearned.append((shape, seconds))

    def learn(self) -> None:
        """Take the observed steps into the fits. Judging a step solves a fit now and then: the
        engine calls this while the next step is on the device, so that it does not lengthen the
        host's gap between a drafting step and the next."""
        unlearned, self._unlearned = self._unlearned, []
        for shape, seconds in unlearned:
            self._learn_one(shape, seconds)

    def _learn_one(self, shape: StepShape, seconds: float) -> None:
        """A step far slower than predicted (a kernel compiled on first use, a garbage collection, or
        a burst of requests tokenized while the step waited for the device) is left out, so that one
        hiccup does not stop speculation for long; a step after a drafting one that is, takes the
        drafting one with it. Such steps are left out rather than capped, since a cap rises with the
        fit and a burst would raise both step after step. A draft-free step is judged by the fit as
        last solved (by `fit`, which the back-off rule calls within its budget): solving it here
        would cost every step."""
        plain = self._plain.terms(MIN_PLAIN_STEPS) if shape.drafting else self._plain.last
        if plain is None:  # nothing to measure against yet: only draft-free steps are taken
            if not (shape.drafting or shape.refilled or shape.priming):
                self._plain.observe((1.0, shape.rows), seconds)
            return
        plain_seconds = plain[0] + plain[1] * shape.rows  # a draft-free step of these rows
        if self._open is not None:
            band, x, added = self._open
            self._open = None
            if shape.refilled:
                if self._outlier(band, seconds, plain_seconds):
                    return
                added += seconds - plain_seconds
            self._drafting[band].observe(x, added)
        if not shape.drafting:
            if not (shape.refilled or shape.priming or self._outlier(PLAIN, seconds, plain_seconds)):
                self._plain.observe((1.0, shape.rows), seconds)
            return
        base = plain[0] + plain[1] * (shape.rows - shape.draft_rows)
        x = (1.0, shape.draft_rows, shape.drafting, shape.kept)
        band = load_band(shape.sequences)
        drafting = self._drafting[band].terms(MIN_DRAFTING_STEPS)
        if drafting is not None and self._outlier(band, seconds, base + float(np.dot(drafting, x))):
            return
        self._open = (band, x, seconds - base)

    def _outlier(self, fit: int, seconds: float, predicted: float) -> bool:
        """Whether to leave out a step that took `seconds` against the `predicted` of `fit` (PLAIN or
        a load band): one slower than OUTLIER_FACTOR times it, unless more than MAX_OUTLIER_RUN
        steps of that fit in a row were."""
        if seconds <= OUTLIER_FACTOR * predicted:
            self._outlier_runs[fit] = 0
            return False
        self._outlier_runs[fit] += 1
        return self._outlier_runs[fit] <= MAX_OUTLIER_RUN

    def fit(self, sequences: int) -> StepCost | None:
        """The estimate for steps of `sequences` sequences, or None before MIN_PLAIN_STEPS draft-free
        steps and MIN_DRAFTING_STEPS drafting ones of their load band."""
        self.learn()
        plain = self._plain.terms(MIN_PLAIN_STEPS)
        drafting = self._drafting[load_band(sequences)].terms(MIN_DRAFTING_STEPS)
        if plain is None or drafting is None:
            return None
        return StepCost(*plain.tolist(), *drafting.tolist())
