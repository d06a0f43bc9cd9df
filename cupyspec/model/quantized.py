"""Weight-only quantization (`wint8`, `wint4`): a decoder's matrices kept packed on the device,
dequantized inside the gemv products (decode and verify steps) and to fp16 before larger ones;
activations, the embedding and the LM head stay as they are.

A packed matrix w [N, K] holds groups of GROUP weights along each row, each group integers q with an
fp16 scale and minimum (s, m): w = s q + m, evaluated in fp32 (where s q is exact) and rounded to
fp16. wint4 spans each group's minimum to maximum in 16 levels (q in [0, 15], as GGUF's Q4_1
blocks); wint8 scales it symmetrically (m = 0, q in [-127, 127], as Q8_0). A group that a GGUF
block of at most as many levels gives exactly keeps that block's levels (Q4_0 and Q4_1, and under
wint8 Q5_0 and Q5_1 too), so the packed weights of such a file are the fp16 weights it loads as;
Q8_0 blocks (an entry of |q| = 127, as llama.cpp quantizes) come back exactly under wint8.
cuda/packed_weights.cuh reads them; `dequantize` is its twin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cupyspec.kernels import load_kernel

GROUP = 32  # weights per scale along K (packed_weights.cuh assumes it)
METHODS = ("wint8", "wint4")
DEQUANTIZE_THREADS = 256


@dataclass(frozen=True)
class QuantizedWeight:
    """A packed matrix [N, K] on the device; `dtype`: what its weights dequantize to (the backend's)."""

    values: Any  # wint8: q [N, K] int8; wint4: [N, K/2] uint8, q of k and k + 1 in the low and high nibble
    scales: Any  # (s, m) [N, K/GROUP, 2] fp16
    method: str  # "wint8" | "wint4"
    dtype: Any

    @property
    def shape(self) -> tuple[int, int]:
        rows, width = self.values.shape
        return rows, width * (2 if self.method == "wint4" else 1)

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes


def check_method(method: str | None, what: str) -> str | None:
    """`method` in lower case (None stays None); ValueError naming `what` for anything else."""
    if method is None:
        return None
    if not isinstance(method, str) or method.lower() not in METHODS:
        raise ValueError(f"{what} must be one of {', '.join(METHODS)}, not {method!r}")
    return method.lower()


def quantize(xp: Any, w: np.ndarray, method: str, dtype: Any) -> QuantizedWeight:
    """Pack host weights w [N, K] (K % GROUP == 0) by groups of GROUP, q rounded to nearest. A group
    that a GGUF block layout of as many levels gives exactly keeps that block's s, m and q (wint4:
    Q4_1, Q4_0; wint8: those and Q5_1, Q5_0); any other group spans its minimum to maximum in 15
    steps (wint4), or is scaled by its largest magnitude over 127 (wint8, as Q8_0)."""
    rows, depth = w.shape
    if depth % GROUP:
        raise ValueError(f"{method} packs rows of a multiple of {GROUP} weights, not {depth}")
    groups = np.asarray(w, dtype=np.float32).reshape(-1, GROUP)  # [N K/G, G]
    ordered = np.sort(groups, axis=1)
    distinct = 1 + np.count_nonzero(ordered[:, 1:] != ordered[:, :-1], axis=1)  # [N K/G]: its distinct weights
    scale, offset = np.zeros((2, len(groups)), np.float16)  # [N K/G] each
    q = np.zeros(groups.shape, np.float32)  # [N K/G, G]
    settled = np.zeros(len(groups), bool)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):  # out of fp16's range: checked below
        for levels, make_grid in EXACT_GRIDS[method]:  # the first that is exact wins
            todo = np.flatnonzero(~settled & (distinct <= levels))  # groups that may lie on such a grid
            candidates = groups if len(todo) == len(groups) else groups[todo]
            grid_scale, grid_offset, grid_q = make_grid(candidates, levels)
            exact = (_values(grid_scale, grid_offset, grid_q) == candidates).all(axis=1)  # [len(todo)]
            done = todo[exact]
            scale[done], offset[done], q[done] = grid_scale[exact], grid_offset[exact], grid_q[exact]
            settled[done] = True
        rest = np.flatnonzero(~settled)
        levels, make_grid = FALLBACK_GRIDS[method]
        scale[rest], offset[rest], q[rest] = make_grid(groups[rest], levels)
    if not (np.isfinite(scale).all() and np.isfinite(offset).all()):
        raise ValueError(f"{method}: weights beyond fp16's range")
    q = q.reshape(rows, depth)
    if method == "wint8":
        values = q.astype(np.int8)
    else:
        nibbles = q.astype(np.uint8)
        values = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    scales = np.stack([scale, offset], axis=1).reshape(rows, depth // GROUP, 2)
    return QuantizedWeight(xp.asarray(values), xp.asarray(scales), method, np.dtype(dtype))


Grid = tuple[np.ndarray, np.ndarray, np.ndarray]  # of groups [n, G]: fp16 s [n], fp16 m [n], q [n, G]


def _range_grid(groups: np.ndarray, levels: int) -> Grid:
    """From each group's minimum (q = 0) to its maximum: Q4_1 and Q5_1 blocks."""
    low = groups.min(axis=1)
    return _grid(groups, ((groups.max(axis=1) - low) / (levels - 1)).astype(np.float16), low.astype(np.float16),
                 0, levels - 1)


def _signed_grid(groups: np.ndarray, levels: int) -> Grid:
    """The group's weight of largest magnitude at q = 0 and zero at q = levels / 2: Q4_0 and Q5_0."""
    extreme = np.take_along_axis(groups, np.abs(groups).argmax(axis=1)[:, None], axis=1)[:, 0]  # [n]
    scale = (extreme / -(levels // 2)).astype(np.float16)
    return _grid(groups, scale, (scale.astype(np.float32) * -(levels // 2)).astype(np.float16), 0, levels - 1)


def _symmetric_grid(groups: np.ndarray, levels: int) -> Grid:
    """Zero at q = 0 and the group's largest magnitude at q = ±(levels // 2), m = 0: Q8_0 blocks."""
    largest = levels // 2
    scale = (np.abs(groups).max(axis=1) / largest).astype(np.float16)
    return _grid(groups, scale, np.zeros_like(scale), -largest, largest)


def _grid(groups: np.ndarray, scale: np.ndarray, offset: np.ndarray, lowest: int, highest: int) -> Grid:
    """The groups' q on the grid of scale and offset, rounded to nearest and clipped to [lowest, highest]."""
    step = scale.astype(np.float32)[:, None]  # [n, 1]
    q = np.where(step != 0, np.rint((groups - offset.astype(np.float32)[:, None]) / step), 0)
    return scale, offset, np.clip(q, lowest, highest)


# Per method, the GGUF block layouts kept where they are exact, as (levels of q, grid) in order; and
# the grid of any other group.
EXACT_GRIDS = {"wint4": [(16, _range_grid), (16, _signed_grid)],
               "wint8": [(16, _range_grid), (16, _signed_grid), (32, _range_grid), (32, _signed_grid)]}
FALLBACK_GRIDS = {"wint4": (16, _range_grid), "wint8": (255, _symmetric_grid)}


def _values(scale: Any, offset: Any, q: Any) -> Any:
    """s q + m in fp32 of groups [..., G] with s and m [...] (s q is exact there): the values a GGUF
    file of such blocks loads as."""
    return q.astype(np.float32) * scale.astype(np.float32)[..., None] + offset.astype(np.float32)[..., None]


def dequantize(xp: Any, w: QuantizedWeight) -> Any:
    """w's weights [N, K] in w.dtype: fp16(s q + m) in fp32; on a GPU the kernel of cuda/gemv_packed.cu."""
    rows, depth = w.shape
    if xp is not np and w.dtype == np.float16:
        out = xp.empty((rows, depth), dtype=np.float16)  # [N, K]
        chunks = rows * depth // 8
        if chunks:
            load_kernel("gemv_packed", f"dequantize_{w.method}")(
                (-(-chunks // DEQUANTIZE_THREADS),), (DEQUANTIZE_THREADS,),
                (w.values, w.scales, out, np.int32(rows), np.int32(depth)))
        return out
    if w.method == "wint8":
        q = w.values  # [N, K]
    else:
        q = xp.stack([w.values & 15, w.values >> 4], axis=2).reshape(rows, depth)
    weights = _values(w.scales[..., 0], w.scales[..., 1], q.reshape(rows, depth // GROUP, GROUP))  # [N, K/G, G]
    return weights.reshape(rows, depth).astype(np.float16).astype(w.dtype)
