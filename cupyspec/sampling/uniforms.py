"""Counter-based random draws: the uniform for a token depends only on (key, position, stream).

A seeded request therefore draws the same numbers whatever shares its batch, and whether or not
its tokens come through speculation: the token at output position p always uses the draw of p.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_STREAM = np.uint64(0xD1B54A32D192ED03)

SAMPLE_STREAM = 0  # picks a token (inverse CDF)
ACCEPT_STREAM = 1  # accepts or rejects a draft (speculative sampling)
DRAFT_STREAM = 2  # picks a draft token from a draft model's distribution (on the device: MTP)


def sampling_key(seed: int, choice_index: int) -> int:
    """The 64-bit key of one choice of a seeded request."""
    return int(counter_uniform_bits(np.array([seed & (2**64 - 1)], np.uint64), np.array([choice_index]), 7)[0])


def counter_uniform_bits(keys: Any, positions: Any, stream: int) -> Any:
    """splitmix64 of key + position and stream offsets: [R] uint64 -> [R] uint64 (NumPy or CuPy
    arrays, with the same bits: unsigned arithmetic wraps on both)."""
    with np.errstate(over="ignore"):
        x = (keys.astype(np.uint64) + positions.astype(np.uint64) * _GOLDEN
             + np.uint64(stream + 1) * _STREAM)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def counter_uniforms(keys: Any, positions: Any, stream: int) -> Any:
    """Uniform draws in [0, 1): keys [R] uint64, positions [R] int -> [R] float64, on the arrays' device."""
    return (counter_uniform_bits(keys, positions, stream) >> np.uint64(11)).astype(np.float64) * 2.0**-53
