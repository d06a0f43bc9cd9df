"""The step cost model (spec_decode/backoff/step_cost.py): what a draft-free step costs and what
drafting adds, fitted online from the engine's steps."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import astuple

import numpy as np
import pytest

from cupyspec.spec_decode.backoff.step_cost import (
    MAX_OUTLIER_RUN,
    REFIT_STEPS,
    StepCost,
    StepCostModel,
    StepShape,
    load_band,
)


def _drafting_episodes(model: StepCostModel, rng: np.random.Generator, device_bound: bool) -> None:
    """300 steps: draft-free ones of 1e-3 + 4e-6 s a row, and drafting ones adding 2e-4 s, 5e-6 s a
    draft row, 30e-6 s a drafting sequence and 8e-6 s a kept draft, each after a draft-free step
    (it waits for that one, the drain) and before a refilled one. Device-bound, the refilled step
    saves what the drain took; host-bound it saves nothing."""
    for _ in range(100):
        seqs = int(rng.integers(1, 257))
        model.observe(StepShape(seqs, sequences=seqs), 1e-3 + 4e-6 * seqs)
        drafting = int(rng.integers(1, seqs + 1))
        draft_rows = drafting * int(rng.integers(0, 6))
        kept = int(rng.integers(0, draft_rows + 1))
        drain = float(rng.random()) * 5e-4
        added = 2e-4 + 5e-6 * draft_rows + 30e-6 * drafting + 8e-6 * kept
        model.observe(StepShape(seqs + draft_rows, drafting, draft_rows, kept=kept, sequences=seqs),
                      1e-3 + 4e-6 * seqs + added + drain)
        model.observe(StepShape(seqs, refilled=True, sequences=seqs),
                      1e-3 + 4e-6 * seqs - (drain if device_bound else 0.0))


def test_the_step_cost_fit_recovers_the_terms():
    """Draft-free steps give the price of a row; a drafting step together with the refilled step
    after it gives what drafting adds: where the device is the bottleneck the wait for the step in
    flight only moves from the refilled step to the drafting one."""
    model = StepCostModel()
    assert model.fit(200) is None  # too few steps
    _drafting_episodes(model, np.random.default_rng(0), device_bound=True)
    assert astuple(model.fit(200)) == pytest.approx((1e-3, 4e-6, 2e-4, 5e-6, 30e-6, 8e-6), rel=1e-3)


def test_observing_a_step_leaves_the_fits_to_learn():
    """Observing a step only records it; `learn` judges it and fits, and `fit` learns first."""
    model = StepCostModel()
    _drafting_episodes(model, np.random.default_rng(0), device_bound=True)
    fitted = astuple(model.fit(200))
    solved = []
    for fit in (model._plain, *model._drafting):
        fit._solve = (lambda solve: lambda: solved.append(1) or solve())(fit._solve)
    _drafting_episodes(model, np.random.default_rng(1), device_bound=True)
    assert not solved  # observing solved nothing
    model.learn()
    assert solved and astuple(model.fit(200)) == pytest.approx(fitted, rel=0.05)


def test_where_the_host_is_the_bottleneck_drafting_is_charged_its_wait():
    """A draft-free step of a host-bound engine waits for nothing, so the refilled step saves
    nothing: the drafting step's wait for the step in flight is what drafting costs."""
    model = StepCostModel()
    _drafting_episodes(model, np.random.default_rng(0), device_bound=False)
    cost = model.fit(200)
    assert cost.per_drafting_step == pytest.approx(2e-4 + 2.5e-4, rel=0.2)  # plus the drain's mean
    assert astuple(cost)[:2] == pytest.approx((1e-3, 4e-6), rel=1e-3)


