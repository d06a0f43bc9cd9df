"""Paged append attention over a flat ragged batch: the CUDA kernel and its NumPy twin.

Rows of one request are contiguous; row t belongs to request batch_id_per_token[t] and sits at
position positions[t]. It attends to that request's cached positions 0..positions[t], whose K/V
sit in the blocks block_tables[b, :]. Prefill chunks, verify segments of k+1 tokens and single
decode tokens mix freely in one call.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cupyspec.kernels import load_kernel

WARPS_PER_BLOCK = 4


def paged_attention(
    xp: Any,
    q: Any,  # [T, Hq, D]
    k_cache: Any,  # [num_blocks, block_size, Hkv, D]
    v_cache: Any,  # [num_blocks, block_size, Hkv, D]
    block_tables: np.ndarray,  # [B, max_blocks] int32 (host)
    batch_id_per_token: np.ndarray,  # [T] int32 (host)
    positions: np.ndarray,  # [T] int32 (host)
    scale: float,
) -> Any:  # [T, Hq, D] in q's dtype
    """The reference twin: one request at a time, fp32 softmax."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = xp.empty_like(q)
    bounds = np.flatnonzero(np.diff(batch_id_per_token)) + 1
    for start, end in zip(np.r_[0, bounds], np.r_[bounds, num_tokens]):
        b, kv_len = int(batch_id_per_token[start]), int(positions[start:end].max()) + 1
        blocks = block_tables[b, : -(-kv_len // block_size)]
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:kv_len].astype(np.float32)  # [L, Hkv, D]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:kv_len].astype(np.float32)  # [L, Hkv, D]
        qb = q[start:end].astype(np.float32).reshape(end - start, num_kv_heads, group, head_dim)  # [n, Hkv, G, D]
        scores = xp.einsum("nkgd,lkd->kgnl", qb, k) * np.float32(scale)  # [Hkv, G, n, L]
        visible = xp.asarray(positions[start:end, None] >= np.arange(kv_len)[None, :])  # [n, L]
        scores = xp.where(visible, scores, np.float32(-np.inf))
        scores -= scores.max(axis=-1, keepdims=True)
        probs = xp.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        ob = xp.einsum("kgnl,lkd->nkgd", probs, v)  # [n, Hkv, G, D]
        out[start:end] = ob.reshape(end - start, num_heads, head_dim).astype(q.dtype)
    return out


def paged_attention_cuda(
    q: Any,  # [T, Hq, D] fp16
    k_cache: Any,  # [num_blocks, block_size, Hkv, D] fp16
    v_cache: Any,  # [num_blocks, block_size, Hkv, D] fp16
    block_tables: Any,  # [B, max_blocks] int32 (device)
    batch_id_per_token: Any,  # [T] int32 (device)
    positions: Any,  # [T] int32 (device)
    scale: float,
) -> Any:  # [T, Hq, D] fp16
    """The kernel `paged_attention_f16` of cuda/paged_attention.cu (same semantics as the twin)."""
    import cupy

    num_tokens, num_heads, head_dim = q.shape
    if head_dim % 32 or head_dim > 128:
        raise ValueError(f"the CUDA attention kernel needs head_dim a multiple of 32 up to 128, not {head_dim}")
    out = cupy.empty_like(q)
    kernel = load_kernel("paged_attention", "paged_attention_f16")
    grid = (num_tokens, -(-num_heads // WARPS_PER_BLOCK))
    kernel(grid, (32 * WARPS_PER_BLOCK,),
           (q, k_cache, v_cache, block_tables, batch_id_per_token, positions, out,
            np.int32(num_tokens), np.int32(num_heads), np.int32(k_cache.shape[2]), np.int32(head_dim),
            np.int32(k_cache.shape[1]), np.int32(block_tables.shape[1]), np.float32(scale)))
    return out
