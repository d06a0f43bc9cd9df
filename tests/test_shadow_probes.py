"""Shadow probes (spec_decode/backoff/shadow.py): a sequence that does not draft keeps its acceptance
estimate current from unverified drafts, scored against the tokens it emits."""

from __future__ import annotations

import time

import pytest
from spec_fixtures import DRAFTED_TOKEN, ConstantProposer, decoding_seq, rule_alone

from cupyspec.spec_decode.backoff.step_cost import StepCost, StepShape
from cupyspec.spec_decode.drafter import Drafter
from cupyspec.spec_decode.speculative_config import SpeculativeConfig


@pytest.mark.parametrize("emitted, recovers", [(DRAFTED_TOKEN, True), (DRAFTED_TOKEN + 1, False)])
def test_shadow_probes_let_a_sequence_that_stopped_drafting_recover(emitted: int, recovers: bool):
    """A sequence below min_acceptance_rate drafts nothing; its proposer's unverified drafts, scored
    against the tokens emitted since, bring it back once its text turns predictable (and only then:
    exploring steps aside, which the rule takes whatever the acceptance)."""
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, min_acceptance_rate=0.5)
    drafter = rule_alone(Drafter(config, ConstantProposer()))
    seq = decoding_seq(3, acceptance=0.05)
    plans = []  # (drafts, whether the step explores)
    for _ in range(80):
        drafts = drafter.plan([seq]).get(seq.seq_id, 0)
        plans.append((drafts, drafter._exploring_step))
        drafter.after_step([seq])
        seq.output_token_ids.append(emitted)
        seq.num_computed_tokens += 1
        seq.spec.record((), 1)  # the drafts of an exploring step are not verified here
        drafter.observe_step(StepShape(1, drafts > 0), 0.1, 1 + drafts)  # a share of 0.1 s: the probes' budget
    chosen = [drafts for drafts, exploring in plans if not exploring]
    assert chosen[0] == 0
    if recovers:
        assert chosen[-10:] == [3] * 10
    else:
        assert not any(chosen)
    assert seq.spec.num_draft_tokens == 0 and seq.spec.proposal_hit_rate > 0.99  # nothing was verified


def test_shadow_probes_have_a_budget_of_their_own():
    """At one sequence an evaluation of the cost-aware rule costs the overhead share of many steps;
    the probes that bring a written-off sequence back must not wait for it."""
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, min_acceptance_rate=0.5)
    assert config.cost_aware_backoff
    drafter = Drafter(config, ConstantProposer())

    def dear_fit(sequences: int) -> StepCost:
        time.sleep(2e-3)  # 200 steps' share of 1e-3 s
        return StepCost(1e-3, 0.0)

    drafter.step_cost.fit = dear_fit
    seq = decoding_seq(3, acceptance=0.05)
    for _ in range(40):
        drafter.plan([seq])
        drafter.after_step([seq])
        seq.output_token_ids.append(DRAFTED_TOKEN)  # what the proposer drafts: its probes are kept
        seq.num_computed_tokens += 1
        seq.spec.record((), 1)
        drafter.observe_step(StepShape(1), 1e-3, 1)
    assert seq.spec.draft_acceptance > 0.5
