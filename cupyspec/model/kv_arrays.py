"""The paged KV cache's storage: one K and one V array per layer, addressed by slot."""

from __future__ import annotations

from typing import Any

import numpy as np

from cupyspec.backend import Backend
from cupyspec.config import CacheConfig, ModelConfig

CPU_KV_CACHE_BYTES = 1 << 30  # the pool's default size without a GPU


class KVCacheArrays:
    """K/V blocks of every layer; the BlockManager decides which request owns which block.

    One block more than the pool's `num_blocks` is allocated: the scratch block, which no request
    owns, takes the K/V of the padding rows of a CUDA-graph step.
    """

    def __init__(self, xp: Any, config: ModelConfig, num_blocks: int, block_size: int, dtype: Any,
                 extra_layers: int = 0) -> None:
        """extra_layers: layers past the target's, for an MTP head's K/V (the head's is layer L)."""
        shape = (config.num_layers + extra_layers, num_blocks + 1, block_size, config.num_kv_heads, config.head_dim)
        self.k = xp.zeros(shape, dtype=dtype)  # [L + extra, num_blocks + 1, block_size, Hkv, D]
        self.v = xp.zeros(shape, dtype=dtype)  # [L + extra, num_blocks + 1, block_size, Hkv, D]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_block = num_blocks

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: Any, extra_layers: int = 0) -> int:
        return (2 * (config.num_layers + extra_layers) * block_size * config.num_kv_heads * config.head_dim
                * np.dtype(dtype).itemsize)


def kv_cache_blocks(cache: CacheConfig, backend: Backend, bytes_per_block: int) -> int:
    """Blocks in the pool: `cache.kv_cache_memory_bytes`, else a share of the GPU memory left free
    (`gpu_memory_utilization`), else CPU_KV_CACHE_BYTES; at least 2."""
    budget = cache.kv_cache_memory_bytes
    if budget is None:
        if backend.is_cuda:
            free, _total = backend.xp.cuda.runtime.memGetInfo()
            budget = int(free * cache.gpu_memory_utilization)
        else:
            budget = CPU_KV_CACHE_BYTES
    num_blocks = budget // bytes_per_block
    if num_blocks < 2:
        raise ValueError(f"the KV cache budget of {budget} bytes holds fewer than 2 blocks "
                         f"of {bytes_per_block} bytes; raise the KV memory budget")
    return int(num_blocks)
