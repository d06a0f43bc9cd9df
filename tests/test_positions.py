"""Positions of a step formed before the host knew the drafts the step before accepted: rows move on
by their sequence's accepted drafts, and their KV slots follow from the block tables."""

from __future__ import annotations

import numpy as np
import pytest

from cupyspec.model.positions import shift_positions


def case(rng: np.random.Generator, rows: int, block_size: int = 4) -> tuple[np.ndarray, ...]:
    tables = rng.permutation(64).reshape(8, 8).astype(np.int32)  # [B, W]: 8 sequences of 8 blocks
    batch_ids = np.sort(rng.integers(0, 8, rows)).astype(np.int32)  # [T]
    positions = rng.integers(0, 20, rows).astype(np.int32)  # [T]
    slots = (tables[batch_ids, positions // block_size] * block_size + positions % block_size).astype(np.int32)
    shift_from = np.where(rng.random(rows) < 0.6, rng.integers(0, 5, rows), -1).astype(np.int32)  # [T]
    accepted = rng.integers(0, 4, 5).astype(np.int32)  # [S]
    return positions, slots, batch_ids, tables, shift_from, accepted


def test_rows_move_on_by_their_sequences_accepted_drafts_and_take_their_slots() -> None:
    positions, slots, batch_ids, tables, shift_from, accepted = case(np.random.default_rng(0), 40)
    moved_positions, moved_slots = positions.copy(), slots.copy()
    shift_positions(np, moved_positions, moved_slots, batch_ids, tables, shift_from, accepted, 4)
    for t in range(40):
        s = shift_from[t]
        want = positions[t] + (accepted[s] if s >= 0 else 0)
        assert moved_positions[t] == want
        assert moved_slots[t] == (tables[batch_ids[t], want // 4] * 4 + want % 4 if s >= 0 else slots[t])


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 37, 300])
def test_the_kernel_matches_its_twin(rows: int) -> None:
    import cupy

    arrays = case(np.random.default_rng(rows), rows)
    want_positions, want_slots = arrays[0].copy(), arrays[1].copy()
    shift_positions(np, want_positions, want_slots, *arrays[2:], 4)
    device = [cupy.asarray(a) for a in arrays]
    shift_positions(cupy, *device, 4)
    np.testing.assert_array_equal(device[0].get(), want_positions)
    np.testing.assert_array_equal(device[1].get(), want_slots)
