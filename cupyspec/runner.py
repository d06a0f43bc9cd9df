"""One forward pass plus sampling: from the scheduler's output to a token per sampling sequence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cupyspec.backend import Backend
from cupyspec.batch import FlatBatch, Segment, build_flat_batch
from cupyspec.model.kv_arrays import KVCacheArrays
from cupyspec.model.llama import LlamaModel
from cupyspec.outputs import TokenLogprob
from cupyspec.sampling.logprobs import compute_logprobs
from cupyspec.sampling.sampler import SamplingRow, sample
from cupyspec.scheduler import SchedulerOutput


@dataclass(frozen=True)
class StepInputs:
    """Everything `run` needs, captured on the event loop so the worker thread reads no live state."""

    batch: FlatBatch
    sample_rows: np.ndarray  # [S] int64: batch rows whose logits pick the next token
    sampling: tuple[SamplingRow, ...]  # [S]
    sample_seq_index: tuple[int, ...]  # [S]: index into the scheduled list
    prompt_rows: np.ndarray  # [P] int64: rows scoring the next prompt token
    prompt_targets: np.ndarray  # [P] int64: that next prompt token
    prompt_owner: tuple[tuple[int, int, int], ...]  # [P]: (scheduled index, target position, top k)


@dataclass(frozen=True)
class StepResult:
    """Per scheduled sequence: the sampled token (or None mid-prefill) and logprobs."""

    token_ids: tuple[int | None, ...]
    logprobs: tuple[TokenLogprob | None, ...]
    prompt_logprobs: tuple[tuple[tuple[int, TokenLogprob], ...], ...]  # (position, logprob) pairs


def _token_logprob(token_id: int, logprob: float, top_ids: np.ndarray, top_lps: np.ndarray, k: int) -> TokenLogprob:
    return TokenLogprob(int(token_id), float(logprob), tuple(zip(top_ids[:k].tolist(), top_lps[:k].tolist())))


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCacheArrays, backend: Backend) -> None:
        self.model, self.kv, self.backend = model, kv, backend

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        segments, sample_rows, sampling, sample_index = [], [], [], []
        prompt_rows, prompt_targets, prompt_owner = [], [], []
        row = 0
        for i, item in enumerate(sched.scheduled):
            seq, start, n = item.seq, item.num_computed_before, item.num_new_tokens
            segments.append(Segment(item.token_ids, start, list(seq.block_ids)))
            if seq.needs_prompt_logprobs:
                for pos in range(start, min(start + n, seq.num_prompt_tokens - 1)):
                    prompt_rows.append(row + pos - start)
                    prompt_targets.append(seq.prompt_token_ids[pos + 1])
                    prompt_owner.append((i, pos + 1, seq.params.prompt_logprobs))
            if item.samples:
                params = seq.params
                sample_rows.append(row + n - 1)
                sample_index.append(i)
                sampling.append(SamplingRow(
                    params=params,
                    uniform=0.0 if params.greedy else float(seq.rng.random()),
                    prompt_token_ids=np.asarray(seq.prompt_token_ids) if params.repetition_penalty != 1.0 else None,
                    output_token_ids=np.asarray(seq.output_token_ids) if params.has_penalties else None,
                ))
            row += n
        return StepInputs(
            batch=build_flat_batch(segments, self.kv.block_size),
            sample_rows=np.asarray(sample_rows, dtype=np.int64),
            sampling=tuple(sampling),
            sample_seq_index=tuple(sample_index),
            prompt_rows=np.asarray(prompt_rows, dtype=np.int64),
            prompt_targets=np.asarray(prompt_targets, dtype=np.int64),
            prompt_owner=tuple(prompt_owner),
        )

    def run(self, inputs: StepInputs) -> StepResult:
        """The forward pass and sampling; safe to call from a worker thread."""
        xp = self.backend.xp
        num_seqs = inputs.batch.num_seqs
        hidden = self.model.forward(inputs.batch, self.kv)  # [T, H]
        token_ids: list[int | None] = [None] * num_seqs
        logprobs: list[TokenLogprob | None] = [None] * num_seqs
        prompt_lps: list[list[tuple[int, TokenLogprob]]] = [[] for _ in range(num_seqs)]
        if len(inputs.sample_rows):
            logits = self.model.compute_logits(hidden[xp.asarray(inputs.sample_rows)])  # [S, V]
            out = sample(xp, logits, list(inputs.sampling))
            for j, i in enumerate(inputs.sample_seq_index):
                token_ids[i] = int(out.token_ids[j])
                k = inputs.sampling[j].params.logprobs
                if k is not None:
                    logprobs[i] = _token_logprob(out.token_ids[j], out.logprobs[j], out.top_token_ids[j],
                                                 out.top_logprobs[j], k)
        if len(inputs.prompt_rows):
            logits = self.model.compute_logits(hidden[xp.asarray(inputs.prompt_rows)])  # [P, V]
            k_max = max(k for _, _, k in inputs.prompt_owner)
            lps, top_ids, top_lps = compute_logprobs(xp, logits, inputs.prompt_targets, k_max)
            for j, (i, position, k) in enumerate(inputs.prompt_owner):
                prompt_lps[i].append((position, _token_logprob(inputs.prompt_targets[j], lps[j], top_ids[j],
                                                               top_lps[j], k)))
        return StepResult(tuple(token_ids), tuple(logprobs), tuple(tuple(p) for p in prompt_lps))
