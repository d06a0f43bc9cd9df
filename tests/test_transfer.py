"""HostTransfer: arrays of any dtype and shape come back exactly, empty ones included."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from cupyspec.transfer import fetch_arrays


def arrays(xp: Any) -> list[Any]:
    rng = np.random.default_rng(0)
    host = [rng.integers(-2**62, 2**62, 7), rng.random((3, 5)).astype(np.float32), rng.random(3) < 0.5,
            np.zeros((0, 4), np.int64), rng.random((2, 3, 1)), np.arange(5, dtype=np.int32)[::2]]
    return [xp.asarray(a) for a in host]


def check(xp: Any) -> None:
    sent = arrays(xp)
    for got, want in zip(fetch_arrays(xp, sent), sent):
        want = want if xp is np else want.get()
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_numpy_arrays_come_back_as_they_are() -> None:
    check(np)


@pytest.mark.gpu
def test_device_arrays_come_back_exactly() -> None:
    check(pytest.importorskip("cupy"))
