"""One engine step on the device: forward pass, then sampling or verification of drafts.

Without speculation each sequence that reaches its last token samples one token from its last
row. With speculation its segment is [last token, d1..dk] and rows 0..k are verified together:
the step emits the accepted drafts plus one bonus or correction token (k = 0 is plain decoding
through the speculative path).

A step is launched, then collected. Launching queues the step's device work and the copies of its
results to the host, and returns at once (on a GPU); `LaunchedStep.ready` tells when collecting
would not wait. A step's emitted tokens (and an MTP head's drafts) also stay on the device, in
`tokens` (cupyspec/model/device_tokens.py), where the next step's placeholder input ids find them. So the engine
can form and launch step N+1 before it has seen the tokens of step N (overlap scheduling).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import replace
from itertools import repeat
from typing import Any, NamedTuple

import numpy as np

from cupyspec.backend import Backend
from cupyspec.engine.step_inputs import StepInputs, prepare_inputs
from cupyspec.engine.step_outputs import (
    SeqStepOutput,
    add_prompt_logprobs,
    sampled_outputs,
    scattered,
    verified_outputs,
)
from cupyspec.logprobs.graphs import LogprobGraphs
from cupyspec.logprobs.logprob_json import LogprobRenderer, VocabJSON
from cupyspec.logprobs.logsoftmax_topk import logprobs_on_device
from cupyspec.model.batch import DeviceBatch
from cupyspec.model.cuda_graphs import CudaGraphs
from cupyspec.model.device_tokens import DeviceTokens
from cupyspec.model.kv_arrays import KVCacheArrays
from cupyspec.model.llama import LlamaModel
from cupyspec.model.positions import shift_positions
from cupyspec.sampling.sampler import SamplerOutput, max_logprobs, sample_tokens_on_device
from cupyspec.scheduling.scheduler import SchedulerOutput
from cupyspec.spec_decode.proposers.mtp import Drafted, MTPDrafting
from cupyspec.spec_decode.proposers.mtp_graphs import DraftGraphs
from cupyspec.spec_decode.speculative_config import SpeculativeConfig
from cupyspec.spec_decode.verification.verify import VerifyInput, draft_distributions
from cupyspec.spec_decode.verification.verify_step import LogprobStream, PendingVerdict, launch_verify
from cupyspec.text.token_text import TokenBytes, TokenText
from cupyspec.transfer import HostTransfer, to_device

SAMPLER_ARRAYS = 4  # sample_on_device's arrays when a row asks for logprobs: tokens, logprobs, top ids and logprobs


class LaunchedStep(NamedTuple):
    """A step whose device work is queued; `ModelRunner.collect` turns it into outputs."""

    inputs: StepInputs
    transfer: HostTransfer  # the sampled tokens (and logprobs) of a plain step, then the prompt logprobs
    num_sample_arrays: int  # how many of the transferred arrays sampling filled (0: none, or verified)
    verdict: PendingVerdict | None  # a speculative step's verification
    mtp_drafts: HostTransfer | None = None  # the MTP head's drafts and their logprobs, each [S, num_model_steps]
    mtp_probs: Any | None = None  # [Sd, num_model_steps, V] (device): q of the drafts drawn at random

    def ready(self) -> bool:
        """Whether its results, but a verified step's logprobs and the MTP head's drafts, are on the
        host (collecting would not wait; the drafts are waited for when proposed)."""
        return self.transfer.done() and (self.verdict is None or self.verdict.done())

    def wait_copies(self) -> None:
        """Wait for every copy to the host the step started, leaving its results unread; its pinned
        buffers may then serve other copies (a tensor-parallel rank's step whose results the first
        rank's step gives: cupyspec/parallel/runner.py)."""
        transfers = (self.transfer, self.mtp_drafts, *(self.verdict.transfers() if self.verdict else ()))
        for transfer in transfers:
            if transfer is not None:
                transfer.result()


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCacheArrays, backend: Backend, speculative: SpeculativeConfig,
                 overlap_logprobs: bool = True, cuda_graph_max_tokens: int = 0, max_model_len: int = 0,
                 max_num_seqs: int = 256, tokenizer: TokenBytes | None = None,
                 mtp: MTPDrafting | None = None) -> None:
        """cuda_graph_max_tokens: on a GPU, steps of up to this many rows replay CUDA graphs (0: none).
        tokenizer: the tokens' bytes, for logprobs rendered as chat JSON entries.
        mtp: the MTP head's drafting, in each step that drafts ahead (graphed with the forward pass when
        it is)."""
        self.model, self.kv, self.backend, self.speculative = model, kv, backend, speculative
        self.tokenizer, self.mtp = tokenizer, mtp
        # the last collected step's MTP drafts, read when proposed: kept here until the next step is
        # collected (its copies follow on the stream), so that their pinned buffer is not reused while
        # the copy into it may still run
        self._collected_drafts: HostTransfer | None = None
        xp = backend.xp
        cuda = xp.cuda if backend.is_cuda else None
        self.stream = cuda.Stream(non_blocking=True) if cuda else contextlib.nullcontext()
        # the CUDA stream that computes a speculative step's logprobs beside verification
        self.logprob_stream = LogprobStream(cuda) if cuda and overlap_logprobs else None
        self.tokens = DeviceTokens(xp, max_num_seqs, mtp.num_model_steps if mtp is not None else 0)
        self.graphs = (CudaGraphs(model, kv, self.stream, cuda_graph_max_tokens, max_model_len, self.tokens.slots,
                                  mtp.catch_up if mtp is not None else None, self.tokens.accepted)
                       if cuda and cuda_graph_max_tokens else None)
        self.draft_graphs = (DraftGraphs(mtp, self.graphs, max_num_seqs, self.tokens)
                             if mtp is not None and self.graphs is not None else None)
        # the logprob work of steps, replayed over the graphs' logits
        self.logprob_graphs = (LogprobGraphs(xp, self.graphs.logits, speculative.num_speculative_tokens)
                               if self.graphs is not None else None)

    def close(self) -> None:
        """Destroy the forward pass's and the MTP head's CUDA graphs (CUDA frees one still running when
        it ends): a tensor-parallel group frees its communicators only after the graphs holding their
        collectives."""
        if self.graphs is None:
            return
        if self.draft_graphs is not None:
            self.draft_graphs.close()
        self.graphs.close()

    @functools.cached_property
    def renderer(self) -> LogprobRenderer:
        """Renders chat logprob entries; its vocabulary table is built on first use (the texts of
        every token, cached on the way, are then let go)."""
        if self.tokenizer is None:
            raise ValueError("rendering logprobs needs the tokenizer (ModelRunner's tokenizer)")
        vocab = VocabJSON.build(TokenText(self.tokenizer), self.model.config.vocab_size)
        return LogprobRenderer(self.backend.xp, vocab)

    def prepare(self, sched: SchedulerOutput, draft_ahead: bool = True) -> StepInputs:
        """The inputs of the step `sched` forms (step_inputs.py); draft_ahead: an MTP head drafts in
        it for the next step."""
        return prepare_inputs(sched, self.kv.block_size, self.tokens if self.mtp is not None else None, draft_ahead)

    def launch(self, inputs: StepInputs) -> LaunchedStep:
        """Queue the forward pass, sampling or verification, logprobs, the MTP head's drafting and the
        copies of the results to the host; on a GPU nothing waits for the device. Safe on the step thread."""
        with self.stream:  # CUDA: the whole step on one stream, the graphs' (a no-op context on the CPU)
            forward = self._forward(inputs)
            step = self._sample_or_verify(inputs, forward)
            if self.mtp is None or not inputs.owners:
                return step
            if not inputs.draft_ahead:
                self._mend(inputs, forward)
                return step
            drafted = self._draft(inputs, forward)
            return step._replace(mtp_drafts=HostTransfer(self.backend.xp, [drafted.tokens, drafted.logprobs]),
                                 mtp_probs=drafted.probs)

    def _draft(self, inputs: StepInputs, forward: _Forward) -> Drafted:
        """The MTP head's drafts from each sampling sequence's last accepted row, queued after
        sampling or verification, which left the accepted drafts and the emitted tokens in `tokens`;
        the drafts go there too."""
        if forward.graphed:
            return self.draft_graphs.run(inputs.first_rows, inputs.draft_sampling)
        drafted = self.mtp.draft_from(forward.residual, forward.batch, self._boundary_rows(inputs),
                                      self.tokens.by_seq[:len(inputs.owners), 0], self.kv, inputs.draft_sampling)
        self.tokens.put_drafts(drafted.tokens)
        return drafted

    def _mend(self, inputs: StepInputs, forward: _Forward) -> None:
        """The head's K/V at each sampling sequence's last accepted row, with the token the step
        emitted after it in place of the catch-up's guess: what drafting's first step writes, where
        the head does not draft."""
        if forward.graphed:
            self.draft_graphs.mend(inputs.first_rows)
        else:
            self.mtp.mend_from(forward.residual, forward.batch, self._boundary_rows(inputs),
                               self.tokens.by_seq[:len(inputs.owners), 0], self.kv)

    def _boundary_rows(self, inputs: StepInputs) -> Any:
        """[S] (device): each sampling sequence's last accepted row in an eager step."""
        return to_device(self.backend.xp, inputs.first_rows) + self.tokens.accepted[:len(inputs.owners)]

    def _sample_or_verify(self, inputs: StepInputs, forward: _Forward) -> LaunchedStep:
        """Sampling or verification of the step's target rows, and their logprobs, queued."""
        xp = self.backend.xp
        target_logits, prompt_logits, static = forward.target_logits, forward.prompt_logits, forward.static
        arrays: list[Any] = []
        verdict = None
        if target_logits is not None and inputs.num_drafts.any():
            probs = None  # [S, K, V]: q of the drafts, where a draft model drew some
            if self.speculative.verify_strategy == "rejection":
                probs = draft_distributions(xp, inputs.drafts, inputs.num_drafts, inputs.draft_probs,
                                            target_logits.shape[1])
            verdict = launch_verify(
                xp, target_logits,
                VerifyInput(inputs.drafts, inputs.num_drafts, probs, inputs.sampling, inputs.accept_uniforms,
                            inputs.draft_logprobs, self.tokens if self.mtp is not None else None),
                inputs.logprobs, self.speculative.verify_strategy, self.speculative.accept_policy,
                self.logprob_stream, self.renderer if inputs.logprobs.renders else None, self.logprob_graphs,
                inputs.first_rows if static else None)
        elif target_logits is not None:
            tokens = sample_tokens_on_device(xp, target_logits, inputs.sampling)
            self.tokens.put_sampled(tokens)
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
            by_sampler = verified_outputs(step.verdict.result(logprobs), inputs)
        elif step.num_sample_arrays:
            sampled = host[:step.num_sample_arrays]
            by_sampler = sampled_outputs(SamplerOutput.from_host(sampled[:SAMPLER_ARRAYS]), sampled[SAMPLER_ARRAYS:],
                                         inputs, self.renderer if inputs.logprobs.renders else None)
        else:
            by_sampler = {}
        for s, out in by_sampler.items():
            outputs[inputs.owners[s]] = out
        if inputs.prompt_owner:
            add_prompt_logprobs(host[step.num_sample_arrays:], inputs, outputs)
        if step.mtp_drafts is not None:
            probs = None
            if step.mtp_probs is not None:
                probs = {int(s): step.mtp_probs[i] for i, s in enumerate(inputs.draft_sampling.rows)}
            self.mtp.proposer.remember(inputs.seq_ids, step.mtp_drafts.result, probs, inputs)
            self._collected_drafts = step.mtp_drafts
        return outputs

    @staticmethod
    def add_logprobs(step: LaunchedStep, outputs: list[SeqStepOutput]) -> list[SeqStepOutput]:
        """`collect(step, logprobs=False)`'s outputs with a verified step's token and draft logprobs
        (a plain step's come with its tokens)."""
        if step.verdict is None or not step.inputs.logprobs.any:
            return outputs
        per_sampler, owners = step.verdict.logprobs(), step.inputs.owners  # (tokens, rendered, drafts), each [S]
        if len(owners) < len(outputs):  # some sequences only ran their prompts: None for them
            per_sampler = [scattered(values, owners, len(outputs)) for values in per_sampler]
        tokens, rendered, drafts = per_sampler
        token_ids, _, num_drafts, accepted, _, prompt_logprobs, _ = zip(*outputs)
        # built column by column in C (tuple.__new__ over the zipped columns): there is one output per
        # sequence and step, and a Python-level SeqStepOutput call (or `_replace`) for each is slower
        return list(map(tuple.__new__, repeat(SeqStepOutput), zip(token_ids, tokens, num_drafts, accepted, drafts,
                                                                   prompt_logprobs, rendered)))

    def _forward(self, inputs: StepInputs) -> _Forward:
        """The forward pass: logits [R, V] f32 of the target rows and [P, V] of the prompt-logprob rows
        (None: no rows), and whether every row's logits are in the graphs' static buffer too.

        Through a CUDA graph when one holds the batch (logits of every row come out, or of the rows
        asked for in a graph past cuda_graphs.EVERY_ROW_MAX: then nothing is static); else eagerly,
        with the LM head applied to the rows that need it only, the pre-norm hidden states and the
        device batch kept for an MTP head's drafting. An MTP head's catch-up runs either way.
        """
        xp = self.backend.xp
        graphed = (self.graphs.run(inputs.batch, inputs.next_token_ids, inputs.shift_from,
                                   (inputs.target_rows, inputs.prompt_rows))
                   if self.graphs is not None else None)
        residual = batch = None
        if graphed is None:
            batch = DeviceBatch.of(xp, inputs.batch, self.tokens.slots)
            if inputs.shift_from is not None:  # (copies: on the CPU the batch's arrays are the host's)
                batch = replace(batch, positions=xp.array(batch.positions), slot_mapping=xp.array(batch.slot_mapping))
                shift_positions(xp, batch.positions, batch.slot_mapping, batch.batch_id_per_token, batch.block_tables,
                                to_device(xp, inputs.shift_from), self.tokens.accepted, self.kv.block_size)
            residual = self.model.forward_residual(batch, self.kv)  # [T, H] fp32
            if self.mtp is not None:
                self.mtp.catch_up(residual, batch, to_device(xp, inputs.next_token_ids), self.kv)
            hidden = self.model.final_normed(residual)  # [T, H]

        def rows_logits(rows: np.ndarray, first: int) -> Any:  # first: where they start among the asked
            if graphed is None:
                return self.model.compute_logits(hidden[to_device(xp, rows)])
            if not graphed.every_row:
                return graphed.logits[first:first + len(rows)]
            every_row = graphed.logits
            return every_row if len(rows) == len(every_row) else every_row[to_device(xp, rows)]

        targets, prompts = inputs.target_rows, inputs.prompt_rows
        target_logits = rows_logits(targets, 0) if len(targets) else None
        prompt_logits = rows_logits(prompts, len(targets)) if len(prompts) else None
        static = graphed is not None and graphed.every_row
        return _Forward(target_logits, prompt_logits, static, graphed is not None, residual, batch)


class _Forward(NamedTuple):
    """What a step's forward pass leaves for the rest of the step."""

    target_logits: Any | None  # [R, V] f32
    prompt_logits: Any | None  # [P, V] f32
    static: bool  # every row's logits are in the graphs' static buffer too
    graphed: bool  # a graph ran it: its rows' hidden states, positions and tables are in static buffers
    residual: Any | None  # [T, H] fp32: pre-norm hidden states of an eager step
    batch: DeviceBatch | None  # the eager step's device batch