def test_a_burst_of_slow_steps_is_left_out_and_a_lasting_change_is_learned():
    """Steps that waited while a burst of requests came in (or a kernel compiled) say nothing of
    what drafting costs: the fit leaves out a few far slower than it predicts. More in a row than
    MAX_OUTLIER_RUN are a new cost, which it learns."""
    model = StepCostModel()
    for _ in range(30):
        model.observe(StepShape(1), 7e-4)
        model.observe(StepShape(6, 1, 5), 7e-4 + 1e-4)
    before = model.fit(1).drafting_seconds(5, 1)
    for _ in range(MAX_OUTLIER_RUN // 2):
        model.observe(StepShape(6, 1, 5), 70e-3)  # the steps a burst of requests ran beside
        model.observe(StepShape(1, refilled=True), 20e-3)
    for _ in range(REFIT_STEPS):
        model.observe(StepShape(1), 7e-4)
    assert model.fit(1).drafting_seconds(5, 1) == pytest.approx(before, rel=1e-2)
    for _ in range(MAX_OUTLIER_RUN + 100):  # past the outliers left out, and long enough to forget the old price
        model.observe(StepShape(6, 1, 5), 7e-4 + 5e-3)  # drafting now adds 5 ms
        model.observe(StepShape(1), 7e-4)
    assert model.fit(1).drafting_seconds(5, 1) > 2e-3


def test_what_drafting_adds_is_learned_apart_for_each_load():
    """A price of drafting learned at 128 sequences (the host the bottleneck: a drafting step gives
    up the overlap of a long step) does not hold at one sequence, nor the other way round; a load
    of the same band shares it, and a load of a band that has seen no drafting step has no price."""
    model = StepCostModel()
    for i in range(60):
        model.observe(StepShape(1, sequences=1), 7e-4)
        model.observe(StepShape(128, sequences=128), 2e-3)
        if i % 3 == 0:
            model.observe(StepShape(6, 1, 5, sequences=1), 7e-4 + 1e-4)
            model.observe(StepShape(128 + 40, 8, 40, sequences=128), 2e-3 + 8e-3)
    assert model.fit(1).drafting_seconds(5, 1) == pytest.approx(1e-4, rel=1e-2)
    assert model.fit(128).drafting_seconds(40, 8) == pytest.approx(8e-3, rel=1e-2)
    beside_busy = [n for n in range(2, 128) if load_band(n) == load_band(128)]
    between = [n for n in range(2, 128) if load_band(n) not in (load_band(1), load_band(128))]
    assert beside_busy and between  # the loads this test needs: one band with 128, others below it
    assert all(model.fit(n).drafting_seconds(40, 8) == model.fit(128).drafting_seconds(40, 8) for n in beside_busy)
    assert all(model.fit(n) is None for n in between)  # no drafting step seen at those loads yet


def _one_sequence_fit(steps: int, plain_seconds: float,
                      drafting_step: Callable[[np.random.Generator], tuple[StepShape, float]]) -> StepCost:
    """The fit at one sequence after `steps` steps, half of them (at random) draft-free ones of
    `plain_seconds`, the others drafting steps from `drafting_step`."""
    model, rng = StepCostModel(), np.random.default_rng(0)
    for _ in range(steps):
        model.observe(*(drafting_step(rng) if rng.random() >= 0.5 else (StepShape(1), plain_seconds)))
    return model.fit(1)


def test_the_step_cost_fit_charges_rows_that_do_not_vary_to_the_step():
    """At one sequence every drafting step has the most drafts: the fit cannot tell the step from
    its rows, and charges the step, so that fewer drafts do not look cheaper."""
    def drafting_step(rng: np.random.Generator) -> tuple[StepShape, float]:
        kept = int(rng.integers(0, 8))
        return StepShape(8, 1, 7, kept=kept), 8e-4 + 5e-4 + 1e-5 * kept

    cost = _one_sequence_fit(100, 8e-4, drafting_step)
    assert cost.seconds(1) == pytest.approx(8e-4, rel=1e-3) and cost.per_row < 1e-7
    assert cost.per_draft_row < 1e-7
    assert cost.drafting_seconds(7, 1) == pytest.approx(5e-4, rel=1e-2)
    assert cost.drafting_seconds(1, 1) == pytest.approx(5e-4, rel=1e-2)  # 6 drafts fewer save nothing
    assert cost.per_kept_draft == pytest.approx(1e-5, rel=1e-2)


def test_a_term_the_fit_would_make_negative_is_left_out_and_the_others_fitted_again():
    """Where draft rows vary a little and the steps with more happened to be quicker, the rows' slope
    comes out negative; set to 0, it must not leave the step the price it offset (clipped alone, a
    7-row drafting step would be priced at several times what any took, and speculation would stop)."""
    def drafting_step(rng: np.random.Generator) -> tuple[StepShape, float]:
        draft_rows = int(rng.integers(6, 8))
        return (StepShape(1 + draft_rows, 1, draft_rows, kept=int(rng.integers(0, 8))),
                7e-4 + (6e-4 if draft_rows == 6 else 4e-4))

    cost = _one_sequence_fit(120, 7e-4, drafting_step)
    assert min(cost.per_drafting_step, cost.per_draft_row, cost.per_drafting_seq, cost.per_kept_draft) >= 0.0
    assert 4e-4 <= cost.drafting_seconds(7, 1) <= 6e-4  # between what 7-row and 6-row steps added


def test_a_fit_from_one_count_of_drafting_sequences_charges_each_sequence():
    """While every drafting step had 8 drafting sequences (a busy server's exploring steps), part of
    the price goes to each of them: more drafting sequences look dearer, not free."""
    model = StepCostModel()
    for i in range(60):
        model.observe(StepShape(128, sequences=128), 2e-3)
        if i % 3 == 0:
            model.observe(StepShape(128 + 24, 8, 24, kept=int(i % 5), sequences=128), 2e-3 + 4e-3 + 1e-6 * (i % 5))
    cost = model.fit(128)
    assert cost.drafting_seconds(24, 8) == pytest.approx(4e-3, rel=1e-2)
    assert cost.drafting_seconds(84 * 3, 84) > 5 * cost.drafting_seconds(24, 8)
