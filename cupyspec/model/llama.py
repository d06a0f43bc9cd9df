"""The llama-family decoder (llama, qwen2) over a flat ragged batch, on NumPy or CuPy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from cupyspec.backend import Backend
from cupyspec.batch import FlatBatch
from cupyspec.config import ModelConfig
from cupyspec.model.attention import paged_attention, paged_attention_cuda
from cupyspec.model.kv_arrays import KVCacheArrays
from cupyspec.model.fused import add_rms_norm, rope_and_cache, swiglu
from cupyspec.model.ops import rope_tables


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer, matrices stored [in, out] so that activations multiply on the left."""

    input_norm: Any  # [H] fp32
    qkv: Any  # [H, (Hq + 2 Hkv) D]
    qkv_bias: Any | None  # [(Hq + 2 Hkv) D] fp32 (qwen2)
    o: Any  # [Hq D, H]
    post_norm: Any  # [H] fp32
    gate_up: Any  # [H, 2 F]: gate columns first
    down: Any  # [F, H]


class LlamaModel:
    """Weights on the backend's device, and the forward pass."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], backend: Backend) -> None:
        xp, dt = backend.xp, backend.dtype
        self.config, self.backend = config, backend

        def matrix(*names: str) -> Any:  # HF [out, in] matrices, concatenated on out, as [in, out]
            return xp.asarray(np.concatenate([weights[n] for n in names], axis=0).T, dtype=dt)

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
        head = weights["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
        self.lm_head = self.embed.T if config.tie_word_embeddings else xp.asarray(head.T, dtype=dt)  # [H, V]
        self.final_norm = vector("model.norm.weight")  # [H]
        self.rope_cos, self.rope_sin = rope_tables(xp, config.head_dim, config.rope_theta,
                                                   config.max_position_embeddings)  # [P, D/2] each

    def forward(self, batch: FlatBatch, kv: KVCacheArrays) -> Any:
        """Run every layer over the batch, writing its K/V; returns final-normed hidden [T, H]."""
        xp, dt, c = self.backend.xp, self.backend.dtype, self.config
        num_tokens = batch.num_tokens
        input_ids = xp.asarray(batch.input_ids)
        positions = xp.asarray(batch.positions)
        slots = xp.asarray(batch.slot_mapping)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # [T, D/2] each
        q_width = c.num_heads * c.head_dim
        scale = 1.0 / float(np.sqrt(c.head_dim))
        residual = self.embed[input_ids].astype(np.float32)  # [T, H] fp32 residual stream
        attend = self._attention_for(batch, positions, scale)
        eps = c.rms_norm_eps
        pending = None  # [T, H]: the last block's output, added to the residual by the next norm
        for i, w in enumerate(self.layers):
            x = add_rms_norm(xp, residual, pending, w.input_norm, eps, dt)  # [T, H]
            qkv = x @ w.qkv  # [T, (Hq + 2 Hkv) D]
            if w.qkv_bias is not None:
                qkv = (qkv.astype(np.float32) + w.qkv_bias).astype(dt)
            q = rope_and_cache(xp, qkv, cos, sin, slots, kv.k[i], kv.v[i], c.num_heads, c.num_kv_heads)
            attn = attend(q, kv.k[i], kv.v[i])  # [T, Hq, D]
            x = add_rms_norm(xp, residual, attn.reshape(num_tokens, q_width) @ w.o, w.post_norm, eps, dt)
            pending = swiglu(xp, x @ w.gate_up) @ w.down  # [T, H]
        return add_rms_norm(xp, residual, pending, self.final_norm, eps, dt)

    def _attention_for(self, batch: FlatBatch, positions: Any, scale: float) -> Callable[[Any, Any, Any], Any]:
        """attention(q, k_cache, v_cache) for this batch: the CUDA kernel on a GPU, else the twin."""
        xp = self.backend.xp
        if self.backend.is_cuda:
            tables, batch_ids = xp.asarray(batch.block_tables), xp.asarray(batch.batch_id_per_token)
            return lambda q, k, v: paged_attention_cuda(q, k, v, tables, batch_ids, positions, scale)
        return lambda q, k, v: paged_attention(xp, q, k, v, batch.block_tables, batch.batch_id_per_token,
                                               batch.positions, scale)

    def compute_logits(self, hidden: Any) -> Any:
        """hidden [R, H] -> logits [R, V] fp32."""
        return (hidden @ self.lm_head).astype(np.float32)
