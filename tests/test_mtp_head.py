"""The MTP head (cupyspec/model/mtp.py) against an independent float64 implementation, on the CPU."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from reference_model import reference_hidden, reference_mtp_step
from tiny_models import TinySpec, random_head_weights, tiny_model_paths, write_head_file

from cupyspec.backend import select_backend
from cupyspec.loader import load_model
from cupyspec.model.batch import DeviceBatch, Segment, build_flat_batch
from cupyspec.model.kv_arrays import KVCacheArrays
from cupyspec.model.llama import LlamaModel
from cupyspec.model.mtp import DRAFT_VOCAB, MTPHead, head_tensor_shapes, load_head_weights

BLOCK_SIZE = 4
BLOCKS = list(range(16))  # one sequence's blocks: 64 positions


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"mtp_{request.param}")
    _hf, gguf_path = tiny_model_paths(folder, request.param)
    loaded = load_model(str(gguf_path))
    head = random_head_weights(TinySpec(arch=request.param))
    return loaded, head, write_head_file(folder / "head.safetensors", head)


def run_target(model: LlamaModel, kv: KVCacheArrays, tokens: list[int]) -> np.ndarray:
    """The target over one sequence from position 0: its pre-norm hidden states [S, H]."""
    batch = build_flat_batch([Segment(tokens, 0, BLOCKS)], BLOCK_SIZE)
    return model.forward_residual(DeviceBatch.of(np, batch), kv)


def run_head(head: MTPHead, kv: KVCacheArrays, hidden: np.ndarray, next_tokens: list[int], start: int) -> np.ndarray:
    """One head step over consecutive positions start.. of one sequence: its residual [n, H]."""
    batch = build_flat_batch([Segment(next_tokens, start, BLOCKS)], BLOCK_SIZE)
    return head.step(hidden, DeviceBatch.of(np, batch), kv)


def test_the_head_file_is_checked_against_the_target(tiny, tmp_path):
    loaded, head, path = tiny
    weights = load_head_weights(path, loaded.config, hashlib.sha256(path.read_bytes()).hexdigest())
    assert {name: w.shape for name, w in weights.items()} == head_tensor_shapes(loaded.config)
    with pytest.raises(ValueError, match="sha256"):
        load_head_weights(path, loaded.config, "0" * 64)
    with pytest.raises(ValueError, match="format"):
        load_head_weights(write_head_file(tmp_path / "other.safetensors", head, "something-else"), loaded.config)
    short = {name: w for name, w in head.items() if name != "mtp.hnorm.weight"}
    with pytest.raises(ValueError, match="missing.*mtp.hnorm.weight"):
        load_head_weights(write_head_file(tmp_path / "short.safetensors", short), loaded.config)
    wide = head | {"mtp.eh_proj.weight": np.zeros((3, 3), np.float32)}
    with pytest.raises(ValueError, match="eh_proj"):
        load_head_weights(write_head_file(tmp_path / "wide.safetensors", wide), loaded.config)


def test_a_draft_vocabulary_restricts_the_heads_logits_to_its_tokens(tiny, tmp_path):
    loaded, head_weights, path = tiny
    vocab_size = loaded.config.vocab_size
    vocab = np.arange(1, vocab_size, 3, dtype=np.int32)  # [Vd]
    vocab_path = write_head_file(tmp_path / "vocab.safetensors", head_weights | {DRAFT_VOCAB: vocab})
    backend = select_backend("cpu")
    model = LlamaModel(loaded.config, loaded.weights, backend)
    full, restricted = MTPHead(model, load_head_weights(path, loaded.config)), \
        MTPHead(model, load_head_weights(vocab_path, loaded.config))
    residual = np.random.default_rng(2).standard_normal((5, loaded.config.hidden_size)).astype(np.float32)
    logits = restricted.logits(residual)  # [5, Vd]
    np.testing.assert_allclose(logits, full.logits(residual)[:, vocab], rtol=0, atol=1e-5)
    picks = logits.argmax(axis=1)
    np.testing.assert_array_equal(restricted.token_ids(picks), vocab[picks])
    np.testing.assert_array_equal(full.token_ids(picks), picks)
    for bad in (vocab[::-1], np.array([0, 0, 1], np.int32), np.array([1, vocab_size], np.int32),
                np.zeros(0, np.int32), np.array([0.5, 2.0], np.float32)):
        bad_path = write_head_file(tmp_path / "bad.safetensors", head_weights | {DRAFT_VOCAB: bad})
        with pytest.raises(ValueError, match=DRAFT_VOCAB):
            load_head_weights(bad_path, loaded.config)


def test_the_targets_prenorm_hidden_state_matches_the_reference(tiny):
    loaded, _head, _path = tiny
    backend = select_backend("cpu")
    model = LlamaModel(loaded.config, loaded.weights, backend)
    kv = KVCacheArrays(np, loaded.config, len(BLOCKS), BLOCK_SIZE, backend.dtype, extra_layers=1)
    tokens = np.random.default_rng(0).integers(0, loaded.config.vocab_size, 19).tolist()
    np.testing.assert_allclose(run_target(model, kv, tokens), reference_hidden(loaded.config, loaded.weights, tokens),
                               rtol=0, atol=1e-4)


def test_a_head_step_over_a_sequence_matches_the_reference(tiny):
    """Over the prompt's positions with the target's hidden states, then one more step on its own
    residual and argmax draft, as drafting runs it."""
    loaded, _head, path = tiny
    backend = select_backend("cpu")
    model = LlamaModel(loaded.config, loaded.weights, backend)
    kv = KVCacheArrays(np, loaded.config, len(BLOCKS), BLOCK_SIZE, backend.dtype, extra_layers=1)
    head_weights = load_head_weights(path, loaded.config)
    head = MTPHead(model, head_weights)
    tokens = np.random.default_rng(1).integers(0, loaded.config.vocab_size, 17).tolist()
    hidden = run_target(model, kv, tokens)  # [17, H]
    ours = run_head(head, kv, hidden[:-1], tokens[1:], 0)  # positions 0..15
    ref_r, ref_logits = reference_mtp_step(loaded.config, loaded.weights, head_weights, hidden[:-1], tokens[1:],
                                           np.arange(16))
    np.testing.assert_allclose(ours, ref_r, rtol=0, atol=1e-4)
    np.testing.assert_allclose(head.logits(ours), ref_logits, rtol=0, atol=1e-4)
    assert np.abs(ref_logits).max() > 0.1  # not degenerate

    draft = int(head.logits(ours[-1:]).argmax())  # the token at position 17, read at position 16
    second = run_head(head, kv, ours[-1:], [draft], 16)
    ref_second, _ = reference_mtp_step(loaded.config, loaded.weights, head_weights,
                                       np.concatenate([hidden[:-1], ours[-1:]]), tokens[1:] + [draft], np.arange(17))
    np.testing.assert_allclose(second, ref_second[-1:], rtol=0, atol=1e-4)


def test_the_head_writes_only_its_own_layer_of_the_pool(tiny):
    loaded, _head, path = tiny
    backend = select_backend("cpu")
    model = LlamaModel(loaded.config, loaded.weights, backend)
    kv = KVCacheArrays(np, loaded.config, len(BLOCKS), BLOCK_SIZE, backend.dtype, extra_layers=1)
    head = MTPHead(model, load_head_weights(path, loaded.config))
    tokens = list(range(3, 12))
    hidden = run_target(model, kv, tokens)
    target_k, target_v = kv.k[:-1].copy(), kv.v[:-1].copy()
    assert not kv.k[-1].any()
    run_head(head, kv, hidden[:-1], tokens[1:], 0)
    np.testing.assert_array_equal(kv.k[:-1], target_k)
    np.testing.assert_array_equal(kv.v[:-1], target_v)
    assert kv.k[-1, :2].any() and not kv.k[-1, 2:].any()  # positions 0..7: blocks 0 and 1


def test_the_shipped_head_fits_the_default_model_and_its_checksum():
    from cupyspec.config import ModelConfig
    from cupyspec.loader.default_model import DEFAULT_MODEL, shipped_mtp_head

    path, sha256 = shipped_mtp_head(DEFAULT_MODEL)
    config = ModelConfig("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                         num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False,
                         bos_token_id=1, eos_token_ids=(2,))
    weights = load_head_weights(path, config, sha256)
    assert set(weights) == set(head_tensor_shapes(config)) | {DRAFT_VOCAB}
    assert len(weights[DRAFT_VOCAB]) == 16384 and set(config.eos_token_ids) <= set(weights[DRAFT_VOCAB])
    with pytest.raises(ValueError, match="sha256"):
        load_head_weights(path, config, "0" * 64)
