"""MTP drafting: the head runs on the device in every step, and its drafts serve the next one.

Two parts, each over device arrays only, so that both run inside CUDA graphs:

1. Catch-up, beside the target's forward pass (`MTPDrafting.catch_up`): the head's K/V at every row
   of the step, from the target's hidden state there and the token after the row where the host
   knows it (the segment's next one; 0 after a sequence's last row, whose next token the step
   emits). K/V alone: nothing reads the head's output at these rows.
2. Drafting, after sampling or verification (`MTPDrafting.draft`): from each sampling sequence's
   boundary row (its last accepted row) and the token the step emitted after it, `num_model_steps`
   head steps, each on the residual and draft of the one before, one position further. The first
   rewrites the K/V that the catch-up wrote at the boundary with a guessed next token.

So every position below a sequence's length holds the head's K/V of its true next token: rows past
a boundary (rejected drafts) and drafting steps 2.. write K/V only at positions that the next
step's rows rewrite before anything reads them. `MTPProposer` hands the drafts of a sequence's last
step to the drafter as the proposal for its next one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from cupyspec.model.batch import DeviceBatch
from cupyspec.model.kv_arrays import KVCacheArrays
from cupyspec.model.llama import LlamaModel
from cupyspec.model.mtp import MTPHead, load_head_weights
from cupyspec.sampling.argmax import argmax_logprobs
from cupyspec.spec_decode.proposers.base import NO_DRAFTS, DraftRequest, Drafts, Proposer
from cupyspec.spec_decode.proposers.chain import ChainProposer
from cupyspec.spec_decode.speculative_config import SpeculativeConfig


class MTPDrafting:
    """The head's work in a step: its K/V caught up over the step's rows, then its drafts, which go
    to `proposer` once the host has them."""

    def __init__(self, head: MTPHead, num_model_steps: int, proposer: MTPProposer, max_model_len: int) -> None:
        """max_model_len: drafting steps past the context's last position write there (their drafts
        cannot be emitted; the scheduler reserves slots up to that position)."""
        self.head, self.num_model_steps, self.proposer = head, num_model_steps, proposer
        self.last_position = max_model_len - 1

    def catch_up(self, hidden: Any, batch: DeviceBatch, next_ids: Any, kv: KVCacheArrays) -> None:
        """The head's K/V at the step's rows: hidden [T, H] fp32 the target's pre-norm hidden states,
        next_ids [T] int32 (device) the token after each row (a guess at sampling rows)."""
        self.head.write_kv(hidden, replace(batch, input_ids=next_ids), kv)

    def draft(self, hidden: Any, tokens: Any, positions: Any, block_tables: Any, previous: Any,
              kv: KVCacheArrays) -> tuple[Any, Any]:
        """Drafts [S, num_model_steps] int32 and the head's logprob of each [S, num_model_steps] f32,
        greedy, from S boundaries: hidden [S, H] fp32 the target's hidden state at each boundary row,
        tokens [S] the token emitted after it, positions [S] int32 its position, block_tables [S, W]
        int32 its sequence's blocks; previous: the placeholder tokens of DeviceBatch (unused here)."""
        xp, block_size = self.head.target.backend.xp, kv.block_size
        rows = xp.arange(len(tokens), dtype=np.int32)  # [S]: each row a sequence of its own
        tokens, drafts, logprobs = tokens.astype(np.int32), [], []
        for _ in range(self.num_model_steps):
            slots = block_tables[rows, positions // block_size] * block_size + positions % block_size  # [S]
            hidden = self.head.step(hidden, DeviceBatch(tokens, positions, rows, slots, block_tables, previous),
                                    kv)  # [S, H]
            picks, logprob = argmax_logprobs(xp, self.head.logits(hidden))  # [S], [S]
            tokens = picks.astype(np.int32)
            drafts.append(tokens)
            logprobs.append(logprob)
            positions = xp.minimum(positions + 1, self.last_position)
        return xp.stack(drafts, axis=1), xp.stack(logprobs, axis=1)

    def draft_from(self, hidden: Any, batch: DeviceBatch, boundary_rows: Any, tokens: Any,
                   kv: KVCacheArrays) -> tuple[Any, Any]:
        """`draft` from the boundary rows [S] of an eager step: hidden [T, H], the step's batch."""
        block_tables = batch.block_tables[batch.batch_id_per_token[boundary_rows]]  # [S, W]
        return self.draft(hidden[boundary_rows], tokens, batch.positions[boundary_rows], block_tables,
                          batch.previous_tokens, kv)


class MTPProposer(Proposer):
    """Proposes, for each sequence, the drafts the head made for it at the end of its last step."""

    method = "mtp"

    def __init__(self) -> None:
        self._drafts: dict[int, Drafts] = {}  # seq_id -> its last step's drafts [num_model_steps]

    def remember(self, seq_ids: Sequence[int], drafts: np.ndarray, logprobs: np.ndarray) -> None:
        """drafts [S, num_model_steps] int32 and the head's logprob of each [S, num_model_steps] f32
        (host) of the sampling sequences seq_ids [S] of a step."""
        for seq_id, tokens, lps in zip(seq_ids, drafts, logprobs):
            self._drafts[seq_id] = Drafts(tokens, logprobs=lps)

    def propose(self, requests: Sequence[DraftRequest]) -> list[Drafts]:
        return [self._drafts.get(request.seq_id, NO_DRAFTS).first(request.max_drafts) for request in requests]

    def on_sequence_finished(self, seq_id: int, request_id: str, token_ids: np.ndarray, num_prompt_tokens: int) -> None:
        self._drafts.pop(seq_id, None)


def make_mtp_drafting(config: SpeculativeConfig, target: LlamaModel, proposer: Proposer | None,
                      max_model_len: int) -> MTPDrafting | None:
    """The head's drafting for `proposer` (an MTPProposer, or a chain that starts with one), its
    weights loaded from config.model; None when the config speculates otherwise."""
    if config.method != "mtp":
        return None
    mtp = proposer.first if isinstance(proposer, ChainProposer) else proposer
    assert isinstance(mtp, MTPProposer), "make_proposer gives an MTPProposer first for method 'mtp'"
    head = MTPHead(target, load_head_weights(config.model, target.config))
    return MTPDrafting(head, config.num_model_steps, mtp, max_model_len)
