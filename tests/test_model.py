"""The model against an independent reference, across weight formats, cache paths and batch shapes."""

from __future__ import annotations

import numpy as np
import pytest
from reference_model import reference_logits
from tiny_models import tiny_model_paths

from cupyspec.backend import select_backend
from cupyspec.loader import load_model
from cupyspec.model.batch import DeviceBatch, Segment, build_flat_batch
from cupyspec.model.kv_arrays import KVCacheArrays
from cupyspec.model.llama import LlamaModel

BLOCK_SIZE = 4


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    hf_dir, gguf_path = tiny_model_paths(tmp_path_factory.mktemp(request.param), request.param)
    return load_model(str(hf_dir)), load_model(str(gguf_path))


class Harness:
    """Runs the model on hand-placed KV blocks: request r owns blocks r*16 .. r*16+15."""

    def __init__(self, loaded) -> None:
        backend = select_backend("cpu")
        self.model = LlamaModel(loaded.config, loaded.weights, backend)
        self.kv = KVCacheArrays(np, loaded.config, 64, BLOCK_SIZE, backend.dtype)

    def step(self, parts: list[tuple[int, list[int], int]]) -> list[np.ndarray]:
        """parts: (request slot, new tokens, start position) -> logits [n, V] per part."""
        segments = [Segment(tokens, start, list(range(slot * 16, slot * 16 + 16))) for slot, tokens, start in parts]
        batch = build_flat_batch(segments, BLOCK_SIZE)
        logits = self.model.compute_logits(self.model.forward(DeviceBatch.of(np, batch), self.kv))
        return [logits[batch.cu_seqlens_q[b]:batch.cu_seqlens_q[b + 1]] for b in range(len(parts))]


def _tokens(loaded, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, loaded.config.vocab_size, n).tolist()


def test_hf_and_gguf_give_identical_logits(tiny):
    hf, gg = tiny
    assert hf.config == gg.config
    tokens = _tokens(hf, 13, 0)
    a, = Harness(hf).step([(0, tokens, 0)])
    b, = Harness(gg).step([(0, tokens, 0)])
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_logits_match_independent_reference(tiny):
    hf, _ = tiny
    tokens = _tokens(hf, 21, 1)
    ours, = Harness(hf).step([(0, tokens, 0)])
    ref = reference_logits(hf.config, hf.weights, tokens)
    assert np.abs(ref).max() > 0.1  # logits are not degenerate
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)


def test_decoding_through_the_paged_cache_equals_rerunning_the_sequence(tiny):
    hf, _ = tiny
    tokens = _tokens(hf, 19, 2)
    full, = Harness(hf).step([(0, tokens, 0)])
    harness = Harness(hf)
    first, = harness.step([(0, tokens[:7], 0)])  # a prefill ending inside a block
    rows = [first[-1]]
    for pos in range(7, len(tokens) - 1):  # then one token at a time across block boundaries
        out, = harness.step([(0, [tokens[pos]], pos)])
        rows.append(out[0])
    np.testing.assert_allclose(np.stack(rows), full[6:-1], rtol=0, atol=1e-4)


def test_ragged_batch_gives_each_request_its_own_logits(tiny):
    hf, _ = tiny
    seqs = [_tokens(hf, n, 10 + n) for n in (11, 9, 6, 30)]
    alone = [Harness(hf).step([(0, s, 0)])[0] for s in seqs]
    harness = Harness(hf)
    # step 1: prefill chunks of different lengths; step 2: a mix of decode tokens, a verify-like
    # segment of 4 tokens, a second prefill chunk and a new request
    harness.step([(0, seqs[0][:10], 0), (1, seqs[1][:5], 0), (3, seqs[3][:12], 0)])
    mixed = harness.step([(0, seqs[0][10:], 10), (1, seqs[1][5:9], 5), (2, seqs[2], 0), (3, seqs[3][12:], 12)])
    expected = [alone[0][10:], alone[1][5:9], alone[2], alone[3][12:]]
    for got, want in zip(mixed, expected):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_a_split_attention_grid_is_as_deep_as_any_rows_partitions() -> None:
    """most_partitions, the depth of a split attention launch, is the most partitions of any row up to
    the block table's length, across the lengths where partition_size changes."""
    from cupyspec.model.attention import PARTITION, most_partitions, partition_size

    for warps in (4, 8):
        for max_length in (1, PARTITION, PARTITION + 1, 3 * PARTITION, 4 * PARTITION, 4 * PARTITION + 1, 8192):
            most = max(-(-n // partition_size(warps, n)) for n in range(1, max_length + 1))
            assert most_partitions(warps, max_length) == most, (warps, max_length)
