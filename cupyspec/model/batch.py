"""The flat ragged batch of one engine step: segments concatenated with no padding."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from cupyspec.transfer import to_device


@dataclass(frozen=True)
class Segment:
    """New tokens of one request in this step, starting at `start_position`."""

    token_ids: Sequence[int]  # a prefill chunk, [last token, d1..dk] or one decode token
    start_position: int
    block_ids: Sequence[int]  # the request's KV blocks, covering every position written


class FlatBatch(NamedTuple):
    """Host arrays describing one forward pass (DESIGN.md, "One engine step"); a tuple: one is made
    per step, on the host's critical path."""

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


@dataclass(frozen=True)
class DeviceBatch:
    """The arrays of a FlatBatch that the forward pass reads, on the model's device (int32)."""

    input_ids: Any  # [T]; ~s (< 0) stands for previous_tokens[s]
    positions: Any  # [T]
    batch_id_per_token: Any  # [T]
    slot_mapping: Any  # [T]
    block_tables: Any  # [B, max_blocks]
    previous_tokens: Any  # [S] the tokens the previous step sampled, not yet seen by the host

    @classmethod
    def of(cls, xp: Any, batch: FlatBatch, previous_tokens: Any | None = None) -> DeviceBatch:
        """previous_tokens: None when no input id is a placeholder."""
        if previous_tokens is None:
            previous_tokens = xp.zeros(1, dtype=np.int32)
        return cls(*(to_device(xp, np.asarray(a, dtype=np.int32)) for a in (
            batch.input_ids, batch.positions, batch.batch_id_per_token, batch.slot_mapping, batch.block_tables)),
            previous_tokens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def build_flat_batch(segments: Sequence[Segment], block_size: int) -> FlatBatch:
    return flat_batch([t for s in segments for t in s.token_ids], [len(s.token_ids) for s in segments],
                      [s.start_position for s in segments], [s.block_ids for s in segments], block_size)


def flat_batch(token_ids: Sequence[int], lengths: Sequence[int], starts: Sequence[int],
               block_ids: Sequence[Sequence[int]], block_size: int) -> FlatBatch:
    """The batch of segments given column-wise: all their tokens concatenated, and per segment its
    length, start position and KV blocks."""
    if not lengths or min(lengths) < 1:
        raise ValueError("a batch needs at least one segment, each with at least one token")
    num_seqs = len(lengths)
    if num_seqs == 1:  # one segment (one sequence running): no ragged bookkeeping
        start, length = starts[0], lengths[0]
        positions = np.arange(start, start + length, dtype=np.int32)
        cu_seqlens_q = np.array((0, length), dtype=np.int32)
        batch_id_per_token = np.zeros(length, dtype=np.int32)
        seq_lens_kv = np.array((start + length,), dtype=np.int32)
    elif len(token_ids) == num_seqs:  # one token each (decoding)
        starts_arr = np.array(starts, dtype=np.int32)  # [B]
        cu_seqlens_q = np.arange(num_seqs + 1, dtype=np.int32)
        batch_id_per_token = np.arange(num_seqs, dtype=np.int32)
        positions = starts_arr
        seq_lens_kv = starts_arr + 1
    else:
        starts_arr = np.array(starts, dtype=np.int32)  # [B]
        lengths_arr = np.array(lengths, dtype=np.int32)
        cu_seqlens_q = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(lengths_arr, out=cu_seqlens_q[1:])
        batch_id_per_token = np.repeat(np.arange(num_seqs, dtype=np.int32), lengths_arr)  # [T]
        positions = (starts_arr - cu_seqlens_q[:-1])[batch_id_per_token] + np.arange(len(token_ids), dtype=np.int32)
        seq_lens_kv = starts_arr + lengths_arr
    block_tables, num_blocks = _block_tables(block_ids)
    if (seq_lens_kv > num_blocks * block_size).any():
        raise ValueError("a segment writes past its KV blocks")
    block_of_token = block_tables.ravel().take(batch_id_per_token * block_tables.shape[1] + positions // block_size)
    slot_mapping = block_of_token.astype(np.int64) * block_size + positions % block_size  # [T]
    input_ids = np.array(token_ids, dtype=np.int32)
    return FlatBatch(input_ids, positions, batch_id_per_token, cu_seqlens_q, seq_lens_kv, block_tables, slot_mapping)


def _block_tables(block_ids: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """[B, max_blocks] int32, each row a segment's blocks padded with 0; and [B] int32 the block counts."""
    if len(block_ids) == 1:
        return np.array(block_ids, dtype=np.int32), np.array((len(block_ids[0]),), dtype=np.int32)
    counts = [len(b) for b in block_ids]
    num_blocks = np.array(counts, dtype=np.int32)
    table = np.zeros((len(counts), max(counts)), dtype=np.int32)
    table[np.arange(table.shape[1]) < num_blocks[:, None]] = np.fromiter(
        itertools.chain.from_iterable(block_ids), dtype=np.int32, count=sum(counts))
    return table, num_blocks
