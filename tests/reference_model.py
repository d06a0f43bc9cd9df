"""A plain, independent NumPy llama/qwen2: float64, full causal attention, no cache, no batching."""

from __future__ import annotations

import numpy as np

from cupyspec.config import ModelConfig


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, theta: float) -> np.ndarray:
    """Rotate-half RoPE as complex rotation: x [S, heads, D], pairs (i, i + D/2)."""
    seq, _, dim = x.shape
    half = dim // 2
    freqs = theta ** (-np.arange(half) * 2.0 / dim)  # [D/2]
    rot = np.exp(1j * np.arange(seq)[:, None] * freqs[None, :])[:, None, :]  # [S, 1, D/2]
    z = (x[..., :half] + 1j * x[..., half:]) * rot
    return np.concatenate([z.real, z.imag], axis=-1)


def reference_logits(config: ModelConfig, weights: dict[str, np.ndarray], token_ids: list[int]) -> np.ndarray:
    """Logits [S, V] of every position of one sequence."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    c = config
    x = w["model.embed_tokens.weight"][token_ids]  # [S, H]
    seq = len(token_ids)
    causal = np.tril(np.ones((seq, seq), dtype=bool))
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        h = _rms_norm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
        proj = {}
        for name, heads in (("q", c.num_heads), ("k", c.num_kv_heads), ("v", c.num_kv_heads)):
            y = h @ w[f"{p}self_attn.{name}_proj.weight"].T
            if f"{p}self_attn.{name}_proj.bias" in w:
                y = y + w[f"{p}self_attn.{name}_proj.bias"]
            proj[name] = y.reshape(seq, heads, c.head_dim)
        q, k = _rope(proj["q"], c.rope_theta), _rope(proj["k"], c.rope_theta)
        out = np.zeros((seq, c.num_heads, c.head_dim))
        for head in range(c.num_heads):
            kv_head = head // (c.num_heads // c.num_kv_heads)
            scores = q[:, head] @ k[:, kv_head].T / np.sqrt(c.head_dim)  # [S, S]
            scores = np.where(causal, scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            out[:, head] = probs @ proj["v"][:, kv_head]
        x = x + out.reshape(seq, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    x = _rms_norm(x, w["model.norm.weight"], c.rms_norm_eps)
    head = w["model.embed_tokens.weight"] if c.tie_word_embeddings else w["lm_head.weight"]
    return x @ head.T
