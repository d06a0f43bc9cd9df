"""Read an HF llama/qwen2 checkpoint directory: config.json, *.safetensors, tokenizer files."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

from cupyspec.config import ModelConfig
from cupyspec.text.tokenizer import Tokenizer

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # buffers some checkpoints store


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file as float32 (F32, F16 and BF16 tensors)."""
    raw = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)
    if raw.size < 8:
        raise ValueError(f"{path}: too short for a safetensors file")
    (header_len,) = struct.unpack("<Q", raw[:8].tobytes())
    if 8 + header_len > raw.size:
        raise ValueError(f"{path}: safetensors header length {header_len} exceeds the file")
    header: dict[str, Any] = json.loads(raw[8 : 8 + header_len].tobytes())
    data = raw[8 + header_len :]
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}, unsupported (F32, F16, BF16)")
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end > data.size or end - start != int(np.prod(shape)) * np.dtype(dtype).itemsize:
            raise ValueError(f"{path}: tensor {name!r} has inconsistent data_offsets {start}..{end} for {shape}")
        values = data[start:end].view(dtype).reshape(shape)
        if info["dtype"] == "BF16":  # bfloat16 is the upper half of a float32
            values = (values.astype(np.uint32) << 16).view(np.float32)
        out[name] = np.ascontiguousarray(values, dtype=np.float32)
    return out


def _eos_ids(path: Path, config: dict[str, Any]) -> tuple[int, ...]:
    """eos ids of config.json, then those generation_config.json adds."""
    ids: list[int] = []
    sources = [config]
    generation = path / "generation_config.json"
    if generation.is_file():
        sources.append(json.loads(generation.read_text()))
    for source in sources:
        value = source.get("eos_token_id")
        ids.extend([value] if isinstance(value, int) else value or [])
    return tuple(dict.fromkeys(ids))


def _architecture(path: Path, config: dict[str, Any]) -> str:
    names = config.get("architectures") or []
    archs = {ARCHITECTURES[n] for n in names if n in ARCHITECTURES}
    if not archs and config.get("model_type") in ARCHITECTURES.values():
        archs = {config["model_type"]}
    if len(archs) != 1:
        raise ValueError(
            f"{path}: architectures {names} / model_type {config.get('model_type')!r} are unsupported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    return archs.pop()


def load_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer]:
    """Configuration, float32 weights (HF names and layout) and tokenizer of an HF checkpoint directory."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path}: config.json is missing (not an HF checkpoint directory)")
    cfg: dict[str, Any] = json.loads(config_file.read_text())
    arch = _architecture(path, cfg)
    if cfg.get("rope_scaling"):
        raise ValueError(f"{config_file}: rope_scaling {cfg['rope_scaling']} is unsupported")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weight files")
    bos = cfg.get("bos_token_id")
    tokenizer = Tokenizer.from_hf_dir(path, bos_token_id=bos, eos_token_ids=_eos_ids(path, cfg))
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        config = ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg["max_position_embeddings"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_ids=tokenizer.eos_token_ids,
        )
    except KeyError as e:
        raise ValueError(f"{config_file}: missing key {e.args[0]!r}") from None
    weights: dict[str, np.ndarray] = {}
    for file in files:
        weights.update(read_safetensors(file))
    for name in [n for n in weights if n.endswith(_IGNORED_SUFFIXES)]:
        del weights[name]
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return config, weights, tokenizer
