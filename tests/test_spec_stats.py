"""A sequence's speculation counters (spec_decode/stats.py): the recent draft acceptance and
proposal hit rate that the back-off rule reads."""

from __future__ import annotations

import pytest

from cupyspec.spec_decode.stats import SpecStats


def test_draft_acceptance_counts_the_drafts_that_verification_tested():
    """Drafts after a step's first rejection are never tested: they do not lower the acceptance."""
    stats = SpecStats(recent_accepted=0.0, recent_tested=0.0)
    stats.record((True, True, False, False), 3)  # 3 tested: 2 accepted, then the first rejection
    assert stats.draft_acceptance == pytest.approx(2 / 3)
    stats.record((True, True), 3)  # both tested and accepted
    assert 4 / 5 < stats.draft_acceptance < 1.0  # above 4 of 5 tested: the recent step weighs more


def test_draft_acceptance_weighs_recent_steps_most():
    recovering, failing = SpecStats(), SpecStats()
    recovering.record((False, False), 1)
    recovering.record((True, True), 3)
    failing.record((True, True), 3)
    failing.record((False, False), 1)
    assert 0.0 < failing.draft_acceptance < recovering.draft_acceptance < 1.0


def test_the_proposal_hit_rate_falls_on_a_miss_and_weighs_recent_answers_most():
    recovering, failing = SpecStats(), SpecStats()
    recovering.record_proposal(False)
    assert recovering.proposal_hit_rate < 1.0
    missed = recovering.proposal_hit_rate
    recovering.record_proposal(True)
    assert recovering.proposal_hit_rate > missed
    failing.record_proposal(True)
    failing.record_proposal(False)
    assert 0.0 < failing.proposal_hit_rate < recovering.proposal_hit_rate < 1.0
    assert recovering.num_proposals == 2 and recovering.num_hits == 1
