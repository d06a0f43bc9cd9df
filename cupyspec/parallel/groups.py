"""Communicators of a tensor-parallel group: each rank runs the whole model on its shard of the
weights and meets the others at the all-reduce after each row-parallel product and at the
all-gather of the logits.

`ThreadGroup` serves ranks that are threads of one process, on NumPy: the CPU's reference for the
sharded arithmetic, whose sums run in rank order, so every rank holds the same result.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import numpy as np


class Group(Protocol):
    """What a rank of a tensor-parallel group needs from its communicator."""

    rank: int
    size: int

    def all_reduce(self, x: Any) -> None:
        """x (the same shape on every rank) becomes the sum over the ranks, in place."""

    def all_gather(self, x: Any) -> Any:
        """The ranks' x [R, N_r] side by side: [R, sum of N_r], in rank order."""


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
        """Break the rendezvous: a rank that fails must not leave the others waiting, whose waits
        then raise threading.BrokenBarrierError."""
        self._meet.barrier.abort()

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

    def all_gather(self, x: Any) -> Any:
        return np.concatenate(self._exchange(x), axis=1)
