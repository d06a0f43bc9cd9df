"""Weight-only quantization (`wint8`, `wint4`): a decoder's matrices kept packed on the device,
dequantized inside the gemv products (decode and verify steps) and to fp16 before larger ones;
activations, the embedding and the LM head stay as they are.

A packed matrix w [N, K] holds groups of GROUP weights along each row, each group integers q with an
fp16 scale s (wint8, symmetric: w = s q, q in [-127, 127]) or an fp16 scale and minimum (wint4:
w = s q + m, q in [0, 15]), evaluated in fp32 and rounded to fp16: the layouts of GGUF's Q8_0 and
Q4_1 blocks. Quantizing recovers such blocks: a Q8_0 group (an entry of |q| = 127, as llama.cpp
quantizes) comes back exactly as wint8, a Q4_1 group (entries of q = 0 and 15) as wint4, so the
packed weights give the fp16 weights those files load as. cuda/packed_weights.cuh reads them;
`dequantize` is its twin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cupyspec.kernels import load_kernel

GROUP = 32  # weights per scale along K (packed_weights.cuh assumes it)
METHODS = ("wint8", "wint4")
_LEVELS = {"wint8": 127, "wint4": 15}  # the largest q
DEQUANTIZE_THREADS = 256


@dataclass(frozen=True)
class QuantizedWeight:
    """A packed matrix [N, K] on the device; `dtype`: what its weights dequantize to (the backend's)."""

    values: Any  # wint8: q [N, K] int8; wint4: [N, K/2] uint8, q of k and k + 1 in the low and high nibble
    scales: Any  # wint8: s [N, K/GROUP] fp16; wint4: (s, m) [N, K/GROUP, 2] fp16
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
    """Pack host weights w [N, K] (K % GROUP == 0) by groups of GROUP: wint8 scales each group by its
    largest magnitude over 127, wint4 spans its minimum to maximum in 15 steps; q rounds to nearest."""
    rows, depth = w.shape
    if depth % GROUP:
        raise ValueError(f"{method} packs rows of a multiple of {GROUP} weights, not {depth}")
    groups = np.asarray(w, dtype=np.float32).reshape(rows, depth // GROUP, GROUP)  # [N, K/G, G]
    levels = _LEVELS[method]
    if method == "wint8":
        scale = (np.abs(groups).max(axis=2) / levels).astype(np.float16)  # [N, K/G]
        offset = np.zeros_like(scale)
    else:
        low = groups.min(axis=2)
        scale = ((groups.max(axis=2) - low) / levels).astype(np.float16)
        offset = low.astype(np.float16)
    if not (np.isfinite(scale).all() and np.isfinite(offset).all()):
        raise ValueError(f"{method}: weights beyond fp16's range")
    step = scale.astype(np.float32)[..., None]  # [N, K/G, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step > 0, np.rint((groups - offset.astype(np.float32)[..., None]) / step), 0)
    q = np.clip(q, -levels if method == "wint8" else 0, levels).reshape(rows, depth)
    if method == "wint8":
        values, scales = q.astype(np.int8), scale
    else:
        nibbles = q.astype(np.uint8)
        values, scales = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4), np.stack([scale, offset], axis=2)
    return QuantizedWeight(xp.asarray(values), xp.asarray(scales), method, np.dtype(dtype))


def dequantize(xp: Any, w: QuantizedWeight) -> Any:
    """w's weights [N, K] in w.dtype: fp16(s q) or fp16(s q + m) in fp32 (s q is exact there); on a GPU
    the kernel of cuda/gemv_packed.cu."""
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
        q = w.values.astype(np.float32)  # [N, K]
        scale, offset = w.scales.astype(np.float32), None  # [N, K/G]
    else:
        q = xp.stack([w.values & 15, w.values >> 4], axis=2).reshape(rows, depth).astype(np.float32)
        scale, offset = w.scales[..., 0].astype(np.float32), w.scales[..., 1].astype(np.float32)
    weights = q.reshape(rows, depth // GROUP, GROUP) * scale[..., None]  # [N, K/G, G]
    if offset is not None:
        weights += offset[..., None]
    return weights.reshape(rows, depth).astype(np.float16).astype(w.dtype)
