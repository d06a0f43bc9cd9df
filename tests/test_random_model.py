"""tools/random_model.py: a GGUF file of a given shape with random weights that the engine loads and runs."""

from __future__ import annotations

import numpy as np
from random_model import Shape, write_random_model
from tiny_models import tiny_model_paths

from cupyspec.backend import select_backend
from cupyspec.loader import load_model
from cupyspec.model.batch import DeviceBatch, Segment, build_flat_batch
from cupyspec.model.kv_arrays import KVCacheArrays
from cupyspec.model.llama import LlamaModel


def test_a_random_model_has_its_shape_and_the_source_tokenizer_and_runs(tmp_path):
    source = load_model(str(tiny_model_paths(tmp_path, "llama")[1]))
    shape = Shape("qwen2", 64, 2, 4, 2, 96, 1000000.0, 1e-6, 256, True)
    loaded = load_model(str(write_random_model(tmp_path / "random.gguf", shape, tmp_path / "llama.gguf")))
    c = loaded.config
    assert (c.architecture, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.intermediate_size) == \
        ("qwen2", 64, 2, 4, 2, 96)
    assert c.attention_bias and c.tie_word_embeddings and c.rms_norm_eps == 1e-6 and c.rope_theta == 1e6
    assert c.vocab_size == source.config.vocab_size
    text = "Paris is the capital of France."
    assert loaded.tokenizer.encode(text) == source.tokenizer.encode(text)
    q = loaded.weights["model.layers.1.self_attn.q_proj.weight"]  # [64, 64]: N(0, 1 / 64)
    assert q.shape == (64, 64) and 0.08 < q.std() < 0.17
    backend = select_backend("cpu")
    model = LlamaModel(c, loaded.weights, backend)
    kv = KVCacheArrays(np, c, 4, 16, backend.dtype)
    batch = build_flat_batch([Segment(loaded.tokenizer.encode(text), 0, [0, 1, 2, 3])], 16)
    logits = model.compute_logits(model.forward(DeviceBatch.of(np, batch), kv))
    assert logits.shape[1] == c.vocab_size and np.isfinite(logits).all()

