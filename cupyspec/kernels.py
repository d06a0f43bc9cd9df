"""The one loader of the CUDA sources in `cuda/`: compiled once per process with cupy.RawModule.

Kernels launch as CuPy launches them, except inside `programmatic_launches()` (the capture of a
CUDA graph), where each launch allows programmatic dependent launch: the kernel may start while the
one before it still runs, up to its `wait_for_prior_grid()` (cuda/grid_dependency.cuh). A gemv thus
streams its weights in while the previous kernel finishes. CuPy cannot pass launch attributes, so
those launches go through the driver's cuLaunchKernelEx.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import importlib
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np


def cuda_source_dir() -> Path:
    """`cuda/` of a source checkout, or `cupyspec/cuda/` of an installed package."""
    return Path(next(iter(importlib.import_module("cupyspec.cuda").__path__)))


def module_source(name: str) -> str:
    """The text of `cuda/<name>.cu`, ending in a comment with a digest of every header in `cuda/`: CuPy
    keys its disk cache of compiled modules on a module's own text, so a changed header must change it."""
    path = cuda_source_dir() / f"{name}.cu"
    if not path.is_file():
        raise FileNotFoundError(f"CUDA source {path} is missing")
    return f"{path.read_text()}\n// headers: {_headers_digest()}\n"


def _headers_digest() -> str:
    digest = hashlib.sha256()
    for header in sorted(cuda_source_dir().glob("*.cuh")):
        digest.update(header.name.encode() + b"\0" + header.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.cache
def _module(name: str) -> Any:
    """`cuda/<name>.cu` compiled, once per process (CuPy's disk cache keeps its binary across processes)."""
    import cupy

    path = cuda_source_dir() / f"{name}.cu"
    try:
        module = cupy.RawModule(code=module_source(name), options=("-std=c++17", f"-I{cuda_source_dir()}"),
                                name_expressions=None)
        module.compile()
    except cupy.cuda.compiler.CompileException as exc:  # name our file, not NVRTC's temporary copy
        message = re.sub(r"\S+\.cubin\.cu", str(path), str(exc))
        raise RuntimeError(f"compiling {path} failed:\n{message}") from None
    return module


@functools.cache
def load_kernel(name: str, function: str) -> Kernel:
    """The kernel `function` of `cuda/<name>.cu`."""
    return Kernel(_module(name).get_function(function))


@functools.cache
def sm_count(device: int) -> int:
    """The streaming multiprocessors of CUDA device `device`, for sizing grids."""
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"]


# ---------------------------------------------------------------- programmatic dependent launch

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID
_launches = threading.local()  # .programmatic: this thread's launches allow programmatic dependent launch


@contextlib.contextmanager
def programmatic_launches() -> Iterator[None]:
    """Kernels this thread launches inside may overlap the kernel before them up to its
    grid-dependency wait (each rank of a tensor-parallel group captures its graphs on its own thread)."""
    _launches.programmatic = True
    try:
        yield
    finally:
        _launches.programmatic = False


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, then a 64-byte union at offset 8
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_ubyte * 4), ("value", ctypes.c_ubyte * 64)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


@functools.cache
def _launch_kernel_ex() -> Any:
    function = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    function.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                         ctypes.c_void_p]
    function.restype = ctypes.c_int
    return function


_SCALARS = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
            np.dtype(np.float32): ctypes.c_float}


def _argument(value: Any) -> Any:
    """A kernel argument as the ctypes value cuLaunchKernelEx copies."""
    if value is None:
        return ctypes.c_void_p(0)
    if hasattr(value, "data") and hasattr(value.data, "ptr"):  # a CuPy array
        return ctypes.c_void_p(value.data.ptr)
    if isinstance(value, np.generic) and value.dtype in _SCALARS:
        return _SCALARS[value.dtype](value.item())
    raise TypeError(f"kernel arguments are CuPy arrays or int32, int64 or float32 NumPy scalars, not {value!r}")


def _dim3(dims: tuple[int, ...]) -> Any:
    return (ctypes.c_uint * 3)(*dims, *(1,) * (3 - len(dims)))


class Kernel:
    """A compiled kernel of `cuda/`, called as a CuPy RawKernel is."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self.raw.max_dynamic_shared_size_bytes

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, size: int) -> None:
        self.raw.max_dynamic_shared_size_bytes = size

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, shared_mem: int = 0) -> None:
        if not getattr(_launches, "programmatic", False):
            self.raw(grid, block, args, shared_mem=shared_mem)
            return
        import cupy

        attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        attribute.value[0] = 1  # programmaticStreamSerializationAllowed
        config = _LaunchConfig(_dim3(grid), _dim3(block), shared_mem, cupy.cuda.get_current_stream().ptr,
                               ctypes.pointer(attribute), 1)
        values = [_argument(a) for a in args]
        pointers = (ctypes.c_void_p * len(values))(*(ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values))
        status = _launch_kernel_ex()(ctypes.byref(config), ctypes.c_void_p(self.raw.kernel.ptr), pointers, None)
        if status:
            raise RuntimeError(f"cuLaunchKernelEx of {self.raw.name} failed with CUresult {status}")
