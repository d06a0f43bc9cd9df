"""Device arrays on their way to the host: copies started now and waited for later."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

ALIGNMENT = 16  # bytes: each array's place in the pinned buffer starts at a multiple of this
MIN_PINNED_BYTES = 1 << 12  # pinned buffers are powers of two from this size up


class HostTransfer:
    """Several device arrays of any shapes and dtypes, brought to the host together.

    With CuPy each array goes as it is, in one asynchronous copy of its own, on the current stream,
    into its place in one pinned buffer: no kernel packs them first (each CuPy kernel launch costs
    the host more than a copy does). `result()` waits for those copies only, not for work queued on
    the stream after them (the next step, say). With NumPy the arrays are taken as they are.
    """

    def __init__(self, xp: Any, arrays: list[Any]) -> None:
        self._event = self._sources = None
        self.read = False  # whether `result` has handed out the arrays
        if xp is np or not arrays:
            self._arrays = [np.asarray(a) for a in arrays]
            return
        import cupyx

        sources = [xp.ascontiguousarray(a) for a in arrays]
        offsets = list(itertools.accumulate((-(-a.nbytes // ALIGNMENT) * ALIGNMENT for a in sources), initial=0))
        host = cupyx.empty_pinned(pinned_size(offsets[-1]), np.uint8)  # [bytes]
        base, runtime, stream = host.ctypes.data, xp.cuda.runtime, xp.cuda.get_current_stream()
        for a, offset in zip(sources, offsets):
            if a.nbytes:
                runtime.memcpyAsync(base + offset, a.data.ptr, a.nbytes, runtime.memcpyDeviceToHost, stream.ptr)
        self._event = stream.record(xp.cuda.Event(disable_timing=True))  # lighter to record and query
        self._sources = sources  # stay allocated until the copies are done
        self._arrays = [host[offset:offset + a.nbytes].view(a.dtype).reshape(a.shape)
                        for a, offset in zip(sources, offsets)]

    @classmethod
    def queued(cls, xp: Any, host_arrays: list[np.ndarray], event: Any | None = None) -> HostTransfer:
        """Host arrays (pinned) that copies already queued on the current stream write, a CUDA
        graph's say: done once the stream has run them. event: the CUDA event to record (one that
        nothing else waits on any more), or None for a new one."""
        transfer = cls.__new__(cls)
        transfer._arrays, transfer._sources, transfer.read = host_arrays, None, False
        transfer._event = xp.cuda.get_current_stream().record(
            event if event is not None else xp.cuda.Event(disable_timing=True))
        return transfer

    def done(self) -> bool:
        """Whether the copies are done (`result` would not wait)."""
        return self._event is None or self._event.done

    def result(self) -> list[np.ndarray]:
        """The arrays on the host, in order (blocks until the copies are done)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = self._sources = None
        self.read = True
        return self._arrays


def pinned_size(nbytes: int) -> int:
    """The pinned buffer for nbytes: the next power of two, so that CuPy's pinned pool, which reuses a
    freed buffer for a request of the same size only, finds one again and again (steps bring results
    of ever different sizes; a fresh page-locked allocation costs the host far more than a copy)."""
    return max(MIN_PINNED_BYTES, 1 << (nbytes - 1).bit_length())


def fetch_arrays(xp: Any, arrays: list[Any]) -> list[np.ndarray]:
    """Several device arrays on the host now (see HostTransfer)."""
    return HostTransfer(xp, arrays).result()


def to_device(xp: Any, array: np.ndarray) -> Any:
    """A host array on xp's device (NumPy: the array itself). CuPy: one asynchronous copy on the
    current stream straight from the array's pageable memory, which the driver stages before it
    returns (so the array may change afterwards). `cupy.asarray` stages it through CuPy's pinned
    memory pool instead, which costs the host more, most of all behind a queued graph."""
    if xp is np:
        return array
    array = np.ascontiguousarray(array)
    device = xp.empty(array.shape, array.dtype)
    if array.nbytes:
        runtime = xp.cuda.runtime
        runtime.memcpyAsync(device.data.ptr, array.ctypes.data, array.nbytes, runtime.memcpyHostToDevice,
                            xp.cuda.get_current_stream().ptr)
    return device


def array_module(array: Any) -> Any:
    """NumPy for a host array, CuPy for a device one."""
    if isinstance(array, np.ndarray):
        return np
    import cupy

    return cupy
