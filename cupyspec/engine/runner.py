"""One engine step on the device: forward pass, then sampling or verification of drafts.

Without speculation each sequence that reaches its last token samples one token from its last
row. With speculation its segment is [last token, d1..dk] and rows 0..k are verified together:
the step emits the accepted drafts plus one bonus or correction token (k = 0 is plain decoding
through the speculative path).

A step is launched, then collected. Launching queues the step's device work and the copies of its
results to the host, and returns at once (on a GPU); `LaunchedStep.ready` tells when collecting
would not wait. A plain step's sampled tokens also stay on the device, in `sampled_tokens`, where
the next step's placeholder input ids (~s for the step's sampling sequence s) find them. So the
engine can form and launch step N+1 before it has seen the tokens of step N (overlap scheduling).
"""

from __future__ import annotations

import contextlib
import functools
from itertools import repeat
from typing import Any, NamedTuple

import numpy as np

from cupyspec.backend import Backend
from cupyspec.model.batch import DeviceBatch, FlatBatch, flat_batch
from cupyspec.logprobs.graphs import LogprobGraphs
from cupyspec.model.cuda_graphs import CudaGraphs
from cupyspec.model.kv_arrays import KVCacheArrays
from cupyspec.model.llama import LlamaModel
from cupyspec.outputs import DraftLogprob, TokenLogprob
from cupyspec.logprobs.logprob_json import LogprobRenderer, LogprobsJSON, VocabJSON
from cupyspec.logprobs.logsoftmax_topk import logprobs_on_device
from cupyspec.sampling.params import SamplingParams
from cupyspec.sampling.sampler import SamplerOutput, SamplingRow, max_logprobs, sample_tokens_on_device
from cupyspec.sampling.uniforms import ACCEPT_STREAM, SAMPLE_STREAM, counter_uniforms
from cupyspec.scheduling.scheduler import SchedulerOutput
from cupyspec.scheduling.sequence import Sequence
from cupyspec.spec_decode.speculative_config import SpeculativeConfig
from cupyspec.spec_decode.verification.verify import PLACEHOLDER_TOKEN_ID, VerifyInput
from cupyspec.spec_decode.verification.verify_step import LogprobRequests, LogprobStream, PendingVerdict, StepVerdict, launch_verify
from cupyspec.text.token_text import TokenBytes, TokenText
from cupyspec.transfer import HostTransfer, to_device


SAMPLER_ARRAYS = 4  # sample_on_device's arrays when a row asks for logprobs: tokens, logprobs, top ids and logprobs


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


class SeqStepOutput(NamedTuple):
    """What one scheduled sequence got from the step (a tuple: one is made per sequence and step)."""

    token_ids: tuple[int, ...] = ()  # emitted tokens; empty for a prefill chunk that ends mid-prompt
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per emitted token, when asked
    num_drafts: int = 0
    accepted: tuple[bool, ...] = ()  # per draft
    draft_logprobs: tuple[DraftLogprob, ...] | None = None  # per draft, when asked
    prompt_logprobs: tuple[tuple[int, TokenLogprob], ...] = ()  # (prompt position, logprob)
    logprobs_json: LogprobsJSON | None = None  # one entry per emitted token, when asked rendered


class LaunchedStep(NamedTuple):
    """A step whose device work is queued; `ModelRunner.collect` turns it into outputs."""

    inputs: StepInputs
    transfer: HostTransfer  # the sampled tokens (and logprobs) of a plain step, then the prompt logprobs
    num_sample_arrays: int  # how many of the transferred arrays sampling filled (0: none, or verified)
    verdict: PendingVerdict | None  # a speculative step's verification

    def ready(self) -> bool:
        """Whether its results, but a verified step's logprobs, are on the host (collecting would not wait)."""
        return self.transfer.done() and (self.verdict is None or self.verdict.done())


