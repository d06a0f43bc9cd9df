"""Fused decoder steps: as few CUDA kernels as possible on a GPU, the NumPy lines they stand for elsewhere.

Each function takes the array module first and runs kernels from `cuda/` for CuPy with fp16
activations, or the plain array code (the kernels' twin) otherwise. Fewer, larger launches are what
make a small model fast on a GPU. Up to GEMV_MAX_ROWS rows a decoder layer is five kernels: the
gemv of norm_qkv_rope, attention, the o product adding into the residual (linear.add_linear), the
gemv of norm_gate_up_swiglu, and the down product adding into the residual. With more rows the
norm, the product and the epilogue of a norm_* step are kernels of their own. Both do the same
arithmetic (cuda/decoder.cuh), so a fused step gives the bits of its separate kernels. Matrices are
fp16 or packed (QuantizedWeight, dequantized to fp16 where a step runs its separate kernels).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cupyspec.kernels import load_kernel
from cupyspec.model import ops
from cupyspec.model.linear import gemv_takes, launch_gemv, linear, weight_args

THREADS = 256
NORM_WARPS = 4  # rows per block: WARPS in cuda/rms_norm.cu


def _fused(xp: Any, dtype: Any) -> bool:
    return xp is not np and np.dtype(dtype) == np.float16


def rms_norm(xp: Any, residual: Any, weight: Any, eps: float, out_dtype: Any) -> Any:
    """RMSNorm of residual [T, H] fp32 with weight [H] fp32 -> [T, H] out_dtype."""
    num_tokens, hidden = residual.shape
    if not (_fused(xp, out_dtype) and hidden % 4 == 0):
        return ops.rms_norm(xp, residual, weight, eps, out_dtype)
    out = xp.empty((num_tokens, hidden), dtype=np.float16)
    if num_tokens:
        residual = xp.ascontiguousarray(residual, dtype=np.float32)
        load_kernel("rms_norm", "rms_norm")((-(-num_tokens // NORM_WARPS),), (NORM_WARPS * 32,),
                                            (residual, weight, out, np.int32(num_tokens), np.int32(hidden),
                                             np.float32(eps)))
    return out


def rope_and_cache(xp: Any, qkv: Any, cos: Any, sin: Any, positions: Any, slots: Any, k_cache: Any,
                   v_cache: Any) -> Any:
    """RoPE on q and k of qkv [T, (Hq + 2 Hkv) D] at positions [T]; k and v written to their cache slots
    [T] of k_cache / v_cache [num_blocks, block_size, Hkv, D]. cos, sin [P, D/2] fp32 tables by position;
    positions, slots int. Returns q [T, Hq, D]."""
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    num_heads = qkv.shape[1] // head_dim - 2 * num_kv_heads
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    if not _fused(xp, qkv.dtype):
        c, s = cos[positions], sin[positions]  # [T, D/2] each
        q = ops.apply_rope(xp, qkv[:, :q_width].reshape(num_tokens, num_heads, head_dim), c, s)
        k = ops.apply_rope(xp, qkv[:, q_width:q_width + kv_width].reshape(num_tokens, num_kv_heads, head_dim), c, s)
        k_cache.reshape(-1, num_kv_heads, head_dim)[slots] = k
        v_cache.reshape(-1, num_kv_heads, head_dim)[slots] = qkv[:, q_width + kv_width:].reshape(
            num_tokens, num_kv_heads, head_dim)
        return q
    q = xp.empty((num_tokens, num_heads, head_dim), dtype=np.float16)
    work = num_tokens * (num_heads + 2 * num_kv_heads) * (head_dim // 2)
    if work:
        load_kernel("rope_cache", "rope_cache")(
            (-(-work // THREADS),), (THREADS,),
            (xp.ascontiguousarray(qkv), cos, sin, xp.asarray(positions, dtype=np.int32),
             xp.asarray(slots, dtype=np.int32), q, k_cache, v_cache, np.int32(num_tokens), np.int32(num_heads),
             np.int32(num_kv_heads), np.int32(head_dim)))
    return q


def swiglu(xp: Any, gate_up: Any) -> Any:
    """silu(gate) * up of gate_up [T, 2F] (gate first) -> [T, F]."""
    if not _fused(xp, gate_up.dtype):
        return ops.silu_mul(xp, gate_up)
    num_tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = xp.empty((num_tokens, width), dtype=np.float16)
    if out.size:
        load_kernel("swiglu", "swiglu")((-(-out.size // THREADS),), (THREADS,),
                                        (xp.ascontiguousarray(gate_up), out, np.int64(num_tokens), np.int32(width)))
    return out


def norm_qkv_rope(xp: Any, residual: Any, norm_weight: Any, eps: float, w: Any, bias: Any | None, cos: Any,
                  sin: Any, positions: Any, slots: Any, k_cache: Any, v_cache: Any) -> Any:
    """rope_and_cache of qkv = RMSNorm(residual) @ w.T (+ bias, in fp32, rounded again): residual [T, H],
    norm_weight [H] and bias [(Hq + 2 Hkv) D] fp32, w [(Hq + 2 Hkv) D, H].
    Returns q [T, Hq, D]; one gemv kernel up to GEMV_MAX_ROWS rows when D % 16 == 0."""
    num_tokens = residual.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if not (gemv_takes(xp, num_tokens, w) and head_dim % 16 == 0):
        qkv = linear(xp, rms_norm(xp, residual, norm_weight, eps, w.dtype), w)  # [T, (Hq + 2 Hkv) D]
        if bias is not None:
            qkv = (qkv.astype(np.float32) + bias).astype(w.dtype)
        return rope_and_cache(xp, qkv, cos, sin, positions, slots, k_cache, v_cache)
    num_rows, hidden = w.shape
    q = xp.empty((num_tokens, num_rows // head_dim - 2 * num_kv_heads, head_dim), dtype=np.float16)
    if num_tokens:
        residual = xp.ascontiguousarray(residual, dtype=np.float32)
        launch_gemv("gemv_norm_rope", w, (
            residual, norm_weight, np.float32(eps), *weight_args(xp, w), norm_weight if bias is None else bias,
            np.int32(bias is not None), cos, sin, xp.asarray(positions, dtype=np.int32),
            xp.asarray(slots, dtype=np.int32), q, k_cache, v_cache, np.int32(num_tokens), np.int32(num_rows),
            np.int32(hidden), np.int32(num_kv_heads), np.int32(head_dim)))
    return q


def norm_gate_up_swiglu(xp: Any, residual: Any, norm_weight: Any, eps: float, w: Any) -> Any:
    """swiglu(RMSNorm(residual) @ w.T): residual [T, H] and norm_weight [H] fp32,
    w [2F, H] (gate rows first) -> [T, F]; one gemv kernel up to GEMV_MAX_ROWS rows when F % 8 == 0."""
    num_tokens = residual.shape[0]
    num_rows, hidden = w.shape
    if not (gemv_takes(xp, num_tokens, w) and num_rows % 16 == 0):
        return swiglu(xp, linear(xp, rms_norm(xp, residual, norm_weight, eps, w.dtype), w))
    out = xp.empty((num_tokens, num_rows // 2), dtype=np.float16)
    if num_tokens:
        residual = xp.ascontiguousarray(residual, dtype=np.float32)
        launch_gemv("gemv_norm_swiglu", w, (residual, norm_weight, np.float32(eps), *weight_args(xp, w), out,
                                            np.int32(num_tokens), np.int32(num_rows), np.int32(hidden)))
    return out
