"""The MTP head: DeepSeek-V3's multi-token prediction module for a llama-family target.

One head step at position i reads a hidden state s_i [H] and the token x at position i+1:

    e = RMSNorm(embed[x]; enorm)                  the target's embedding, shared
    g = RMSNorm(s_i; hnorm)
    u = concat(e, g) @ eh_proj.T                  eh_proj [H, 2H], the embedding half first
    r = decoder layer of the target's shape (u)   causal attention over the head's own K/V at 0..i
    logits = lm_head(final_norm(r))               the target's final norm and LM head, shared

The logits predict the token at position i+2; r, the head's residual after its layer (before any
norm), is the hidden state of the next step. The first step after the target emitted token t_m
reads the target's hidden state at m-1 (its last layer's residual, before the final norm) and
t_m, and drafts the token at m+1; step j > 1 reads step j-1's r and draft, one position further.
Over positions whose next token is known (a prompt, a verified step's accepted tokens) the head's
K/V alone is needed, for later steps to attend to: `write_kv` computes u and the layer's K/V there
and stops.

A head file may name a draft vocabulary, the token ids the head drafts from (DRAFT_VOCAB [Vd],
ascending): its logits are then those of the LM head's rows for these tokens alone, as EAGLE-3 and
FR-Spec draft, since at a few rows the LM head over the whole vocabulary is the largest part of a
head step; every other token has draft probability 0.

The head's file is safetensors with the tensor names below (HF [out, in] layout), the optional
DRAFT_VOCAB, and metadata "format": FORMAT; the embedding, final norm and LM head are the target's
and not stored.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file

from cupyspec.config import ModelConfig
from cupyspec.kernels import load_kernel
from cupyspec.model.batch import DeviceBatch
from cupyspec.model.fused import rms_norm
from cupyspec.model.kv_arrays import KVCacheArrays
from cupyspec.model.linear import add_linear, linear
from cupyspec.model.llama import LlamaModel, layer_weights, matrix

FORMAT = "cupyspec-mtp-v1"
INPUT_WARPS = 4  # rows per block: WARPS in cuda/mtp_input.cu
PREFIX = "mtp."
LAYER_PREFIX = "mtp.layer."
DRAFT_VOCAB = "mtp.draft_vocab"  # [Vd] integer token ids, ascending, unique


def head_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a head file holds for a target of `config`, with its shape."""
    h, d, f = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * d, config.num_kv_heads * d
    shapes = {"mtp.enorm.weight": (h,), "mtp.hnorm.weight": (h,), "mtp.eh_proj.weight": (h, 2 * h),
              f"{LAYER_PREFIX}input_layernorm.weight": (h,), f"{LAYER_PREFIX}post_attention_layernorm.weight": (h,),
              f"{LAYER_PREFIX}self_attn.q_proj.weight": (q, h), f"{LAYER_PREFIX}self_attn.k_proj.weight": (kv, h),
              f"{LAYER_PREFIX}self_attn.v_proj.weight": (kv, h), f"{LAYER_PREFIX}self_attn.o_proj.weight": (h, q),
              f"{LAYER_PREFIX}mlp.gate_proj.weight": (f, h), f"{LAYER_PREFIX}mlp.up_proj.weight": (f, h),
              f"{LAYER_PREFIX}mlp.down_proj.weight": (h, f)}
    if config.attention_bias:
        shapes |= {f"{LAYER_PREFIX}self_attn.q_proj.bias": (q,), f"{LAYER_PREFIX}self_attn.k_proj.bias": (kv,),
                   f"{LAYER_PREFIX}self_attn.v_proj.bias": (kv,)}
    return shapes


def load_head_weights(path: str | Path, config: ModelConfig, sha256: str | None = None) -> dict[str, np.ndarray]:
    """A head file's tensors, the weights as float32 and the draft vocabulary (when it has one) as
    int64, checked against the target's shapes (and the file's sha256 when given); ValueError names
    what does not fit."""
    path = Path(path)
    if sha256 is not None:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != sha256:
            raise ValueError(f"MTP head {path}: sha256 {digest}, expected {sha256}")
    with safe_open(str(path), framework="numpy") as file:
        metadata = file.metadata() or {}
    if metadata.get("format") != FORMAT:
        raise ValueError(f"MTP head {path}: metadata format {metadata.get('format')!r}, expected {FORMAT!r}")
    tensors = load_file(str(path))
    expected = head_tensor_shapes(config)
    vocab = tensors.pop(DRAFT_VOCAB, None)
    missing, unknown = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unknown:
        raise ValueError(f"MTP head {path} does not fit the target: missing {missing}, unknown {unknown}")
    for name, shape in expected.items():
        if tensors[name].shape != shape:
            raise ValueError(f"MTP head {path}: {name} has shape {tensors[name].shape}, the target needs {shape}")
    weights = {name: array.astype(np.float32) for name, array in tensors.items()}
    if vocab is not None:
        weights[DRAFT_VOCAB] = _checked_draft_vocab(path, vocab, config.vocab_size)
    return weights


def _checked_draft_vocab(path: Path, vocab: np.ndarray, vocab_size: int) -> np.ndarray:
    """The draft vocabulary [Vd] int64; ValueError unless it is ascending unique ids of the target's."""
    if vocab.ndim != 1 or not len(vocab) or vocab.dtype.kind not in "iu":
        raise ValueError(f"MTP head {path}: {DRAFT_VOCAB} must be a non-empty 1-D integer tensor")
    vocab = vocab.astype(np.int64)
    if vocab[0] < 0 or vocab[-1] >= vocab_size or np.any(np.diff(vocab) <= 0):
        raise ValueError(f"MTP head {path}: {DRAFT_VOCAB} must hold ascending unique token ids below {vocab_size}")
    return vocab


