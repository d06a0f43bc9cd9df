"""The kernel loader: a module's text names its headers' contents (CuPy's cache key); its launches: the
driver structs of programmatic dependent launch, argument conversion, and on a GPU a captured chain of
launches that may overlap yet keep their order."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from cupyspec import kernels
from cupyspec.kernels import _argument, _LaunchAttribute, _LaunchConfig, module_source, programmatic_launches


def test_a_modules_source_changes_with_any_header(tmp_path, monkeypatch) -> None:
    """CuPy finds a compiled module in its disk cache by the module's text alone: an edited header
    (a new packed layout, say) must not bring back the module compiled against the old one."""
    (tmp_path / "a.cu").write_text('#include "b.cuh"\n')
    (tmp_path / "b.cuh").write_text("#define LAYOUT 1\n")
    monkeypatch.setattr(kernels, "cuda_source_dir", lambda: tmp_path)
    before = module_source("a")
    (tmp_path / "b.cuh").write_text("#define LAYOUT 2\n")
    after = module_source("a")
    assert before.startswith('#include "b.cuh"\n') and after.startswith('#include "b.cuh"\n')
    assert before != after
    with pytest.raises(FileNotFoundError, match="missing"):
        module_source("c")


def test_launch_structs_have_the_driver_layout() -> None:
    # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte value union; CUlaunchConfig: 7 uints, then
    # the stream, the attributes and their count (cuda.h, CUDA 12 and 13)
    assert ctypes.sizeof(_LaunchAttribute) == 72 and _LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(_LaunchConfig) == 56
    assert (_LaunchConfig.stream.offset, _LaunchConfig.attrs.offset, _LaunchConfig.num_attrs.offset) == (32, 40, 48)


def test_arguments_become_the_c_types_of_the_kernels() -> None:
    assert isinstance(_argument(np.int32(-3)), ctypes.c_int32) and _argument(np.int32(-3)).value == -3
    assert isinstance(_argument(np.int64(1 << 40)), ctypes.c_int64)
    assert isinstance(_argument(np.float32(0.5)), ctypes.c_float) and _argument(np.float32(0.5)).value == 0.5
    assert _argument(None).value is None
    for bad in (3, 0.5, np.float64(1.0)):  # a Python or float64 scalar would not match the kernel's C type
        with pytest.raises(TypeError):
            _argument(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 40])  # the gemv, and the tiles
def test_a_captured_chain_with_programmatic_launches_keeps_its_order(rows: int) -> None:
    """300 products that each add into the residual the one before wrote: a launch that overtook
    its predecessor's writes would lose a sum. Small integers keep every sum exact."""
    import cupy

    from cupyspec.model.linear import add_linear

    rng = np.random.default_rng(rows)
    x = cupy.asarray(rng.integers(-2, 3, (rows, 256)).astype(np.float16))  # [M, K]
    w = cupy.asarray(rng.integers(-2, 3, (96, 256)).astype(np.float16))  # [N, K]
    residual = cupy.zeros((rows, 96), dtype=np.float32)  # [M, N]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        add_linear(cupy, residual, x, w)  # compiles outside the capture
        residual.fill(0)
        stream.begin_capture()
        with programmatic_launches():
            for _ in range(300):
                add_linear(cupy, residual, x, w)
        graph = stream.end_capture()
        graph.launch(stream)
    stream.synchronize()
    want = 300 * (x.get().astype(np.float32) @ w.get().astype(np.float32).T)
    np.testing.assert_array_equal(residual.get(), want)
