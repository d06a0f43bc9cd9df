"""Weight-only quantization (`wint8`, `wint4`): a decoder's matrices kept packed on the device,
dequantized inside the gemv products (decode and verify steps) and to fp16 before larger ones;
activations, the embedding and the LM head stay as they are.

A packed matrix w [N, K] holds groups of GROUP weights along each row, each group integers q with an
fp16 scale and minimum (s, m): w = s q + m, evaluated in fp32 (where s q is exact) and rounded to
fp16. wint4 spans each group's minimum to maximum in 16 levels (q in [0, 15]): GGUF's Q4_1 blocks.
wint8 scales each group symmetrically (m = 0, q in [-127, 127]: GGUF's Q8_0 blocks), but keeps a group
that 16 levels hold exactly as wint4 would: a 4-bit file's blocks stay as they are. Quantizing
recovers such blocks: a Q8_0 group (an entry of |q| = 127, as llama.cpp quantizes) comes back exactly
as wint8, a Q4_1 group (entries of q = 0 and 15) as wint4 and wint8, so the packed weights give the
fp16 weights those files load as. cuda/packed_weights.cuh reads them; `dequantize` is its twin.
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
    """Pack host weights w [N, K] (K % GROUP == 0) by groups of GROUP, q rounded to nearest: wint4
    spans each group's minimum to maximum in 15 steps; wint8 scales it by its largest magnitude over
    127, unless the 15 steps give its fp16 weights exactly."""
    rows, depth = w.shape
    if depth % GROUP:
        raise ValueError(f"{method} packs rows of a multiple of {GROUP} weights, not {depth}")
    groups = np.asarray(w, dtype=np.float32).reshape(rows, depth // GROUP, GROUP)  # [N, K/G, G]
    scale, offset, q = _levels(groups, 15, symmetric=False)  # [N, K/G] fp16 twice, [N, K/G, G]
    if method == "wint8":
        exact = (_weights(scale, offset, q) == groups.astype(np.float16)).all(axis=2)  # [N, K/G]
        wide_scale, wide_offset, wide_q = _levels(groups, 127, symmetric=True)
        scale, offset = np.where(exact, scale, wide_scale), np.where(exact, offset, wide_offset)
        q = np.where(exact[..., None], q, wide_q)
    q = q.reshape(rows, depth)
    if method == "wint8":
        values = q.astype(np.int8)
    else:
        nibbles = q.astype(np.uint8)
        values = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    return QuantizedWeight(xp.asarray(values), xp.asarray(np.stack([scale, offset], axis=2)), method, np.dtype(dtype))


def _levels(groups: np.ndarray, levels: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each group's fp16 scale and minimum, and its q: symmetric, q in [-levels, levels] and m = 0;
    else from the minimum to the maximum, q in [0, levels]."""
    if symmetric:
        scale = (np.abs(groups).max(axis=2) / levels).astype(np.float16)  # [N, K/G]
        offset = np.zeros_like(scale)
    else:
        low = groups.min(axis=2)
        scale = ((groups.max(axis=2) - low) / levels).astype(np.float16)
        offset = low.astype(np.float16)
    if not (np.isfinite(scale).all() and np.isfinite(offset).all()):
        raise ValueError("quantization: weights beyond fp16's range")
    step = scale.astype(np.float32)[..., None]  # [N, K/G, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step > 0, np.rint((groups - offset.astype(np.float32)[..., None]) / step), 0)
    return scale, offset, np.clip(q, -levels if symmetric else 0, levels)


def _weights(scale: Any, offset: Any, q: Any) -> Any:
    """fp16(s q + m) of groups [N, K/G, G], computed in fp32 (s q is exact there)."""
    return (q.astype(np.float32) * scale.astype(np.float32)[..., None]
            + offset.astype(np.float32)[..., None]).astype(np.float16)


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
    weights = _weights(w.scales[..., 0], w.scales[..., 1], q.reshape(rows, depth // GROUP, GROUP))  # [N, K/G, G]
    return weights.reshape(rows, depth).astype(w.dtype)
