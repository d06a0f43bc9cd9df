"""Draft proposers: naive, ngram (prompt lookup), suffix decoding, chains, and the factory."""

from __future__ import annotations

import collections
import random
from collections.abc import Sequence

import numpy as np
import pytest

from cupyspec.model.device_tokens import DeviceTokens
from cupyspec.spec_decode.proposers.base import NO_DRAFTS, DraftRequest, Drafts, NaiveProposer, Proposer
from cupyspec.spec_decode.proposers.chain import ChainProposer
from cupyspec.spec_decode.proposers.factory import make_proposer, mtp_proposer
from cupyspec.spec_decode.proposers.hybrid import MTPWithNgram
from cupyspec.spec_decode.proposers.mtp import MTPProposer
from cupyspec.spec_decode.proposers.ngram import NgramProposer
from cupyspec.spec_decode.proposers.suffix import INSERT_CHUNK, SuffixProposer, SuffixTree
from cupyspec.spec_decode.speculative_config import SpeculativeConfig


def ask(proposer: Proposer, ctx: Sequence[int], k: int = 5, seq_id: int = 0) -> list[int]:
    request = DraftRequest(seq_id, f"r{seq_id}", np.array(ctx), 0, k)
    return proposer.propose([request])[0].token_ids.tolist()


# --- interface -------------------------------------------------------------------------------------


def test_draft_request_and_drafts_validate() -> None:
    r = DraftRequest(1, "a", np.array([1, 2], dtype=np.int64), 1, 3)
    assert r.token_ids.dtype == np.int32
    with pytest.raises(ValueError, match="token_ids"):
        DraftRequest(1, "a", np.zeros((2, 2), dtype=np.int32), 0, 1)
    with pytest.raises(ValueError, match="max_drafts"):
        DraftRequest(1, "a", np.array([1]), 0, -1)
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        DraftRequest(1, "a", np.array([1]), 2, 1)
    with pytest.raises(ValueError, match="probs"):
        Drafts(np.array([1, 2]), np.zeros((3, 10)))
    assert len(Drafts([4, 5])) == 2 and Drafts([4, 5]).token_ids.dtype == np.int32


def test_naive_proposes_nothing() -> None:
    out = NaiveProposer().propose([DraftRequest(i, "r", np.array([1, 2, 1, 2]), 0, 4) for i in range(3)])
    assert [len(d) for d in out] == [0, 0, 0]


# --- ngram ---------------------------------------------------------------------------------------------


def test_ngram_longest_n_first_and_what_followed() -> None:
    # "1" last occurred before 9, but "2 1" occurred before 8: the longer n-gram decides.
    ctx = [2, 1, 8, 4, 1, 9, 6, 2, 1]
    assert ask(NgramProposer(1, 2), ctx, k=3) == [8, 4, 1]
    assert ask(NgramProposer(1, 1, agreement_window=1), ctx, k=3) == [9, 6, 2]  # most recent 1-gram


def test_ngram_ranks_equal_ngrams_by_agreement_then_recency() -> None:
    # Both "1"s are 1-gram matches; the first is also preceded by 4, like the tail.
    assert ask(NgramProposer(1, 1), [4, 1, 7, 5, 1, 8, 4, 1], k=1) == [7]
    assert ask(NgramProposer(1, 1), [6, 1, 7, 5, 1, 8, 4, 1], k=1) == [8]


def test_ngram_respects_max_drafts_min_n_and_short_contexts() -> None:
    p = NgramProposer(1, 4)
    ctx = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    assert ask(p, ctx, k=3) == [3, 4, 5]
    assert ask(p, ctx, k=0) == []
    assert ask(p, [1, 2, 3, 4], k=3) == []  # no earlier occurrence
    assert ask(NgramProposer(2, 3), [5, 1, 6, 1], k=2) == []  # only a 1-gram matches
    assert ask(NgramProposer(3, 4), [7, 7], k=2) == []  # context shorter than n
    assert ask(NgramProposer(3, 4), [7], k=2) == []
    assert ask(p, [7, 7], k=2) == [7, 7]


def test_ngram_continues_a_periodic_tail() -> None:
    assert ask(NgramProposer(1, 4), [1, 2, 3, 1, 2, 3], k=5) == [1, 2, 3, 1, 2]


