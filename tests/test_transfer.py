"""HostTransfer: arrays of any dtype and shape come back exactly, empty ones included, through pinned
buffers of a few sizes; to_device takes host arrays to the device as they were at the call."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from cupyspec.transfer import MIN_PINNED_BYTES, HostTransfer, fetch_arrays, pinned_size, to_device


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


@pytest.mark.gpu
def test_an_upload_queued_behind_device_work_takes_the_array_as_it_was_at_the_call() -> None:
    cupy = pytest.importorskip("cupy")
    busy = cupy.zeros(1 << 26, cupy.float32)
    for host in (np.zeros(0, np.int64), *(a for a in (x.get() for x in arrays(cupy)) if a.size)):
        busy += 1.0  # device work ahead of the copy on the stream
        sent = host.copy()
        device = to_device(cupy, host)
        host[...] = 0  # the caller may reuse the array at once
        assert device.dtype == sent.dtype and device.shape == sent.shape
        np.testing.assert_array_equal(device.get(), sent)


def test_a_transfer_says_once_its_arrays_are_handed_out() -> None:
    transfer = HostTransfer(np, arrays(np))
    assert transfer.done() and not transfer.read
    transfer.result()
    assert transfer.read


def test_pinned_buffers_come_in_powers_of_two() -> None:
    """A buffer is the smallest power of two that holds the bytes, and no smaller than MIN_PINNED_BYTES."""
    for nbytes in (0, 1, MIN_PINNED_BYTES - 1, MIN_PINNED_BYTES, MIN_PINNED_BYTES + 1, 300_000, 1 << 19, (1 << 19) + 1):
        size = pinned_size(nbytes)
        assert size >= max(nbytes, MIN_PINNED_BYTES) and size & (size - 1) == 0, nbytes
        assert size == MIN_PINNED_BYTES or size < 2 * nbytes, nbytes


@pytest.mark.gpu
def test_transfers_of_nearby_sizes_reuse_one_pinned_buffer() -> None:
    cupy = pytest.importorskip("cupy")
    addresses = set()
    for size in range(20_000, 30_000, 1_000):  # a step's results differ in size from the last one's
        transfer = HostTransfer(cupy, [cupy.ones(size, cupy.uint8)])
        (host,) = transfer.result()
        assert host.sum() == size
        addresses.add(host.ctypes.data)
        del transfer, host  # back to the pool
    assert len(addresses) == 1
