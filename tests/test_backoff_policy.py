"""The back-off rule (spec_decode/backoff/policy.py): how many drafts each decoding sequence gets,
within its limits, the step's draft budget and what drafts cost."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from spec_fixtures import decoding_seq

from cupyspec.spec_decode.backoff.policy import best_drafts, draft_limits
from cupyspec.spec_decode.backoff.step_cost import StepCost
from cupyspec.spec_decode.speculative_config import SpeculativeConfig

CONFIG = SpeculativeConfig(method="ngram", num_speculative_tokens=5, max_draft_tokens_per_step=12,
                           min_acceptance_rate=0.2)


def test_sequences_draft_up_to_their_limit_and_share_the_step_budget():
    few = [decoding_seq(5) for _ in range(2)]
    assert list(draft_limits(few, CONFIG).values()) == [5, 5]
    crowd = [decoding_seq(5) for _ in range(4)]
    assert list(draft_limits(crowd, CONFIG).values()) == [3, 3, 3, 3]  # 12 drafts, earliest positions first
    many = list(draft_limits([decoding_seq(5) for _ in range(13)], CONFIG).values())
    assert sum(many) == 12 and max(many) == 1


def test_the_step_budget_goes_to_the_drafts_likeliest_to_be_kept():
    mixed = [decoding_seq(5, acceptance=0.9), decoding_seq(5, acceptance=0.5), decoding_seq(5)]
    assert list(draft_limits(mixed, replace(CONFIG, max_draft_tokens_per_step=6)).values()) == [1, 0, 5]


def test_a_sequence_below_min_acceptance_rate_stops_drafting():
    assert list(draft_limits([decoding_seq(5, acceptance=0.1)], CONFIG).values()) == [0]
    assert list(draft_limits([decoding_seq(5, acceptance=0.3)], CONFIG).values()) == [5]


def test_a_sequence_near_its_token_limit_drafts_only_what_it_may_still_emit():
    near_end = decoding_seq(5)
    near_end.max_total_tokens = near_end.num_tokens + 3
    assert list(draft_limits([near_end], CONFIG).values()) == [2]  # the step emits at most 3 tokens


def test_drafts_are_taken_while_they_pay_for_their_time():
    acceptance, limits = np.array([0.9, 0.5, 0.1]), np.array([5, 5, 5])
    # a step of 1 ms for 3 tokens whose rows cost 1 us: every draft that may be kept pays
    assert best_drafts(acceptance, limits, 3, 1e-3, 1e-6, 1e-6).tolist() == [5, 5, 2]
    # 256 sequences in 27 ms: a draft row costs 20 us, a drafting sequence 80 us more
    assert best_drafts(acceptance, limits, 256, 27e-3, 20e-6, 80e-6).tolist() == [5, 0, 0]
    # drafts that cost more than a whole step's tokens are worth: none
    assert best_drafts(acceptance, limits, 256, 27e-3, 1e-3, 0.0).tolist() == [0, 0, 0]


def test_a_drafting_step_must_also_pay_for_the_overlap_it_gives_up():
    acceptance, limits = np.array([0.9]), np.array([5])
    # one sequence, a 1 ms step: 5 drafts keep 3.69 tokens in expectation for 0.1 ms more
    assert best_drafts(acceptance, limits, 1, 1e-3, 10e-6, 50e-6).tolist() == [5]
    # giving up overlap costs 2 ms: (1 + 3.69) / 3.1 ms still beats 1 / 1 ms
    assert best_drafts(acceptance, limits, 1, 1e-3, 10e-6, 50e-6, per_drafting_step=2e-3).tolist() == [5]
    # at 4 ms it does not: (1 + 3.69) / 5.1 ms < 1 / 1 ms
    assert best_drafts(acceptance, limits, 1, 1e-3, 10e-6, 50e-6, per_drafting_step=4e-3).tolist() == [0]
    # a proposer that finds drafts one time in five: 0.2 * 3.69 kept for 2.1 ms more does not pay
    assert best_drafts(acceptance, limits, 1, 1e-3, 10e-6, 50e-6, per_drafting_step=2e-3,
                       hit_rate=np.array([0.2])).tolist() == [0]


def test_proposals_that_miss_lower_what_drafting_is_worth():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=5)
    missing = [decoding_seq(5, acceptance=0.9, hit_rate=0.2), decoding_seq(5, acceptance=0.9)]
    costly_step = StepCost(1e-3, 0.0, per_drafting_step=2e-3, per_draft_row=10e-6, per_drafting_seq=50e-6)
    # when a drafting step costs much more than a draft-free one (overlap scheduling given up), the
    # sequence whose proposer mostly misses makes drafting not pay, unlike one that finds drafts
    assert list(draft_limits(missing[:1], config, costly_step).values()) == [0]
    assert list(draft_limits(missing, config, costly_step).values()) == [5, 5]
    assert list(draft_limits(missing[:1], config, replace(costly_step, per_drafting_step=0.0)).values()) == [5]


def test_kept_drafts_are_charged_what_the_host_spends_on_them():
    """Each kept draft costs the host `per_kept` (a token to process): drafts pay while that is
    less than a draft-free step spends per token, and not beyond."""
    acceptance, limits = np.array([0.9, 0.9]), np.array([4, 4])
    cheap = best_drafts(acceptance, limits, 2, 1e-3, 1e-6, 1e-5, 1e-4, per_kept=1e-5)
    assert cheap.tolist() == [4, 4]
    dear = best_drafts(acceptance, limits, 2, 1e-3, 1e-6, 1e-5, 1e-4, per_kept=6e-4)  # more than 0.5 ms a token
    assert dear.tolist() == [0, 0]
