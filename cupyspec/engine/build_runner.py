"""The engine's device side: each rank's model, MTP head, KV pool and ModelRunner.

Without tensor parallelism one rank holds the whole model. With it (`tensor_parallel_size` N),
rank r holds its shard (cupyspec/parallel/sharding.py) on GPU r, or on a thread of the CPU; the
ranks are built at once on their threads (their CUDA graphs capture collectives, which need every
rank), and their KV pools take the number of blocks the fullest GPU holds, since every rank keeps
the K/V of its heads for every block the scheduler hands out.
"""

from __future__ import annotations

from cupyspec.backend import Backend
from cupyspec.config import EngineConfig
from cupyspec.engine.runner import ModelRunner
from cupyspec.loader import LoadedModel
from cupyspec.model.kv_arrays import KVCacheArrays, kv_cache_blocks
from cupyspec.model.llama import LlamaModel
from cupyspec.parallel.ranks import RankThreads, make_groups
from cupyspec.parallel.runner import ParallelRunner
from cupyspec.parallel.sharding import plan_shard, shard_config, shard_weights
from cupyspec.spec_decode.proposers.mtp import MTPDrafting, MTPProposer, make_mtp_drafting, mtp_head_weights


def build_runner(config: EngineConfig, loaded: LoadedModel, backend: Backend, mtp: MTPProposer | None,
                 max_model_len: int, graph_tokens: int) -> tuple[ModelRunner | ParallelRunner, int]:
    """The runner of every rank (a ParallelRunner over several), and the KV pool's blocks. mtp: the
    MTP head's proposer, or None; graph_tokens: the rows of the largest CUDA graph (0: none)."""
    size = config.tensor_parallel_size
    shards = [plan_shard(loaded.config, rank, size) for rank in range(size)]  # ValueError before any GPU work
    head = mtp_head_weights(config.speculative, loaded.config, config.model) if mtp is not None else None
    extra_layers = int(mtp is not None)  # an MTP head's K/V is one more layer of the pool
    block_size = config.cache.block_size
    threads = RankThreads(make_groups(size, backend), backend)

    def place(rank: int) -> tuple[LlamaModel, MTPDrafting | None, int]:
        """The rank's model and head on its device, and the KV blocks its memory left holds."""
        group, model_config, weights = threads.groups[rank], loaded.config, loaded.weights
        head_weights = head
        if group is not None:
            model_config = shard_config(loaded.config, shards[rank])
            weights = shard_weights(loaded.weights, loaded.config, shards[rank])
            head_weights = None if head is None else shard_weights(head, loaded.config, shards[rank])
        model = LlamaModel(model_config, weights, backend, group, config.quantization)
        drafting = make_mtp_drafting(config.speculative, model, mtp, max_model_len, head_weights)
        per_block = KVCacheArrays.bytes_per_block(model_config, block_size, backend.dtype, extra_layers)
        return model, drafting, kv_cache_blocks(config.cache, backend, per_block)

    def make_runner(rank: int) -> ModelRunner:
        model, drafting, _ = placed[rank]
        kv = KVCacheArrays(backend.xp, model.config, num_blocks, block_size, backend.dtype, extra_layers)
        return ModelRunner(model, kv, backend, config.speculative, config.overlap_logprobs, graph_tokens,
                           max_model_len, config.scheduler.max_num_seqs, loaded.tokenizer, drafting)

    try:
        placed = threads.map(place)
        num_blocks = min(blocks for _, _, blocks in placed)
        runners = threads.map(make_runner)
    except BaseException:
        threads.close()
        raise
    if size == 1:
        threads.close()
        return runners[0], num_blocks
    return ParallelRunner(runners, threads), num_blocks

