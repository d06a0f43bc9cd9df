"""The drafter (spec_decode/drafter.py): when the cost-aware rule is evaluated, when it explores
the kind of step it would not choose, and what a new sequence expects."""

from __future__ import annotations

from itertools import groupby

import pytest
from spec_fixtures import ConstantProposer, decoding_seq, rule_alone

from cupyspec.scheduling.sequence import Sequence
from cupyspec.spec_decode.backoff.step_cost import MIN_DRAFTING_STEPS, MIN_PLAIN_STEPS, StepCost, StepShape
from cupyspec.spec_decode.drafter import (
    EXPLORE_SEQS,
    EXPLORE_STEPS,
    MAX_BACKOFF,
    OVERHEAD_BUDGET_CAP,
    SAME_ROWS_STREAK_FACTOR,
    Drafter,
)
from cupyspec.spec_decode.speculative_config import SpeculativeConfig

FREE = StepCost(1e-3, 0.0)  # drafts add nothing to a 1 ms step
HOPELESS = StepCost(1e-3, 0.0, per_drafting_seq=3e-4)  # a drafting sequence adds 0.3 ms: 3 drafts never pay


def _drafter(cost: StepCost | None = None, **config) -> Drafter:
    """A drafter under the cost-aware rule whose cost fit, if `cost` is given, always answers `cost`;
    the rule alone (`rule_alone`)."""
    drafter = rule_alone(Drafter(SpeculativeConfig(method="ngram", num_speculative_tokens=3, **config),
                                 ConstantProposer()))
    if cost is not None:
        drafter.step_cost.fit = lambda sequences: cost
    return drafter


def _runs(plans: list[int]) -> list[tuple[bool, int]]:
    """(drafting, length) of each run of steps of one kind, in order."""
    return [(drafting, len(list(run))) for drafting, run in groupby(k > 0 for k in plans)]


def test_between_evaluations_the_last_plan_stands():
    """The cost-aware rule is evaluated within the overhead budget; in between, the sequences its
    last plan asked drafts of keep them (within the tokens each may still emit). A decoding sequence
    the plan has not seen makes the rule evaluate anew when the plan drafts (at one sequence, each
    new request would otherwise wait for the budget), on credit up to a bound, and waits when it
    drafts nothing (under load)."""
    drafter = _drafter(FREE)
    first, near_end, newcomer = decoding_seq(3), decoding_seq(3), decoding_seq(3)
    drafter._budget = 1.0
    assert drafter.plan([first, near_end]) == {first.seq_id: 3, near_end.seq_id: 3}
    drafter._budget = 0.0
    near_end.output_token_ids += [5] * 97  # 101 of its 103 tokens: room for one more draft
    near_end.num_computed_tokens = near_end.num_tokens - 1
    assert drafter.plan([first, near_end]) == {first.seq_id: 3, near_end.seq_id: 1}
    assert drafter._budget == 0.0  # the plan stood: nothing was evaluated
    assert drafter.plan([first, near_end, newcomer]) == {first.seq_id: 3, near_end.seq_id: 1, newcomer.seq_id: 3}
    assert drafter._budget < 0.0  # evaluated, on credit
    later = decoding_seq(3)
    drafter._budget = -2 * OVERHEAD_BUDGET_CAP  # too deep in debt: the newcomer waits
    assert drafter.plan([first, near_end, newcomer, later]) == {first.seq_id: 3, near_end.seq_id: 1,
                                                                newcomer.seq_id: 3}
    drafter._last_plan = {first.seq_id: 0, near_end.seq_id: 0}
    drafter._budget = 0.0
    assert drafter.plan([first, near_end, newcomer]) == {}


def test_a_new_sequence_expects_what_finished_ones_showed_weighed_by_evidence():
    drafter = _drafter()
    assert drafter.new_stats().draft_acceptance == 1.0 and drafter.new_stats().proposal_hit_rate == 1.0
    good, unlucky = decoding_seq(5), decoding_seq(5)
    for _ in range(10):  # 4 of 5 drafts kept at every step
        good.spec.record_proposal(True)
        good.spec.record((True,) * 4 + (False,), 5)
    unlucky.spec.record_proposal(True)
    unlucky.spec.record((False,) * 5, 1)  # one step, nothing kept
    drafter.on_sequence_finished(unlucky)
    drafter.on_sequence_finished(good)
    # near the 40 of 50 tested drafts kept over both: one unlucky step does not drag it towards 0
    assert drafter.new_stats().draft_acceptance == pytest.approx(0.8, abs=0.02)
    assert drafter.new_stats().proposal_hit_rate == 1.0


