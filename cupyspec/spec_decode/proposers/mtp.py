"""MTP drafting: the head runs on the device in a step, and its drafts serve the next one.

Two parts, each over device arrays only, so that both run inside CUDA graphs:

1. Catch-up, beside the target's forward pass (`MTPDrafting.catch_up`): the head's K/V at every row
   of the step, from the target's hidden state there and the token after the row where the host
   knows it (the segment's next one; 0 after a sequence's last row, whose next token the step
   emits). K/V alone: nothing reads the head's output at these rows.
2. Drafting, after sampling or verification (`MTPDrafting.draft`): from each sampling sequence's
   boundary row (its last accepted row) and the token the step emitted after it, `num_model_steps`
   head steps, each on the residual and draft of the one before, one position further. The first
   rewrites the K/V that the catch-up wrote at the boundary with a guessed next token. A greedy
   sequence drafts the head's argmax; one that samples draws its draft from the head's distribution
   q under its own temperature, top-k, top-p and min-p (penalties left out), with the counter-based
   draw of the draft's position (`DRAFT_STREAM`), and q goes to verification with the draft.
   Drafting runs in a step that drafts ahead (the back-off plan drafts: cupyspec/spec_decode/
   drafter.py); in the others `MTPDrafting.mend` writes the boundary's K/V alone.

So every position below a sequence's length holds the head's K/V of its true next token: rows past
a boundary (rejected drafts) and drafting steps 2.. write K/V only at positions that the next
step's rows rewrite before anything reads them. `MTPProposer` hands the drafts of a sequence's last
step to the drafter as the proposal for its next one (none after a step that did not draft).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np

from cupyspec.config import ModelConfig
from cupyspec.loader.default_model import shipped_mtp_head
from cupyspec.model.batch import DeviceBatch
from cupyspec.model.kv_arrays import KVCacheArrays
from cupyspec.model.llama import LlamaModel
from cupyspec.model.mtp import MTPHead, load_head_weights
from cupyspec.sampling.argmax import argmax_logprobs
from cupyspec.sampling.params import SamplingParams
from cupyspec.sampling.sampler import inverse_cdf, rank_probs
from cupyspec.sampling.uniforms import DRAFT_STREAM, counter_uniforms
from cupyspec.spec_decode.proposers.base import NO_DRAFTS, DraftRequest, Drafts, Proposer
from cupyspec.spec_decode.speculative_config import SpeculativeConfig
from cupyspec.transfer import to_device


@dataclass(frozen=True)
class DraftSampling:
    """The drafting rows that draw at random, with their requests' parameters and sampling keys."""

    rows: np.ndarray  # [Sd] int64: indices among the step's sampling sequences
    params: tuple[SamplingParams, ...]  # [Sd]
    keys: np.ndarray  # [Sd] uint64


