"""How many drafts each decoding sequence gets this step: the back-off rule.

1. A sequence drafts up to its limit: the server's `num_speculative_tokens`, lowered by the
   request's own setting and by the tokens it may still emit (a step emits drafts + 1).
2. A sequence whose recent acceptance rate (an average weighted towards recent steps) is below
   `min_acceptance_rate` stops drafting, except for a one-draft probe every
   `PROBE_INTERVAL` steps that lets its average recover.
3. A step holds at most `max_draft_tokens_per_step` drafts in all: with many sequences
   decoding, each gets floor(that / their number), and none once they outnumber it.
"""

from __future__ import annotations

from collections.abc import Iterable

from cupyspec.sequence import Sequence
from cupyspec.speculative_config import SpeculativeConfig

PROBE_INTERVAL = 8


def draft_limits(seqs: Iterable[Sequence], config: SpeculativeConfig) -> dict[int, int]:
    """seq_id -> the most drafts that sequence may propose now."""
    decoding = [s for s in seqs if s.num_uncomputed_tokens == 1 and s.output_token_ids]
    if not decoding:
        return {}
    share = config.max_draft_tokens_per_step // len(decoding)
    limits = {}
    for seq in decoding:
        limit = min(seq.max_drafts, share, seq.max_total_tokens - seq.num_tokens - 1)
        if seq.spec.acceptance_ema < config.min_acceptance_rate:
            limit = min(limit, 1) if seq.spec.steps_since_draft >= PROBE_INTERVAL else 0
        limits[seq.seq_id] = max(0, limit)
    return limits
