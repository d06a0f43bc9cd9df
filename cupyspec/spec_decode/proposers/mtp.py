"""MTP drafting: the head runs on the device at the end of every step, and its drafts serve the next.

After the target's forward pass and the step's sampling or verification, `MTPDrafting.run` takes
every row of the step through the head (`cupyspec/model/mtp.py`) with the target's hidden states,
each row's next token being the segment's next one, or, at each sampling sequence's boundary row
(its last accepted row), the token the step emitted there. That writes the head's K/V for every
position whose next token is now known; rows past a boundary write K/V at positions that the
next step's rows overwrite before anything reads them, so rejected drafts leave nothing behind.
From each boundary row the head then drafts `num_model_steps` tokens greedily, each step on its
own residual and last draft one position further. `MTPProposer` hands the drafts of a sequence's
last step to the drafter as the proposal for its next one.
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
from cupyspec.sampling.argmax import argmax_rows
from cupyspec.spec_decode.proposers.base import NO_DRAFTS, DraftRequest, Drafts, Proposer
from cupyspec.spec_decode.proposers.chain import ChainProposer
from cupyspec.spec_decode.speculative_config import SpeculativeConfig
from cupyspec.transfer import to_device


class MTPDrafting:
    """The head's work in a step: catching its K/V up over the step's rows, then drafting; the drafts
    go to `proposer` once the host has them."""

    def __init__(self, head: MTPHead, num_model_steps: int, proposer: MTPProposer, max_model_len: int) -> None:
        """max_model_len: drafting steps past the context's last position write there (their drafts
        cannot be emitted; the scheduler reserves slots up to that position)."""
        self.head, self.num_model_steps, self.proposer = head, num_model_steps, proposer
        self.last_position = max_model_len - 1

    def run(self, hidden: Any, batch: DeviceBatch, kv: KVCacheArrays, next_token_ids: np.ndarray,
            boundary_rows: Any, boundary_tokens: Any) -> Any:
        """hidden [T, H] fp32: the target's pre-norm hidden states of the step's rows; batch: the step's
        rows; next_token_ids [T] int32 (host): the token after each row where the host knows it;
        boundary_rows [S] int64 and boundary_tokens [S] (device): each sampling sequence's last
        accepted row and the token emitted after it. Returns the drafts [S, num_model_steps] int32
        (device), drafted from the boundary rows."""
        xp = self.head.target.backend.xp
        next_tokens = to_device(xp, next_token_ids.astype(np.int32))  # [T]
        next_tokens[boundary_rows] = boundary_tokens.astype(np.int32)
        residual = self.head.step(hidden, replace(batch, input_ids=next_tokens), kv)  # [T, H]
        if not len(boundary_rows):  # the step only ran prompt chunks: nothing to draft
            return xp.zeros((0, self.num_model_steps), dtype=np.int32)
        drafts = []
        residual = residual[boundary_rows]  # [S, H]
        positions = batch.positions[boundary_rows]  # [S]
        block_tables = batch.block_tables[batch.batch_id_per_token[boundary_rows]]  # [S, max_blocks]
        rows = xp.arange(len(boundary_rows), dtype=np.int32)  # [S]: each draft row is a request of its own
        block_size = kv.block_size
        for step in range(self.num_model_steps):
            token = argmax_rows(xp, self.head.logits(residual)).astype(np.int32)  # [S]
            drafts.append(token)
            if step + 1 == self.num_model_steps:
                break
            positions = xp.minimum(positions + 1, self.last_position)
            slots = block_tables[rows, positions // block_size] * block_size + positions % block_size  # [S]
            step_batch = DeviceBatch(token, positions, rows, slots.astype(np.int32), block_tables,
                                     batch.previous_tokens)
            residual = self.head.step(residual, step_batch, kv)  # [S, H]
        return xp.stack(drafts, axis=1)  # [S, num_model_steps]


class MTPProposer(Proposer):
    """Proposes, for each sequence, the drafts the head made for it at the end of its last step."""

    method = "mtp"

    def __init__(self) -> None:
        self._drafts: dict[int, np.ndarray] = {}  # seq_id -> [num_model_steps] int32

    def remember(self, seq_ids: Sequence[int], drafts: np.ndarray) -> None:
        """drafts [S, num_model_steps] (host) of the sampling sequences seq_ids [S] of a step."""
        for seq_id, row in zip(seq_ids, drafts):
            self._drafts[seq_id] = row

    def propose(self, requests: Sequence[DraftRequest]) -> list[Drafts]:
        proposals = []
        for request in requests:
            drafts = self._drafts.get(request.seq_id)
            proposals.append(NO_DRAFTS if drafts is None else Drafts(drafts[:request.max_drafts]))
        return proposals

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
