"""The flat ragged batch: each token's position, request and KV slot, against a token-by-token reference."""

from __future__ import annotations

import numpy as np
import pytest

from cupyspec.model.batch import flat_batch

BLOCK_SIZE = 4


def test_each_token_gets_its_position_request_and_slot():
    """One segment, decode tokens only, and ragged segments each take a path of their own."""
    rng = np.random.default_rng(0)
    for num_seqs, longest in ((1, 10), (1, 1), (3, 10), (17, 10), (5, 1)):
        lengths = rng.integers(1, longest + 1, num_seqs).tolist()  # decode tokens, verify segments, prefill chunks
        starts = rng.integers(0, 30, num_seqs).tolist()
        block_ids = [rng.permutation(100)[:-(-(s + n) // BLOCK_SIZE) + int(rng.integers(0, 3))].tolist()
                     for s, n in zip(starts, lengths)]  # enough blocks, some to spare
        token_ids = rng.integers(0, 1000, sum(lengths)).tolist()
        batch = flat_batch(token_ids, lengths, starts, block_ids, BLOCK_SIZE)
        want = [(b, starts[b] + j) for b in range(num_seqs) for j in range(lengths[b])]  # (request, position)
        assert batch.input_ids.tolist() == token_ids
        assert batch.batch_id_per_token.tolist() == [b for b, _ in want]
        assert batch.positions.tolist() == [p for _, p in want]
        assert batch.slot_mapping.tolist() == [block_ids[b][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                                               for b, p in want]
        assert batch.cu_seqlens_q.tolist() == np.cumsum([0] + lengths).tolist()
        assert batch.seq_lens_kv.tolist() == [s + n for s, n in zip(starts, lengths)]
        for b, blocks in enumerate(block_ids):
            assert batch.block_tables[b].tolist() == blocks + [0] * (batch.block_tables.shape[1] - len(blocks))
        assert [a.dtype for a in batch] == [np.int32] * 6 + [np.int64]  # slot_mapping last


def test_a_segment_past_its_blocks_is_refused():
    with pytest.raises(ValueError, match="past its KV blocks"):
        flat_batch([1, 2, 3], [3], [6], [[0, 1]], BLOCK_SIZE)  # positions 6..8 need a third block