def test_until_the_cost_fit_is_ready_one_step_in_a_few_drafts():
    """The fit needs both kinds of steps before it prices drafting: until then drafting steps come
    now and then, each followed by at least two draft-free ones (under overlap scheduling the first
    is refilled and shows no draft-free step's price), and the fit is soon ready."""
    drafter = _drafter()
    seq = decoding_seq(3)
    plans = []
    while drafter.step_cost.fit(1) is None:
        assert len(plans) < 4 * (MIN_PLAIN_STEPS + MIN_DRAFTING_STEPS)
        plans.append(drafter.plan([seq]).get(seq.seq_id, 0))
        refilled = len(plans) > 1 and plans[-2] > 0  # under overlap scheduling, the step after a drafting one
        drafter.observe_step(StepShape(1 + plans[-1], plans[-1] > 0, plans[-1], refilled=refilled),
                             1e-3 + 1e-3 * (plans[-1] > 0), 1 + plans[-1])
    drafting = [i for i, k in enumerate(plans) if k]
    assert all(plans[i] == 3 for i in drafting)  # every draft the sequence may ask for
    assert all(later - earlier > 2 for earlier, later in zip(drafting, drafting[1:]))
    assert len(drafting) < len(plans) / 2


@pytest.mark.parametrize("overlap", [False, True])
def test_while_drafting_pays_a_draft_free_step_now_and_then_keeps_its_price_current(overlap: bool):
    """The cost fit cannot tell what a step without drafts costs from drafting steps alone: the
    cost-aware rule breaks a long run of drafting steps with draft-free ones until the fit has taken
    one. Under overlap scheduling the first draft-free step after a drafting one is refilled, which
    the fit leaves out, so two run: else the fit's draft-free price would never be brought up to
    date while drafting pays. Nearly every step still drafts."""
    drafter = _drafter(FREE)
    seq = decoding_seq(3)
    plans = []
    for _ in range(4 * EXPLORE_STEPS):
        plans.append(drafter.plan([seq]).get(seq.seq_id, 0))
        refilled = overlap and len(plans) > 1 and plans[-2] > 0 and not plans[-1]
        drafter.observe_step(StepShape(4, plans[-1] > 0, refilled=refilled), 1e-3, 4)
    draft_free_runs = [length for drafting, length in _runs(plans)[:-1] if not drafting]  # the last may be cut
    assert len(draft_free_runs) >= 2  # they keep coming
    assert all(length == (2 if overlap else 1) for length in draft_free_runs)  # as many as the fit needs
    assert plans.count(0) <= len(plans) / 5


def test_at_an_unchanged_batch_drafting_runs_longer_before_a_draft_free_step():
    """A draft-free step at the rows of the last one the fit took shows nothing new (one sequence
    decoding alone): drafting steps then run longer in a row than after the batch changed."""
    def first_draft_free_step(rows_of_last_draft_free_step: int) -> int | None:
        drafter = _drafter(FREE)
        seq = decoding_seq(3)
        drafter.observe_step(StepShape(rows_of_last_draft_free_step), 1e-3, 1)
        for step in range(2 * SAME_ROWS_STREAK_FACTOR * EXPLORE_STEPS):
            drafts = drafter.plan([seq]).get(seq.seq_id, 0)
            if not drafts:
                return step
            drafter.observe_step(StepShape(1 + drafts, 1, drafts), 1e-3, 1 + drafts)
        return None

    changed, unchanged = first_draft_free_step(4), first_draft_free_step(1)  # the batch has 1 row
    assert changed is not None and unchanged is not None  # drafting is broken in either case
    assert unchanged > changed


