"""Model loading: a known name, a GGUF file or an HF checkpoint directory -> config, weights, tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cupyspec.config import ModelConfig
from cupyspec.loader.default_model import DEFAULT_MODEL, KNOWN_MODELS, resolve_model
from cupyspec.loader.gguf_file import load_gguf
from cupyspec.loader.hf_dir import load_hf_dir
from cupyspec.text.tokenizer import Tokenizer

__all__ = ["DEFAULT_MODEL", "LoadedModel", "Tokenizer", "expected_shapes", "load_model", "resolve_model"]


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for the engine: float32 weights with HF names in [out, in] layout."""

    config: ModelConfig
    weights: dict[str, np.ndarray]
    tokenizer: Tokenizer


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every weight a model with `config` has."""
    h, hd, ffn = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (ffn, h),
            p + "mlp.up_proj.weight": (ffn, h),
            p + "mlp.down_proj.weight": (h, ffn),
        }
        if config.attention_bias:
            shapes |= {f"{p}self_attn.{n}_proj.bias": (size,) for n, size in (("q", q), ("k", kv), ("v", kv))}
    return shapes


def _check_weights(source: str, config: ModelConfig, weights: dict[str, np.ndarray]) -> None:
    expected = expected_shapes(config)
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(f"{source}: missing weights {missing[:5]}, unexpected weights {unexpected[:5]}")
    for name, shape in expected.items():
        if weights[name].shape != shape:
            raise ValueError(f"{source}: weight {name} has shape {weights[name].shape}, expected {shape}")


def load_model(name_or_path: str) -> LoadedModel:
    """Load a known model name (see KNOWN_MODELS), a .gguf file or an HF checkpoint directory."""
    path = resolve_model(name_or_path)
    if not path.exists():
        known = ", ".join(KNOWN_MODELS)
        raise FileNotFoundError(f"model {name_or_path!r}: {path} does not exist (known names: {known})")
    if path.is_dir():
        config, weights, tokenizer = load_hf_dir(path)
    elif path.suffix.lower() == ".gguf":
        config, weights, tokenizer = load_gguf(path)
    else:
        raise ValueError(f"model {name_or_path!r}: {path} is neither a .gguf file nor an HF checkpoint directory")
    _check_weights(str(path), config, weights)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer)
