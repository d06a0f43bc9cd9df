"""The array backend: NumPy (fp32) on the CPU, CuPy (fp16 weights, fp32 accumulation) on a GPU."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")

log = logging.getLogger("cupyspec")


@dataclass(frozen=True)
class Backend:
    """Which array module runs the model, and in which dtype."""

    xp: ModuleType  # numpy or cupy
    device: str  # "cpu" | "cuda"
    dtype: Any  # weights and activations: np.float32 on the CPU, np.float16 on the GPU

    @property
    def is_cuda(self) -> bool:
        return self.device == "cuda"

    def to_host(self, array: Any) -> np.ndarray:
        """A host NumPy copy (a no-op view for NumPy arrays)."""
        return array.get() if self.is_cuda else np.asarray(array)

    def synchronize(self) -> None:
        if self.is_cuda:
            self.xp.cuda.get_current_stream().synchronize()


def _cuda_unavailable_reason() -> str | None:
    """None when CuPy imports and sees a GPU; otherwise why not."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install
        return f"CuPy is not importable ({exc}); install cupyspec[cuda12] or cupyspec[cuda13]"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"CUDA is not usable ({exc})"
    return None if count > 0 else "no CUDA device is visible"


def available_cpus(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """The CPUs this process may use: its CPU affinity, bounded by a cgroup v2 CPU quota (a container's
    `--cpus`, read from `cpu_max`), which the BLAS library's own count of the machine's cores does not see."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        with open(cpu_max) as file:
            quota, period = file.read().split()
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cpus


def limit_cpu_threads(threads: int | None) -> None:
    """Limit the BLAS library NumPy calls to `threads` threads, for the whole process, and log the
    number. None: the CPUs this process may use (`available_cpus`), unless OPENBLAS_NUM_THREADS,
    OMP_NUM_THREADS or MKL_NUM_THREADS chose a number."""
    from threadpoolctl import threadpool_info, threadpool_limits

    if threads is None and not any(name in os.environ for name in BLAS_THREAD_VARIABLES):
        threads = available_cpus()
    if threads is not None:
        threadpool_limits(limits=threads, user_api="blas")
    counts = sorted({pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"})
    log.info("CPU: BLAS threads %s", ", ".join(map(str, counts)) or "none found")


def select_backend(device: str) -> Backend:
    """`cpu`, `cuda` (an error without a usable GPU) or `auto` (GPU if usable, else CPU with a warning)."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, not {device!r}")
    if device == "cpu":
        return Backend(np, "cpu", np.float32)
    reason = _cuda_unavailable_reason()
    if reason is None:
        import cupy

        return Backend(cupy, "cuda", np.float16)
    if device == "cuda":
        raise RuntimeError(f"--device cuda: {reason}")
    log.warning("no usable GPU (%s): running on the CPU with NumPy", reason)
    return Backend(np, "cpu", np.float32)
