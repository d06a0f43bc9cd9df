"""Paged append attention over a flat ragged batch: the CUDA kernel and its NumPy twin.

Rows of one request are contiguous; row t belongs to request batch_id_per_token[t] and sits at
position positions[t]. It attends to that request's cached positions 0..positions[t], whose K/V
sit in the blocks block_tables[b, :]. Prefill chunks, verify segments of k+1 tokens and single
decode tokens mix freely in one call.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from cupyspec.kernels import load_kernel

FEW_ROWS = 16  # launches of up to this many rows take CTAs of 8 warps, others of 4; a CUDA-graph bucket
GROUPED_ABOVE = 512  # launches of more rows (prefill chunks for the most part) group rows in CTAs
PARTITION = 256  # positions per partition, but see partition_size: PARTITION in cuda/paged_attention.cu
HEADS_PER_CTA = (1, 2, 3, 4, 6, 8)  # the kernel's instantiations: query heads of a GQA group per CTA
SPLIT_BELOW_CTAS = 512  # split positions across CTAs when the rows alone give fewer CTAs (~4 per SM)
MAX_SPLIT_WORKSPACE = 64 << 20  # ... and the partition states fit in these many bytes


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
    """The kernel of cuda/paged_attention.cu (same semantics as the twin).

    One CTA per (row, KV head, chunk of its query heads) folds the row's partitions (partition_size).
    When the rows alone would underfill the GPU, the grid also spans the most partitions a row of
    block_tables can have (flash-decoding), and the last CTA of a row to finish folds them; both
    paths give a row the same bits, so the grid depends on T and the shapes only, never on the data.
    Up to FEW_ROWS rows a CTA has 8 warps (a warp's tiles come in turn: fewer of them each pays where
    the CTAs are few), else 4 (fewer warps' states to fold where the CTAs fill the GPU). A row's bits
    depend on that choice, which a CUDA graph's padding to its bucket does not change. In launches of
    more than GROUPED_ABOVE rows, a CTA takes several consecutive rows of one request (a prefill
    chunk's) where it can: they read each K/V row once, and each comes out with the bits it would have
    in a CTA of its own. Launches of fewer rows, where decode and verify rows are the most, keep the
    kernel of one row a CTA, whose smaller shared memory suits them.
    """
    import cupy

    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if head_dim % 8 or head_dim > 128:
        raise ValueError(f"the CUDA attention kernel needs head_dim a multiple of 8 up to 128, not {head_dim}")
    if block_size & (block_size - 1):
        raise ValueError(f"the CUDA attention kernel needs block_size a power of two, not {block_size}")
    group = num_heads // num_kv_heads
    chunks = -(-group // HEADS_PER_CTA[-1])  # CTAs per KV head
    heads = next(h for h in HEADS_PER_CTA if h * chunks >= group)
    padded_dim = 32 if head_dim <= 32 else 64 if head_dim <= 64 else 128
    warps = 8 if num_tokens <= FEW_ROWS else 4
    partitions = most_partitions(warps, block_tables.shape[1] * block_size)
    split = (partitions > 1 and num_tokens * num_kv_heads * chunks < SPLIT_BELOW_CTAS
             and num_tokens * num_heads * partitions * (head_dim + 2) * 4 <= MAX_SPLIT_WORKSPACE)
    parts = partitions if split else 0
    partial_acc = cupy.empty((num_tokens, num_heads, parts, head_dim), dtype=cupy.float32)  # [T, Hq, P, D]
    partial_stats = cupy.empty((num_tokens, num_heads, parts, 2), dtype=cupy.float32)  # [T, Hq, P, (max, sum)]
    out = cupy.empty_like(q)  # [T, Hq, D]
    kind = f"w{warps}" if num_tokens <= GROUPED_ABOVE else "g4"
    kernel = load_kernel("paged_attention", f"paged_attention_d{padded_dim}_h{heads}_{kind}")
    arrivals = _arrivals(q.device.id, cupy.cuda.get_current_stream().ptr)
    kernel((num_tokens, num_kv_heads * chunks, max(parts, 1)), (32 * warps,),
           (q, k_cache, v_cache, block_tables, batch_id_per_token, positions, out, partial_acc, partial_stats,
            arrivals, np.int32(num_tokens), np.int32(num_heads), np.int32(num_kv_heads), np.int32(head_dim),
            np.int32(block_size.bit_length() - 1), np.int32(block_tables.shape[1]), np.float32(scale)))
    return out


def partition_size(warps: int, length: int) -> int:
    """Positions per partition of a row of `length` positions in a CTA of `warps` warps: PARTITION,
    but half of it for a row of more than one and at most four PARTITIONs in 8 warps (the kernel's
    partition_size has the reasons)."""
    return PARTITION // 2 if warps == 8 and PARTITION < length <= 4 * PARTITION else PARTITION


def most_partitions(warps: int, max_length: int) -> int:
    """The most partitions a row of up to `max_length` positions has: the depth of a split grid. Within
    each range of partition_size the count grows with the length, so the most is at either end."""
    lengths = (max_length, min(max_length, 4 * PARTITION))
    return max(-(-n // partition_size(warps, n)) for n in lengths)


@functools.cache
def _arrivals(device: int, stream: int) -> Any:
    """int32 zeros [SPLIT_BELOW_CTAS], one per (row, CTA column) of a split launch on this stream: how
    many of the row's partitions have finished; the last CTA resets its counter, so they stay zero
    between launches (and a CUDA graph can replay the launches that captured them)."""
    import cupy

    if cupy.cuda.get_current_stream().is_capturing():  # the zeros would come with the graph's first replay
        raise RuntimeError("run paged_attention_cuda on a stream before capturing it in a CUDA graph")
    return cupy.zeros(SPLIT_BELOW_CTAS, dtype=np.int32)
