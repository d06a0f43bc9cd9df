"""A step's inputs, formed on the host from the scheduler's output: the flat batch, the target rows
that pick or verify tokens, and the prompt rows that score prompt logprobs."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from cupyspec.model.batch import FlatBatch, flat_batch
from cupyspec.model.device_tokens import DeviceTokens
from cupyspec.sampling.params import SamplingParams
from cupyspec.sampling.sampler import SamplingRow
from cupyspec.sampling.uniforms import ACCEPT_STREAM, SAMPLE_STREAM, counter_uniforms
from cupyspec.scheduling.scheduler import SchedulerOutput
from cupyspec.scheduling.sequence import Sequence
from cupyspec.spec_decode.proposers.base import Drafts
from cupyspec.spec_decode.proposers.mtp import DraftSampling
from cupyspec.spec_decode.verification.verify import PLACEHOLDER_TOKEN_ID
from cupyspec.spec_decode.verification.verify_step import LogprobRequests


class StepInputs(NamedTuple):
    """Everything a step needs, captured on the event loop, so that a step run on the step thread (CPU)
    reads no live state (a tuple: one is made per step, on the host's critical path)."""

    batch: FlatBatch
    target_rows: np.ndarray  # [R] int64: batch rows whose logits pick (or verify) tokens
    sampling: tuple[SamplingRow, ...]  # [R]
    accept_uniforms: np.ndarray  # [R] float64: draws of the draft acceptance tests (0 for greedy rows)
    owners: tuple[int, ...]  # [S]: scheduled index of each sampling sequence
    first_rows: np.ndarray  # [S] int64: batch row of each sampling sequence's first target row
    drafts: np.ndarray  # [S, K] int64, PLACEHOLDER_TOKEN_ID past each sequence's drafts
    num_drafts: np.ndarray  # [S] int64
    logprobs: LogprobRequests  # [S]: logprobs and draft logprobs asked by each sampling sequence
    prompt_rows: np.ndarray  # [P] int64: rows scoring the next prompt token
    prompt_targets: np.ndarray  # [P] int64: that next prompt token
    prompt_owner: tuple[tuple[int, int, int], ...]  # [P]: (scheduled index, target position, top k)
    draft_probs: tuple[Any | None, ...] = ()  # [S]: q [k, V] of each sequence's drafts, where a draft model drew them
    draft_logprobs: np.ndarray | None = None  # [S, K] f32: the draft model's logprob of each draft (NaN: none)
    seq_ids: tuple[int, ...] = ()  # [S]: each sampling sequence's seq_id, for an MTP head
    next_token_ids: np.ndarray | None = None  # [T] int32: the token after each row, for an MTP head
    draft_sampling: DraftSampling | None = None  # the sampling sequences that draw an MTP head's drafts
    draft_ahead: bool = False  # an MTP head drafts for the next step (else it only mends its K/V: runner.py)
    # [T] int32: for the rows of a sequence whose step in flight verifies drafts, its index there (its
    # accepted drafts move the rows' positions on: device_tokens.py); -1 elsewhere; None: no such row
    shift_from: np.ndarray | None = None


def _sampling_rows(seq: Sequence, drafts: list[int]) -> list[SamplingRow]:
    """Rows for positions num_tokens .. num_tokens + len(drafts), uniforms still 0: penalties see
    the drafts before each row."""
    params = seq.params
    if not params.has_penalties:
        return [SamplingRow(params, 0.0)] * (len(drafts) + 1)
    prompt = np.asarray(seq.prompt_token_ids) if params.repetition_penalty != 1.0 else None
    return [SamplingRow(params, 0.0, prompt, np.asarray(seq.output_token_ids + drafts[:j]))
            for j in range(len(drafts) + 1)]


class _TargetRows:
    """The rows of a step that pick (or verify) tokens: each sampling sequence's last row and its
    drafts' rows, with their sampling parameters and random draws."""

    def __init__(self) -> None:
        self.rows: list[int] = []  # batch rows
        self.sampling: list[SamplingRow] = []
        self.owners: list[int] = []  # scheduled index of each sampling sequence
        self.first_rows: list[int] = []  # batch row of its first target row
        self.drafts: list[list[int]] = []  # its drafts
        self.proposals: list[Drafts | None] = []  # their draft model's distributions and logprobs
        self.params: list[SamplingParams] = []  # its parameters
        self.keys: list[int] = []  # its sampling key
        self._drawn, self._keys, self._positions = [], [], []  # rows that draw at random: index, key, position

    def add(self, index: int, seq: Sequence, drafts: list[int], first_row: int) -> None:
        """`seq`, scheduled at `index`, samples from batch rows first_row .. first_row + len(drafts)."""
        count = len(drafts) + 1
        self.owners.append(index)
        self.first_rows.append(first_row)
        self.drafts.append(drafts)
        self.proposals.append(seq.proposal.first(len(drafts)) if seq.proposal is not None and drafts else None)
        self.params.append(seq.params)
        self.keys.append(seq.sampling_key)
        self.rows.extend(range(first_row, first_row + count))
        if not seq.params.greedy:
            self._drawn.extend(range(len(self.sampling), len(self.sampling) + count))
            self._keys.extend([seq.sampling_key] * count)
            self._positions.extend(range(seq.num_tokens, seq.num_tokens + count))
        self.sampling += _sampling_rows(seq, drafts)

    def draw_uniforms(self) -> np.ndarray:
        """Set the sampling draw of the rows that draw at random; return every row's acceptance draw [R].

        Greedy rows ignore their draws (and a greedy row's acceptance test is 0 < p, p in {0, 1}): 0.
        """
        accept_uniforms = np.zeros(len(self.sampling), dtype=np.float64)
        if self._drawn:
            keys, positions = np.array(self._keys, dtype=np.uint64), np.array(self._positions, dtype=np.int64)
            for r, u in zip(self._drawn, counter_uniforms(keys, positions, SAMPLE_STREAM).tolist()):
                self.sampling[r] = self.sampling[r]._replace(uniform=u)
            accept_uniforms[self._drawn] = counter_uniforms(keys, positions, ACCEPT_STREAM)
        return accept_uniforms


class _PromptRows:
    """The rows of a step that score the next prompt token, for prompt logprobs."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.targets: list[int] = []
        self.owner: list[tuple[int, int, int]] = []  # (scheduled index, target position, top k)

    def add(self, index: int, seq: Sequence, start: int, num_new: int, first_row: int) -> None:
        """The rows of a segment of `num_new` tokens from position `start`, its first at `first_row`."""
        for pos in range(start, min(start + num_new, seq.num_prompt_tokens - 1)):
            self.rows.append(first_row + pos - start)
            self.targets.append(seq.prompt_token_ids[pos + 1])
            self.owner.append((index, pos + 1, seq.params.prompt_logprobs))


def _drafts_array(draft_lists: list[list[int]]) -> np.ndarray:
    """[S, K] int64: each sequence's drafts, PLACEHOLDER_TOKEN_ID past them."""
    max_drafts = max(map(len, draft_lists), default=0)
    drafts = np.full((len(draft_lists), max_drafts), PLACEHOLDER_TOKEN_ID, dtype=np.int64)
    if max_drafts:
        for s, d in enumerate(draft_lists):
            drafts[s, :len(d)] = d
    return drafts


def _draft_logprobs(proposals: list[Drafts | None], max_drafts: int) -> np.ndarray | None:
    """[S, K] f32: the draft model's logprob of each draft, NaN where there is none; None when no
    sequence has any."""
    if all(p.logprobs is None for p in proposals if p is not None):
        return None
    out = np.full((len(proposals), max_drafts), np.nan, dtype=np.float32)
    for s, proposal in enumerate(proposals):
        if proposal is not None and proposal.logprobs is not None:
            out[s, :len(proposal)] = proposal.logprobs
    return out


def _draft_sampling(targets: _TargetRows) -> DraftSampling | None:
    """The sampling sequences that draw at random, for an MTP head's drafting; None if none does."""
    rows = [s for s, p in enumerate(targets.params) if not p.greedy]
    if not rows:
        return None
    return DraftSampling(np.array(rows, dtype=np.int64), tuple(targets.params[s] for s in rows),
                         np.array([targets.keys[s] for s in rows], dtype=np.uint64))


def _next_tokens(batch: FlatBatch, afters: list[int]) -> np.ndarray:
    """[T] int32: the token after each row of the batch, the next row's within a segment and `afters`
    [B] after each segment's last row."""
    next_ids = np.empty_like(batch.input_ids)
    next_ids[:-1] = batch.input_ids[1:]
    next_ids[batch.cu_seqlens_q[1:] - 1] = afters
    return next_ids


def prepare_inputs(sched: SchedulerOutput, block_size: int, device_tokens: DeviceTokens | None = None,
                   draft_ahead: bool = True) -> StepInputs:
    """The flat batch of the scheduled segments (each a prefill chunk, one token, or [last token,
    d1..dk]), the rows that pick or verify tokens with their sampling rows and random draws, and the
    rows that score prompt tokens for prompt logprobs. With an MTP head (device_tokens: where the step
    before left its tokens and drafts) also what the head reads, the sampling sequences' ids and the
    token after each row where the host knows it (a segment's next one; 0 after a sampling segment's
    last row), and the rows whose positions move on by the drafts a step in flight accepts; and
    whether the head drafts for the next step (`draft_ahead`)."""
    for_mtp = device_tokens is not None
    token_ids: list[int] = []
    afters: list[int] = []  # with an MTP head: the token after each segment's last row
    shifted: list[tuple[int, int, int]] = []  # (first row, rows, sequence index in the step in flight)
    lengths, starts, block_ids = [], [], []
    targets, prompt = _TargetRows(), _PromptRows()
    row = 0
    for i, item in enumerate(sched.scheduled):
        seq, start, n = item.seq, item.num_computed_before, item.num_new_tokens
        drafts = seq.draft_token_ids[:item.num_lookahead_tokens]
        segment = item.token_ids + drafts
        token_ids += segment
        if for_mtp:
            afters.append(0 if item.samples else seq.tokens(start + n, start + n + 1)[0])
            if seq.num_held_drafts:  # the segment starts at the place its step in flight holds
                shifted.append((row, n + len(drafts), device_tokens.sequence_of(segment[0])))
        lengths.append(n + len(drafts))
        starts.append(start)
        block_ids.append(seq.block_ids)
        if seq.needs_prompt_logprobs:
            prompt.add(i, seq, start, n, row)
        if item.samples:
            targets.add(i, seq, drafts, row + n - 1)
        row += n + len(drafts)
    accept_uniforms = targets.draw_uniforms()
    drafts = _drafts_array(targets.drafts)
    proposed = any(p is not None for p in targets.proposals)  # a draft model made some drafts
    shift_from = None
    if shifted:
        shift_from = np.full(len(token_ids), -1, dtype=np.int32)
        for first, rows, s in shifted:
            shift_from[first:first + rows] = s
    batch = flat_batch(token_ids, lengths, starts, block_ids, block_size)
    return StepInputs(
        batch=batch,
        target_rows=np.array(targets.rows, dtype=np.int64),
        sampling=tuple(targets.sampling),
        accept_uniforms=accept_uniforms,
        owners=tuple(targets.owners),
        first_rows=np.array(targets.first_rows, dtype=np.int64),
        drafts=drafts,
        num_drafts=np.array([len(d) for d in targets.drafts], dtype=np.int64),
        logprobs=LogprobRequests(tuple(p.logprobs for p in targets.params),
                                 tuple(p.include_draft_logprobs for p in targets.params),
                                 tuple(p.render_logprobs for p in targets.params)),
        prompt_rows=np.array(prompt.rows, dtype=np.int64),
        prompt_targets=np.array(prompt.targets, dtype=np.int64),
        prompt_owner=tuple(prompt.owner),
        draft_probs=tuple(p.probs if p is not None else None for p in targets.proposals) if proposed else (),
        draft_logprobs=_draft_logprobs(targets.proposals, drafts.shape[1]) if proposed else None,
        seq_ids=tuple(sched.scheduled[i].seq.seq_id for i in targets.owners) if for_mtp else (),
        next_token_ids=_next_tokens(batch, afters) if for_mtp else None,
        draft_sampling=_draft_sampling(targets) if for_mtp and draft_ahead else None,
        draft_ahead=for_mtp and draft_ahead,
        shift_from=shift_from,
    )
