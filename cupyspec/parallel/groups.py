"""Communicators of a tensor-parallel group: each rank runs the whole model on its shard of the
weights and meets the others at the all-reduce after each row-parallel product and at the
all-gather of the logits.

- `ThreadGroup` serves ranks that are threads of one process, on NumPy: the CPU's reference for
  the sharded arithmetic, whose sums run in rank order, so every rank holds the same result.
- `NcclGroup` serves ranks that are threads of one process, one GPU each, over NCCL
  (`cupy.cuda.nccl`): each call is queued on the rank's current stream, so a CUDA graph captures it.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np


class Group(Protocol):
    """What a rank of a tensor-parallel group needs from its communicator."""

    rank: int
    size: int

    def all_reduce(self, x: Any) -> None:
        """x (the same shape on every rank) becomes the sum over the ranks, in place."""

    def all_gather(self, x: Any, widths: Sequence[int]) -> Any:
        """The ranks' x [R, widths[r]] side by side: [R, sum(widths)], in rank order."""

    def abort(self) -> None:
        """Release the ranks waiting at a collective that a failed rank will never reach."""

    def close(self) -> None:
        """Free the communicator's resources, once no rank will call it again."""


class _Rendezvous:
    """Where the threads of one group leave their arrays and wait for one another."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size)
        self.slots: list[Any] = [None] * size


class ThreadGroup:
    """Rank `rank` of a group of threads in one process (`ThreadGroup.create`)."""

    def __init__(self, rendezvous: _Rendezvous, rank: int) -> None:
        self._meet, self.rank, self.size = rendezvous, rank, len(rendezvous.slots)

    @classmethod
    def create(cls, size: int) -> list[ThreadGroup]:
        """The `size` ranks of a new group, one for each thread."""
        rendezvous = _Rendezvous(size)
        return [cls(rendezvous, rank) for rank in range(size)]

    def abort(self) -> None:
        """Break the rendezvous: the others' waits raise threading.BrokenBarrierError."""
        self._meet.barrier.abort()

    def close(self) -> None:
        """Nothing to free: the rendezvous is the threads' Python objects."""

    def _exchange(self, x: Any) -> list[Any]:
        """Every rank's x, once all have left theirs; the slots are free again when this returns on
        every rank (the second wait), so the next exchange cannot overwrite one still being read."""
        self._meet.slots[self.rank] = x
        self._meet.barrier.wait()
        arrays = list(self._meet.slots)
        self._meet.barrier.wait()
        return arrays

    def all_reduce(self, x: Any) -> None:
        arrays = self._exchange(x.copy())
        total = arrays[0].copy()
        for other in arrays[1:]:
            total += other
        x[...] = total

    def all_gather(self, x: Any, widths: Sequence[int]) -> Any:
        arrays = self._exchange(x)
        if [a.shape[1] for a in arrays] != list(widths):
            raise ValueError(f"all_gather: the ranks' widths are {[a.shape[1] for a in arrays]}, not {list(widths)}")
        return np.concatenate(arrays, axis=1)


class NcclGroup:
    """Rank `rank` of a group of GPUs driven by threads of one process (`NcclGroup.create`); each rank
    calls from its own thread, with its GPU current. NCCL sums in an order of its own, but every
    rank receives the same sum."""

    def __init__(self, communicator: Any, rank: int, size: int, device: int) -> None:
        self._comm, self.rank, self.size, self.device = communicator, rank, size, device

    @classmethod
    def create(cls, devices: Sequence[int]) -> list[NcclGroup]:
        """The ranks of a new group over CUDA devices `devices`, rank r on devices[r]. NVLink multicast
        (NVLS) stays off: on a shared host, a program that uses it can put the GPUs out of service."""
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        from cupy.cuda import nccl

        communicators = nccl.NcclCommunicator.initAll(list(devices))
        return [cls(communicator, rank, len(devices), devices[rank])
                for rank, communicator in enumerate(communicators)]

    def all_reduce(self, x: Any) -> None:
        from cupy.cuda import get_current_stream, nccl

        self._comm.allReduce(x.data.ptr, x.data.ptr, x.size, _nccl_type(x.dtype), nccl.NCCL_SUM,
                             get_current_stream().ptr)

    def all_gather(self, x: Any, widths: Sequence[int]) -> Any:
        """NCCL gathers equal counts: each rank's x goes padded to the widest, then the padding is cut."""
        import cupy

        rows, width = x.shape[0], max(widths)
        send = x if x.shape[1] == width else cupy.zeros((rows, width), x.dtype)  # [R, width]
        if send is not x:
            send[:, :x.shape[1]] = x
        send = cupy.ascontiguousarray(send)
        gathered = cupy.empty((self.size, rows, width), x.dtype)  # [ranks, R, width]
        self._comm.allGather(send.data.ptr, gathered.data.ptr, send.size, _nccl_type(x.dtype),
                             cupy.cuda.get_current_stream().ptr)
        if all(w == width for w in widths):
            return gathered.transpose(1, 0, 2).reshape(rows, -1)  # a copy: [R, ranks * width]
        return cupy.concatenate([gathered[r, :, :w] for r, w in enumerate(widths)], axis=1)

    def abort(self) -> None:
        """Abort the communicator, its GPU current: this rank's NCCL work on its GPU ends instead of
        waiting for its peers. The last of a process's communicators to be aborted or destroyed frees
        them all, after waiting until every CUDA graph that captured a collective on any of them is
        destroyed: so the graphs go first (RankThreads.abort and close)."""
        import cupy

        with cupy.cuda.Device(self.device):
            self._comm.abort()

    def close(self) -> None:
        """Destroy the communicator (nothing left to do once aborted), its GPU current; the last to go
        waits for the CUDA graphs as `abort` says. Left to the garbage collector, a communicator could
        go before its graphs and hang the process."""
        import cupy

        with cupy.cuda.Device(self.device):
            self._comm.destroy()


@functools.cache
def _nccl_type(dtype: Any) -> int:
    """NCCL's code of a NumPy dtype (looked up once per dtype: every collective asks)."""
    from cupy.cuda import nccl

    types = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float16): nccl.NCCL_FLOAT16,
             np.dtype(np.int32): nccl.NCCL_INT32, np.dtype(np.int64): nccl.NCCL_INT64}
    return types[np.dtype(dtype)]
