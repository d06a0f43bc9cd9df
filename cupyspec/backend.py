"""The array backend: NumPy (fp32) on the CPU, CuPy (fp16 weights, fp32 accumulation) on a GPU."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

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
