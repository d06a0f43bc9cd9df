"""Device arrays on their way to the host: one packed copy, started now and waited for later."""

from __future__ import annotations

from typing import Any

import numpy as np


class HostTransfer:
    """Several device arrays of any shapes, brought to the host in ONE copy.

    They travel flattened and concatenated as float64, which holds int32/int64 token ids (< 2**53),
    booleans and float32 values exactly; each comes back as float64 in its own shape (a single array
    travels as it is, in its own dtype: no packing kernels for the tokens of a plain step). With CuPy the
    copy goes asynchronously, on the current stream, into pinned memory, and `result()` waits for
    that copy only, not for work queued on the stream after it (the next step, say).
    """

    def __init__(self, xp: Any, arrays: list[Any]) -> None:
        self._shapes = [a.shape for a in arrays]
        self._event = self._packed = None
        if not arrays:
            self._host = np.empty(0)
            return
        if len(arrays) == 1:
            packed = xp.ascontiguousarray(arrays[0]).ravel()  # [size]
        else:
            packed = xp.concatenate([a.astype(xp.float64).ravel() for a in arrays])  # [sum sizes]
        if xp is np:
            self._host = packed
            return
        import cupyx

        runtime = xp.cuda.runtime
        stream = xp.cuda.get_current_stream()
        self._host = cupyx.empty_pinned(packed.shape, packed.dtype)
        runtime.memcpyAsync(self._host.ctypes.data, packed.data.ptr, packed.nbytes, runtime.memcpyDeviceToHost,
                            stream.ptr)
        self._event = stream.record()
        self._packed = packed  # the source stays allocated until the copy is done

    def result(self) -> list[np.ndarray]:
        """The arrays on the host, in order (blocks until the copy is done)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = self._packed = None
        bounds = np.cumsum([0] + [int(np.prod(shape)) for shape in self._shapes])
        return [self._host[lo:hi].reshape(shape) for shape, lo, hi in zip(self._shapes, bounds[:-1], bounds[1:])]


def fetch_arrays(xp: Any, arrays: list[Any]) -> list[np.ndarray]:
    """Several device arrays on the host now, in one transfer (see HostTransfer)."""
    return HostTransfer(xp, arrays).result()
