"""The paged KV cache's storage: one K and one V array per layer, addressed by slot."""

from __future__ import annotations

from typing import Any

import numpy as np

from cupyspec.config import ModelConfig


class KVCacheArrays:
    """K/V blocks of every layer; the BlockManager decides which request owns which block.

    One block more than the pool's `num_blocks` is allocated: the scratch block, which no request
    owns, takes the K/V of the padding rows of a CUDA-graph step.
    """

    def __init__(self, xp: Any, config: ModelConfig, num_blocks: int, block_size: int, dtype: Any) -> None:
        shape = (config.num_layers, num_blocks + 1, block_size, config.num_kv_heads, config.head_dim)
        self.k = xp.zeros(shape, dtype=dtype)  # [L, num_blocks + 1, block_size, Hkv, D]
        self.v = xp.zeros(shape, dtype=dtype)  # [L, num_blocks + 1, block_size, Hkv, D]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_block = num_blocks

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: Any) -> int:
        return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * np.dtype(dtype).itemsize
