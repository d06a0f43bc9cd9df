"""Decoding sequences with chosen acceptance estimates, and a proposer that always drafts, for the
unit tests of the drafter, the back-off rule and the shadow probes."""

from __future__ import annotations

import numpy as np

from cupyspec.sampling.params import SamplingParams
from cupyspec.scheduling.sequence import Sequence
from cupyspec.spec_decode.drafter import Drafter
from cupyspec.spec_decode.proposers.base import Drafts, Proposer

DRAFTED_TOKEN = 7  # what `ConstantProposer` drafts


def decoding_seq(max_drafts: int, acceptance: float = 1.0, hit_rate: float = 1.0) -> Sequence:
    """A sequence of a 3-token prompt that has emitted one token and may emit 100 in all, whose
    recent draft acceptance and proposal hit rate are `acceptance` and `hit_rate`, each with the
    weight of one observation."""
    seq = Sequence("r", 0, [1, 2, 3], SamplingParams(max_tokens=100), 103, 0.0, 0, max_drafts=max_drafts)
    seq.output_token_ids = [4]
    seq.num_computed_tokens = 3
    seq.spec.recent_accepted, seq.spec.recent_tested = acceptance, 1.0
    seq.spec.recent_found, seq.spec.recent_asked = hit_rate, 1.0
    return seq


class ConstantProposer(Proposer):
    """Drafts DRAFTED_TOKEN as many times as asked, for every request."""

    method = "constant"

    def propose(self, requests):
        return [Drafts(np.full(r.max_drafts, DRAFTED_TOKEN)) for r in requests]


def rule_alone(drafter: Drafter) -> Drafter:
    """The drafter's back-off rule without its goodput check (test_goodput_check.py), which would
    otherwise stop drafting now and then to measure a window without it: the check always lets it draft."""
    drafter.goodput.drafting = lambda band: True
    return drafter
