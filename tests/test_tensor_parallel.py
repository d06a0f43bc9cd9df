"""Tensor parallelism's arithmetic on the CPU: a tiny model's weights split N ways, each rank a thread
that computes its partial results and sums them with the others' as the all-reduce does, give the
unsharded model's logits and K/V."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import TinySpec, random_head_weights, tiny_model_paths

from cupyspec.backend import select_backend
from cupyspec.loader import load_model
from cupyspec.model.batch import DeviceBatch, Segment, build_flat_batch
from cupyspec.model.kv_arrays import KVCacheArrays
from cupyspec.model.llama import LlamaModel
from cupyspec.model.mtp import DRAFT_VOCAB, MTPHead
from cupyspec.parallel.groups import ThreadGroup
from cupyspec.parallel.ranks import RankThreads
from cupyspec.parallel.sharding import plan_shard, shard_config, shard_weights

BLOCK_SIZE = 4
NUM_BLOCKS = 24


@pytest.fixture(scope="module", params=[("llama", False), ("qwen2", False), ("llama", True)],
                ids=["llama", "qwen2", "tied"])
def tiny(request, tmp_path_factory):
    arch, tied = request.param
    return load_model(str(tiny_model_paths(tmp_path_factory.mktemp(arch), arch, tied=tied)[1]))


def _segments(vocab_size: int) -> list[Segment]:
    """A prompt chunk, a decode step and a verify-like run, each of its own sequence."""
    rng = np.random.default_rng(3)
    return [Segment(rng.integers(0, vocab_size, 13).tolist(), 0, list(range(0, 8))),
            Segment(rng.integers(0, vocab_size, 1).tolist(), 0, list(range(8, 12))),
            Segment(rng.integers(0, vocab_size, 4).tolist(), 0, list(range(12, 24)))]


def _run(config, weights, group=None, quantization=None):
    """The model over the segments: logits [T, V] and the K/V arrays it wrote."""
    backend = select_backend("cpu")
    model = LlamaModel(config, weights, backend, group, quantization)
    kv = KVCacheArrays(np, config, NUM_BLOCKS, BLOCK_SIZE, backend.dtype)
    batch = build_flat_batch(_segments(config.vocab_size), BLOCK_SIZE)
    return model.compute_logits(model.forward(DeviceBatch.of(np, batch), kv)), kv


def _in_ranks(size: int, work) -> list:
    """work(rank, group) on `size` ranks, threads meeting at every collective: each rank's result."""
    groups = ThreadGroup.create(size)
    return RankThreads(groups, select_backend("cpu")).map(lambda rank: work(rank, groups[rank]))


def _sharded(config, weights, rank: int, size: int):
    """Rank `rank`'s shard of a model: (shard, its config, its weights)."""
    shard = plan_shard(config, rank, size)
    return shard, shard_config(config, shard), shard_weights(weights, config, shard)


def _run_ranks(loaded, size: int, quantization=None) -> list:
    """Each rank's (logits, K/V, shard)."""
    def work(r, group):
        shard, config, weights = _sharded(loaded.config, loaded.weights, r, size)
        return *_run(config, weights, group, quantization), shard

    return _in_ranks(size, work)


@pytest.mark.parametrize("size", [2, 4])
def test_sharded_ranks_summed_give_the_unsharded_logits_and_kv(tiny, size):
    """Two ranks split the tiny model's 2 K/V heads; four replicate them (each rank's one query head
    attends with its group's K/V head)."""
    want_logits, want_kv = _run(tiny.config, tiny.weights)
    d = tiny.config.head_dim
    for logits, kv, shard in _run_ranks(tiny, size):
        np.testing.assert_allclose(logits, want_logits, rtol=0, atol=1e-4)
        heads = slice(shard.kv_heads.start, shard.kv_heads.stop)
        np.testing.assert_allclose(kv.k, want_kv.k[..., heads, :], rtol=0, atol=1e-5)
        np.testing.assert_allclose(kv.v, want_kv.v[..., heads, :], rtol=0, atol=1e-5)
        assert kv.k.shape[-2:] == (len(shard.kv_heads), d)
    assert np.abs(want_logits).max() > 0.1  # not degenerate


@pytest.mark.parametrize("method", ["wint8", "wint4"])
def test_quantized_shards_give_the_quantized_models_logits(tiny, method):
    """Shards split the row-parallel matrices between groups of 32 inputs, so each rank packs its
    slice of the whole model's packed weights; a split inside a group is refused."""
    want, _ = _run(tiny.config, tiny.weights, quantization=method)
    for logits, _, _ in _run_ranks(tiny, 2, method):
        np.testing.assert_allclose(logits, want, rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="multiple of 32"):
        _run_ranks(tiny, 4, method)  # o: 16 inputs a rank


def test_the_shards_cover_every_head_column_and_token_once(tiny):
    config = tiny.config
    shards = [plan_shard(config, r, 4) for r in range(4)]
    assert [h for s in shards for h in s.q_heads] == list(range(config.num_heads))
    assert [f for s in shards for f in s.ffn] == list(range(config.intermediate_size))
    assert [t for s in shards for t in s.vocab] == list(range(config.vocab_size))
    group = config.num_heads // config.num_kv_heads
    for s in shards:  # each query head attends with the K/V head of its group, held by its rank
        assert all(h // group in s.kv_heads for h in s.q_heads)


def test_shapes_that_do_not_split_are_refused(tiny):
    with pytest.raises(ValueError, match="attention heads"):
        plan_shard(tiny.config, 0, 3)
    with pytest.raises(ValueError, match="rank"):
        plan_shard(tiny.config, 2, 2)


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_a_sharded_mtp_head_gives_the_unsharded_heads_logits(tiny, draft_vocab):
    """The head's layer splits as the target's, its input rows embed through the ranks' vocabulary
    slices, and its logits (over a draft vocabulary that spans the slices unevenly) are gathered."""
    spec = TinySpec(arch=tiny.config.architecture)
    head_weights = random_head_weights(spec)
    if draft_vocab:
        head_weights[DRAFT_VOCAB] = np.array([1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 300], np.int64)
    backend = select_backend("cpu")
    tokens = np.random.default_rng(5).integers(0, tiny.config.vocab_size, 11).tolist()

    def head_logits(config, weights, head, group=None):
        model = LlamaModel(config, weights, backend, group)
        mtp = MTPHead(model, head)
        kv = KVCacheArrays(np, config, NUM_BLOCKS, BLOCK_SIZE, backend.dtype, extra_layers=1)
        blocks = list(range(NUM_BLOCKS))
        hidden = model.forward_residual(DeviceBatch.of(np, build_flat_batch([Segment(tokens, 0, blocks)], BLOCK_SIZE)),
                                        kv)  # [11, H]
        head_batch = build_flat_batch([Segment(tokens[1:], 0, blocks)], BLOCK_SIZE)
        return mtp.logits(mtp.step(hidden[:-1], DeviceBatch.of(np, head_batch), kv))  # [10, Vd]

    want = head_logits(tiny.config, tiny.weights, head_weights)

    def work(r, group):
        shard, config, weights = _sharded(tiny.config, tiny.weights, r, 2)
        return head_logits(config, weights, shard_weights(head_weights, tiny.config, shard), group)

    results = _in_ranks(2, work)
    assert want.shape[1] == (13 if draft_vocab else tiny.config.vocab_size)
    for got in results:
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
