"""The threads of a tensor-parallel group's ranks: one process drives every GPU, one thread a rank.

A rank's step is mostly queued device work, so one process serves: the ranks share the host's
memory (the model is read once and sliced for each rank), the scheduler and the outputs, and no
step's inputs cross a process boundary. Each rank has a thread of its own because a collective
that one thread issues for several GPUs may wait for the others' launches before it returns
(NCCL then asks for grouped calls); with a thread per rank each issues its own calls in order, as
one process per GPU would.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from cupyspec.backend import Backend
from cupyspec.parallel.groups import Group, NcclGroup, ThreadGroup

T = TypeVar("T")


def make_groups(size: int, backend: Backend) -> Sequence[Group | None]:
    """The communicators of `size` ranks, rank r on CUDA device r (NCCL), or threads on the CPU
    (ThreadGroup); [None] for one rank. ValueError when fewer GPUs are visible."""
    if size == 1:
        return [None]
    if not backend.is_cuda:
        return ThreadGroup.create(size)
    visible = backend.xp.cuda.runtime.getDeviceCount()
    if size > visible:
        raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs; {visible} visible")
    return NcclGroup.create(range(size))


class RankThreads:
    """Runs a function for every rank at once: rank 0 on the calling thread, each other rank on a
    thread of its own; each call with its rank's GPU current."""

    def __init__(self, groups: Sequence[Group | None], backend: Backend) -> None:
        self.groups, self.backend = groups, backend
        self._aborted = False
        self._lock = threading.Lock()
        self.failure: BaseException | None = None  # the first rank's error: the others' follow from the abort
        self._threads = [ThreadPoolExecutor(1, thread_name_prefix=f"cupyspec-rank{rank}")
                         for rank in range(1, len(groups))]

    def map(self, fn: Callable[[int], T]) -> list[T]:
        """[fn(0), fn(1), ...], the ranks running at once. A rank that raises aborts the group at once
        (no rank waits for it at a collective); once every rank has returned, the error that came
        first is raised (the others' errors follow from the abort)."""
        futures = [thread.submit(self._call, fn, rank) for rank, thread in enumerate(self._threads, start=1)]
        calls = [lambda: self._call(fn, 0), *(future.result for future in futures)]
        results, errors = [], []
        for call in calls:
            try:
                results.append(call())
            except BaseException as exc:  # noqa: BLE001 - raised below, once no rank runs
                errors.append(exc)
        if errors:
            raise self.failure or errors[0]
        return results

    def _call(self, fn: Callable[[int], T], rank: int) -> T:
        """fn(rank) with the rank's GPU current; the group aborted if it raises."""
        device: Any = self.backend.xp.cuda.Device(rank) if self.backend.is_cuda else contextlib.nullcontext()
        try:
            with device:
                return fn(rank)
        except BaseException as exc:
            with self._lock:
                self.failure = self.failure or exc
            self.abort(rank)
            raise

    def abort(self, failed: int) -> None:
        """Abort the communicators of every rank but `failed`, once: their work stops waiting at a
        collective that the failed rank may never reach, and the group is of no further use. The
        failed rank's own is aborted by `close`, after the CUDA graphs (NcclGroup.abort says why)."""
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
        for rank, group in enumerate(self.groups):
            if group is not None and rank != failed:
                group.abort()

    def close(self) -> None:
        """Free the communicators (aborting what a failure left) and end the ranks' threads; any CUDA
        graph that holds their collectives must be destroyed first. A failure's frames may hold graphs
        that no runner does (a rank's, captured before it failed to build): they are cleared first."""
        if self.failure is not None:
            traceback.clear_frames(self.failure.__traceback__)
        for group in self.groups:
            if group is None:
                continue
            if self._aborted:
                group.abort()
            else:
                group.close()
        for thread in self._threads:
            thread.shutdown(wait=False)
