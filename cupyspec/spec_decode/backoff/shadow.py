"""Shadow probes: drafts that are never verified but scored, later, against the tokens emitted since.

A sequence that does not draft learns nothing from verification, yet its text may turn
predictable (a code block it starts to copy). Its proposer is asked for drafts from the tokens
the host has, at most every PROBE_INTERVAL of its decode steps and once the last probe is decided:
the drafts are compared with the tokens emitted since as soon as those decide them (one differs
from its draft, or all came), and the probe is scored. That costs the device nothing, and estimates
acceptance without bias: a greedy target accepts exactly the drafts equal to its tokens, and a
sampling one accepts a one-hot draft with the probability that it samples that token. (Drafts with
distributions of their own would need the residual rule instead; the proposers here give none.)
"""

from __future__ import annotations

from collections.abc import Collection
from collections.abc import Sequence as Seq

from cupyspec.scheduling.sequence import Sequence
from cupyspec.spec_decode.proposers.base import DraftRequest, Proposer
from cupyspec.spec_decode.proposers.contexts import Contexts

PROBE_INTERVAL = 1  # a sequence's decode steps between its shadow probes


class ShadowProbes:
    """The shadow drafts awaiting a score, and when each sequence was last probed."""

    def __init__(self, contexts: Contexts) -> None:
        self._contexts = contexts
        self._pending: dict[int, tuple[int, list[int]]] = {}  # seq_id -> (position, drafts) awaiting a score
        self._probed_at: dict[int, int] = {}  # seq_id -> its spec.num_steps at its last shadow probe

    def probe(self, running: Seq[Sequence], proposer: Proposer, asked: Collection[int],
              most: int | None = None) -> None:
        """Score the pending shadow drafts whose tokens are on the host, then ask the proposer anew for
        the decoding sequences that are due (PROBE_INTERVAL steps since their last probe) and were not
        asked for real drafts this step (seq_ids in `asked`); at most `most` of them (None: all)."""
        if not (self._pending or proposer.has_drafts()):
            return
        due: list[tuple[Sequence, int, int]] = []  # (sequence, tokens known on the host, most drafts)
        for seq in running:
            if not seq.max_drafts or seq.seq_id in asked or not seq.output_token_ids:
                continue
            steps = seq.spec.num_steps
            if steps - self._probed_at.get(seq.seq_id, 0) < PROBE_INTERVAL:
                continue
            known = seq.num_known_tokens  # the last tokens may still be on the device
            if not self._score(seq, known):
                continue
            limit = min(seq.max_drafts, seq.max_total_tokens - known - 1)
            if limit > 0:
                due.append((seq, known, limit))
                if len(due) == most:
                    break
        if not due:
            return
        requests = [DraftRequest(seq.seq_id, seq.request_id, self._contexts.of(seq, known), seq.num_prompt_tokens,
                                 limit) for seq, known, limit in due]
        for (seq, known, limit), drafts in zip(due, proposer.propose(requests)):
            self._probed_at[seq.seq_id] = seq.spec.num_steps
            if proposer.answered(len(drafts)):
                seq.spec.record_proposal(len(drafts) > 0)
            if len(drafts):
                self._pending[seq.seq_id] = (known, drafts.token_ids[:limit].tolist())

    def forget(self, seq_id: int) -> None:
        self._pending.pop(seq_id, None)
        self._probed_at.pop(seq_id, None)

    def _score(self, seq: Sequence, known: int) -> bool:
        """Score the pending shadow drafts of `seq` once the tokens emitted since decide them (all
        of them came, or one that differs from its draft); whether it is free for new ones."""
        pending = self._pending.get(seq.seq_id)
        if pending is None:
            return True
        start, drafts = pending
        emitted = seq.tokens(start, min(known, start + len(drafts)))
        kept = next((j for j, (d, t) in enumerate(zip(drafts, emitted)) if d != t), len(emitted))
        if kept == len(emitted) < len(drafts):
            return False  # all kept so far: the rest is still to come
        del self._pending[seq.seq_id]
        seq.spec.learn(kept, len(drafts))
        return True
