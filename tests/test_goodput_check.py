"""The goodput check (spec_decode/backoff/goodput.py): per load band, drafting is kept only while it
emits more tokens per second than not drafting, and the losing mode is tried again at a small cost."""

from __future__ import annotations

import pytest
from spec_fixtures import ConstantProposer, decoding_seq

from cupyspec.spec_decode.backoff.goodput import MAX_WAIT, TRIAL_SHARE, WINDOW_TURNS, GoodputCheck
from cupyspec.spec_decode.backoff.step_cost import StepCost, StepShape, load_band
from cupyspec.spec_decode.drafter import Drafter
from cupyspec.spec_decode.speculative_config import SpeculativeConfig


def _serve(check: GoodputCheck, band: int, turns: int, drafting_speedup: float) -> list[bool]:
    """Turns of 1 ms that emit 10 tokens, or 10 * `drafting_speedup` while drafting; the modes of the turns."""
    modes = []
    for _ in range(turns):
        drafting = check.drafting(band)
        modes.append(drafting)
        check.observe(band, round(10 * (drafting_speedup if drafting else 1.0)), 1e-3)
    return modes


@pytest.mark.parametrize("speedup", [0.5, 0.8, 1.25, 1.6])
def test_the_mode_that_emits_more_leads_and_trying_the_other_costs_at_most_the_trial_share(speedup: float):
    """Drafting emits `speedup` times the tokens a second of not drafting: the better mode runs nearly
    always, and the trials of the other (two per wait) lose at most about 2 * TRIAL_SHARE of the
    better mode's tokens."""
    turns = 400 * WINDOW_TURNS
    modes = _serve(GoodputCheck(), 4, turns, speedup)
    better = speedup > 1
    later = modes[4 * WINDOW_TURNS:]  # once both were measured
    assert sum(mode == better for mode in later) > 0.9 * len(later)
    emitted = sum(speedup if mode else 1.0 for mode in modes)
    lost = 1 - emitted / (turns * max(speedup, 1.0))
    assert lost <= 2 * TRIAL_SHARE + 4 / 400  # the first windows measure both modes
    assert any(mode != better for mode in later)  # the other mode is still tried now and then


def test_a_mode_that_lost_is_tried_again_and_leads_once_it_emits_more():
    """A trial that wins leads; the other mode is tried once more soon after, then rarely."""
    check = GoodputCheck()
    assert not _serve(check, 4, 8 * WINDOW_TURNS, 0.5)[-1]  # drafting loses: off
    modes = _serve(check, 4, (MAX_WAIT + 40) * WINDOW_TURNS, 2.0)  # then drafting doubles the tokens
    first = modes.index(True)
    assert first <= (MAX_WAIT + 1) * WINDOW_TURNS
    assert sum(modes[first:]) > 0.9 * len(modes[first:])  # and leads


def test_one_slow_window_does_not_turn_drafting_off_for_long():
    """Drafting pays, but one of its windows is slowed down fivefold (a burst of prompts): the off
    mode may take the lead for that, but drafting is tried again at once and leads again."""
    check = GoodputCheck()
    _serve(check, 4, 8 * WINDOW_TURNS, 1.6)
    while check.drafting(4):  # up to a window of drafting, its turns slow
        check.observe(4, 16, 5e-3)
    modes = _serve(check, 4, 6 * WINDOW_TURNS, 1.6)
    assert sum(modes) >= 3 * WINDOW_TURNS


def test_a_mode_that_lost_one_trial_is_tried_again_soon():
    """Drafting's first windows are slow (the back-off rule still learns what steps cost), so it
    loses the lead and then a trial; once it pays, it is tried again within a window and leads."""
    check = GoodputCheck()
    _serve(check, 4, 4 * WINDOW_TURNS, 0.5)
    modes = _serve(check, 4, 6 * WINDOW_TURNS, 1.6)
    assert sum(modes) >= 3 * WINDOW_TURNS