def _token_logprob(token_id: int, logprob: float, top_ids: np.ndarray, top_lps: np.ndarray, k: int) -> TokenLogprob:
    return TokenLogprob(int(token_id), float(logprob), top_ids[:k].tolist(), top_lps[:k].tolist())


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
        self.params: list[SamplingParams] = []  # its parameters
        self._drawn, self._keys, self._positions = [], [], []  # rows that draw at random: index, key, position

    def add(self, index: int, seq: Sequence, drafts: list[int], first_row: int) -> None:
        """`seq`, scheduled at `index`, samples from batch rows first_row .. first_row + len(drafts)."""
        count = len(drafts) + 1
        self.owners.append(index)
        self.first_rows.append(first_row)
        self.drafts.append(drafts)
        self.params.append(seq.params)
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


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCacheArrays, backend: Backend, speculative: SpeculativeConfig,
                 overlap_logprobs: bool = True, cuda_graph_max_tokens: int = 0, max_model_len: int = 0,
                 max_num_seqs: int = 256, tokenizer: TokenBytes | None = None) -> None:
        """cuda_graph_max_tokens: on a GPU, steps of up to this many rows replay CUDA graphs (0: none).
        tokenizer: the tokens' bytes, for logprobs rendered as chat JSON entries."""
        self.model, self.kv, self.backend, self.speculative = model, kv, backend, speculative
        self.tokenizer = tokenizer
        xp = backend.xp
        cuda = xp.cuda if backend.is_cuda else None
        self.stream = cuda.Stream(non_blocking=True) if cuda else contextlib.nullcontext()
        # the CUDA stream that computes a speculative step's logprobs beside verification
        self.logprob_stream = LogprobStream(cuda) if cuda and overlap_logprobs else None
        self.sampled_tokens = xp.zeros(max_num_seqs, dtype=np.int32)  # [S] the last plain step's tokens
        self.graphs = (CudaGraphs(model, kv, self.stream, cuda_graph_max_tokens, max_model_len, self.sampled_tokens)
                       if cuda and cuda_graph_max_tokens else None)
        # the logprob work of steps, replayed over the graphs' logits
        self.logprob_graphs = (LogprobGraphs(xp, self.graphs.logits, speculative.num_speculative_tokens)
                               if self.graphs is not None else None)

    @functools.cached_property
    def renderer(self) -> LogprobRenderer:
        """Renders chat logprob entries; its vocabulary table is built on first use (the texts of
        every token, cached on the way, are then let go)."""
        if self.tokenizer is None:
            raise ValueError("rendering logprobs needs the tokenizer (ModelRunner's tokenizer)")
        vocab = VocabJSON.build(TokenText(self.tokenizer), self.model.config.vocab_size)
        return LogprobRenderer(self.backend.xp, vocab)

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        token_ids: list[int] = []
        lengths, starts, block_ids = [], [], []
        targets, prompt = _TargetRows(), _PromptRows()
        row = 0
        for i, item in enumerate(sched.scheduled):
            seq, start, n = item.seq, item.num_computed_before, item.num_new_tokens
            drafts = seq.draft_token_ids[:item.num_lookahead_tokens]
            token_ids += item.token_ids
            token_ids += drafts
            lengths.append(n + len(drafts))
            starts.append(start)
            block_ids.append(seq.block_ids)
            if seq.needs_prompt_logprobs:
                prompt.add(i, seq, start, n, row)
            if item.samples:
                targets.add(i, seq, drafts, row + n - 1)
            row += n + len(drafts)
        accept_uniforms = targets.draw_uniforms()
        return StepInputs(
            batch=flat_batch(token_ids, lengths, starts, block_ids, self.kv.block_size),
            target_rows=np.array(targets.rows, dtype=np.int64),
            sampling=tuple(targets.sampling),
            accept_uniforms=accept_uniforms,
            owners=tuple(targets.owners),
            first_rows=np.array(targets.first_rows, dtype=np.int64),
            drafts=_drafts_array(targets.drafts),
            num_drafts=np.array([len(d) for d in targets.drafts], dtype=np.int64),
            logprobs=LogprobRequests(tuple(p.logprobs for p in targets.params),
                                     tuple(p.include_draft_logprobs for p in targets.params),
                                     tuple(p.render_logprobs for p in targets.params)),
            prompt_rows=np.array(prompt.rows, dtype=np.int64),
            prompt_targets=np.array(prompt.targets, dtype=np.int64),
            prompt_owner=tuple(prompt.owner),
        )

    def launch(self, inputs: StepInputs) -> LaunchedStep:
        """Queue the forward pass, sampling or verification, logprobs and the copies of the results to
        the host; on a GPU nothing waits for the device. Safe on the step thread."""
        xp = self.backend.xp
        with self.stream:  # CUDA: the whole step on one stream, the graphs' (a no-op context on the CPU)
            target_logits, prompt_logits, static = self._logits(inputs)
            arrays, verdict = [], None
            if target_logits is not None and inputs.num_drafts.any():
                verdict = launch_verify(
                    xp, target_logits,
                    VerifyInput(inputs.drafts, inputs.num_drafts, None, inputs.sampling, inputs.accept_uniforms),
                    inputs.logprobs, self.speculative.verify_strategy, self.speculative.accept_policy,
                    self.logprob_stream, self.renderer if inputs.logprobs.renders else None, self.logprob_graphs,
                    inputs.first_rows if static else None)
            elif target_logits is not None:
                tokens = sample_tokens_on_device(xp, target_logits, inputs.sampling)
                self.sampled_tokens[:len(inputs.owners)] = tokens
                k = max_logprobs(inputs.sampling)
                replayed = self._replay_logprobs(tokens, k, inputs) if static and prompt_logits is None else None
                if replayed is not None:
                    return LaunchedStep(inputs, replayed, SAMPLER_ARRAYS + int(inputs.logprobs.renders), None)
                arrays = [tokens] if k is None else [tokens, *logprobs_on_device(xp, target_logits, tokens, k)]
                if inputs.logprobs.renders:  # each row is its request's: entries of its token
                    rows = len(inputs.owners)
                    arrays.append(self.renderer.render(xp, *arrays, k, to_device(xp, inputs.logprobs.render_k), rows,
                                                       rows))
            num_sample_arrays = len(arrays)
            if prompt_logits is not None:
                k_max = max(k for _, _, k in inputs.prompt_owner)
                arrays += logprobs_on_device(xp, prompt_logits, inputs.prompt_targets, k_max)
            return LaunchedStep(inputs, HostTransfer(xp, arrays), num_sample_arrays, verdict)

    def _replay_logprobs(self, tokens: Any, k: int | None, inputs: StepInputs) -> HostTransfer | None:
        """A plain step's logprobs of its sampled tokens [R] (top k) by a CUDA graph over the static
        logits: the transfer of the tokens, their logprobs (and entries); None where no graph replays them."""
        if k is None or self.logprob_graphs is None:
            return None
        graph = self.logprob_graphs.find_plain(len(inputs.owners), k,
                                               self.renderer if inputs.logprobs.renders else None)
        slot = graph.free_slot() if graph is not None else None
        return graph.launch(slot, tokens, inputs.target_rows, inputs.logprobs.render_k) if slot is not None else None

    def collect(self, step: LaunchedStep, logprobs: bool = True) -> list[SeqStepOutput]:
        """Wait for a launched step's results; each scheduled sequence's output, in order. Without
        `logprobs` a verified step's come later, from `add_logprobs`."""
        inputs, host = step.inputs, step.transfer.result()
        outputs = [SeqStepOutput()] * inputs.batch.num_seqs
        if step.verdict is not None:
            by_sampler = _verified_outputs(step.verdict.result(logprobs), inputs)
        elif step.num_sample_arrays:
            sampled = host[:step.num_sample_arrays]
            by_sampler = _sampled_outputs(SamplerOutput.from_host(sampled[:SAMPLER_ARRAYS]), sampled[SAMPLER_ARRAYS:],
                                          inputs, self.renderer if inputs.logprobs.renders else None)
        else:
            by_sampler = {}
        for s, out in by_sampler.items():
            outputs[inputs.owners[s]] = out
        if inputs.prompt_owner:
            _add_prompt_logprobs(host[step.num_sample_arrays:], inputs, outputs)
        return outputs

    @staticmethod
    def add_logprobs(step: LaunchedStep, outputs: list[SeqStepOutput]) -> list[SeqStepOutput]:
        """`collect(step, logprobs=False)`'s outputs with a verified step's token and draft logprobs
        (a plain step's come with its tokens)."""
        if step.verdict is None or not step.inputs.logprobs.any:
            return outputs
        per_sampler, owners = step.verdict.logprobs(), step.inputs.owners  # (tokens, rendered, drafts), each [S]
        if len(owners) < len(outputs):  # some sequences only ran their prompts: None for them
            per_sampler = [_scattered(values, owners, len(outputs)) for values in per_sampler]
        tokens, rendered, drafts = per_sampler
        token_ids, _, num_drafts, accepted, _, prompt_logprobs, _ = zip(*outputs)
        # made column by column in C: one output per sequence and step, and at 64 sequences calling
        # SeqStepOutput for each (or `_replace`) took the host 30-60 µs a step
        return list(map(tuple.__new__, repeat(SeqStepOutput), zip(token_ids, tokens, num_drafts, accepted, drafts,
                                                                   prompt_logprobs, rendered)))

    def _logits(self, inputs: StepInputs) -> tuple[Any | None, Any | None, bool]:
        """Logits [R, V] f32 of the target rows and [P, V] of the prompt-logprob rows (None: no rows),
        and whether every row's logits are in the graphs' static buffer too (a row per batch row).

        Through a CUDA graph when one holds the batch (logits of every row come out); else eagerly,
        with the LM head applied to the rows that need it only.
        """
        xp = self.backend.xp
        every_row = self.graphs.run(inputs.batch) if self.graphs is not None else None  # [T, V] or None
        if every_row is None:
            hidden = self.model.forward(DeviceBatch.of(xp, inputs.batch, self.sampled_tokens), self.kv)  # [T, H]

        def rows_logits(rows: np.ndarray) -> Any:
            if every_row is None:
                return self.model.compute_logits(hidden[to_device(xp, rows)])
            return every_row if len(rows) == len(every_row) else every_row[to_device(xp, rows)]

        target_logits, prompt_logits = (rows_logits(rows) if len(rows) else None
                                        for rows in (inputs.target_rows, inputs.prompt_rows))
        return target_logits, prompt_logits, every_row is not None