class MTPHead:
    """The head's weights on the target's device, and its step; its K/V is the pool's layer
    `kv_layer` (KVCacheArrays made with one extra layer), addressed by the target's block tables.
    With a draft vocabulary the LM head's rows for it are gathered once, a [Vd, H] copy. `quantization`
    (wint8, wint4) packs eh_proj and the layer's matrices."""

    def __init__(self, target: LlamaModel, weights: dict[str, np.ndarray], quantization: str | None = None) -> None:
        backend, config = target.backend, target.config
        xp = backend.xp
        self.target = target
        self.enorm = xp.asarray(weights["mtp.enorm.weight"], dtype=np.float32)  # [H]
        self.hnorm = xp.asarray(weights["mtp.hnorm.weight"], dtype=np.float32)  # [H]
        self.eh_proj = matrix(xp, backend.dtype, weights, "mtp.eh_proj.weight", quantization=quantization)  # [H, 2H]
        self.layer = layer_weights(weights, LAYER_PREFIX, config, backend, quantization)
        self.kv_layer = config.num_layers
        vocab = weights.get(DRAFT_VOCAB)
        self.draft_vocab = None if vocab is None else xp.asarray(vocab)  # [Vd] int64, or None: every token
        self.lm_head = target.lm_head  # [V_r, H]: the target's, or its rank's vocabulary slice
        self.vocab_widths = target.vocab_widths  # with a group, the ranks' columns of `logits`
        if vocab is not None:  # the draft vocabulary's rows among them: its ids ascend, as the ranks' slices do
            first = target.vocab_first or 0
            mine = vocab[(vocab >= first) & (vocab < first + target.lm_head.shape[0])] - first
            self.lm_head = xp.ascontiguousarray(target.lm_head[xp.asarray(mine)])  # [Vd_r, H]
            if target.group is not None:
                bounds = np.cumsum((0, *target.vocab_widths))  # the ranks' slices, as token ids
                self.vocab_widths = tuple(np.diff(np.searchsorted(vocab, bounds)).tolist())

    def step(self, hidden: Any, batch: DeviceBatch, kv: KVCacheArrays) -> Any:
        """hidden [T, H] fp32 (the target's pre-norm hidden states, or the head's own) over a batch
        whose input ids [T] are the token after each row's position (placeholders ~s allowed, as the
        target's) -> the head's residual r [T, H] fp32, its K/V written at the batch's slots."""
        residual = self._input(hidden, batch)  # [T, H] fp32
        self.target.run_layer(residual, self.layer, kv.k[self.kv_layer], kv.v[self.kv_layer], batch)
        return residual

    def write_kv(self, hidden: Any, batch: DeviceBatch, kv: KVCacheArrays) -> None:
        """`step`'s K/V alone, written at the batch's slots."""
        self.target.write_kv(self._input(hidden, batch), self.layer, kv.k[self.kv_layer], kv.v[self.kv_layer], batch)

    def _input(self, hidden: Any, batch: DeviceBatch) -> Any:
        """u = concat(enorm(embedding), hnorm(hidden)) @ eh_proj.T: [T, H] fp32, added into zeros as
        the layers add their products (rounded to the weights' dtype): at a few rows that is a gemv,
        where an fp32 product would take the tiles."""
        xp = self.target.backend.xp
        rows = self._input_rows(hidden, batch)  # [T, 2H]
        u = xp.zeros((rows.shape[0], self.eh_proj.shape[0]), dtype=np.float32)  # [T, H]
        add_linear(xp, u, rows, self.eh_proj)
        return u

    def _input_rows(self, hidden: Any, batch: DeviceBatch) -> Any:
        """concat(enorm(embedding of the input ids), hnorm(hidden [T, H] fp32)): [T, 2H] in the weights'
        dtype. On a GPU with fp16 weights cuda/mtp_input.cu; these lines are its twin."""
        xp, dt, eps = self.target.backend.xp, self.target.backend.dtype, self.target.config.rms_norm_eps
        num_tokens, width = hidden.shape
        if xp is np or np.dtype(dt) != np.float16 or width % 4 or self.target.group is not None:
            embedded = self.target.embed_rows(batch.input_ids, batch.previous_tokens)  # [T, H] fp32
            return xp.concatenate([rms_norm(xp, embedded, self.enorm, eps, dt),
                                   rms_norm(xp, hidden, self.hnorm, eps, dt)], axis=1)
        out = xp.empty((num_tokens, 2 * width), dtype=np.float16)
        if num_tokens:
            load_kernel("mtp_input", "mtp_input")(
                (-(-num_tokens // INPUT_WARPS),), (INPUT_WARPS * 32,),
                (self.target.embed, xp.ascontiguousarray(batch.input_ids, dtype=np.int32), batch.previous_tokens,
                 xp.ascontiguousarray(hidden, dtype=np.float32), self.enorm, self.hnorm, out, np.int32(num_tokens),
                 np.int32(width), np.float32(eps)))
        return out

    def logits(self, residual: Any) -> Any:
        """The head's residual [R, H] -> logits [R, Vd] fp32 over its draft vocabulary (Vd = V without
        one) through the target's final norm and LM head (its rank's rows gathered)."""
        return self.target.gather_vocab(linear(self.target.backend.xp, self.target.final_normed(residual),
                                               self.lm_head, np.float32), self.vocab_widths)

    def token_ids(self, columns: Any) -> Any:
        """The token ids of columns of `logits` (any shape, int)."""
        return columns if self.draft_vocab is None else self.draft_vocab[columns]