class Drafted(NamedTuple):
    """The head's drafts of a step's sampling sequences (device arrays)."""

    tokens: Any  # [S, num_model_steps] int32
    logprobs: Any  # [S, num_model_steps] f32: the head's logprob of each (log-softmax over its draft vocabulary)
    probs: Any | None = None  # [Sd, num_model_steps, V] f32: q of the rows that draw (DraftSampling.rows)


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
              kv: KVCacheArrays, sampling: DraftSampling | None = None) -> Drafted:
        """The drafts of S boundaries: hidden [S, H] fp32 the target's hidden state at each boundary
        row, tokens [S] the token emitted after it, positions [S] int32 its position, block_tables
        [S, W] int32 its sequence's blocks; previous: the placeholder tokens of DeviceBatch (unused
        here); sampling: the rows that draw at random (None: every row is greedy)."""
        xp, steps = self.head.target.backend.xp, self.num_model_steps
        rows = xp.arange(len(tokens), dtype=np.int32)  # [S]: each row a sequence of its own
        # [steps, S]: the position and KV slot of each head step, worked out at once
        at = xp.minimum(positions[None, :] + xp.arange(steps, dtype=np.int32)[:, None], self.last_position)
        slots = _slots(block_tables, rows[None, :], at, kv.block_size)
        tokens, drafts, logprobs, probs = tokens.astype(np.int32), [], [], []
        for step in range(steps):
            batch = DeviceBatch(tokens, at[step], rows, slots[step], block_tables, previous)
            hidden = self.head.step(hidden, batch, kv)  # [S, H]
            logits = self.head.logits(hidden)  # [S, Vd]
            picks, logprob = argmax_logprobs(xp, logits)  # [S] columns of logits, [S]
            if sampling is not None:
                draft_positions = at[step] + 2  # a head step at p predicts the token at p + 2
                q = draw_drafts(xp, logits, draft_positions, sampling, picks, logprob)  # [Sd, Vd]
                probs.append(self._in_vocab(xp, q))
            tokens = self.head.token_ids(picks).astype(np.int32)
            drafts.append(tokens)
            logprobs.append(logprob)
        return Drafted(xp.stack(drafts, axis=1), xp.stack(logprobs, axis=1),
                       xp.stack(probs, axis=1) if probs else None)

    def _in_vocab(self, xp: Any, q: Any) -> Any:
        """q [Sd, Vd] over the head's draft vocabulary -> [Sd, V] over the target's."""
        if self.head.draft_vocab is None:
            return q
        full = xp.zeros((q.shape[0], self.head.target.config.vocab_size), dtype=q.dtype)  # [Sd, V]
        full[:, self.head.draft_vocab] = q
        return full

    def draft_from(self, hidden: Any, batch: DeviceBatch, boundary_rows: Any, tokens: Any, kv: KVCacheArrays,
                   sampling: DraftSampling | None = None) -> Drafted:
        """`draft` from the boundary rows [S] of an eager step: hidden [T, H], the step's batch."""
        return self.draft(*_boundaries(hidden, batch, boundary_rows, tokens), kv, sampling)

    def mend(self, hidden: Any, tokens: Any, positions: Any, block_tables: Any, previous: Any,
             kv: KVCacheArrays) -> None:
        """The K/V that `draft`'s first step writes at S boundaries (`draft`'s arguments), alone: where
        the head does not draft, the K/V there must still hold the emitted token, not the catch-up's
        guess."""
        xp = self.head.target.backend.xp
        rows = xp.arange(len(tokens), dtype=np.int32)  # [S]
        slots = _slots(block_tables, rows, positions, kv.block_size)  # [S]
        self.head.write_kv(hidden, DeviceBatch(tokens.astype(np.int32), positions, rows, slots, block_tables, previous),
                           kv)

    def mend_from(self, hidden: Any, batch: DeviceBatch, boundary_rows: Any, tokens: Any, kv: KVCacheArrays) -> None:
        """`mend` at the boundary rows [S] of an eager step: hidden [T, H], the step's batch."""
        self.mend(*_boundaries(hidden, batch, boundary_rows, tokens), kv)


def _boundaries(hidden: Any, batch: DeviceBatch, rows: Any, tokens: Any) -> tuple[Any, ...]:
    """`MTPDrafting.draft`'s first arguments for the boundary rows [S] of an eager step's batch."""
    block_tables = batch.block_tables[batch.batch_id_per_token[rows]]  # [S, W]
    return hidden[rows], tokens, batch.positions[rows], block_tables, batch.previous_tokens


