"""Element-wise building blocks of the decoder, written once for NumPy and CuPy."""

from __future__ import annotations

from typing import Any

import numpy as np


def rms_norm(xp: Any, x: Any, weight: Any, eps: float, out_dtype: Any) -> Any:
    """RMSNorm in fp32: x [T, H] (any float dtype), weight [H] fp32 -> [T, H] out_dtype."""
    x32 = x.astype(np.float32, copy=False)
    inv_rms = 1.0 / xp.sqrt(xp.mean(x32 * x32, axis=-1, keepdims=True) + np.float32(eps))  # [T, 1]
    return (x32 * inv_rms * weight).astype(out_dtype, copy=False)


def rope_tables(xp: Any, head_dim: int, theta: float, max_positions: int) -> tuple[Any, Any]:
    """cos and sin tables [max_positions, head_dim // 2] fp32 for rotate-half RoPE."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))  # [D/2]
    angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)  # [P, D/2]
    return xp.asarray(np.cos(angles), dtype=np.float32), xp.asarray(np.sin(angles), dtype=np.float32)


def apply_rope(xp: Any, x: Any, cos: Any, sin: Any) -> Any:
    """Rotate-half RoPE: x [T, heads, D], cos/sin [T, D/2] fp32 -> [T, heads, D] in x's dtype."""
    half = x.shape[-1] // 2
    x32 = x.astype(np.float32, copy=False)
    x1, x2 = x32[..., :half], x32[..., half:]  # [T, heads, D/2] each
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, D/2]
    return xp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype, copy=False)


def silu_mul(xp: Any, gate_up: Any) -> Any:
    """SwiGLU: gate_up [T, 2F] (gate first) -> silu(gate) * up [T, F], computed in fp32."""
    f = gate_up.shape[-1] // 2
    gate = gate_up[:, :f].astype(np.float32)
    up = gate_up[:, f:].astype(np.float32)
    return (gate / (1.0 + xp.exp(-gate)) * up).astype(gate_up.dtype, copy=False)
