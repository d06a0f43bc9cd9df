"""Fused decoder steps: one CUDA kernel each on a GPU, the NumPy lines they stand for elsewhere.

Each function takes the array module first and runs its kernel from `cuda/` for CuPy with fp16
activations, or the plain array code (the kernel's twin) otherwise. Fewer, larger launches are
what make a small model fast on a GPU: a layer is four matrix products and four kernels.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cupyspec.kernels import load_kernel
from cupyspec.model.ops import apply_rope, rms_norm, silu_mul

THREADS = 256


def _fused(xp: Any, dtype: Any) -> bool:
    return xp is not np and np.dtype(dtype) == np.float16


def add_rms_norm(xp: Any, residual: Any, delta: Any | None, weight: Any, eps: float, out_dtype: Any) -> Any:
    """residual [T, H] fp32 += delta [T, H] (None: nothing), in place; returns RMSNorm(residual) [T, H]."""
    if not _fused(xp, out_dtype):
        if delta is not None:
            residual += delta.astype(np.float32)
        return rms_norm(xp, residual, weight, eps, out_dtype)
    num_tokens, hidden = residual.shape
    out = xp.empty((num_tokens, hidden), dtype=np.float16)
    if num_tokens:
        delta = out if delta is None else xp.ascontiguousarray(delta, dtype=np.float16)
        load_kernel("rms_norm", "add_rms_norm")(
            (num_tokens,), (THREADS,),
            (residual, delta, weight, out, np.int32(delta is not out), np.int32(hidden), np.float32(eps)))
    return out


def rope_and_cache(xp: Any, qkv: Any, cos: Any, sin: Any, slots: Any, k_cache: Any, v_cache: Any,
                   num_heads: int, num_kv_heads: int) -> Any:
    """RoPE on q and k of qkv [T, (Hq + 2 Hkv) D]; k and v written to their cache slots [T] of
    k_cache / v_cache [num_blocks, block_size, Hkv, D]. cos, sin [T, D/2] fp32; slots int. Returns q [T, Hq, D]."""
    num_tokens = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    if not _fused(xp, qkv.dtype):
        q = apply_rope(xp, qkv[:, :q_width].reshape(num_tokens, num_heads, head_dim), cos, sin)
        k = apply_rope(xp, qkv[:, q_width:q_width + kv_width].reshape(num_tokens, num_kv_heads, head_dim), cos, sin)
        k_cache.reshape(-1, num_kv_heads, head_dim)[slots] = k
        v_cache.reshape(-1, num_kv_heads, head_dim)[slots] = qkv[:, q_width + kv_width:].reshape(
            num_tokens, num_kv_heads, head_dim)
        return q
    q = xp.empty((num_tokens, num_heads, head_dim), dtype=np.float16)
    work = num_tokens * (num_heads + 2 * num_kv_heads) * (head_dim // 2)
    if work:
        load_kernel("rope_cache", "rope_cache")(
            (-(-work // THREADS),), (THREADS,),
            (xp.ascontiguousarray(qkv), xp.ascontiguousarray(cos), xp.ascontiguousarray(sin),
             xp.asarray(slots, dtype=np.int32), q, k_cache, v_cache, np.int32(num_tokens), np.int32(num_heads),
             np.int32(num_kv_heads), np.int32(head_dim)))
    return q


def swiglu(xp: Any, gate_up: Any) -> Any:
    """silu(gate) * up of gate_up [T, 2F] (gate first) -> [T, F]."""
    if not _fused(xp, gate_up.dtype):
        return silu_mul(xp, gate_up)
    num_tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = xp.empty((num_tokens, width), dtype=np.float16)
    if out.size:
        load_kernel("swiglu", "swiglu")((-(-out.size // THREADS),), (THREADS,),
                                        (xp.ascontiguousarray(gate_up), out, np.int64(num_tokens), np.int32(width)))
    return out