def _ngram_reference(ctx: list[int], k: int, nmin: int, nmax: int, window: int) -> list[int]:
    n = len(ctx)
    best: tuple[int, int] | None = None
    for e in range(n - 1):
        agree = 0
        while agree < min(window, e + 1) and ctx[e - agree] == ctx[n - 1 - agree]:
            agree += 1
        if agree >= nmin and (best is None or (agree, e) >= best):
            best = (agree, e)
    if best is None or k == 0:
        return []
    e = best[1]
    return [ctx[e + 1 + i % (n - 1 - e)] for i in range(k)]


def test_ngram_batch_matches_a_scalar_reference() -> None:
    rng = np.random.default_rng(0)
    p = NgramProposer(2, 3, agreement_window=12)
    ctxs = [rng.integers(0, 4, size=int(rng.integers(1, 60))).tolist() for _ in range(200)]
    ks = rng.integers(0, 6, size=len(ctxs)).tolist()
    out = p.propose([DraftRequest(i, "r", np.array(c), 0, k) for i, (c, k) in enumerate(zip(ctxs, ks))])
    assert [d.token_ids.tolist() for d in out] == [_ngram_reference(c, k, 2, 3, 12) for c, k in zip(ctxs, ks)]


# --- suffix ---------------------------------------------------------------------------------------------

PATTERN = list(range(10, 30))


def test_suffix_proposes_the_continuation_of_a_repeated_pattern() -> None:
    assert ask(SuffixProposer(64, 0, 4.0, 0.1), PATTERN + PATTERN[:6], k=5) == PATTERN[6:11]


def test_suffix_max_spec_factor_caps_by_match_length() -> None:
    ctx = PATTERN + PATTERN[:2]  # the tail matches 2 tokens
    assert ask(SuffixProposer(64, 0, 0.5, 0.1), ctx, k=8) == PATTERN[2:3]
    assert ask(SuffixProposer(64, 0, 1.0, 0.1), ctx, k=8) == PATTERN[2:4]
    assert ask(SuffixProposer(64, 0, 2.0, 0.1), ctx, k=8) == PATTERN[2:6]


def test_suffix_min_token_prob_stops_uncertain_paths() -> None:
    # "9 1" came before 5, 5 and 6: 5 has probability 2/3, and after "9 1 5 9 1" 5 and 6 tie (1/3).
    ctx = [9, 1, 5, 9, 1, 5, 9, 1, 6, 9, 1]
    assert ask(SuffixProposer(64, 0, 1.0, 0.7), ctx) == []
    assert ask(SuffixProposer(64, 0, 1.0, 0.5), ctx) == [5, 9]
    assert ask(SuffixProposer(64, 0, 4.0, 0.5), ctx) == [5, 9, 1]
    assert ask(SuffixProposer(64, 0, 4.0, 0.3), ctx) == [5, 9, 1, 5, 9]


def test_suffix_match_and_drafts_stay_within_the_tree_depth() -> None:
    ctx = PATTERN + PATTERN[:10]
    assert ask(SuffixProposer(4, 0, 8.0, 0.1), ctx, k=8) == PATTERN[10:13]  # match + drafts <= 4 tokens
    assert ask(SuffixProposer(64, 0, 8.0, 0.1), ctx, k=8) == PATTERN[10:18]


def _substring_counts(seqs: list[list[int]], depth: int) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(i + depth, len(s)) + 1):
                counts[tuple(s[i:j])] += 1
    return counts


def _tree_counts(tree: SuffixTree) -> dict[tuple[int, ...], int]:
    out: dict[tuple[int, ...], int] = {}
    stack = [(tree.root, ())]
    while stack:
        node, path = stack.pop()
        if node.children is None:  # a lazy chain: count 1 all along
            for i in range(tree._chain_len(node)):
                out[path + tuple(node.seq[node.pos : node.pos + i + 1])] = 1
            continue
        for token, child in node.children.items():
            out[path + (token,)] = child.count
            stack.append((child, path + (token,)))
    return out


def test_suffix_tree_counts_every_substring_through_appends_and_removals() -> None:
    rng = random.Random(0)
    for _ in range(150):
        depth, vocab = rng.randint(1, 7), rng.randint(1, 4)
        tree, live = SuffixTree(depth), []
        for _ in range(rng.randint(1, 5)):
            seq: list[int] = []
            active: list = []
            tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 25))]
            while len(seq) < len(tokens):  # in chunks, as tokens arrive
                active = tree.extend(seq, active, tokens[len(seq) : len(seq) + rng.randint(1, 4)])
            live.append(seq)
            if len(live) > 1 and rng.random() < 0.4:
                tree.remove(live.pop(rng.randrange(len(live))))
            assert _tree_counts(tree) == dict(_substring_counts(live, depth))


