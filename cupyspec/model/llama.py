"""The llama-family decoder (llama, qwen2) over a flat ragged batch, on NumPy or CuPy."""

from __future__ import annotations

from dataclasses import dataclass, fields
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
from cupyspec.model.quantized import quantize
from cupyspec.parallel.groups import Group
from cupyspec.parallel.sharding import vocab_slice


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer; matrices in the [out, in] layout of HF checkpoints (products are x @ w.T),
    in the backend's dtype or packed (QuantizedWeight)."""

    input_norm: Any  # [H] fp32
    qkv: Any  # [(Hq + 2 Hkv) D, H]
    qkv_bias: Any | None  # [(Hq + 2 Hkv) D] fp32 (qwen2)
    o: Any  # [H, Hq D]
    post_norm: Any  # [H] fp32
    gate_up: Any  # [2 F, H]: gate rows first
    down: Any  # [H, F]


def matrix(xp: Any, dtype: Any, weights: dict[str, np.ndarray], *names: str, quantization: str | None = None) -> Any:
    """HF [out, in] matrices, concatenated on out, on the device in `dtype`, or packed by `quantization`
    (wint8, wint4) to dequantize to it."""
    w = np.concatenate([weights[n] for n in names], axis=0)
    if quantization is not None:
        return quantize(xp, w, quantization, dtype)
    return xp.asarray(w, dtype=dtype)


def layer_weights(weights: dict[str, np.ndarray], prefix: str, config: ModelConfig, backend: Backend,
                  quantization: str | None = None) -> LayerWeights:
    """The decoder layer whose HF tensor names start with `prefix` (e.g. "model.layers.3."), its
    matrices packed by `quantization` (None: the backend's dtype)."""
    xp, dt = backend.xp, backend.dtype
    attn = [f"{prefix}self_attn.{n}_proj" for n in ("q", "k", "v")]
    bias = None
    if config.attention_bias:
        bias = xp.asarray(np.concatenate([weights[f"{a}.bias"] for a in attn]), dtype=np.float32)

    def product(*names: str) -> Any:
        return matrix(xp, dt, weights, *names, quantization=quantization)

    return LayerWeights(
        input_norm=xp.asarray(weights[f"{prefix}input_layernorm.weight"], dtype=np.float32),
        qkv=product(*(f"{a}.weight" for a in attn)),
        qkv_bias=bias,
        o=product(f"{prefix}self_attn.o_proj.weight"),
        post_norm=xp.asarray(weights[f"{prefix}post_attention_layernorm.weight"], dtype=np.float32),
        gate_up=product(f"{prefix}mlp.gate_proj.weight", f"{prefix}mlp.up_proj.weight"),
        down=product(f"{prefix}mlp.down_proj.weight"),
    )


