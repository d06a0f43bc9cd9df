"""Before each step: decide who drafts (the back-off rule), then ask the proposer for drafts.
After each step: shadow probes keep the acceptance estimates of sequences that do not draft, and
the proposer catches up on deferred bookkeeping.

This bookkeeping is overhead, paid from budgets that are shares of the engine's step time (the
time the engine waits for the device is no measure of spare host time: a server's event loop
writes responses meanwhile). Evaluating the rule again (the last plan stands in between) has a
budget of OVERHEAD_SHARE; shadow probing and the proposer's catching up have another, so that the
evaluations, which at one sequence cost the share of several steps, cannot starve the probes.
Exploring steps (see `Drafter.plan`) take at most 1 / EXPLORE_STEPS of the step time, less while
exploring shows nothing that pays, so that under a load where speculation does not pay the engine
runs within a few percent of one that does not speculate. The budgets do not back off: they pay
for the evaluations and probes that let the rule draft again when acceptance recovers, which at
low load are cheap and must come soon.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence as Seq

from cupyspec.scheduling.sequence import Sequence
from cupyspec.spec_decode.backoff.goodput import GoodputCheck
from cupyspec.spec_decode.backoff.policy import draft_limits
from cupyspec.spec_decode.backoff.shadow import ShadowProbes
from cupyspec.spec_decode.backoff.step_cost import StepCostModel, StepShape, load_band
from cupyspec.spec_decode.proposers.base import DraftRequest, Proposer
from cupyspec.spec_decode.proposers.contexts import Contexts
from cupyspec.spec_decode.speculative_config import SpeculativeConfig
from cupyspec.spec_decode.stats import SpecStats

OVERHEAD_SHARE = 0.01  # of each step's wall time, for the overhead budget (module docstring)
OVERHEAD_BUDGET_CAP = 0.005  # seconds the overhead budget may save up
EXPLORE_STEPS = 32  # cost-aware rule: after this many steps in a row of one kind, one of the other
# ... but drafting steps run this many times longer in a row while the batch keeps the rows of the
# last draft-free step the fit took (at one sequence: a draft-free step there would show nothing new)
SAME_ROWS_STREAK_FACTOR = 8
EXPLORE_SEQS = 8  # sequences that draft in an exploring step, at most
MAX_BACKOFF = 8  # exploring slows down at most this many times while it finds nothing that pays (see `plan`)
SHADOWS_PER_STEP = 4  # sequences given shadow drafts per step, at most, under the cost-aware rule
PRIOR_DECAY = 0.9  # weight kept by the server-wide evidence at each finished sequence
# cost-aware rule, until the cost fit is ready: one step in this many explores (under overlap
# scheduling the step after a drafting one has no step to wait for, so the next shows a plain step's price)
WARM_UP_PERIOD = 3


class Drafter:
    """Sets `draft_token_ids` on the running sequences; the scheduler reserves KV slots for them.

    `plan` reads no token, so the engine can decide whether a step drafts while the tokens of the
    step before are still on the device; `propose` needs them all on the host.
    """

    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config, self.proposer = config, proposer
        self.step_cost = StepCostModel()  # what rows and drafting cost, for the back-off rule
        self.goodput = GoodputCheck()  # per load band, whether drafting emits more per second than not
        # whether the last evaluated plan found no cost fit for its load band: the rule then drafts
        # one step in WARM_UP_PERIOD to learn its costs, which no window of the goodput check would
        # show at its worth, and the check takes no turns in which the rule may draft
        self._warming_up = True
        self.num_steps = 0  # engine steps observed
        self.contexts = Contexts()  # each sequence's tokens as an array, for the proposer
        self.shadows = ShadowProbes(self.contexts)
        self._last_plan: dict[int, int] | None = None  # the cost-aware rule's last evaluated plan
        self._asked: set[int] = set()  # seq_ids asked for drafts this step
        self._drafted: list[Sequence] = []  # the sequences given drafts this step (to clear at the next)
        self._drafting_streak = 0  # drafting steps observed since the last draft-free step the cost fit took
        self._plain_streak = 0  # observed steps in a row that did not
        self._plain_rows = -1  # rows of the last draft-free step the cost fit took
        self._plain_seconds = 0.0  # their wall time
        self._explore_after: float | None = None  # plain seconds after which exploring pays (see `plan`)
        self._exploring_step = False  # the last plan explored (`observe_step` prices it)
        self._primed: SpeculativeConfig | None = None  # the rule of an exploring step primed the step before
        # A proposer that drafts ahead drafts in a step for the next (an MTP head), so the step being
        # formed drafts ahead when the plan asks drafts of anyone, as the next plan usually does
        # again (always under the fixed rule, whose shadow probes need the head's drafts), and the
        # proposer wants it (`Proposer.wants_drafts_ahead`). Where speculation does not pay, the head
        # then costs nothing but its K/V. Set by `propose`.
        self.drafts_ahead = False
        self._explore_price: dict[int, float] = {}  # per load band: seconds its last exploring step added
        self._budget = 0.0  # seconds the engine may spend now evaluating the rule (see the module docstring)
        self._probe_budget = 0.0  # ... and on shadow probes and the proposer's deferred bookkeeping
        self._backoff = 1  # how many times longer than at first the rule waits to explore
        self._drafted_since_exploring = True  # a step other than an exploring one drafted since the last of those
        # a new sequence's prior: the verified drafts and the proposals of recently finished sequences,
        # summed with decay (each sequence weighs as much as its evidence), with one accepted test and
        # one hit as the prior of the prior
        self._accepted, self._tested, self._hits, self._proposals = 1.0, 1.0, 1.0, 1.0
        # the fixed rule without its acceptance floor: what an exploring step drafts (see `plan`)
        self._exploring = dataclasses.replace(config, min_acceptance_rate=0.0)

    def new_stats(self) -> SpecStats:
        """A new sequence's counters: with the cost-aware rule it expects what recent sequences got,
        until it learns its own; with the fixed rules it expects every draft to be accepted."""
        if not self.config.cost_aware_backoff:
            return SpecStats()
        return SpecStats.expecting(self._accepted / self._tested, self._hits / self._proposals)

    def observe_step(self, shape: StepShape, seconds: float, emitted: int) -> None:
        """One engine turn: the shape of the step it launched and its wall time (step_cost.py), and
        the tokens it emitted (goodput.py)."""
        self.step_cost.observe(shape, seconds)
        band = load_band(shape.sequences)
        if self.config.cost_aware_backoff and not (self._warming_up and self.goodput.drafting(band)):
            self.goodput.observe(band, emitted, seconds)
        self.num_steps += 1
        if shape.drafting and not self._exploring_step:  # drafting pays somewhere: exploring backs off no more
            self._drafted_since_exploring, self._backoff = True, 1
        if shape.drafting:
            self._drafting_streak += 1
            self._plain_streak, self._plain_seconds, self._explore_after = 0, 0.0, None
        else:
            self._plain_streak += 1
            self._plain_seconds += seconds
            if not (shape.refilled or shape.priming):  # neither shows a draft-free step's price (step_cost.py)
                self._drafting_streak, self._plain_rows = 0, shape.rows
        if self._exploring_step:
            self._exploring_step = False
            cost = self.step_cost.fit(shape.sequences)
            base = 0.0 if cost is None else cost.seconds(shape.rows - shape.draft_rows)
            self._explore_price[band] = max(0.0, seconds - base)
        self._budget = min(OVERHEAD_BUDGET_CAP, self._budget + OVERHEAD_SHARE * seconds)
        self._probe_budget = min(OVERHEAD_BUDGET_CAP, self._probe_budget + OVERHEAD_SHARE * seconds)

    def learn_step_costs(self) -> None:
        """Take the steps observed so far into the cost fits (`StepCostModel.learn`); the engine calls
        this while a step is on the device."""
        self.step_cost.learn()

    def plan(self, running: Seq[Sequence]) -> dict[int, int]:
        """seq_id -> drafts to ask for this step (the back-off rule; see policy.py). The cost-aware
        rule is evaluated again only within the overhead budget: it reads every sequence (and
        solves for the best drafts when some pay), and its inputs change slowly. Meanwhile its
        last plan stands, for the sequences it asked drafts of (`_standing`).

        The cost fit learns only from the steps the rule lets happen, so the rule explores both ways:
        after EXPLORE_STEPS drafting steps in a row (SAME_ROWS_STREAK_FACTOR times as many while the
        batch has the rows of the last draft-free step the fit took, which another would not price
        anew) it takes steps without drafts until the fit has taken one (under overlap scheduling
        the first is refilled, so two); after as many steps without drafts, it takes one in which
        the EXPLORE_SEQS likeliest sequences draft, whatever their acceptance (`_explore`), once
        what such a step adds is at most 1 / (EXPLORE_STEPS * backoff) of the time since the last
        drafting step. That price is the fit's, or what the last exploring step of the load band
        added if more (a first proposal may index a whole prompt, host work the fit leaves out as
        an outlier). The back-off doubles, up to MAX_BACKOFF, each time no step but the exploring
        ones drafted since the last exploring step, and is 1 again at the first that does.
        Exploring lets drafting resume at a load where it pays after a cost learned at another
        stopped it (drafting at one sequence is one sequence drafting and one synchronous step at
        once, which no fit can tell apart). Over all of it, in the windows where the goodput check
        has the load band off (goodput.py), nobody drafts."""
        if self.config.cost_aware_backoff and not self.goodput.drafting(load_band(len(running))):
            self._primed = None  # drafting emits less than not at this load (goodput.py)
            return {}
        if self._primed is not None:  # the head drafted for this exploring step in the one before
            rule, self._primed = self._primed, None
            return self._explore(running, rule)
        if self.config.cost_aware_backoff:
            longest = EXPLORE_STEPS * (SAME_ROWS_STREAK_FACTOR if len(running) == self._plain_rows else 1)
            if self._drafting_streak >= longest:
                return {}
            if self._plain_streak >= EXPLORE_STEPS:
                if self._explore_after is None:  # priced once per run of draft-free steps: it reads the fit
                    if not self._drafted_since_exploring:
                        self._backoff = min(2 * self._backoff, MAX_BACKOFF)
                    self._explore_after = (self._exploring_seconds(min(EXPLORE_SEQS, len(running)), len(running))
                                           * EXPLORE_STEPS * self._backoff)
                if self._plain_seconds >= self._explore_after:
                    self._plain_streak, self._plain_seconds, self._explore_after = 0, 0.0, None
                    self._drafted_since_exploring = False
                    return self._explore(running, self._exploring)
            if self._budget <= 0 and self._last_plan is not None:
                standing, complete = self._standing(running)
                if complete or self._budget < -OVERHEAD_BUDGET_CAP:
                    return standing
        started = time.perf_counter()
        cost = self.step_cost.fit(len(running)) if self.config.cost_aware_backoff else None
        self._warming_up = cost is None
        if cost is None and self.config.cost_aware_backoff:  # until the fit is ready, it needs both kinds
            return {} if self.num_steps % WARM_UP_PERIOD else self._explore(running, self.config)
        limits = draft_limits(running, self.config, cost)
        if self.config.cost_aware_backoff:
            self._last_plan = limits
            self._budget -= time.perf_counter() - started
        return limits

    def _standing(self, running: Seq[Sequence]) -> tuple[dict[int, int], bool]:
        """The last evaluated plan, for the sequences it asked drafts of that still decode, within
        the tokens each may still emit (a step emits drafts + 1); and whether it can stand: not
        when it drafts and a decoding sequence came after it (at one sequence, each new request's),
        which is then planned at once, on credit up to OVERHEAD_BUDGET_CAP."""
        if not self._last_plan or not any(self._last_plan.values()):  # the usual case under load: nobody drafts
            return {}, True
        limits, complete = {}, True
        for seq in running:
            if seq.num_tokens - seq.num_computed_tokens != 1:
                continue
            k = self._last_plan.get(seq.seq_id)
            if k is None:
                complete = complete and not seq.output_token_ids
            elif k:
                limits[seq.seq_id] = max(0, min(k, seq.max_total_tokens - seq.num_tokens - 1))
        return limits, complete

    def _exploring_seconds(self, drafting: int, sequences: int) -> float:
        """What an exploring step of `drafting` sequences adds to a step of `sequences`: the fit's
        price (0 before it is ready), or what the last one of its load band added if more."""
        cost = self.step_cost.fit(sequences)
        fitted = 0.0 if cost is None else cost.drafting_seconds(drafting * self.config.num_speculative_tokens, drafting)
        return max(fitted, self._explore_price.get(load_band(sequences), 0.0))

    def _explore(self, running: Seq[Sequence], rule: SpeculativeConfig) -> dict[int, int]:
        """Drafts up to each sequence's limit under the fixed `rule` for the EXPLORE_SEQS sequences
        likeliest to keep them (hit rate times acceptance); none for the others. The exploring rule
        drops the acceptance floor, so that a sequence written off after a few rejections is
        verified again now and then; a step under it is an exploring step (`observe_step` prices
        it). Where the proposer drafts ahead and the step before did not, this step only primes it:
        the next step explores under the same rule."""
        limits = draft_limits(running, rule)
        if self.proposer.drafts_ahead and not self.drafts_ahead and any(limits.values()):
            self._primed = rule
        else:
            self._exploring_step = rule is self._exploring
        ranked = sorted((s for s in running if limits.get(s.seq_id)),
                        key=lambda s: s.spec.proposal_hit_rate * s.spec.draft_acceptance, reverse=True)
        chosen = {s.seq_id for s in ranked[:EXPLORE_SEQS]}
        return {seq_id: k if seq_id in chosen else 0 for seq_id, k in limits.items()}

    def propose(self, running: Seq[Sequence], limits: dict[int, int]) -> None:
        """Set each running sequence's drafts: up to limits[seq_id] from the proposer, else none; and
        whether the step drafts ahead (`drafts_ahead`)."""
        self.drafts_ahead = not self.config.cost_aware_backoff or any(limits.values())
        for seq in self._drafted:
            seq.draft_token_ids, seq.proposal = [], None
        asking = [seq for seq in running if limits.get(seq.seq_id, 0) > 0] if any(limits.values()) else []
        self._asked = {seq.seq_id for seq in asking}
        self._drafted = asking
        if not asking:
            return
        requests = [DraftRequest(seq.seq_id, seq.request_id, self.contexts.of(seq), seq.num_prompt_tokens,
                                 limits[seq.seq_id]) for seq in asking]
        for seq, drafts in zip(asking, self.proposer.propose(requests)):
            drafts = drafts.first(limits[seq.seq_id])
            seq.draft_token_ids = drafts.token_ids.tolist()
            seq.proposal = drafts if drafts.probs is not None or drafts.logprobs is not None else None
            if self.proposer.answered(len(seq.draft_token_ids)):
                seq.spec.record_proposal(bool(seq.draft_token_ids))
        self.drafts_ahead = self.drafts_ahead and self.proposer.wants_drafts_ahead()

    def after_step(self, running: Seq[Sequence]) -> None:
        """Shadow probes (shadow.py) of the sequences not asked for drafts, then the proposer's
        deferred bookkeeping: under the cost-aware rule within their budget (a few sequences a step),
        else all that are due."""
        if not self.config.cost_aware_backoff:
            self.shadows.probe(running, self.proposer, self._asked)
            self.proposer.catch_up()
        elif self._probe_budget > 0:
            started = time.perf_counter()
            self.shadows.probe(running, self.proposer, self._asked, SHADOWS_PER_STEP)
            self.proposer.catch_up(max(0.0, self._probe_budget - (time.perf_counter() - started)))
            self._probe_budget -= time.perf_counter() - started

    def catch_up(self, seconds: float) -> bool:
        """The proposer's deferred bookkeeping, for about `seconds` (the engine is idle); whether some is left."""
        return self.proposer.catch_up(seconds)

    def on_sequence_finished(self, seq: Sequence) -> None:
        self.shadows.forget(seq.seq_id)
        spec = seq.spec
        self._accepted = PRIOR_DECAY * self._accepted + spec.num_accepted_tokens
        self._tested = PRIOR_DECAY * self._tested + spec.num_tested_tokens
        self._hits = PRIOR_DECAY * self._hits + spec.num_hits
        self._proposals = PRIOR_DECAY * self._proposals + spec.num_proposals
        self.proposer.on_sequence_finished(seq.seq_id, seq.request_id, self.contexts.of(seq), seq.num_prompt_tokens)
        self.contexts.forget(seq.seq_id)
