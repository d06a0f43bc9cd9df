"""Weight-only quantization (`wint8`, `wint4`): a decoder's matrices kept packed on the device,
dequantized inside the gemv products (decode and verify steps) and to fp16 before larger ones;
activations, the embedding and the LM head stay as they are.

A packed matrix w [N, K] holds groups of GROUP weights along each row, each group integers q with an
fp16 scale and minimum (s, m): w = fp16(s q + m), rounded once from the exact value (as the kernels'
fma.rn.f16x2 does). wint4 spans each group's minimum to maximum in 16 levels (q in [0, 15], as GGUF's Q4_1
blocks); wint8 scales it symmetrically (m = 0, q in [-127, 127], as Q8_0). A group that a GGUF
block of at most as many levels gives exactly keeps that block's levels (Q4_0 and Q4_1, and under
wint8 Q5_0 and Q5_1 too), so the packed weights of such a file are the fp16 weights it loads as;
Q8_0 blocks (an entry of |q| = 127, as llama.cpp quantizes) come back exactly under wint8.
A row's whole rounds of ROUND slices of GROUP weights are stored in the order the gemv lanes read
them (`to_round_order`), the rest in k order. cuda/packed_weights.cuh reads them; `dequantize` is
its twin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cupyspec.kernels import load_kernel

GROUP = 32  # weights per scale along K (packed_weights.cuh assumes it)
WARPS, UNROLL = 12, 4  # a gemv round: warps, and slices of GROUP weights each: GEMV_WARPS, GEMV_UNROLL
ROUND = WARPS * UNROLL  # slices
METHODS = ("wint8", "wint4")
DEQUANTIZE_THREADS = 256


@dataclass(frozen=True)
class QuantizedWeight:
    """A packed matrix [N, K] on the device; `dtype`: what its weights dequantize to (the backend's)."""

    values: Any  # wint8: q [N, K] int8; wint4: [N, K/2] uint8, a word of 8 weights in 4 bytes (`_pack_nibbles`)
    scales: Any  # (s, m) [N, K4, 2] fp16; K4: K/GROUP rounded up to a multiple of 4, zeros past K/GROUP
    # (both in round order, `to_round_order`)
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
            exact = (_values(grid_scale, grid_offset, grid_q) == candidates.astype(np.float16)).all(axis=1)
            done = todo[exact]
            scale[done], offset[done], q[done] = grid_scale[exact], grid_offset[exact], grid_q[exact]
            settled[done] = True
        rest = np.flatnonzero(~settled)
        levels, make_grid = FALLBACK_GRIDS[method]
        scale[rest], offset[rest], q[rest] = make_grid(groups[rest], levels)
    if not (np.isfinite(scale).all() and np.isfinite(offset).all()):
        raise ValueError(f"{method}: weights beyond fp16's range")
    q = q.reshape(rows, depth)
    values = q.astype(np.int8) if method == "wint8" else _pack_nibbles(q.astype(np.uint8))
    scales = to_round_order(np.stack([scale, offset], axis=1).reshape(rows, depth // GROUP, 2), 1)
    scales = np.pad(scales, ((0, 0), (0, -scales.shape[1] % 4), (0, 0)))  # 16-byte rows: [N, K4, 2]
    values = to_round_order(_words(values, method)).reshape(rows, -1)
    return QuantizedWeight(xp.asarray(values), xp.asarray(scales), method, np.dtype(dtype))


# Which weight of a word of 8 goes in the low and the high nibble of its bytes 0..3: weight 2 i in bits
# 4 i, weight 2 i + 1 in bits 16 + 4 i (i < 4), so that a shift and a mask give a pair as a half2.
LOW_NIBBLE, HIGH_NIBBLE = [0, 4, 1, 5], [2, 6, 3, 7]


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """q [N, K] in [0, 16) as wint4's words: [N, K/2] uint8."""
    words = q.reshape(q.shape[0], -1, 8)  # [N, K/8, 8]
    return (words[..., LOW_NIBBLE] | (words[..., HIGH_NIBBLE] << 4)).reshape(q.shape[0], -1)


def _unpack_nibbles(xp: Any, values: Any) -> Any:
    """wint4's words [N, K/2] (k order) back to q [N, K]."""
    data = values.reshape(values.shape[0], -1, 4)  # [N, K/8, 4 bytes]
    q = xp.empty((*data.shape[:2], 8), dtype=values.dtype)  # [N, K/8, 8]
    q[..., LOW_NIBBLE], q[..., HIGH_NIBBLE] = data & 15, data >> 4
    return q.reshape(values.shape[0], -1)


def _words(values: Any, method: str) -> Any:
    """values [N, K or K/2] as words of 8 weights: [N, K/8, 8 or 4 bytes]."""
    return values.reshape(values.shape[0], -1, 8 if method == "wint8" else 4)


def to_round_order(a: Any, words: int = 4, inverse: bool = False) -> Any:
    """a [N, S * words, ...] of a row's S slices, `words` entries each (4 words of 8 weights, or 1 (s, m)
    pair), with each whole round of ROUND slices in the gemv lanes' order: warp w's entry j of its slice
    u, which is slice w + WARPS u of the round, at (w words + j) UNROLL + u. `inverse`: back to k order."""
    rows, width = a.shape[:2]
    full = width // (ROUND * words) * ROUND * words  # entries of whole rounds
    k_order = (rows, -1, UNROLL, WARPS, words, *a.shape[2:])  # [N, rounds, u, w, j, ...]
    kernel_order = (rows, -1, WARPS, words, UNROLL, *a.shape[2:])  # [N, rounds, w, j, u, ...]
    head = a[:, :full].reshape(kernel_order if inverse else k_order)
    head = head.transpose(0, 1, 4, 2, 3, *range(5, head.ndim)) if inverse else \
        head.transpose(0, 1, 3, 4, 2, *range(5, head.ndim))
    out = a.copy()
    out[:, :full] = head.reshape(rows, full, *a.shape[2:])
    return out


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
    """fp16(s q + m) of groups [..., G] with s and m [...]: s q + m is exact in fp64, then rounded once."""
    exact = q.astype(np.float64) * scale.astype(np.float64)[..., None] + offset.astype(np.float64)[..., None]
    return exact.astype(np.float16)


def dequantize(xp: Any, w: QuantizedWeight) -> Any:
    """w's weights [N, K] in w.dtype: fp16(s q + m); on a GPU the kernel of cuda/gemv_packed.cu."""
    rows, depth = w.shape
    if xp is not np and w.dtype == np.float16:
        out = xp.empty((rows, depth), dtype=np.float16)  # [N, K]
        lanes = rows * -(-depth // (GROUP * ROUND)) * WARPS * 4  # each expands a gemv lane's 4 x 8 weights
        if lanes:
            load_kernel("gemv_packed", f"dequantize_{w.method}")(
                (-(-lanes // DEQUANTIZE_THREADS),), (DEQUANTIZE_THREADS,),
                (w.values, w.scales, out, np.int32(rows), np.int32(depth)))
        return out
    values = to_round_order(_words(w.values, w.method), inverse=True).reshape(rows, -1)  # [N, K or K/2] in k order
    scales = to_round_order(w.scales[:, : depth // GROUP], 1, inverse=True)  # [N, K/G, 2]
    q = values if w.method == "wint8" else _unpack_nibbles(xp, values)
    weights = _values(scales[..., 0], scales[..., 1], q.reshape(rows, depth // GROUP, GROUP))  # [N, K/G, G]
    return weights.reshape(rows, depth).astype(w.dtype)