class LlamaModel:
    """Weights on the backend's device, and the forward pass. With a tensor-parallel group the config
    and weights are one rank's (cupyspec/parallel/sharding.py), and the rank sums its row-parallel
    products and its embedding with the others', and gathers their logits. `quantization` (wint8,
    wint4) packs the decoder layers' matrices; the embedding and the LM head stay in the backend's
    dtype."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], backend: Backend,
                 group: Group | None = None, quantization: str | None = None) -> None:
        xp, dt = backend.xp, backend.dtype
        self.config, self.backend, self.group, self.quantization = config, backend, group, quantization
        # the token id of the embedding's and LM head's row 0 (a rank's vocabulary slice), and the
        # sizes of the ranks' slices
        self.vocab_first = None if group is None else vocab_slice(config.vocab_size, group.rank, group.size).start
        self.vocab_widths = None if group is None else \
            tuple(len(vocab_slice(config.vocab_size, r, group.size)) for r in range(group.size))
        self.layers = [layer_weights(weights, f"model.layers.{i}.", config, backend, quantization)
                       for i in range(config.num_layers)]
        self.embed = xp.asarray(weights["model.embed_tokens.weight"], dtype=dt)  # [V, H]
        self.lm_head = self.embed if config.tie_word_embeddings else matrix(xp, dt, weights, "lm_head.weight")  # [V, H]
        self.final_norm = xp.asarray(weights["model.norm.weight"], dtype=np.float32)  # [H]
        self.rope_cos, self.rope_sin = rope_tables(xp, config.head_dim, config.rope_theta,
                                                   config.max_position_embeddings)  # [P, D/2] each

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights on the device (a tied LM head counted once)."""
        arrays = [self.embed, self.final_norm,
                  *(getattr(layer, field.name) for layer in self.layers for field in fields(layer))]
        if self.lm_head is not self.embed:
            arrays.append(self.lm_head)
        return sum(a.nbytes for a in arrays if a is not None)

    def forward(self, batch: DeviceBatch, kv: KVCacheArrays) -> Any:
        """Run every layer over the batch, writing its K/V; returns final-normed hidden [T, H].

        Only device work: no host transfer or synchronization, so that a CUDA graph can capture it.
        """
        return self.final_normed(self.forward_residual(batch, kv))

    def forward_residual(self, batch: DeviceBatch, kv: KVCacheArrays) -> Any:
        """Run every layer over the batch, writing its K/V; returns the residual stream after the last
        layer, before the final norm [T, H] fp32 (the hidden state an MTP head reads)."""
        residual = self.embed_rows(batch.input_ids, batch.previous_tokens)  # [T, H] fp32
        for i, w in enumerate(self.layers):
            self.run_layer(residual, w, kv.k[i], kv.v[i], batch)
        return residual

    def embed_rows(self, ids: Any, previous: Any) -> Any:
        """The embedding's fp32 rows [T, H] for ids [T] (placeholders as embed_tokens takes them);
        with a group, each rank's vocabulary slice summed."""
        rows = embed_tokens(self.backend.xp, self.embed, ids, previous, self.vocab_first)  # [T, H]
        if self.group is not None:
            self.group.all_reduce(rows)
        return rows

    def gather_vocab(self, logits: Any, widths: tuple[int, ...] | None = None) -> Any:
        """Logits [R, V_r] over this rank's vocabulary slice -> [R, V] over the ranks' (as they are
        without a group); widths: the ranks' V_r, when they are not the ranks' vocabulary slices."""
        if self.group is None:
            return logits
        return self.group.all_gather(logits, widths or self.vocab_widths)

    def run_layer(self, residual: Any, w: LayerWeights, k_cache: Any, v_cache: Any, batch: DeviceBatch) -> None:
        """One decoder layer over the batch, in place on residual [T, H] fp32, writing the layer's K/V
        at the batch's slots; the target's RoPE tables, norm eps and attention serve any layer of its
        shape (an MTP head's too)."""
        xp, c = self.backend.xp, self.config
        q = self.write_kv(residual, w, k_cache, v_cache, batch)  # [T, Hq, D]
        attn = self._attention(q, k_cache, v_cache, batch, 1.0 / float(np.sqrt(c.head_dim)))  # [T, Hq, D]
        self._add_row_parallel(residual, attn.reshape(residual.shape[0], c.num_heads * c.head_dim), w.o)
        self._add_row_parallel(residual, norm_gate_up_swiglu(xp, residual, w.post_norm, c.rms_norm_eps, w.gate_up),
                               w.down)

    def _add_row_parallel(self, residual: Any, x: Any, w: Any) -> None:
        """residual [T, H] fp32 += x @ w.T; with a group, x and w hold this rank's share of the inputs,
        and the ranks' partial products are summed before they are added."""
        xp = self.backend.xp
        if self.group is None:
            add_linear(xp, residual, x, w)
            return
        partial = xp.zeros_like(residual)  # [T, H]
        add_linear(xp, partial, x, w)
        self.group.all_reduce(partial)
        residual += partial

    def write_kv(self, residual: Any, w: LayerWeights, k_cache: Any, v_cache: Any, batch: DeviceBatch) -> Any:
        """A layer's first step alone: the K/V of residual [T, H] fp32 written at the batch's slots;
        returns the queries [T, Hq, D]."""
        return norm_qkv_rope(self.backend.xp, residual, w.input_norm, self.config.rms_norm_eps, w.qkv, w.qkv_bias,
                             self.rope_cos, self.rope_sin, batch.positions, batch.slot_mapping, k_cache, v_cache)

    def final_normed(self, residual: Any) -> Any:
        """residual [T, H] fp32 -> the final norm's output [T, H] in the weights' dtype."""
        return rms_norm(self.backend.xp, residual, self.final_norm, self.config.rms_norm_eps, self.backend.dtype)

    def _attention(self, q: Any, k_cache: Any, v_cache: Any, batch: DeviceBatch, scale: float) -> Any:
        """Paged attention of q [T, Hq, D]: the CUDA kernel on a GPU, else its twin."""
        if self.backend.is_cuda:
            return paged_attention_cuda(q, k_cache, v_cache, batch.block_tables, batch.batch_id_per_token,
                                        batch.positions, scale)
        return paged_attention(self.backend.xp, q, k_cache, v_cache, batch.block_tables, batch.batch_id_per_token,
                               batch.positions, scale)

    def compute_logits(self, hidden: Any, out: Any | None = None) -> Any:
        """hidden [R, H] -> logits [R, V] fp32 (into `out` when given); with a group, each rank's
        vocabulary slice gathered."""
        if self.group is None:
            return linear(self.backend.xp, hidden, self.lm_head, np.float32, out=out)
        logits = self.gather_vocab(linear(self.backend.xp, hidden, self.lm_head, np.float32))  # [R, V]
        if out is not None:
            out[...] = logits
            return out
        return logits
