"""The llama-family decoder (llama, qwen2) over a flat ragged batch, on NumPy or CuPy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cupyspec.backend import Backend
from cupyspec.config import ModelConfig
from cupyspec.model.attention import paged_attention, paged_attention_cuda
from cupyspec.model.batch import DeviceBatch
from cupyspec.model.embedding import embed_tokens
from cupyspec.model.fused import norm_gate_up_swiglu, norm_qkv_rope, rms_norm
from cupyspec.model.kv_arrays import KVCacheArrays
from cupyspec.model.linear import add_linear, linear
from cupyspec.model.ops import rope_tables


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer; matrices in the [out, in] layout of HF checkpoints (products are x @ w.T)."""

    input_norm: Any  # [H] fp32
    qkv: Any  # [(Hq + 2 Hkv) D, H]
    qkv_bias: Any | None  # [(Hq + 2 Hkv) D] fp32 (qwen2)
    o: Any  # [H, Hq D]
    post_norm: Any  # [H] fp32
    gate_up: Any  # [2 F, H]: gate rows first
    down: Any  # [H, F]


class LlamaModel:
    """Weights on the backend's device, and the forward pass."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], backend: Backend) -> None:
        xp, dt = backend.xp, backend.dtype
        self.config, self.backend = config, backend

        def matrix(*names: str) -> Any:  # HF [out, in] matrices, concatenated on out
            return xp.asarray(np.concatenate([weights[n] for n in names], axis=0), dtype=dt)

        def vector(name: str) -> Any:
            return xp.asarray(weights[name], dtype=np.float32)

        self.layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            attn = [f"{p}self_attn.{n}_proj" for n in ("q", "k", "v")]
            bias = None
            if config.attention_bias:
                bias = xp.asarray(np.concatenate([weights[f"{a}.bias"] for a in attn]), dtype=np.float32)
            self.layers.append(LayerWeights(
                input_norm=vector(f"{p}input_layernorm.weight"),
                qkv=matrix(*(f"{a}.weight" for a in attn)),
                qkv_bias=bias,
                o=matrix(f"{p}self_attn.o_proj.weight"),
                post_norm=vector(f"{p}post_attention_layernorm.weight"),
                gate_up=matrix(f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"),
                down=matrix(f"{p}mlp.down_proj.weight"),
            ))
        self.embed = xp.asarray(weights["model.embed_tokens.weight"], dtype=dt)  # [V, H]
        self.lm_head = self.embed if config.tie_word_embeddings else matrix("lm_head.weight")  # [V, H]
        self.final_norm = vector("model.norm.weight")  # [H]
        self.rope_cos, self.rope_sin = rope_tables(xp, config.head_dim, config.rope_theta,
                                                   config.max_position_embeddings)  # [P, D/2] each

    def forward(self, batch: DeviceBatch, kv: KVCacheArrays) -> Any:
        """Run every layer over the batch, writing its K/V; returns final-normed hidden [T, H].

        Only device work: no host transfer or synchronization, so that a CUDA graph can capture it.
        """
        xp, dt, c = self.backend.xp, self.backend.dtype, self.config
        num_tokens = batch.num_tokens
        q_width = c.num_heads * c.head_dim
        scale = 1.0 / float(np.sqrt(c.head_dim))
        eps = c.rms_norm_eps
        residual = embed_tokens(xp, self.embed, batch.input_ids, batch.previous_tokens)  # [T, H] fp32 residual
        for i, w in enumerate(self.layers):
            q = norm_qkv_rope(xp, residual, w.input_norm, eps, w.qkv, w.qkv_bias, self.rope_cos, self.rope_sin,
                              batch.positions, batch.slot_mapping, kv.k[i], kv.v[i])  # [T, Hq, D]
            attn = self._attention(q, kv.k[i], kv.v[i], batch, scale)  # [T, Hq, D]
            add_linear(xp, residual, attn.reshape(num_tokens, q_width), w.o)
            add_linear(xp, residual, norm_gate_up_swiglu(xp, residual, w.post_norm, eps, w.gate_up), w.down)
        return rms_norm(xp, residual, self.final_norm, eps, dt)

    def _attention(self, q: Any, k_cache: Any, v_cache: Any, batch: DeviceBatch, scale: float) -> Any:
        """Paged attention of q [T, Hq, D]: the CUDA kernel on a GPU, else its twin."""
        if self.backend.is_cuda:
            return paged_attention_cuda(q, k_cache, v_cache, batch.block_tables, batch.batch_id_per_token,
                                        batch.positions, scale)
        return paged_attention(self.backend.xp, q, k_cache, v_cache, batch.block_tables, batch.batch_id_per_token,
                               batch.positions, scale)

    def compute_logits(self, hidden: Any, out: Any | None = None) -> Any:
        """hidden [R, H] -> logits [R, V] fp32 (into `out` when given)."""
        return linear(self.backend.xp, hidden, self.lm_head, np.float32, out=out)
