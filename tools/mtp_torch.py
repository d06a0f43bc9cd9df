"""The PyTorch side of MTP training (tools/train_mtp.py): the target model, with the hidden states an MTP
head reads, and the head (cupyspec/model/mtp.py's architecture), unrolled over its steps with the
attention pattern of inference."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cupyspec.config import ModelConfig

# ---------------------------------------------------------------- phase 2: the target in PyTorch

class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H] fp32
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()


def rope_tables(config: ModelConfig, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [L, D/2] fp32 of positions 0..L-1, as cupyspec's rope_tables."""
    steps = torch.arange(0, config.head_dim, 2, dtype=torch.float64, device=device)
    angles = torch.outer(torch.arange(length, dtype=torch.float64, device=device),
                         config.rope_theta ** (-steps / config.head_dim))  # [L, D/2]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the HF layout): x [B, heads, L, D], cos/sin [L, D/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)  # [B, heads, L, D/2] each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class DecoderLayer(nn.Module):
    """One llama decoder layer on an fp32 residual stream; parameter names as in HF checkpoints."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.config = c
        h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.input_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(h, q, bias=c.attention_bias)
        self.self_attn.k_proj = nn.Linear(h, kv, bias=c.attention_bias)
        self.self_attn.v_proj = nn.Linear(h, kv, bias=c.attention_bias)
        self.self_attn.o_proj = nn.Linear(q, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(c.intermediate_size, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: list | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, L, H] fp32 -> [B, L, H] fp32. Without `cache`, causal attention over this call's keys;
        with it, this call's (K, V) is appended to `cache` and the queries attend to every key listed
        there, in order, where `mask` [L, keys] is True."""
        c, attn, (batch, length, _) = self.config, self.self_attn, x.shape
        h = self.input_layernorm(x).to(attn.q_proj.weight.dtype)
        q = attn.q_proj(h).view(batch, length, c.num_heads, c.head_dim).transpose(1, 2)  # [B, Hq, L, D]
        k = attn.k_proj(h).view(batch, length, c.num_kv_heads, c.head_dim).transpose(1, 2)  # [B, Hkv, L, D]
        v = attn.v_proj(h).view(batch, length, c.num_kv_heads, c.head_dim).transpose(1, 2)  # [B, Hkv, L, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            cache.append((k, v))
            k, v = torch.cat([kc for kc, _ in cache], dim=2), torch.cat([vc for _, vc in cache], dim=2)
        groups = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [B, Hq, keys, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)  # [B, Hq, L, D]
        x = x + attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1)).float()
        h = self.post_attention_layernorm(x).to(attn.q_proj.weight.dtype)
        return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h)).float()


class TargetModel(nn.Module):
    """The target, frozen: matrices in `dtype`, norms and the residual stream in fp32."""

    def __init__(self, c: ModelConfig, weights: dict[str, np.ndarray], dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.config = c
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.model.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        state = {name: torch.from_numpy(np.array(w, dtype=np.float32)) for name, w in weights.items()}
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        self.load_state_dict(state)
        self.requires_grad_(False).to(device)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.to(dtype)

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, L] (right-padded) -> h [B, L, H] fp32: the last layer's residual, before the final norm."""
        cos, sin = rope_tables(self.config, tokens.shape[1], tokens.device)
        with torch.no_grad():
            x = self.model.embed_tokens(tokens).float()
            for layer in self.model.layers:
                x = layer(x, cos, sin)
        return x

    def logits(self, h: torch.Tensor) -> torch.Tensor:  # [..., H] pre-norm -> [..., V] fp32
        return self.lm_head(self.model.norm(h).to(self.lm_head.weight.dtype)).float()


# ---------------------------------------------------------------- phase 3: the head

def unrolled_mask(length: int, step: int, device: torch.device) -> torch.Tensor:
    """[L, step * L] bool: step `step`'s query at p sees step 1's keys at positions <= p-step+1 (those the
    target's hidden states wrote) and step k's key at p-step+k for k = 2..step (its chain's earlier drafts)."""
    p = torch.arange(length, device=device)[:, None]
    q = torch.arange(length, device=device)[None, :]
    return torch.cat([q <= p - step + 1] + [q == p - step + k for k in range(2, step + 1)], dim=1)


class MTPHead(nn.Module):
    """The spec's head; its state_dict names are the file's tensor names without the `mtp.` prefix."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.config = c
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)  # embedding half first
        self.layer = DecoderLayer(c)

    @classmethod
    def from_target(cls, target: TargetModel, hidden_rms: float = 1.0) -> MTPHead:
        """The target's last layer, eh_proj = [0 | I], and enorm and hnorm scaling by `hidden_rms` (the
        hidden states' typical size): the head starts by passing the hidden state, normed and back at
        its usual scale, through that layer, and the embedding half learns at the same scale."""
        head = cls(target.config)
        head.layer.load_state_dict({k: v.float() for k, v in target.model.layers[-1].state_dict().items()})
        size = target.config.hidden_size
        with torch.no_grad():
            head.eh_proj.weight.copy_(torch.cat([torch.zeros(size, size), torch.eye(size)], dim=1))
            head.enorm.weight.fill_(hidden_rms)
            head.hnorm.weight.fill_(hidden_rms)
        return head.to(target.lm_head.weight.device)

    def forward(self, h: torch.Tensor, next_tokens: torch.Tensor, target: TargetModel,
                num_steps: int) -> list[torch.Tensor]:
        """Output hidden states r [B, L, H] fp32 of steps 1..num_steps, unrolled as inference runs them.

        h [B, L, H]: the target's hidden states; next_tokens [B, L]: the token at p+1 for position p.
        Step 1 at p reads h at p; step j > 1 at p reads step j-1's output at p-1, so position p of step j
        continues the chain that step 1 began at p-j+1 (with the sequence's tokens as its drafts)."""
        cos, sin = rope_tables(self.config, h.shape[1], h.device)
        e = self.enorm(target.model.embed_tokens(next_tokens))  # [B, L, H] fp32
        cache: list = []
        outputs, s = [], h
        for step in range(1, num_steps + 1):
            u = self.eh_proj(torch.cat([e, self.hnorm(s)], dim=-1).to(self.eh_proj.weight.dtype))  # [B, L, H]
            r = self.layer(u.float(), cos, sin, cache, unrolled_mask(h.shape[1], step, h.device))
            outputs.append(r)
            s = F.pad(r[:, :-1], (0, 0, 1, 0))  # [B, L, H]: step j+1 at p reads r at p-1
        return outputs
