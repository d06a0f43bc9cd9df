"""How a llama-family model splits across the ranks of a tensor-parallel group (Megatron-LM's layout,
as vLLM shards it).

- Column-parallel (each rank computes some of the outputs): the Q/K/V projections by heads, gate
  and up by the MLP's intermediate columns; biases alike.
- Row-parallel (each rank computes a partial sum over its inputs, then the all-reduce): o by the
  query heads it takes, down by the intermediate columns.
- The embedding and the LM head by vocabulary: a rank embeds the ids in its slice (zeros elsewhere,
  then the all-reduce), and its logits cover its slice (then the all-gather).
- K/V heads split when the group's size divides their number, else replicated: each rank holds the
  one its query heads attend with (the size a multiple of their number).
- Norms are replicated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from cupyspec.config import ModelConfig

# HF names (their suffixes) of the split matrices: which range of `Shard` splits them
COLUMN_PARALLEL = {"self_attn.q_proj": "q", "self_attn.k_proj": "kv", "self_attn.v_proj": "kv",
                   "mlp.gate_proj": "ffn", "mlp.up_proj": "ffn"}  # rows (outputs), and biases
ROW_PARALLEL = {"self_attn.o_proj": "q", "mlp.down_proj": "ffn"}  # columns (inputs)
BY_VOCABULARY = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class Shard:
    """What one rank holds of the model: its heads, intermediate columns and vocabulary slice."""

    rank: int
    size: int
    q_heads: range  # the query heads it computes
    kv_heads: range  # the K/V heads they attend with
    ffn: range  # its columns of the MLP's intermediate
    vocab: range  # its token ids: rows of the embedding and the LM head


def vocab_slice(vocab_size: int, rank: int, size: int) -> range:
    """Rank `rank`'s token ids: consecutive slices whose sizes differ by one at most."""
    return range(vocab_size * rank // size, vocab_size * (rank + 1) // size)


def plan_shard(config: ModelConfig, rank: int, size: int) -> Shard:
    """Rank `rank` of `size`; ValueError where the model's shape does not split that many ways."""
    heads, kv_heads, ffn = config.num_heads, config.num_kv_heads, config.intermediate_size
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"rank {rank} of a tensor-parallel group of {size}")
    if heads % size or ffn % size:
        raise ValueError(f"tensor parallel size {size} must divide the attention heads ({heads}) and the MLP's "
                         f"intermediate size ({ffn})")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"tensor parallel size {size} must divide the K/V heads ({kv_heads}) or be a multiple of them")
    per_rank, group = heads // size, heads // kv_heads  # query heads per rank, and per K/V head
    q = range(rank * per_rank, (rank + 1) * per_rank)
    kv = range(q.start // group, (q.stop - 1) // group + 1)
    width = ffn // size
    return Shard(rank, size, q, kv, range(rank * width, (rank + 1) * width), vocab_slice(config.vocab_size, rank, size))


def shard_config(config: ModelConfig, shard: Shard) -> ModelConfig:
    """The shape one rank computes: its heads and intermediate columns (the vocabulary stays whole:
    token ids are the model's)."""
    return dataclasses.replace(config, num_heads=len(shard.q_heads), num_kv_heads=len(shard.kv_heads),
                               intermediate_size=len(shard.ffn))


def shard_weights(weights: dict[str, np.ndarray], config: ModelConfig, shard: Shard) -> dict[str, np.ndarray]:
    """One rank's slices of HF-named weights ([out, in] layout); names and everything unsplit kept."""
    d = config.head_dim
    rows = {"q": slice(shard.q_heads.start * d, shard.q_heads.stop * d),
            "kv": slice(shard.kv_heads.start * d, shard.kv_heads.stop * d),
            "ffn": slice(shard.ffn.start, shard.ffn.stop)}
    vocab = slice(shard.vocab.start, shard.vocab.stop)
    out = {}
    for name, w in weights.items():
        module, _, kind = name.rpartition(".")  # e.g. "model.layers.0.self_attn.q_proj", "weight"
        column = next((part for suffix, part in COLUMN_PARALLEL.items() if module.endswith(suffix)), None)
        row = next((part for suffix, part in ROW_PARALLEL.items() if module.endswith(suffix)), None)
        if name in BY_VOCABULARY:
            out[name] = w[vocab]
        elif column is not None:
            out[name] = w[rows[column]]  # a weight's rows or a bias's entries
        elif row is not None:
            if kind != "weight":  # every rank would add it: the all-reduce would count it size times
                raise ValueError(f"{name}: a row-parallel product's bias cannot be sharded")
            out[name] = w[:, rows[row]]
        else:
            out[name] = w
    return out