def _scattered(values: tuple, owners: tuple[int, ...], count: int) -> list:
    """values [S] of the sampling sequences at their scheduled indices owners [S], None elsewhere: [count]."""
    full = [None] * count
    for value, i in zip(values, owners):
        full[i] = value
    return full


def _verified_outputs(step: StepVerdict, inputs: StepInputs) -> dict[int, SeqStepOutput]:
    """Each sampling sequence's tokens (and logprobs, when asked) from a speculative step's verdict:
    its accepted drafts, then the bonus or correction token."""
    drafts, num_drafts = inputs.drafts.tolist(), inputs.num_drafts.tolist()  # whole arrays at once
    logprobs = step.logprobs
    outputs = {}
    for s, (n, emitted) in enumerate(zip(step.num_accepted, step.emitted)):
        outputs[s] = SeqStepOutput((*drafts[s][:n], emitted), logprobs.tokens[s], num_drafts[s],
                                   (True,) * n + (False,) * (num_drafts[s] - n), draft_logprobs=logprobs.drafts[s],
                                   logprobs_json=logprobs.rendered[s])
    return outputs


def _sampled_outputs(out: SamplerOutput, rendered: list[np.ndarray], inputs: StepInputs,
                     renderer: LogprobRenderer | None) -> dict[int, SeqStepOutput]:
    """Each sampling sequence's one token (and its logprobs, when asked) from a plain step;
    rendered: [the host copy of the rendered entries], when a request asked for them."""
    token_ids = out.token_ids.tolist()
    wanted = inputs.logprobs.top_logprobs
    if out.logprobs is None:
        return {s: SeqStepOutput((token,)) for s, token in enumerate(token_ids)}
    entries = [None] * len(token_ids)
    if renderer is not None:
        render_k, rows = inputs.logprobs.render_k, len(token_ids)
        bounds = [(s, s + 1) if k >= 0 else None for s, k in enumerate(render_k.tolist())]  # a row each
        entries = renderer.entries(rendered[0], rows, bounds,
                                   lambda: (out.token_ids, out.logprobs, out.top_token_ids, out.top_logprobs,
                                            out.top_token_ids.shape[1], render_k, rows, rows))
    lps, top_ids, top_lps = out.logprobs.tolist(), out.top_token_ids.tolist(), out.top_logprobs.tolist()  # whole
    return {s: SeqStepOutput((token_ids[s],), None if k is None or entries[s] is not None else (
        TokenLogprob(token_ids[s], lps[s], top_ids[s][:k], top_lps[s][:k]),), logprobs_json=entries[s])
        for s, k in enumerate(wanted)}


def _add_prompt_logprobs(host: list[np.ndarray], inputs: StepInputs, outputs: list[SeqStepOutput]) -> None:
    """Prompt logprobs from the host copies (logprob [P], top ids [P, K], top logprobs [P, K]) of the
    prompt rows, into each sequence's output."""
    lps, top_ids, top_lps = host[0].astype(np.float32), host[1].astype(np.int64), host[2].astype(np.float32)
    per_seq: dict[int, list[tuple[int, TokenLogprob]]] = {}
    for j, (i, position, k) in enumerate(inputs.prompt_owner):
        per_seq.setdefault(i, []).append(
            (position, _token_logprob(inputs.prompt_targets[j], lps[j], top_ids[j], top_lps[j], k)))
    for i, pairs in per_seq.items():
        outputs[i] = outputs[i]._replace(prompt_logprobs=tuple(pairs))
