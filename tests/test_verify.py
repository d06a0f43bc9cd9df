"""Draft verification: greedy equivalence, accept policies, penalties over drafts, batching, and
the statistical proof that `rejection` and `target_match` reproduce the target distribution."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import pytest

from cupyspec.sampling.params import SamplingParams
from cupyspec.sampling.sampler import SamplingRow, sample
from cupyspec.spec_decode.verification.verify import PLACEHOLDER_TOKEN_ID, VerifyInput, verify

STRATEGIES = ("rejection", "greedy", "target_match", "topp")
GREEDY = SamplingParams(temperature=0.0)


def make_input(drafts: list[list[int]], params: list[SamplingParams], rng: np.random.Generator,
               draft_probs: np.ndarray | None = None, k: int | None = None) -> VerifyInput:
    """One request per draft list; every row of request b uses params[b] and fresh uniforms."""
    k = max((len(d) for d in drafts), default=0) if k is None else k
    ids = np.full((len(drafts), k), PLACEHOLDER_TOKEN_ID, dtype=np.int64)
    for b, d in enumerate(drafts):
        ids[b, :len(d)] = d
    rows = tuple(SamplingRow(params[b], float(rng.random())) for b, d in enumerate(drafts) for _ in range(len(d) + 1))
    return VerifyInput(ids, np.array([len(d) for d in drafts], dtype=np.int64), draft_probs, rows,
                       rng.random(len(rows)))


def first_rows(inp: VerifyInput) -> np.ndarray:
    return np.cumsum(inp.num_drafts + 1) - (inp.num_drafts + 1)


# ---------------------------------------------------------------- greedy targets and policies


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_greedy_target_emits_the_argmax_path(strategy: str, with_draft_probs: bool) -> None:
    rng = np.random.default_rng(0)
    vocab, k = 20, 4
    path = rng.integers(0, vocab, size=(5, k + 1))  # what step-by-step argmax decoding emits
    drafts = [list(path[0, :4]),  # all right: bonus token
              [(path[1, 0] + 1) % vocab, *path[1, 1:4]],  # first wrong
              [path[2, 0], path[2, 1], (path[2, 2] + 3) % vocab],  # third wrong
              [],  # no drafts
              list(path[4, :2])]  # short, all right
    probs = rng.dirichlet(np.ones(vocab), size=(5, k)).astype(np.float32) if with_draft_probs else None
    inp = make_input(drafts, [GREEDY] * 5, rng, probs, k)
    logits = np.concatenate([rng.normal(size=(len(d) + 1, vocab)) + 10.0 * np.eye(vocab)[path[b, :len(d) + 1]]
                             for b, d in enumerate(drafts)]).astype(np.float32)
    out = verify(np, logits, inp, strategy, "normal")
    right = [4, 0, 2, 0, 2]
    np.testing.assert_array_equal(out.num_accepted_drafts, right)
    np.testing.assert_array_equal(out.accept_num, np.array(right) + 1)
    for b, m in enumerate(right):
        np.testing.assert_array_equal(out.output_token_ids[b, :m + 1], path[b, :m + 1])
        assert (out.output_token_ids[b, m + 1:] == PLACEHOLDER_TOKEN_ID).all()
        np.testing.assert_array_equal(out.accepted_mask[b], np.arange(k) < m)
    assert out.output_token_ids.shape == (5, k + 1) and out.output_token_ids.dtype == np.int64


def mixed_case(rng: np.random.Generator, vocab: int = 30) -> tuple[np.ndarray, VerifyInput]:
    params = [SamplingParams(temperature=0.8, top_p=0.9), GREEDY, SamplingParams(top_k=4),
              SamplingParams(temperature=1.2, min_p=0.05), SamplingParams(temperature=0.7)]
    drafts = [list(rng.integers(0, vocab, n)) for n in (3, 2, 0, 3, 1)]
    inp = make_input(drafts, params, rng)
    return (rng.normal(size=(len(inp.rows), vocab)) * 2).astype(np.float32), inp


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reject_all_is_plain_sampling(strategy: str) -> None:
    logits, inp = mixed_case(np.random.default_rng(1))
    out = verify(np, logits, inp, strategy, "reject_all")
    first = first_rows(inp)
    plain = sample(np, logits[first], [inp.rows[r] for r in first]).token_ids
    np.testing.assert_array_equal(out.accept_num, 1)
    np.testing.assert_array_equal(out.output_token_ids[:, 0], plain)
    assert (out.output_token_ids[:, 1:] == PLACEHOLDER_TOKEN_ID).all() and not out.accepted_mask.any()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_accept_all_takes_every_draft_and_a_bonus(strategy: str) -> None:
    logits, inp = mixed_case(np.random.default_rng(2))
    out = verify(np, logits, inp, strategy, "accept_all")
    last = first_rows(inp) + inp.num_drafts
    bonus = sample(np, logits[last], [inp.rows[r] for r in last]).token_ids
    np.testing.assert_array_equal(out.accept_num, inp.num_drafts + 1)
    for b, n in enumerate(inp.num_drafts):
        np.testing.assert_array_equal(out.output_token_ids[b, :n], inp.draft_token_ids[b, :n])
        assert out.output_token_ids[b, n] == bonus[b]
        assert out.accepted_mask[b].sum() == n


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_mixed_batch_equals_one_request_at_a_time(strategy: str) -> None:
    rng = np.random.default_rng(3)
    logits, inp = mixed_case(rng)
    probs = rng.dirichlet(np.ones(logits.shape[1]), size=inp.draft_token_ids.shape).astype(np.float32)
    together = verify(np, logits, VerifyInput(inp.draft_token_ids, inp.num_drafts, probs, inp.rows,
                                              inp.extra_uniforms), strategy, "normal")
    first = first_rows(inp)
    for b, n in enumerate(inp.num_drafts):
        rows = slice(first[b], first[b] + n + 1)
        alone = verify(np, logits[rows], VerifyInput(inp.draft_token_ids[b:b + 1], inp.num_drafts[b:b + 1],
                                                     probs[b:b + 1], inp.rows[rows], inp.extra_uniforms[rows]),
                       strategy, "normal")
        np.testing.assert_array_equal(alone.output_token_ids[0], together.output_token_ids[b])
        assert 1 <= together.accept_num[b] <= n + 1
    zero = np.flatnonzero(inp.num_drafts == 0)  # a request without drafts is plain sampling
    plain = sample(np, logits[first[zero]], [inp.rows[r] for r in first[zero]]).token_ids
    np.testing.assert_array_equal(together.output_token_ids[zero, 0], plain)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_greedy_batches_verify_as_they_do_beside_a_sampled_request(strategy: str) -> None:
    """A batch without sampled rows takes a shortcut (each draft passes iff it is its row's argmax);
    it must agree with the general path, which a sampled request in the batch forces."""
    rng = np.random.default_rng(7)
    vocab, lengths = 40, (5, 0, 3, 5, 1, 4)
    logits = (rng.normal(size=(sum(n + 1 for n in lengths), vocab)) * 2).astype(np.float32)
    argmax, start, drafts = logits.argmax(axis=1), 0, []
    for n in lengths:  # the argmax path for a random number of drafts, then a miss
        good = int(rng.integers(0, n + 1))
        drafts.append([int(argmax[start + j]) if j < good else int((argmax[start + j] + 1) % vocab) for j in range(n)])
        start += n + 1
    greedy = make_input(drafts, [GREEDY] * len(lengths), rng)
    alone = verify(np, logits, greedy, strategy, "normal")
    sampled = make_input([[1, 2]], [SamplingParams(temperature=0.9)], rng, k=5)
    beside = verify(np, np.concatenate([logits, rng.normal(size=(3, vocab)).astype(np.float32)]),
                    VerifyInput(np.vstack([greedy.draft_token_ids, sampled.draft_token_ids]),
                                np.append(greedy.num_drafts, 2), None, greedy.rows + sampled.rows,
                                np.append(greedy.extra_uniforms, sampled.extra_uniforms)), strategy, "normal")
    np.testing.assert_array_equal(beside.output_token_ids[:len(lengths)], alone.output_token_ids)
    np.testing.assert_array_equal(beside.accept_num[:len(lengths)], alone.accept_num)
    assert alone.num_accepted_drafts.sum() > 0 and (alone.num_accepted_drafts < np.array(lengths)).any()


def test_no_requests_and_no_drafts_at_all() -> None:
    rng = np.random.default_rng(4)
    empty = verify(np, np.zeros((0, 5), np.float32), make_input([], [], rng, k=2), "rejection", "normal")
    assert empty.output_token_ids.shape == (0, 3) and empty.accept_num.shape == (0,)
    inp = make_input([[], []], [GREEDY, SamplingParams()], rng)
    logits = rng.normal(size=(2, 5)).astype(np.float32)
    out = verify(np, logits, inp, "rejection", "normal")
    assert out.output_token_ids.shape == (2, 1)
    np.testing.assert_array_equal(out.output_token_ids[:, 0], sample(np, logits, list(inp.rows)).token_ids)


# ---------------------------------------------------------------- each strategy's rule on random rows


def test_rejection_picks_from_the_documented_residual() -> None:
    p = np.array([0.4, 0.3, 0.2, 0.1])
    logits = np.log(np.tile(p, (4, 1))).astype(np.float32)  # 2 requests x (1 draft + bonus)
    params = SamplingParams()
    rows = (SamplingRow(params, 0.6), SamplingRow(params, 0.5), SamplingRow(params, 0.6), SamplingRow(params, 0.95))
    # draft 1 has p = 0.3: accepted when u' < 0.3. Residual (p without token 1) in rank order:
    # 0.4, 0, 0.2, 0.1 over 0.7 -> cumulative 0.571, 0.571, 0.857, 1, so u = 0.6 picks token 2.
    inp = VerifyInput(np.array([[1], [1]]), np.array([1, 1]), None, rows, np.array([0.31, 0.0, 0.29, 0.0]))
    out = verify(np, logits, inp, "rejection", "normal")
    np.testing.assert_array_equal(out.output_token_ids, [[2, PLACEHOLDER_TOKEN_ID], [1, 3]])  # bonus: u = 0.95
    assert sample(np, logits[:1], [rows[0]]).token_ids[0] == 1  # p itself would give back the draft


def test_rejection_falls_back_to_p_when_the_residual_vanishes() -> None:
    p = np.array([0.5, 0.25, 0.125, 0.125])
    logits = np.log(np.tile(p, (2, 1))).astype(np.float32)
    q = np.tile(2 * p, (1, 1, 1)).astype(np.float32)  # q >= p everywhere: max(0, p - q) == 0
    rows = (SamplingRow(SamplingParams(), 0.7), SamplingRow(SamplingParams(), 0.1))
    inp = VerifyInput(np.array([[0]]), np.array([1]), q, rows, np.array([0.9, 0.0]))  # 0.9 * 1.0 >= 0.5: rejected
    out = verify(np, logits, inp, "rejection", "normal")
    assert out.accept_num[0] == 1
    assert out.output_token_ids[0, 0] == sample(np, logits[:1], [rows[0]]).token_ids[0] == 1


def test_topp_accepts_inside_the_top_p_set_only() -> None:
    logits = np.log(np.array([0.05, 0.4, 0.3, 0.15, 0.1])).astype(np.float32)
    rng = np.random.default_rng(5)
    narrow, wide = SamplingParams(top_p=0.6), SamplingParams(top_p=1.0)  # narrow set: {1, 2}
    inp = make_input([[2], [3], [0]], [narrow, narrow, wide], rng)
    out = verify(np, np.tile(logits, (6, 1)), inp, "topp", "normal")
    np.testing.assert_array_equal(out.num_accepted_drafts, [1, 0, 1])  # the rarest token passes at top_p = 1
    assert out.output_token_ids[1, 0] == sample(np, logits[None], [inp.rows[2]]).token_ids[0]
    assert out.output_token_ids[1, 0] in (1, 2)


def test_greedy_strategy_on_random_rows_accepts_the_argmax_and_emits_a_sample() -> None:
    logits = np.log(np.array([0.1, 0.5, 0.3, 0.1])).astype(np.float32)
    rng = np.random.default_rng(6)
    inp = make_input([[1, 1], [2, 1]], [SamplingParams(temperature=1.0)] * 2, rng)
    out = verify(np, np.tile(logits, (6, 1)), inp, "greedy", "normal")
    np.testing.assert_array_equal(out.num_accepted_drafts, [2, 0])
    np.testing.assert_array_equal([out.output_token_ids[0, 2], out.output_token_ids[1, 0]],
                                  sample(np, np.tile(logits, (2, 1)), [inp.rows[2], inp.rows[3]]).token_ids)


# ---------------------------------------------------------------- penalties over the drafts


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_penalties_see_the_drafts_before_each_row(temperature: float) -> None:
    params = SamplingParams(temperature=temperature, frequency_penalty=1.5)
    base = np.array([0.0, 1.8, 0.0, 2.5, 0.0, -1.0], dtype=np.float32)  # token 3 leads by 0.7
    logits = np.tile(base, (2, 1))
    history = np.array([0], dtype=np.int64)
    rows = (SamplingRow(params, 0.3, output_token_ids=history),
            SamplingRow(params, 0.42, output_token_ids=np.append(history, 3)))  # draft 3 before row 1
    inp = VerifyInput(np.array([[3]]), np.array([1]), None, rows, np.array([0.0, 0.0]))
    out = verify(np, logits, inp, "rejection", "accept_all")
    expected = sample(np, logits[1:], [rows[1]]).token_ids[0]
    unpenalized = sample(np, logits[1:], [SamplingRow(params, 0.42, output_token_ids=history)]).token_ids[0]
    assert out.output_token_ids[0, 1] == expected
    if temperature == 0.0:
        assert (expected, unpenalized) == (1, 3)
        normal = verify(np, logits, inp, "rejection", "normal")  # row 0: argmax 3 accepted, row 1 penalized
        np.testing.assert_array_equal(normal.output_token_ids[0], [3, 1])
        history_rows = tuple(SamplingRow(params, r.uniform, output_token_ids=np.array([3])) for r in rows)
        repeated = VerifyInput(np.array([[3]]), np.array([1]), None, history_rows, np.array([0.0, 0.0]))
        np.testing.assert_array_equal(verify(np, logits, repeated, "greedy", "normal").output_token_ids[0],
                                      [1, PLACEHOLDER_TOKEN_ID])  # penalized row 0 rejects the draft


# ---------------------------------------------------------------- validation


def test_bad_input_names_the_parameter() -> None:
    rng = np.random.default_rng(7)
    inp = make_input([[1, 2]], [GREEDY], rng)
    logits = np.zeros((3, 4), np.float32)
    with pytest.raises(ValueError, match="strategy"):
        verify(np, logits, inp, "typical", "normal")
    with pytest.raises(ValueError, match="accept_policy"):
        verify(np, logits, inp, "greedy", "sometimes")
    with pytest.raises(ValueError, match="target_logits"):
        verify(np, logits[:2], inp, "greedy", "normal")
    with pytest.raises(ValueError, match="draft_token_ids"):
        verify(np, np.zeros((3, 2), np.float32), inp, "greedy", "normal")
    with pytest.raises(ValueError, match="draft_probs"):
        verify(np, logits, VerifyInput(inp.draft_token_ids, inp.num_drafts, np.zeros((1, 2, 5), np.float32),
                                       inp.rows, inp.extra_uniforms), "rejection", "normal")
    with pytest.raises(ValueError, match="num_drafts"):
        VerifyInput(inp.draft_token_ids, np.array([3]), None, inp.rows, inp.extra_uniforms)
    with pytest.raises(ValueError, match="rows"):
        VerifyInput(inp.draft_token_ids, inp.num_drafts, None, inp.rows[:2], inp.extra_uniforms)
    with pytest.raises(ValueError, match="extra_uniforms"):
        VerifyInput(inp.draft_token_ids, inp.num_drafts, None, inp.rows, np.array([0.1, 1.0, 0.2]))


# ---------------------------------------------------------------- the target distribution is preserved

TRIALS = 50_000
VOCAB = 6
FIRST_LOGITS = np.array([1.2, 0.9, 0.5, 0.1, -0.4, -1.0], dtype=np.float32)  # position 1
NEXT_LOGITS = (np.random.default_rng(42).normal(size=(VOCAB, VOCAB)) * 1.2).astype(np.float32)  # [prev, V]
POOR_DRAFTS = (1, 2)  # fixed one-hot drafts: never the most likely token
DRAFT_FIRST = np.array([0.05, 0.1, 0.15, 0.2, 0.2, 0.3])  # q for position 1: mass where p has little or none
DRAFT_NEXT = np.random.default_rng(43).dirichlet(np.ones(VOCAB), size=VOCAB)  # [prev, V]
Verifier = Callable[..., Any]  # verify, or the broken variant below
TARGETS = {"temperature=1": SamplingParams(temperature=1.0), "top_p=0.8,top_k=5": SamplingParams(top_p=0.8, top_k=5)}


def reference_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Float64 distributions [n, V] after temperature, top-k and top-p (tokens ranked by probability)."""
    z = np.exp((logits - logits.max(axis=-1, keepdims=True)).astype(np.float64) / params.temperature)
    p = z / z.sum(axis=-1, keepdims=True)
    order = np.argsort(-p, axis=-1, kind="stable")  # [n, V] most likely first
    rank = np.argsort(order, axis=-1)  # [n, V] 0 = most likely
    if params.top_k > 0:
        p = np.where(rank < params.top_k, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    ranked = np.take_along_axis(p, order, axis=-1)
    above = np.take_along_axis(np.cumsum(ranked, axis=-1) - ranked, rank, axis=-1)  # mass ranked higher
    p = np.where(above < params.top_p, p, 0.0)
    return p / p.sum(axis=-1, keepdims=True)


def draw_from(probs: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """Inverse-CDF draws in token order from rows of probs [n, V] with uniforms [n]."""
    cdf = np.cumsum(probs, axis=-1)
    return np.minimum((cdf <= uniforms[:, None] * cdf[:, -1:]).sum(axis=-1), probs.shape[-1] - 1)


def biased_verify(xp: Any, logits: np.ndarray, inp: VerifyInput, strategy: str, accept_policy: str) -> Any:
    """A broken verifier: accepts with min(1, p/q) but corrects from p instead of the residual."""
    batch, k = inp.draft_token_ids.shape  # every request has k drafts here
    p = reference_probs(logits, inp.rows[0].params).reshape(batch, k + 1, VOCAB)
    u = np.array([r.uniform for r in inp.rows]).reshape(batch, k + 1)
    drafts = inp.draft_token_ids
    q = np.eye(VOCAB)[drafts] if inp.draft_probs is None else inp.draft_probs.astype(np.float64)
    p_d = np.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
    q_d = np.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    count = np.cumprod(inp.extra_uniforms.reshape(batch, k + 1)[:, :k] * q_d < p_d, axis=1).sum(axis=1)
    last = draw_from(p[np.arange(batch), count], u[np.arange(batch), count])
    out = np.where(np.arange(k + 1) < count[:, None], np.pad(drafts, ((0, 0), (0, 1))), PLACEHOLDER_TOKEN_ID)
    out[np.arange(batch), count] = last
    return SimpleNamespace(output_token_ids=out, accept_num=count + 1)


def verify_step(verifier: Verifier, strategy: str, params: SamplingParams, prev: np.ndarray, drafts: np.ndarray,
                draft_probs: np.ndarray | None, rng: np.random.Generator) -> Any:
    """One step for len(prev) requests after token prev (FIRST_LOGITS where prev < 0); drafts [n, k]."""
    n, k = drafts.shape
    context = np.concatenate([prev[:, None], drafts], axis=1)  # [n, k+1]: the token before each row
    logits = np.where((context < 0)[..., None], FIRST_LOGITS, NEXT_LOGITS[np.maximum(context, 0)])
    rows = tuple(SamplingRow(params, float(u)) for u in rng.random(n * (k + 1)))
    inp = VerifyInput(drafts, np.full(n, k), draft_probs, rows, rng.random(n * (k + 1)))
    return verifier(np, logits.reshape(n * (k + 1), VOCAB).astype(np.float32), inp, strategy, "normal")


def first_two_tokens(verifier: Verifier, strategy: str, params: SamplingParams, random_drafts: bool,
                     rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The first two emitted tokens [TRIALS] each, continuing with a second step where the first emitted one."""
    def propose(prev: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray | None]:
        if not random_drafts:
            return np.tile(POOR_DRAFTS[-k:], (len(prev), 1)), None
        drafts, probs = [], []
        for _ in range(k):
            q = np.where((prev < 0)[:, None], DRAFT_FIRST, DRAFT_NEXT[np.maximum(prev, 0)])
            prev = draw_from(q, rng.random(len(prev)))
            drafts.append(prev)
            probs.append(q)
        return np.stack(drafts, axis=1), np.stack(probs, axis=1).astype(np.float32)

    start = np.full(TRIALS, -1)
    out = verify_step(verifier, strategy, params, start, *propose(start, 2), rng)
    first, second = out.output_token_ids[:, 0], out.output_token_ids[:, 1].copy()
    again = out.accept_num == 1
    second[again] = verify_step(verifier, strategy, params, first[again], *propose(first[again], 1),
                                rng).output_token_ids[:, 0]
    return first, second, out.accept_num


def chi_square_passes(tokens: np.ndarray, probs: np.ndarray) -> bool:
    """Pearson test at significance 1e-3 (bins under 5 expected pooled; Wilson-Hilferty quantile)."""
    observed = np.bincount(tokens, minlength=probs.size).astype(np.float64)
    if observed[probs == 0].sum():
        return False  # a token the target never emits
    expected = probs * len(tokens)
    small = (expected > 0) & (expected < 5)
    big = expected >= 5
    obs = np.append(observed[big], observed[small].sum()) if small.any() else observed[big]
    exp = np.append(expected[big], expected[small].sum()) if small.any() else expected[big]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = len(exp) - 1
    critical = df * (1 - 2 / (9 * df) + 3.0902 * np.sqrt(2 / (9 * df))) ** 3
    return bool(stat < critical)


def target_first_and_pairs(params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    first = reference_probs(FIRST_LOGITS[None], params)[0]  # [V]
    return first, (first[:, None] * reference_probs(NEXT_LOGITS, params)).reshape(-1)  # [V*V]: p(x1) p(x2|x1)


@pytest.mark.parametrize("strategy", ["rejection", "target_match"])
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("random_drafts", [False, True], ids=["one-hot", "random-q"])
def test_lossless_strategies_reproduce_the_target(strategy: str, target: str, random_drafts: bool) -> None:
    params = TARGETS[target]
    first, second, accept_num = first_two_tokens(verify, strategy, params, random_drafts, np.random.default_rng(8))
    assert 0.05 < (accept_num > 1).mean() < 0.95 and (accept_num == 3).any()  # both branches exercised
    p_first, p_pairs = target_first_and_pairs(params)
    assert chi_square_passes(first, p_first)
    assert chi_square_passes(first * VOCAB + second, p_pairs)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("random_drafts", [False, True], ids=["one-hot", "random-q"])
def test_correcting_from_p_instead_of_the_residual_is_caught(target: str, random_drafts: bool) -> None:
    params = TARGETS[target]
    first, _, _ = first_two_tokens(biased_verify, "rejection", params, random_drafts, np.random.default_rng(9))
    assert not chi_square_passes(first, target_first_and_pairs(params)[0])


# ---------------------------------------------------------------- device


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("greedy_only", [False, True], ids=["mixed", "greedy"])
def test_cupy_matches_numpy(strategy: str, greedy_only: bool) -> None:
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(12)
    vocab, k = 49152, 5
    kinds = [GREEDY, SamplingParams(temperature=0.9, top_p=0.9), SamplingParams(top_k=20, min_p=0.02),
             SamplingParams(temperature=1.1, frequency_penalty=0.5, repetition_penalty=1.2)]
    if greedy_only:
        kinds = [GREEDY, SamplingParams(temperature=0.0, frequency_penalty=0.5, repetition_penalty=1.2)] * 2
    drafts = [list(rng.integers(0, vocab, int(n))) for n in rng.integers(0, k + 1, 24)]
    inp = make_input(drafts, [kinds[b % 4] for b in range(24)], rng, k=k)
    history = rng.integers(0, vocab, 12)
    rows = tuple(SamplingRow(r.params, r.uniform, history, history) for r in inp.rows)
    logits = (rng.normal(size=(len(rows), vocab)) * 3).astype(np.float32)
    probs = rng.dirichlet(np.full(vocab, 0.05), size=(24, k)).astype(np.float32)
    ids = inp.draft_token_ids.copy()
    for b, (first, n) in enumerate(zip(first_rows(inp), inp.num_drafts)):  # the argmax path but for the last draft
        ids[b, :max(0, n - 1)] = logits[first:first + max(0, n - 1)].argmax(axis=1)
    for draft_probs in (None, probs):
        for policy in ("normal", "accept_all", "reject_all"):
            args = (ids, inp.num_drafts)
            host = verify(np, logits, VerifyInput(*args, draft_probs, rows, inp.extra_uniforms), strategy, policy)
            device = verify(cupy, cupy.asarray(logits),
                            VerifyInput(*args, None if draft_probs is None else cupy.asarray(draft_probs), rows,
                                        inp.extra_uniforms), strategy, policy)
            np.testing.assert_array_equal(device.output_token_ids, host.output_token_ids)
            np.testing.assert_array_equal(device.accept_num, host.accept_num)
