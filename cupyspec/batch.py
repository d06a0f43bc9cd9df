"""The flat ragged batch of one engine step: segments concatenated with no padding."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Segment:
    """New tokens of one request in this step, starting at `start_position`."""

    token_ids: Sequence[int]  # a prefill chunk, [last token, d1..dk] or one decode token
    start_position: int
    block_ids: Sequence[int]  # the request's KV blocks, covering every position written


@dataclass(frozen=True)
class FlatBatch:
    """Host arrays describing one forward pass (DESIGN.md, "One engine step")."""

    input_ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    batch_id_per_token: np.ndarray  # [T] int32
    cu_seqlens_q: np.ndarray  # [B+1] int32
    seq_lens_kv: np.ndarray  # [B] int32: cached positions once this step's K/V are written
    block_tables: np.ndarray  # [B, max_blocks] int32, padded with 0
    slot_mapping: np.ndarray  # [T] int64: block * block_size + offset of each new token's K/V

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_kv)

    def last_rows(self) -> np.ndarray:
        """[B] int64: the row of each segment's last token."""
        return self.cu_seqlens_q[1:].astype(np.int64) - 1


@dataclass(frozen=True)
class DeviceBatch:
    """The arrays of a FlatBatch that the forward pass reads, on the model's device (int32)."""

    input_ids: Any  # [T]
    positions: Any  # [T]
    batch_id_per_token: Any  # [T]
    slot_mapping: Any  # [T]
    block_tables: Any  # [B, max_blocks]

    @classmethod
    def of(cls, xp: Any, batch: FlatBatch) -> DeviceBatch:
        return cls(*(xp.asarray(a, dtype=np.int32) for a in (
            batch.input_ids, batch.positions, batch.batch_id_per_token, batch.slot_mapping, batch.block_tables)))

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def build_flat_batch(segments: Sequence[Segment], block_size: int) -> FlatBatch:
    lengths = np.array([len(s.token_ids) for s in segments], dtype=np.int32)  # [B]
    if len(segments) == 0 or lengths.min() < 1:
        raise ValueError("a batch needs at least one segment, each with at least one token")
    num_blocks = np.array([len(s.block_ids) for s in segments], dtype=np.int32)  # [B]
    cu_seqlens_q = np.zeros(len(segments) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu_seqlens_q[1:])
    starts = np.array([s.start_position for s in segments], dtype=np.int32)  # [B]
    batch_id_per_token = np.repeat(np.arange(len(segments), dtype=np.int32), lengths)  # [T]
    positions = (np.arange(cu_seqlens_q[-1], dtype=np.int32) - cu_seqlens_q[batch_id_per_token]
                 + starts[batch_id_per_token])  # [T]
    seq_lens_kv = starts + lengths
    if np.any(-(-seq_lens_kv // block_size) > num_blocks):
        raise ValueError("a segment writes past its KV blocks")
    block_tables = np.zeros((len(segments), num_blocks.max()), dtype=np.int32)
    owner = np.repeat(np.arange(len(segments)), num_blocks)  # [sum blocks]: the segment of each block
    column = np.arange(len(owner)) - np.repeat(np.cumsum(num_blocks) - num_blocks, num_blocks)
    block_tables[owner, column] = list(itertools.chain.from_iterable(s.block_ids for s in segments))
    slot_mapping = (block_tables[batch_id_per_token, positions // block_size].astype(np.int64) * block_size
                    + positions % block_size)
    input_ids = np.array(list(itertools.chain.from_iterable(s.token_ids for s in segments)), dtype=np.int32)
    return FlatBatch(input_ids, positions, batch_id_per_token, cu_seqlens_q, seq_lens_kv, block_tables, slot_mapping)
