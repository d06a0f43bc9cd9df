"""How many drafts each decoding sequence gets this step: the back-off rule.

1. A sequence drafts up to its limit: the server's `num_speculative_tokens`, lowered by the
   request's own setting and by the tokens it may still emit (a step emits drafts + 1).
2. Its recent draft acceptance a (the share of tested drafts accepted, weighted towards recent
   steps) says how much a draft is worth: draft i of the step is kept with probability a^i. Its
   recent hit rate h (the share of its proposer's answers that held any draft) discounts that: the
   expected kept drafts of k asked for are h * (a + a^2 + ... + a^k).
   Below `min_acceptance_rate` it stops drafting. A sequence that does not draft keeps both
   estimates current through shadow probes (`shadow.py`): now and then its proposer is asked for
   drafts that are not verified but scored, steps later, against the tokens emitted since, which
   costs the device nothing.
3. Drafts cost time: the engine learns what a draft-free step costs, and what drafting adds to a
   step per draft row, per drafting sequence, per kept draft and per step (`StepCostModel`). Each
   step takes the drafts that maximize the expected tokens emitted per second of the step (exactly,
   by Dinkelbach's iteration), or none when a draft-free step emits more per second. With few
   sequences and repetitive text every useful draft is taken; as the batch grows, or proposals
   miss, a draft must be likelier to be kept to pay for itself, and speculation stops.
4. A step holds at most `max_draft_tokens_per_step` drafts in all: the likeliest ones.
5. The cost fits predict; a goodput check measures (`goodput.py`): where, at the present load, the
   rule's drafting emits fewer tokens per second than no drafting, nobody drafts for a while.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np

from cupyspec.scheduling.sequence import Sequence
from cupyspec.spec_decode.backoff.step_cost import StepCost
from cupyspec.spec_decode.speculative_config import SpeculativeConfig

DINKELBACH_ITERATIONS = 16  # `best_drafts` stops after this many ratio updates if the choice has not settled


def draft_limits(running: Seq[Sequence], config: SpeculativeConfig, cost: StepCost | None = None) -> dict[int, int]:
    """seq_id -> the most drafts that decoding sequence may ask for now; cost: None before it is learned."""
    decoding: list[Sequence] = []
    rates: list[tuple[float, float, int]] = []  # (acceptance, hit rate, most drafts) of each decoding sequence
    for s in running:  # one pass: this runs under load, on every sequence
        num_tokens = s.num_tokens
        if num_tokens - s.num_computed_tokens != 1 or not s.output_token_ids:
            continue
        decoding.append(s)
        rates.append((s.spec.draft_acceptance, s.spec.proposal_hit_rate,
                      max(0, min(s.max_drafts, s.max_total_tokens - num_tokens - 1))))
    if not decoding:
        return {}
    acceptance, hit_rate, limits = (np.array(column) for column in zip(*rates))  # [S] each
    limits = np.where(acceptance < config.min_acceptance_rate, 0, limits)
    if cost is not None and limits.any():
        limits = best_drafts(acceptance, limits, len(decoding), cost.seconds(len(running)), cost.per_draft_row,
                             cost.per_drafting_seq, cost.per_drafting_step, hit_rate, cost.per_kept_draft)
    limits = likeliest(acceptance, limits, config.max_draft_tokens_per_step)
    return {s.seq_id: int(k) for s, k in zip(decoding, limits)}


def _kept(acceptance: np.ndarray, width: int) -> np.ndarray:
    """[S, width]: probability that draft i + 1 is kept, acceptance^(i + 1)."""
    return acceptance[:, None] ** np.arange(1, width + 1)[None, :]


def best_drafts(acceptance: np.ndarray, limits: np.ndarray, base_tokens: float, base_seconds: float,
                per_row: float, per_drafting_seq: float, per_drafting_step: float = 0.0,
                hit_rate: np.ndarray | None = None, per_kept: float = 0.0) -> np.ndarray:
    """Drafts [S] per sequence, each within limits [S], that maximize
    (base_tokens + expected kept drafts)
    / (base_seconds + per_drafting_step * [any drafts] + per_drafting_seq * drafting + per_row * drafts
       + per_kept * expected kept drafts),
    where k drafts asked of sequence s keep hit_rate[s] * (a + ... + a^k) in expectation (hit rate 1
    when None).

    Dinkelbach: for the current ratio r, each sequence independently takes the k maximizing
    (expected kept of its k drafts) - r * (cost of k drafts); r is then re-evaluated, and grows
    until no sequence changes its choice. With the step's own cost charged from the start, that
    finds the best drafting choice; it is kept if it beats a step without drafts.

    At load one test settles it first: drafts beat the draft-free ratio r0 only if their expected
    kept exceed r0 times their cost, so when no sequence has a k with gain > r0 * cost, none drafts.
    """
    width = int(limits.max())
    count = np.arange(1, width + 1)  # [K]
    gain = np.cumsum(_kept(acceptance, width), axis=1)  # [S, K]: expected kept with k = 1..K drafts
    if hit_rate is not None:
        gain *= hit_rate[:, None]
    cost = per_drafting_seq + per_row * count[None, :] + per_kept * gain  # [S, K]
    allowed = count[None, :] <= limits[:, None]  # [S, K]
    take = np.zeros(len(limits), dtype=int)
    if not (allowed & (gain > base_tokens / max(base_seconds, 1e-9) * cost)).any():
        return take
    drafting_seconds = base_seconds + per_drafting_step
    ratio = base_tokens / max(drafting_seconds, 1e-9)
    for _ in range(DINKELBACH_ITERATIONS):
        value = np.where(allowed, gain - ratio * cost, 0.0)  # [S, K]
        best = value.argmax(axis=1)  # [S]
        choice = np.where(value[np.arange(len(limits)), best] > 0, best + 1, 0)  # [S]
        if np.array_equal(choice, take):
            break
        take = choice
        drafting = np.flatnonzero(take)
        ratio = ((base_tokens + gain[drafting, take[drafting] - 1].sum())
                 / max(drafting_seconds + cost[drafting, take[drafting] - 1].sum(), 1e-9))
    if ratio <= base_tokens / max(base_seconds, 1e-9):  # a draft-free step does better
        take[:] = 0
    return take


def likeliest(acceptance: np.ndarray, limits: np.ndarray, budget: int) -> np.ndarray:
    """limits [S] cut to the `budget` drafts likeliest to be kept (ties: earlier draft positions first)."""
    if limits.sum() <= budget:
        return limits
    width = int(limits.max())
    kept = np.where(np.arange(width)[None, :] < limits[:, None], _kept(acceptance, width), -1.0)  # [S, K]
    order = np.lexsort((np.arange(kept.size) % len(limits), np.arange(kept.size) // len(limits),
                        -kept.T.ravel()))[:budget]  # position-major flat indices into kept.T
    return np.bincount(order % len(limits), minlength=len(limits))
