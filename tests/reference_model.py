"""A plain, independent NumPy llama/qwen2: float64, full causal attention, no cache, no batching."""

from __future__ import annotations

import numpy as np

from cupyspec.config import ModelConfig


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, theta: float, positions: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE as complex rotation: x [S, heads, D] at positions [S], pairs (i, i + D/2)."""
    _, _, dim = x.shape
    half = dim // 2
    freqs = theta ** (-np.arange(half) * 2.0 / dim)  # [D/2]
    rot = np.exp(1j * positions[:, None] * freqs[None, :])[:, None, :]  # [S, 1, D/2]
    z = (x[..., :half] + 1j * x[..., half:]) * rot
    return np.concatenate([z.real, z.imag], axis=-1)


def _layer(c: ModelConfig, w: dict[str, np.ndarray], p: str, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """One decoder layer (tensor names under prefix p) over rows x [S, H] at `positions` [S], each row
    attending to the rows at earlier or equal positions."""
    seq = len(x)
    causal = positions[:, None] >= positions[None, :]  # [S, S]
    h = _rms_norm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
    proj = {}
    for name, heads in (("q", c.num_heads), ("k", c.num_kv_heads), ("v", c.num_kv_heads)):
        y = h @ w[f"{p}self_attn.{name}_proj.weight"].T
        if f"{p}self_attn.{name}_proj.bias" in w:
            y = y + w[f"{p}self_attn.{name}_proj.bias"]
        proj[name] = y.reshape(seq, heads, c.head_dim)
    q, k = _rope(proj["q"], c.rope_theta, positions), _rope(proj["k"], c.rope_theta, positions)
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
    return x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T


def _head_logits(c: ModelConfig, w: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    x = _rms_norm(x, w["model.norm.weight"], c.rms_norm_eps)
    head = w["model.embed_tokens.weight"] if c.tie_word_embeddings else w["lm_head.weight"]
    return x @ head.T


def reference_hidden(config: ModelConfig, weights: dict[str, np.ndarray], token_ids: list[int]) -> np.ndarray:
    """The residual after the last layer, before the final norm, of every position [S, H] (float64)."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    x = w["model.embed_tokens.weight"][token_ids]  # [S, H]
    positions = np.arange(len(token_ids))
    for i in range(config.num_layers):
        x = _layer(config, w, f"model.layers.{i}.", x, positions)
    return x


def reference_logits(config: ModelConfig, weights: dict[str, np.ndarray], token_ids: list[int]) -> np.ndarray:
    """Logits [S, V] of every position of one sequence."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    return _head_logits(config, w, reference_hidden(config, weights, token_ids))


def reference_mtp_step(config: ModelConfig, weights: dict[str, np.ndarray], head: dict[str, np.ndarray],
                       hidden: np.ndarray, next_tokens: list[int],
                       positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One MTP head step over rows at `positions` [S] (0..S-1 of one sequence, or any causal order):
    hidden [S, H] and the token after each row's position -> (the head's residual [S, H], logits [S, V])."""
    w = {k: v.astype(np.float64) for k, v in (weights | head).items()}
    e = _rms_norm(w["model.embed_tokens.weight"][next_tokens], w["mtp.enorm.weight"], config.rms_norm_eps)
    g = _rms_norm(hidden.astype(np.float64), w["mtp.hnorm.weight"], config.rms_norm_eps)
    u = np.concatenate([e, g], axis=1) @ w["mtp.eh_proj.weight"].T  # [S, H]
    r = _layer(config, w, "mtp.layer.", u, positions)
    return r, _head_logits(config, w, r)