def test_each_load_band_has_its_own_verdict():
    check = GoodputCheck()
    for _ in range(8):
        _serve(check, 0, WINDOW_TURNS, 1.6)  # one sequence: drafting pays
        _serve(check, 4, WINDOW_TURNS, 0.7)  # a large batch: it does not
    assert check.drafting(0) and not check.drafting(4)


def test_while_the_check_has_drafting_off_nobody_drafts_not_even_to_explore():
    """The drafter asks the check first: with drafts free (the rule would draft at nearly every step)
    but drafting turns emitting fewer tokens per second, its plans are empty while the check has
    drafting off, which is most of the time, and draft again on a trial."""
    drafter = Drafter(SpeculativeConfig(method="ngram", num_speculative_tokens=3), ConstantProposer())
    drafter.step_cost.fit = lambda sequences: StepCost(1e-3, 0.0)
    seq = decoding_seq(3)
    plans, allowed = [], []
    for _ in range((MAX_WAIT + 4) * WINDOW_TURNS):
        drafter._budget = 1.0
        allowed.append(drafter.goodput.drafting(load_band(1)))
        plans.append(drafter.plan([seq]).get(seq.seq_id, 0))
        drafting = plans[-1] > 0
        drafter.observe_step(StepShape(1 + plans[-1], drafting, plans[-1]), 5e-3 if drafting else 1e-3,
                             1 + plans[-1])
    assert not any(k for k, on in zip(plans, allowed) if not on)
    assert allowed.count(False) > len(allowed) / 2
    trials = [i for i in range(4 * WINDOW_TURNS, len(plans)) if allowed[i]]
    assert any(plans[i] for i in trials)


def test_the_check_takes_no_turns_while_the_rule_learns_its_step_costs():
    """Until the cost fit is ready the rule drafts one step in a few, to learn: such windows say
    nothing of drafting's worth, even when they emit less per second, and drafting stays allowed."""
    drafter = Drafter(SpeculativeConfig(method="ngram", num_speculative_tokens=3), ConstantProposer())
    drafter.step_cost.fit = lambda sequences: None
    seq = decoding_seq(3)
    allowed = []
    for _ in range(8 * WINDOW_TURNS):
        allowed.append(drafter.goodput.drafting(load_band(1)))
        drafts = drafter.plan([seq]).get(seq.seq_id, 0)
        drafter.observe_step(StepShape(1 + drafts, drafts > 0, drafts), 5e-3 if drafts else 1e-3, 1 + drafts)
    assert all(allowed)


def test_windows_without_drafting_count_while_the_rule_learns_so_drafting_is_tried_again():
    """A load band the check turned off is measured off whatever the rule knows, so the check comes
    to try drafting there again even while the rule has no cost fit for it."""
    drafter = Drafter(SpeculativeConfig(method="ngram", num_speculative_tokens=3), ConstantProposer())
    drafter.step_cost.fit = lambda sequences: None
    _serve(drafter.goodput, load_band(1), 8 * WINDOW_TURNS, 0.5)  # drafting lost twice: a long wait
    seq = decoding_seq(3)
    allowed = []
    for _ in range((MAX_WAIT + 4) * WINDOW_TURNS):
        allowed.append(drafter.goodput.drafting(load_band(1)))
        drafts = drafter.plan([seq]).get(seq.seq_id, 0)
        drafter.observe_step(StepShape(1 + drafts, drafts > 0, drafts), 1e-3, 1)
    assert not allowed[0] and any(allowed)


@pytest.mark.parametrize("drift", [0.97, 1.03])
def test_a_trial_is_judged_by_the_windows_beside_it_so_a_drifting_host_does_not_decide(drift: float):
    """Each window runs `drift` times as fast as the one before (the host slowing down or speeding
    up), and drafting emits 10% less than not: measured against the leading mode's windows on either
    side, not against older ones, off wins its trials and leads."""
    check, modes = GoodputCheck(), []
    for window in range(60):
        for _ in range(WINDOW_TURNS):
            modes.append(check.drafting(4))
            check.observe(4, round(1000 * drift ** window * (0.9 if modes[-1] else 1.0)), 1e-3)
    later = modes[8 * WINDOW_TURNS:]
    assert later.count(False) > 0.9 * len(later)