def _suffix_reference(ctx: list[int], outputs: list[list[int]], depth: int, k: int, factor: float,
                      min_prob: float) -> list[int]:
    """Suffix decoding from plain substring counts (own trie leaves out the context's own last occurrence)."""
    best, best_score = [], 0.0
    for seqs, own in (([ctx], 1), (outputs, 0)):
        counts = _substring_counts(seqs, depth)
        for length in range(min(depth - 1, len(ctx)), 0, -1):
            path = tuple(ctx[-length:])
            cap = min(k, int(length * factor + 1e-6))
            if counts[path] - own <= 0:
                continue
            if cap == 0 or best_score >= cap:
                break
            tokens, prob, score, total = [], 1.0, 0.0, counts[path] - own
            while len(tokens) < cap and len(path) < depth:
                options = [(counts[path + (t,)], -t) for t in set(ctx).union(*outputs) if counts[path + (t,)]]
                if not options:
                    break
                count, neg = max(options)
                prob *= count / total
                if prob < min_prob:
                    break
                tokens.append(-neg)
                score, path, total = score + prob, path + (-neg,), count
            if score > best_score + 1e-9:
                best, best_score = tokens, score
    return best


def test_suffix_incremental_proposals_match_a_reference_and_a_fresh_build() -> None:
    rng = random.Random(1)
    for _ in range(60):
        depth, vocab, k = rng.randint(2, 8), rng.randint(2, 4), rng.randint(1, 6)
        factor, min_prob = rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.2, 0.6])
        max_cached = rng.choice([-1, 0, 1, 2])
        proposer, cached, ctxs = SuffixProposer(depth, max_cached, factor, min_prob), collections.OrderedDict(), {}
        for step in range(25):
            sid = rng.randrange(3)
            ctx = ctxs.setdefault(sid, [rng.randrange(vocab) for _ in range(rng.randint(1, 6))])
            ctx += [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
            if rng.random() < 0.15:
                proposer.on_sequence_finished(sid, f"r{step}", np.array(ctx), 1)
                proposer.catch_up()
                if max_cached != 0 and len(ctx) > 1:
                    cached[f"r{step}"] = ctx[1:]
                    while 0 < max_cached < len(cached):
                        cached.popitem(last=False)
                del ctxs[sid]
                continue
            got = ask(proposer, ctx, k, seq_id=sid)
            assert got == _suffix_reference(ctx, list(cached.values()), depth, k, factor, min_prob)
            if max_cached == 0:
                assert got == ask(SuffixProposer(depth, 0, factor, min_prob), ctx, k)


RESPONSE = [int(t) for t in np.random.default_rng(7).permutation(np.arange(100, 160))]


def _accepted_drafts(proposer: Proposer, seq_id: int, request_id: str, prompt: list[int],
                     response: list[int]) -> int:
    """Decode `response` with a greedy target that always emits it; count drafts that match it."""
    ctx, accepted = list(prompt), 0
    while len(ctx) < len(prompt) + len(response):
        draft = ask(proposer, ctx, k=4, seq_id=seq_id)
        truth = response[len(ctx) - len(prompt) :]
        n = next((i for i, (d, t) in enumerate(zip(draft, truth)) if d != t), min(len(draft), len(truth)))
        accepted += n
        ctx += truth[: n + 1]
    proposer.on_sequence_finished(seq_id, request_id, np.array(ctx), len(prompt))
    proposer.catch_up()
    return accepted


def test_suffix_global_cache_helps_a_repeated_request() -> None:
    proposer = SuffixProposer(64, -1, 1.0, 0.1)
    first = _accepted_drafts(proposer, 0, "a", [1, 2, 3], RESPONSE)
    second = _accepted_drafts(proposer, 1, "b", [1, 2, 3], RESPONSE)
    assert first == 0 and second >= 40  # at most 48: each step of 4 drafts also emits the target's token


def test_suffix_eviction_drops_the_oldest_request() -> None:
    other = [int(t) for t in np.random.default_rng(8).permutation(np.arange(200, 260))]
    for max_cached, helps in ((1, False), (2, True), (0, False)):
        proposer = SuffixProposer(64, max_cached, 1.0, 0.1)
        _accepted_drafts(proposer, 0, "a", [1, 2, 3], RESPONSE)
        _accepted_drafts(proposer, 1, "b", [1, 2, 3], other)
        again = _accepted_drafts(proposer, 2, "c", [1, 2, 3], RESPONSE)
        assert (again > len(RESPONSE) // 2) == helps, max_cached


def test_suffix_global_matches_follow_insertions_and_evictions() -> None:
    x = list(range(50, 70))
    proposer = SuffixProposer(64, 2, 1.0, 0.1)
    proposer.on_sequence_finished(9, "a", np.array([1] + x), 1)
    proposer.catch_up()
    ctx = [1, 2, 3] + x[:5]  # the tail matches inside the cached output
    assert ask(proposer, ctx, k=3) == x[5:8]
    proposer.on_sequence_finished(8, "b", np.array([1] + x[:8] + [99, 98]), 1)  # shares x[:8], then 99
    proposer.catch_up()
    ctx += x[5:6]
    assert ask(proposer, ctx, k=4) == x[6:10] == _suffix_reference(ctx, [x, x[:8] + [99, 98]], 64, 4, 1.0, 0.1)
    proposer.on_sequence_finished(7, "c", np.array([1, 5, 5]), 1)  # evicts "a": only "b" still has x[:8]
    proposer.catch_up()
    assert ask(proposer, ctx, k=4) == x[6:8] + [99, 98]


def test_suffix_caches_finished_outputs_a_chunk_at_a_time() -> None:
    """The engine moves finished outputs into the global trie when it has time: until then they
    are not proposed from. A catch_up given no time caches a piece and says whether some is left,
    so that the start of an output is proposed from before its end is cached."""
    output = [int(t) for t in np.random.default_rng(7).permutation(np.arange(100, 100 + 8 * INSERT_CHUNK))]
    proposer = SuffixProposer(64, -1, 1.0, 0.1)
    proposer.on_sequence_finished(0, "a", np.array([1, 2, 3] + output), 3)
    early, late = [9] + output[:4], [9] + output[-8:-3]  # tails near the start and near the end
    seq_ids = iter(range(1, 1000))
    assert ask(proposer, early, k=3, seq_id=next(seq_ids)) == []
    left, calls = True, 0
    while left and not ask(proposer, early, k=3, seq_id=next(seq_ids)):
        left, calls = proposer.catch_up(0.0), calls + 1
    assert left and ask(proposer, late, k=3, seq_id=next(seq_ids)) == []  # the start only
    while left:
        left, calls = proposer.catch_up(0.0), calls + 1
    assert 1 < calls <= len(output)  # a piece a call
    assert ask(proposer, early, k=3, seq_id=next(seq_ids)) == output[4:7]
    assert ask(proposer, late, k=3, seq_id=next(seq_ids)) == output[-3:]


def test_suffix_drops_waiting_outputs_beyond_the_cache_limit() -> None:
    proposer = SuffixProposer(64, 1, 1.0, 0.1)
    proposer.on_sequence_finished(0, "a", np.array([1] + RESPONSE), 1)
    proposer.on_sequence_finished(1, "b", np.array([1, 7, 7, 7]), 1)  # "a" waited: dropped, never inserted
    assert not proposer.catch_up()
    assert ask(proposer, [9] + RESPONSE[:5], k=3, seq_id=2) == []


def test_suffix_rebuilds_a_sequence_whose_history_changed() -> None:
    proposer = SuffixProposer(64, 0, 1.0, 0.1)
    assert ask(proposer, PATTERN + PATTERN[:3]) == PATTERN[3:6]
    assert ask(proposer, [5, 6, 7, 5, 6]) == [7, 5]  # same seq_id, different tokens


# --- chain and factory -------------------------------------------------------------------------------


class _Fixed(Proposer):
    """Always proposes the same tokens, optionally with flat probabilities over a vocabulary of 300."""

    method = "fixed"

    def __init__(self, tokens: list[int], with_probs: bool = False) -> None:
        self.tokens, self.with_probs, self.finished = tokens, with_probs, []

    def propose(self, requests: Sequence[DraftRequest]) -> list[Drafts]:
        out = []
        for r in requests:
            ids = np.array(self.tokens[: r.max_drafts], dtype=np.int32)
            out.append(Drafts(ids, np.full((ids.size, 300), 1 / 300, np.float32) if self.with_probs else None))
        return out

    def on_sequence_finished(self, seq_id: int, request_id: str, token_ids: np.ndarray, num_prompt_tokens: int) -> None:
        self.finished.append(seq_id)


def test_a_chain_continues_the_first_proposers_drafts_with_the_second() -> None:
    ctx = [7, 1, 2, 3, 4, 5, 6, 9]  # after the first's drafts [1, 2] the ngram continues with 3, 4, ...
    chain = ChainProposer(_Fixed([1, 2, 200]), NgramProposer(1, 4), first_count=2)
    assert ask(chain, ctx, k=5) == [1, 2, 3, 4, 5]
    assert ask(chain, ctx, k=1) == [1]
    assert ask(chain, ctx, k=0) == []
    assert chain.method == "fixed+ngram"
    chain.on_sequence_finished(3, "r", np.array(ctx), 1)
    assert chain.first.finished == [3]


def test_chain_probs_are_one_hot_for_model_free_rows() -> None:
    ctx = [7, 1, 2, 3, 4, 5, 6, 9]
    out = ChainProposer(_Fixed([1, 2], with_probs=True), NgramProposer(1, 4), 2).propose(
        [DraftRequest(0, "r", np.array(ctx), 0, 4)])[0]
    assert out.token_ids.tolist() == [1, 2, 3, 4] and out.probs.shape == (4, 300)
    assert np.allclose(out.probs[:2], 1 / 300) and out.probs[2, 3] == 1 and out.probs[3].sum() == 1
    assert ChainProposer(_Fixed([1, 2]), NgramProposer(1, 4), 2).propose(
        [DraftRequest(0, "r", np.array(ctx), 0, 4)])[0].probs is None


def test_chain_refuses_a_stateful_second_proposer() -> None:
    with pytest.raises(ValueError, match="per-sequence state"):
        ChainProposer(NgramProposer(), SuffixProposer(), 2)


def test_the_factory_builds_the_configured_proposer() -> None:
    assert make_proposer(SpeculativeConfig()) is None
    assert isinstance(make_proposer(SpeculativeConfig(method="naive")), NaiveProposer)
    ngram = make_proposer(SpeculativeConfig(method="ngram", num_speculative_tokens=3, ngram_min=2, ngram_max=5))
    assert isinstance(ngram, NgramProposer) and (ngram.ngram_min, ngram.ngram_max) == (2, 5)
    suffix = make_proposer(SpeculativeConfig(method="suffix", num_speculative_tokens=4,
                                             suffix_decoding_max_tree_depth=16,
                                             suffix_decoding_max_cached_requests=5,
                                             suffix_decoding_max_spec_factor=2.0,
                                             suffix_decoding_min_token_prob=0.2))
    assert isinstance(suffix, SuffixProposer)
    assert (suffix.max_tree_depth, suffix.max_cached_requests, suffix.max_spec_factor, suffix.min_token_prob) == (
        16, 5, 2.0, 0.2)
    assert isinstance(make_proposer(SpeculativeConfig(method="mtp", num_speculative_tokens=1, model="head")),
                      MTPProposer)
    hybrid = make_proposer(SpeculativeConfig(method="mtp", num_speculative_tokens=5, num_model_steps=2, model="head",
                                             mtp_strategy="with_ngram"))
    assert isinstance(hybrid, MTPWithNgram) and mtp_proposer(hybrid) is hybrid.first
    assert isinstance(hybrid.first, MTPProposer) and isinstance(hybrid.ngram, NgramProposer)
    assert hybrid.chain.first is hybrid.first and hybrid.chain.first_count == 2
    assert NaiveProposer().propose([]) == [] and len(NO_DRAFTS) == 0


def test_mtp_proposes_the_drafts_of_a_sequences_last_step_in_flight_or_collected() -> None:
    """A context that ends with a placeholder (its step in flight) gets that step's drafts, still on the
    device, as placeholder ids; a context of known tokens gets the drafts of the last collected step,
    which made them after exactly those tokens (shadow probes score those)."""
    mtp = MTPProposer()
    known, in_flight = np.array([5, 6, 7], np.int32), np.array([5, 6, 7, -9], np.int32)
    step_one, step_two = object(), object()
    mtp.launched([3], step_one, True, np.array([[-10, -11, -12]], np.int32))
    assert mtp.propose([DraftRequest(3, "r", in_flight, 2, 3)])[0].token_ids.tolist() == [-10, -11, -12]
    assert not len(mtp.propose([DraftRequest(3, "r", known, 2, 3)])[0])  # nothing collected yet
    mtp.launched([3], step_two, True, np.array([[-14, -15, -16]], np.int32))  # launched before step one is collected
    mtp.remember([3], lambda: (np.array([[40, 41, 42]], np.int32), np.full((1, 3), -0.5, np.float32)), None, step_one)
    assert mtp.propose([DraftRequest(3, "r", in_flight, 2, 2)])[0].token_ids.tolist() == [-14, -15]
    drafts = mtp.propose([DraftRequest(3, "r", known, 2, 3)])[0]
    assert drafts.token_ids.tolist() == [40, 41, 42] and drafts.logprobs.tolist() == [-0.5] * 3
    mtp.remember([3], lambda: (np.array([[50, 51, 52]], np.int32), np.zeros((1, 3), np.float32)), None, step_two)
    assert not len(mtp.propose([DraftRequest(3, "r", in_flight, 2, 3)])[0])  # nothing holds it any more
    assert mtp.propose([DraftRequest(3, "r", known, 2, 3)])[0].token_ids.tolist() == [50, 51, 52]


def test_mtp_has_no_drafts_for_a_sequence_whose_last_step_did_not_draft() -> None:
    """A step in which the head does not draft (the back-off drafts nobody) leaves its sequences no
    drafts: neither the placeholders nor the drafts of an earlier step, even one collected after it."""
    mtp = MTPProposer()
    known, in_flight = np.array([5, 6, 7], np.int32), np.array([5, 6, 7, -9], np.int32)
    drafting, plain = object(), object()
    mtp.launched([3], drafting, True, np.array([[-10, -11, -12]], np.int32))
    mtp.launched([3], plain, False)  # overlapped, but no drafts on the device
    mtp.remember([3], lambda: (np.array([[40, 41, 42]], np.int32), np.zeros((1, 3), np.float32)), None, drafting)
    assert not len(mtp.propose([DraftRequest(3, "r", in_flight, 2, 3)])[0])
    assert not len(mtp.propose([DraftRequest(3, "r", known, 2, 3)])[0])
    mtp.launched([3], drafting, True)  # not overlapped: its drafts come when it is collected
    mtp.remember([3], lambda: (np.array([[50, 51, 52]], np.int32), np.zeros((1, 3), np.float32)), None, drafting)
    assert mtp.propose([DraftRequest(3, "r", known, 2, 3)])[0].token_ids.tolist() == [50, 51, 52]
    mtp.launched([3], plain, False)
    assert not len(mtp.propose([DraftRequest(3, "r", known, 2, 3)])[0])


def test_with_ngram_takes_ngrams_drafts_where_the_text_copies_itself_else_the_heads_continued_by_ngram() -> None:
    mtp, ngram = MTPProposer(), NgramProposer(1, 4)
    hybrid = MTPWithNgram(mtp, ngram, num_model_steps=2)
    copying = np.array([10, 11, 12, 13, 14, 15, 16, 10, 11, 12, 13], np.int32)  # "10 11 12 13" again: 4 agree
    fresh = np.array([20, 21, 22, 23, 24, 30, 22], np.int32)  # the last token occurred once before: 1 agrees
    mtp.remember([1, 2], lambda: (np.array([[90, 91], [22, 23]], np.int32), np.zeros((2, 2), np.float32)))
    out = hybrid.propose([DraftRequest(1, "a", copying, 4, 3), DraftRequest(2, "b", fresh, 4, 4)])
    assert out[0].token_ids.tolist() == [14, 15, 16]  # ngram's copy, not the head's 90, 91
    # the head's two drafts, then ngram from the context followed by them ("22 23" -> "24 30")
    assert out[1].token_ids.tolist() == [22, 23, 24, 30] and np.isnan(out[1].logprobs[2:]).all()
    assert hybrid.wants_drafts_ahead()  # the head's drafts served one sequence
    hybrid.propose([DraftRequest(1, "a", copying, 4, 3)])
    assert not hybrid.wants_drafts_ahead()  # every sequence copies: the head need not draft


def test_the_placeholders_of_a_steps_drafts_name_their_sequences_slots() -> None:
    tokens = DeviceTokens(np, max_num_seqs=4, num_model_steps=3)
    placeholders = tokens.drafts(2)
    assert placeholders.dtype == np.int32 and placeholders.tolist() == [[~1, ~2, ~3], [~5, ~6, ~7]]
    assert [tokens.sequence_of(int(p)) for p in placeholders.ravel()] == [0, 0, 0, 1, 1, 1]
    assert tokens.sequence_of(tokens.emitted(1)) == 1 and tokens.emitted(1) not in placeholders
