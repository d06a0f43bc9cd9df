"""Contexts: each sequence's tokens as an array, extended in place, equal to the token list at every call."""

from __future__ import annotations

import numpy as np
import pytest

from cupyspec.sampling.params import SamplingParams
from cupyspec.scheduling.sequence import Sequence
from cupyspec.spec_decode.proposers.base import unseen_tokens
from cupyspec.spec_decode.proposers.contexts import Contexts


def test_contexts_follow_growth_placeholders_and_shorter_reads():
    seq = Sequence("r", 0, list(range(10, 50)), SamplingParams(max_tokens=500), 540, 0.0, 0)
    contexts, rng = Contexts(), np.random.default_rng(0)
    for step in range(300):
        if seq.awaits_token:  # the in-flight token arrives
            seq.output_token_ids[-1] = int(rng.integers(0, 1000))
        seq.output_token_ids += rng.integers(0, 1000, size=int(rng.integers(0, 4))).tolist()
        if step % 3 == 0:
            seq.output_token_ids.append(~0)  # a placeholder for a token still on the device
        stop = seq.num_tokens - int(rng.integers(0, 2))
        view = contexts.of(seq, stop)
        assert view.dtype == np.int32 and not view.flags.writeable
        np.testing.assert_array_equal(view, seq.token_ids[:stop])
    contexts.forget(seq.seq_id)
    np.testing.assert_array_equal(contexts.of(seq), seq.token_ids)


@pytest.mark.parametrize(("seen", "tokens", "expected"), [
    ([], [1, 2], [1, 2]),
    ([1, 2], [1, 2, 3, 4], [3, 4]),
    ([1, 2], [1, 2], []),
    ([1, 2], [1], None),  # shorter: another sequence
    ([1, 2], [1, 5, 3], None),  # the last seen token differs
])
def test_unseen_tokens_are_what_follows_the_seen_context_or_none_for_another(seen, tokens, expected):
    assert unseen_tokens(seen, np.array(tokens, dtype=np.int32)) == expected
