"""Positions of a step formed before the host knew how many drafts the step before accepted."""

from __future__ import annotations

from typing import Any

import numpy as np

from cupyspec.kernels import load_kernel

THREADS = 128


def shift_positions(xp: Any, positions: Any, slots: Any, batch_ids: Any, tables: Any, shift_from: Any,
                    accepted: Any, block_size: int) -> None:
    """In place: the rows t with shift_from[t] = s >= 0 move on by accepted[s] positions, and their KV
    slots [T] follow from the block tables [B, W]; all int32 on xp's device. cuda/positions.cu on a
    GPU; these lines are its twin."""
    rows = len(positions)
    if xp is np:
        moved = shift_from >= 0
        positions[moved] += accepted[shift_from[moved]]
        p = positions[moved]
        slots[moved] = tables[batch_ids[moved], p // block_size] * block_size + p % block_size
        return
    if rows:
        load_kernel("positions", "shift_positions")(
            (-(-rows // THREADS),), (THREADS,),
            (positions, slots, batch_ids, tables, np.int32(tables.shape[1]), shift_from, accepted,
             np.int32(block_size), np.int32(rows)))
