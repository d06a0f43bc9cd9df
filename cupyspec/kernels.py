"""The one loader of the CUDA sources in `cuda/`: compiled once per process with cupy.RawModule."""

from __future__ import annotations

import functools
import importlib
import re
from pathlib import Path
from typing import Any


def cuda_source_dir() -> Path:
    """`cuda/` of a source checkout, or `cupyspec/cuda/` of an installed package."""
    return Path(next(iter(importlib.import_module("cupyspec.cuda").__path__)))


def _compile(xp: Any, name: str) -> Any:
    path = cuda_source_dir() / f"{name}.cu"
    if not path.is_file():
        raise FileNotFoundError(f"CUDA source {path} is missing")
    try:
        module = xp.RawModule(code=path.read_text(), options=("-std=c++17", f"-I{cuda_source_dir()}"),
                              name_expressions=None)
        module.compile()
    except xp.cuda.compiler.CompileException as exc:  # name our file, not NVRTC's temporary copy
        message = re.sub(r"\S+\.cubin\.cu", str(path), str(exc))
        raise RuntimeError(f"compiling {path} failed:\n{message}") from None
    return module


@functools.cache
def load_kernel(name: str, function: str) -> Any:
    """The kernel `function` of `cuda/<name>.cu` (compiled and cached on first use)."""
    import cupy

    return _compile(cupy, name).get_function(function)
