"""Read a llama or qwen2 GGUF file: configuration, float32 weights in HF layout, tokenizer."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from cupyspec.config import ModelConfig
from cupyspec.text.tokenizer import Tokenizer

Q = GGMLQuantizationType
SUPPORTED_TENSOR_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.F16, Q.BF16, Q.F32})
ARCHITECTURES = ("llama", "qwen2")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"attn_{p}.{kind}": f"self_attn.{p}_proj.{kind}" for p in "qkv" for kind in ("weight", "bias")},
    "attn_output.weight": "self_attn.o_proj.weight",
    **{f"ffn_{p}.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
}


class _Reader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map: the same data, parsed faster, since
    slicing a plain ndarray skips numpy.memmap's per-view bookkeeping."""

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = value.view(np.ndarray)


def read_tensor(tensor: ReaderTensor) -> np.ndarray:
    """Dequantize one GGUF tensor to a C-contiguous float32 array in numpy order ([out, in])."""
    if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
        names = ", ".join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))
        raise ValueError(
            f"tensor {tensor.name!r} has type {tensor.tensor_type.name}, which is unsupported (supported: {names})"
        )
    values = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists dims innermost first
    if values.shape != shape:
        raise ValueError(f"tensor {tensor.name!r} dequantized to shape {values.shape}, expected {shape}")
    return np.ascontiguousarray(values, dtype=np.float32)


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF rotate-half halves).

    w: [n_head * head_dim, ...] (weight) or [n_head * head_dim] (bias).
    """
    half = w.shape[0] // n_head // 2
    return np.ascontiguousarray(w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def hf_name(gguf_name: str) -> str:
    """The HF name of a llama.cpp tensor name (ValueError for a tensor the model does not use)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and suffix in _LAYER_NAMES:
        return f"model.layers.{int(layer)}.{_LAYER_NAMES[suffix]}"
    raise ValueError(f"tensor {gguf_name!r} is not part of a supported llama/qwen2 model")


def _shortest(value: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _config(meta: dict[str, Any], tensor_names: set[str], tokenizer: Tokenizer) -> ModelConfig:
    arch = meta["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    if get("rope.scaling.type", "none") != "none":
        raise ValueError(f"RoPE scaling {meta[f'{arch}.rope.scaling.type']!r} is unsupported")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(get("vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rope_theta=_shortest(get("rope.freq_base", 10000.0)),
        rms_norm_eps=_shortest(get("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
    )


def load_gguf(path: Path) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer]:
    """Configuration, float32 weights (HF names, [out, in], rotate-half Q/K) and tokenizer of a GGUF file."""
    reader = _Reader(path)
    try:
        return _load(reader)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def _load(reader: GGUFReader) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer]:
    meta = {key: field.contents() for key, field in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is unsupported (supported: {', '.join(ARCHITECTURES)})")
    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError("GGUF metadata lacks the tokenizer (tokenizer.ggml.tokens)")
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    config = _config(meta, {t.name for t in reader.tensors}, tokenizer)
    names = [hf_name(t.name) for t in reader.tensors]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # numpy releases the GIL
        arrays = list(pool.map(read_tensor, reader.tensors))
    weights = dict(zip(names, arrays))
    if arch == "llama":  # llama.cpp permutes llama's Q/K rows for interleaved RoPE; qwen2's it leaves alone
        for name in names:
            if ".self_attn.q_proj." in name:
                weights[name] = unpermute_rope(weights[name], config.num_heads)
            elif ".self_attn.k_proj." in name:
                weights[name] = unpermute_rope(weights[name], config.num_kv_heads)
    return config, weights, tokenizer