def _explorations(drafter: Drafter, seqs: list[Sequence], step_seconds: float, steps: int) -> list[dict[int, int]]:
    """The plans of `steps` steps of `step_seconds` each, the rule evaluated at every one."""
    plans = []
    for _ in range(steps):
        drafter._budget = 1.0
        plans.append(drafter.plan(seqs))
        drafter.observe_step(StepShape(len(seqs), sum(k > 0 for k in plans[-1].values()), sequences=len(seqs)),
                             step_seconds, len(seqs))
    return plans


def _exploring_steps(plans: list[dict[int, int]]) -> list[int]:
    return [i for i, plan in enumerate(plans) if any(plan.values())]


def _candidates() -> list[Sequence]:
    """More sequences than an exploring step drafts for, of rising acceptance, all above the floor."""
    return [decoding_seq(3, acceptance=0.5 + 0.04 * i) for i in range(EXPLORE_SEQS + 4)]


def test_a_run_of_steps_without_drafts_is_broken_to_measure_drafting_again():
    """A cost fit that makes drafting look hopeless would never be corrected by steps that do not
    draft: now and then the likeliest few sequences draft anyway, once what such a step adds is at
    most 1 / EXPLORE_STEPS of the time since the last drafting step, so sooner where steps are long."""
    seqs = _candidates()
    added = HOPELESS.drafting_seconds(3 * EXPLORE_SEQS, EXPLORE_SEQS)  # what an exploring step adds
    first_exploring = {}
    for step_seconds in (3e-3, 1e-3):
        horizon = int(EXPLORE_STEPS * (1 + added / step_seconds)) + 2
        plans = _explorations(_drafter(HOPELESS), seqs, step_seconds, horizon)
        exploring = _exploring_steps(plans)
        assert exploring, step_seconds
        first_exploring[step_seconds] = exploring[0]
        previous = -1
        for i in exploring:
            drafting = {seq_id for seq_id, k in plans[i].items() if k}
            likeliest = sorted(seqs, key=lambda s: s.spec.draft_acceptance, reverse=True)[:len(drafting)]
            assert drafting == {s.seq_id for s in likeliest} and len(drafting) < len(seqs)
            assert all(plans[i][s.seq_id] == 3 for s in likeliest)
            waited = step_seconds * (i - previous - 1)  # the draft-free steps since the last drafting one
            assert HOPELESS.drafting_seconds(3 * len(drafting), len(drafting)) <= waited / EXPLORE_STEPS * (1 + 1e-9)
            previous = i
    assert first_exploring[3e-3] < first_exploring[1e-3]


def test_while_exploring_finds_nothing_that_pays_it_backs_off_until_drafting_pays_again():
    """Each exploring step after which no other step drafted makes the wait for the next one longer,
    up to MAX_BACKOFF times the first, so that exploring never stops; the first step that drafts
    brings the wait back to the first one's."""
    drafter = _drafter(HOPELESS)
    seqs, step_seconds = _candidates(), 3e-3
    # an exploring step is priced at what the fit says it adds, or what the last one added if more
    # (here it takes as long as the others: step_seconds against the fit's draft-free step)
    price = max(HOPELESS.drafting_seconds(3 * EXPLORE_SEQS, EXPLORE_SEQS), step_seconds - HOPELESS.seconds(len(seqs)))
    unit = EXPLORE_STEPS * price / step_seconds  # the draft-free steps it waits at a back-off of 1
    plans = _explorations(drafter, seqs, step_seconds, int(6 * MAX_BACKOFF * unit) + EXPLORE_STEPS)
    exploring = _exploring_steps(plans)
    waits = [later - earlier - 1 for earlier, later in zip([-1] + exploring, exploring)]  # draft-free steps before each
    assert len(waits) >= 4
    assert waits[1] > waits[0]  # it backs off
    assert all(earlier <= later for earlier, later in zip(waits, waits[1:]))  # and comes no sooner while nothing pays
    assert waits[-1] <= waits[-2] + 1 and max(waits) <= MAX_BACKOFF * unit + 1  # the wait stops growing
    drafter.step_cost.fit = lambda sequences: FREE  # drafts turn free: the rule drafts
    assert any(_explorations(drafter, seqs, step_seconds, steps=1)[0].values())
    drafter.step_cost.fit = lambda sequences: HOPELESS
    plans = _explorations(drafter, seqs, step_seconds, steps=exploring[0] + 2)
    assert _exploring_steps(plans) == [exploring[0]]