def _slots(block_tables: Any, rows: Any, positions: Any, block_size: int) -> Any:
    """The KV slots of `positions` in the sequences of block_tables [S, W] at `rows` (broadcast alike)."""
    return block_tables[rows, positions // block_size] * block_size + positions % block_size


def draw_drafts(xp: Any, logits: Any, positions: Any, sampling: DraftSampling, picks: Any,
                logprobs: Any) -> Any:
    """Draw the drafts of the sampling rows from q, the head's logits [S, V] under their requests'
    parameters, with the draw of each draft's position [S]: into picks [S] (int64, columns of the
    logits) and their head logprobs into logprobs [S]; returns q [Sd, V] f32 in column order."""
    index = to_device(xp, sampling.rows)  # [Sd]
    x = logits[index]  # [Sd, V]
    ranked = rank_probs(xp, x, sampling.params)
    uniforms = counter_uniforms(to_device(xp, sampling.keys), positions[index], DRAFT_STREAM)  # [Sd]
    ranks = inverse_cdf(xp, ranked.weights, uniforms[:, None])  # [Sd]
    drawn = xp.take_along_axis(ranked.order, ranks[:, None], axis=1)[:, 0]  # [Sd]
    picks[index] = drawn
    top = x.max(axis=1, keepdims=True)  # [Sd, 1]
    log_total = top[:, 0] + xp.log(xp.exp(x - top).sum(axis=1))  # [Sd]
    logprobs[index] = xp.take_along_axis(x, drawn[:, None], axis=1)[:, 0] - log_total
    q = xp.zeros(x.shape, dtype=np.float32)  # [Sd, V]
    q[xp.arange(len(index))[:, None], ranked.order] = ranked.weights / ranked.weights.sum(axis=1, keepdims=True)
    return q


class CollectedDrafts:
    """A collected step's drafts, brought to the host when first read."""

    def __init__(self, fetch: Callable[[], Sequence[np.ndarray]]) -> None:
        self._fetch: Callable[[], Sequence[np.ndarray]] | None = fetch
        self._arrays: Sequence[np.ndarray] = ()  # drafts and head logprobs, each [S, num_model_steps]

    def row(self, s: int) -> tuple[np.ndarray, np.ndarray]:
        """Sequence s's drafts and their head logprobs."""
        if self._fetch is not None:
            self._arrays, self._fetch = self._fetch(), None
        return self._arrays[0][s], self._arrays[1][s]


class MTPProposer(Proposer):
    """Proposes, for each sequence, the drafts the head made for it in its last step: the drafts of
    its last collected step, or, while a step is in flight for it (its context ends with a
    placeholder), the placeholder ids of the drafts that step makes on the device."""

    method = "mtp"
    drafts_ahead = True

    def __init__(self) -> None:
        # seq_id -> its last collected step's drafts (CollectedDrafts), its row there and its q (or None)
        self._drafts: dict[int, tuple[CollectedDrafts, int, Any | None]] = {}
        self._held: dict[int, tuple[object, np.ndarray]] = {}  # seq_id -> (its step in flight, placeholder ids)
        self._drafting: dict[int, bool] = {}  # seq_id -> whether the head drafts in its last launched step

    def launched(self, seq_ids: Sequence[int], step: object, drafting: bool,
                 placeholders: np.ndarray | None = None) -> None:
        """At the launch of `step` (any object unique to it) over the sampling sequences seq_ids [S]:
        whether the head drafts in it for their next step and, when the step is overlapped, the
        placeholder ids [S, num_model_steps] int32 its drafts have on the device until it is
        collected (cupyspec/model/device_tokens.py). A step that does not draft leaves them no drafts
        (bookkeeping that runs on every step under load, hence dict-wide operations)."""
        self._drafting.update(dict.fromkeys(seq_ids, drafting))
        if placeholders is not None:
            self._held.update(zip(seq_ids, zip([step] * len(seq_ids), placeholders)))
        elif self._held:
            for seq_id in seq_ids:
                self._held.pop(seq_id, None)
        if not drafting and self._drafts:
            for seq_id in seq_ids:
                self._drafts.pop(seq_id, None)

    def remember(self, seq_ids: Sequence[int], fetch: Callable[[], Sequence[np.ndarray]],
                 probs: dict[int, Any] | None = None, step: object = None) -> None:
        """The drafts of the sampling sequences seq_ids [S] of a collected step: `fetch` returns them
        [S, num_model_steps] int32 with the head's logprob of each [S, num_model_steps] f32 (host),
        when first proposed (the step's outputs are processed meanwhile); probs: s -> q
        [num_model_steps, V] (device) of the sequences that drew their drafts. A sequence whose step
        launched since does not draft keeps none of them."""
        probs, collected = probs or {}, CollectedDrafts(fetch)
        for s, seq_id in enumerate(seq_ids):
            if not self._drafting.get(seq_id, True):
                continue
            self._drafts[seq_id] = collected, s, probs.get(s)
            held = self._held.get(seq_id)
            if held is not None and held[0] is step:
                del self._held[seq_id]

    def has_drafts(self) -> bool:
        return bool(self._drafts or self._held)

    def made_for(self, seq_id: int) -> Drafts | None:
        """The drafts the head made for a sequence's next step in its last collected step (a prefill
        server ships them with the first token: cupyspec/disagg/); None where it made none."""
        entry = self._drafts.get(seq_id)
        if entry is None:
            return None
        collected, s, probs = entry
        tokens, logprobs = collected.row(s)
        return Drafts(tokens.copy(), probs, logprobs.copy())

    def adopt(self, seq_id: int, drafts: Drafts) -> None:
        """Propose `drafts`, made by another engine's head (`made_for`), for the sequence's next step,
        as if the head had made them here."""
        arrays = (drafts.token_ids[None], drafts.logprobs[None])  # each [1, K]
        self._drafts[seq_id] = CollectedDrafts(lambda: arrays), 0, drafts.probs

    def propose(self, requests: Sequence[DraftRequest]) -> list[Drafts]:
        proposals = []
        for request in requests:
            if request.token_ids[-1] < 0:  # a step in flight: its drafts, on the device
                held = self._held.get(request.seq_id)
                proposals.append(NO_DRAFTS if held is None else Drafts(held[1]).first(request.max_drafts))
                continue
            entry = self._drafts.get(request.seq_id)
            if entry is None:
                proposals.append(NO_DRAFTS)
                continue
            collected, s, probs = entry
            tokens, logprobs = collected.row(s)
            proposals.append(Drafts(tokens, probs, logprobs).first(request.max_drafts))
        return proposals

    def on_sequence_finished(self, seq_id: int, request_id: str, token_ids: np.ndarray, num_prompt_tokens: int) -> None:
        self._drafts.pop(seq_id, None)
        self._held.pop(seq_id, None)
        self._drafting.pop(seq_id, None)


def head_file(config: SpeculativeConfig, served_model: str) -> tuple[str, str | None]:
    """The MTP head's file (config.model, else the head shipped for `served_model`, a model name or
    path) and the sha256 it must have (None: unchecked); ValueError when there is none."""
    if config.model:
        return config.model, None
    shipped = shipped_mtp_head(served_model)
    if shipped is None:
        raise ValueError(f"speculative config: method 'mtp' needs 'model' (the MTP weights): no head ships "
                         f"for {served_model!r}")
    path, sha256 = shipped
    return str(path), sha256


def mtp_head_weights(config: SpeculativeConfig, target: ModelConfig, served_model: str) -> dict[str, np.ndarray]:
    """The weights of the head `head_file` names, checked against the target's shape `target`."""
    path, sha256 = head_file(config, served_model)
    return load_head_weights(path, target, sha256)


def make_mtp_drafting(config: SpeculativeConfig, target: LlamaModel, mtp: MTPProposer | None,
                      max_model_len: int, weights: dict[str, np.ndarray] | None) -> MTPDrafting | None:
    """The head's drafting for the proposer `mtp` (factory.mtp_proposer) over `target`, from the
    head's weights (`mtp_head_weights`, or a rank's shard of them), packed by the config's
    quantization or else the target's; None when the config speculates otherwise."""
    if mtp is None:
        return None
    head = MTPHead(target, weights, config.quantization or target.quantization)
    return MTPDrafting(head, config.num_model_steps, mtp, max_model_len)