def test_an_exploring_step_that_took_long_makes_the_next_one_wait():
    """The fit leaves out a step far slower than it predicts, so it cannot price an exploring step whose
    proposals indexed whole prompts: what the last exploring step added prices the next one, which
    waits until that is at most 1 / EXPLORE_STEPS of the time since."""
    drafter = _drafter(StepCost(1e-3, 0.0, per_drafting_seq=1e-6))  # exploring looks cheap
    seqs = [decoding_seq(3, acceptance=0.01) for _ in range(EXPLORE_SEQS)]  # below the acceptance floor
    plain_seconds, exploring_seconds = 1e-3, 1e-2  # exploring adds 9 ms
    exploring, waited = [], 0.0
    for _ in range(24 * EXPLORE_STEPS):
        drafting = sum(k > 0 for k in drafter.plan(seqs).values())
        if drafting:
            exploring.append(waited)
            waited = 0.0
        seconds = exploring_seconds if drafting else plain_seconds
        drafter.observe_step(StepShape(len(seqs) + 3 * drafting, drafting, 3 * drafting, sequences=len(seqs)), seconds,
                             len(seqs))
        waited += 0.0 if drafting else seconds
    assert len(exploring) >= 2  # it waits, and explores again
    assert all(exploring_seconds - plain_seconds <= since / EXPLORE_STEPS * (1 + 1e-9) for since in exploring[1:])


def test_an_exploring_step_verifies_a_sequence_whatever_its_acceptance():
    drafter = _drafter(min_acceptance_rate=0.5)
    seq = decoding_seq(3, acceptance=0.05)  # written off by the acceptance floor
    plans = []
    for _ in range(4 * EXPLORE_STEPS):
        drafter._budget = 1.0
        plans.append(drafter.plan([seq]).get(seq.seq_id, 0))
        drafter.observe_step(StepShape(1, plans[-1] > 0), 1e-3, 1)
        if plans[-1]:
            break
    assert plans[0] == 0
    assert plans[-1] == 3  # every draft it may ask for


class DraftingAhead(ConstantProposer):
    """Stands for an MTP head: its drafts come from the step before."""

    drafts_ahead = True


def test_a_head_drafts_only_while_the_plan_drafts_and_is_primed_before_an_exploring_step():
    """A proposer that drafts ahead (an MTP head) runs in a step only when that step's plan drafts
    anyone, so where drafting does not pay the head costs nothing. An exploring step after steps in
    which it did not run comes twice: the first primes the head (the step before made no drafts for
    it), the second verifies and is the one priced."""
    drafter = rule_alone(Drafter(SpeculativeConfig(method="ngram", num_speculative_tokens=3), DraftingAhead()))
    drafter.step_cost.fit = lambda sequences: HOPELESS
    seqs = _candidates()
    added = HOPELESS.drafting_seconds(3 * EXPLORE_SEQS, EXPLORE_SEQS)
    plans, ahead, priced = [], [], []
    for _ in range(3 * int(EXPLORE_STEPS * (1 + added / 1e-3))):
        drafter._budget = 1.0
        plans.append(drafter.plan(seqs))
        drafter.propose(seqs, plans[-1])
        ahead.append(drafter.drafts_ahead)
        priced.append(drafter._exploring_step)
        priming = ahead[-1] and (len(ahead) < 2 or not ahead[-2])
        drafting = 0 if priming else sum(k > 0 for k in plans[-1].values())
        drafter.observe_step(StepShape(len(seqs), drafting, sequences=len(seqs), priming=priming), 1e-3, len(seqs))
    assert ahead == [any(plan.values()) for plan in plans]
    exploring = _exploring_steps(plans)
    assert len(exploring) >= 4 and len(exploring) % 2 == 0
    for first, second in zip(exploring[::2], exploring[1::2]):
        assert second == first + 1 and plans[second] == plans[first]
        assert not ahead[first - 1] and not priced[first] and priced[second]
