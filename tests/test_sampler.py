"""Sampler, penalties and logprobs on NumPy, plus a CuPy-vs-NumPy comparison on a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from cupyspec.logprobs.logsoftmax_topk import logprobs_on_device, top_k_indices
from cupyspec.sampling.params import SamplingParams
from cupyspec.sampling.penalties import apply_penalties
from cupyspec.sampling.sampler import SamplingRow, sample

V = 8
DRAWS = 20_000


def softmax64(x: np.ndarray) -> np.ndarray:
    z = np.exp(x.astype(np.float64) - x.max())
    return z / z.sum()


def chi_square(tokens: np.ndarray, probs: np.ndarray) -> float:
    """Pearson statistic of observed token counts against expected probabilities (zero-prob bins must be empty)."""
    observed = np.bincount(tokens, minlength=len(probs))
    assert observed[probs == 0].sum() == 0, "sampled a token outside the allowed set"
    expected = probs * len(tokens)
    live = probs > 0
    return float(((observed[live] - expected[live]) ** 2 / expected[live]).sum())


def draw(logits_row: np.ndarray, params: SamplingParams, n: int = DRAWS, seed: int = 0) -> np.ndarray:
    """n draws from one logits row, as one batch of n identical rows with independent uniforms."""
    uniforms = np.random.default_rng(seed).random(n)
    rows = [SamplingRow(params, float(u)) for u in uniforms]
    return sample(np, np.tile(logits_row, (n, 1)), rows).token_ids


def reference_filtered(logits_row: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Float64 target distribution after temperature, top-k, top-p and min-p, one token at a time."""
    p = softmax64(logits_row / params.temperature)
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    keep: list[int] = []
    mass = 0.0
    for rank, i in enumerate(order):
        if params.top_k > 0 and rank >= params.top_k:
            break
        keep.append(i)
    top_mass = sum(p[i] for i in keep)
    if params.top_p < 1.0:
        chosen = []
        for i in keep:
            chosen.append(i)
            mass += p[i] / top_mass
            if mass >= params.top_p:
                break
        keep = chosen
    keep = [i for i in keep if p[i] >= params.min_p * p[order[0]]]
    out = np.zeros_like(p)
    out[keep] = p[keep]
    return out / out.sum()


LOGITS = np.array([2.0, 1.5, 1.4, 0.3, 0.0, -0.5, -1.0, -3.0], dtype=np.float32)
CHI2_LIMIT = 30.0  # df <= 7: p < 1e-4 under the null


def test_greedy_equals_argmax_with_ties_to_lowest_index() -> None:
    logits = np.random.default_rng(1).normal(size=(6, 50)).astype(np.float32)
    logits[2, [7, 30]] = 9.0  # a tie for the maximum
    rows = [SamplingRow(SamplingParams(temperature=0.0), 0.99) for _ in range(6)]
    out = sample(np, logits, rows)
    assert out.token_ids.dtype == np.int64
    np.testing.assert_array_equal(out.token_ids, np.argmax(logits, axis=1))
    assert out.token_ids[2] == 7
    assert out.logprobs is None and out.top_token_ids is None


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_sampling_matches_softmax(temperature: float) -> None:
    params = SamplingParams(temperature=temperature)
    tokens = draw(LOGITS, params)
    assert chi_square(tokens, softmax64(LOGITS / temperature)) < CHI2_LIMIT


def test_wrong_temperature_is_detected() -> None:
    tokens = draw(LOGITS, SamplingParams(temperature=1.0))
    assert chi_square(tokens, softmax64(LOGITS / 1.3)) > CHI2_LIMIT


@pytest.mark.parametrize("params", [
    SamplingParams(top_k=3),
    SamplingParams(top_p=0.6),
    SamplingParams(top_p=0.9, temperature=0.7),
    SamplingParams(min_p=0.3),
    SamplingParams(top_k=5, top_p=0.8, min_p=0.1, temperature=1.5),
])
def test_truncation_matches_renormalized_distribution(params: SamplingParams) -> None:
    target = reference_filtered(LOGITS, params)
    assert (target == 0).any()
    assert chi_square(draw(LOGITS, params), target) < CHI2_LIMIT


def test_top_p_keeps_the_top_token_and_ties_by_lower_index() -> None:
    logits = np.array([0.0, 5.0, 5.0, 1.0], dtype=np.float32)
    assert set(draw(logits, SamplingParams(top_p=0.01), n=500)) == {1}
    assert set(draw(logits, SamplingParams(top_k=1), n=500)) == {1}


def test_inverse_cdf_is_deterministic_and_batch_independent() -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(5, 40)).astype(np.float32)
    params = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0.0),
              SamplingParams(top_k=4), SamplingParams(min_p=0.05, frequency_penalty=0.5),
              SamplingParams(temperature=1.3)]
    rows = [SamplingRow(p, float(u), output_token_ids=np.array([1, 2, 2]) if p.has_penalties else None)
            for p, u in zip(params, rng.random(5))]
    together = sample(np, logits, rows).token_ids
    for i in range(5):
        alone = sample(np, logits[i:i + 1], [rows[i]]).token_ids
        assert alone[0] == together[i]
    shuffled = [4, 2, 0, 3, 1]
    np.testing.assert_array_equal(sample(np, logits[shuffled], [rows[i] for i in shuffled]).token_ids,
                                  together[shuffled])


def test_inverse_cdf_picks_the_documented_token() -> None:
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3], dtype=np.float32))
    # descending order 1 (0.4), 3 (0.3), 2 (0.2), 0 (0.1); cumsum 0.4, 0.7, 0.9, 1.0
    expect = {0.0: 1, 0.39: 1, 0.41: 3, 0.69: 3, 0.71: 2, 0.89: 2, 0.91: 0, 0.999999: 0}
    rows = [SamplingRow(SamplingParams(), u) for u in expect]
    np.testing.assert_array_equal(sample(np, np.tile(logits, (len(rows), 1)), rows).token_ids,
                                  list(expect.values()))


def test_uniform_out_of_range_is_rejected() -> None:
    with pytest.raises(ValueError, match="uniform"):
        sample(np, LOGITS[None], [SamplingRow(SamplingParams(), 1.0)])


def reference_penalties(logits: np.ndarray, params: SamplingParams, prompt: list[int], output: list[int]) -> np.ndarray:
    x = logits.astype(np.float64).copy()
    for t in set(prompt) | set(output):
        p = params.repetition_penalty
        x[t] = x[t] / p if x[t] > 0 else x[t] * p
    for t in set(output):
        x[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    return x


def test_penalties_match_reference_loop() -> None:
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(4, 12)).astype(np.float32) * 3
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(frequency_penalty=0.7),
              SamplingParams(presence_penalty=-1.1), SamplingParams(repetition_penalty=0.8,
                                                                    frequency_penalty=-0.4, presence_penalty=0.9)]
    prompts = [[0, 1, 1, 5], [], [3], [11, 2]]
    outputs = [[2, 2, 7], [4, 4, 4, 9], [6, 6, 0], [2, 8, 8]]
    got = apply_penalties(np, logits, params, [np.array(p) for p in prompts], [np.array(o) for o in outputs])
    for i in range(4):
        np.testing.assert_allclose(got[i], reference_penalties(logits[i], params[i], prompts[i], outputs[i]),
                                   rtol=1e-6, atol=1e-6)
    assert not np.allclose(got, logits)


def test_penalties_steer_greedy_but_not_logprobs() -> None:
    logits = np.array([[3.0, 2.9, 0.0, -1.0]], dtype=np.float32)
    row = SamplingRow(SamplingParams(temperature=0.0, presence_penalty=0.5, logprobs=1),
                      0.0, output_token_ids=np.array([0]))
    before = logits.copy()
    out = sample(np, logits, [row])
    np.testing.assert_array_equal(logits, before)  # the caller's logits are left alone
    assert out.token_ids[0] == 1
    np.testing.assert_allclose(out.logprobs[0], np.log(softmax64(logits[0]))[1], atol=1e-5)
    assert out.top_token_ids[0, 0] == 0  # top-1 of the raw logits, before penalties


def test_penalty_token_out_of_vocab_is_rejected() -> None:
    row = SamplingRow(SamplingParams(frequency_penalty=1.0), 0.5, output_token_ids=np.array([V]))
    with pytest.raises(ValueError, match="output_token_ids"):
        sample(np, LOGITS[None], [row])


def test_logprobs_match_float64_reference() -> None:
    rng = np.random.default_rng(7)
    logits = (rng.normal(size=(6, 3000)) * 4).astype(np.float32)
    targets = rng.integers(0, 3000, size=6)
    chosen, top_ids, top_lps = logprobs_on_device(np, logits, targets, 5)
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(chosen, ref[np.arange(6), targets], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(top_ids, np.argsort(-ref, axis=1, kind="stable")[:, :5])
    np.testing.assert_allclose(top_lps, np.take_along_axis(ref, top_ids, axis=1), atol=1e-5, rtol=0)
    assert chosen.dtype == np.float32 and top_ids.dtype == np.int64 and top_lps.dtype == np.float32


def test_top_k_ties_go_to_the_lower_index() -> None:
    values = np.array([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0],
                       [5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0]], dtype=np.float32)
    np.testing.assert_array_equal(top_k_indices(np, values, 4), [[1, 3, 2, 4], [0, 1, 2, 3]])
    assert top_k_indices(np, values, 0).shape == (2, 0)


def test_sample_logprobs_width_is_the_largest_request() -> None:
    logits = np.random.default_rng(9).normal(size=(3, 30)).astype(np.float32)
    rows = [SamplingRow(SamplingParams(logprobs=2, temperature=0.7), 0.3), SamplingRow(SamplingParams(), 0.6),
            SamplingRow(SamplingParams(logprobs=4, temperature=0.0), 0.0)]
    out = sample(np, logits, rows)
    chosen, top_ids, top_lps = logprobs_on_device(np, logits, out.token_ids, 4)
    assert out.top_token_ids.shape == (3, 4) and out.top_logprobs.shape == (3, 4)
    np.testing.assert_array_equal(out.top_token_ids, top_ids)
    np.testing.assert_allclose(out.logprobs, chosen, atol=1e-6)
    np.testing.assert_allclose(out.top_logprobs, top_lps, atol=1e-6)


def test_logprobs_k_larger_than_vocab_is_rejected() -> None:
    with pytest.raises(ValueError, match="k must"):
        logprobs_on_device(np, LOGITS[None], [0], V + 1)


def _cupy_or_skip():
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception as exc:  # CUDA driver missing
        pytest.skip(f"CUDA unusable: {exc}")
    return cupy


@pytest.mark.gpu
def test_cupy_matches_numpy() -> None:
    cupy = _cupy_or_skip()
    rng = np.random.default_rng(11)
    logits = (rng.normal(size=(64, 49152)) * 3).astype(np.float32)
    kinds = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.9, top_p=0.9),
             SamplingParams(top_k=20, logprobs=5), SamplingParams(min_p=0.02, frequency_penalty=0.3,
                                                                  repetition_penalty=1.2)]
    rows = [SamplingRow(kinds[i % 4], float(rng.random()), prompt_token_ids=rng.integers(0, 49152, 30),
                        output_token_ids=rng.integers(0, 49152, 10)) for i in range(64)]
    host = sample(np, logits, rows)
    device = sample(cupy, cupy.asarray(logits), rows)
    np.testing.assert_array_equal(device.token_ids, host.token_ids)
    np.testing.assert_array_equal(device.top_token_ids, host.top_token_ids)
    np.testing.assert_allclose(device.logprobs, host.logprobs, atol=1e-4)
    np.testing.assert_allclose(device.top_logprobs, host.top_logprobs, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,vocab", [(1, 49152), (7, 1000), (300, 513), (2, 1)])
def test_argmax_kernel_matches_numpy(rows: int, vocab: int) -> None:
    import cupy

    from cupyspec.sampling.argmax import argmax_rows

    rng = np.random.default_rng(rows + vocab)
    x = rng.integers(-3, 4, (rows, vocab)).astype(np.float32)  # many ties at the maximum
    x[rows // 2, rng.integers(0, vocab, 3)] = np.nan  # NaN counts as largest, the first one wins
    x[-1, -1] = 1e9 if rows > 1 else x[-1, -1]  # the last column can win
    got = argmax_rows(cupy, cupy.asarray(x)).get()
    np.testing.assert_array_equal(got, x.argmax(axis=1))
    assert got.dtype == np.int64


@pytest.mark.gpu
@pytest.mark.parametrize("rows,vocab,ties", [(1, 49152, False), (7, 1000, False), (300, 513, False), (2, 1, False),
                                             (5, 4096, True), (3, 1003, True), (1, 49152, True), (2, 9001, True),
                                             (32, 49152, False)])
def test_argmax_logprob_kernel_matches_its_twin(rows: int, vocab: int, ties: bool) -> None:
    """Rows read as float4s (vocab % 4 == 0) or one value at a time, whole or in column chunks merged
    after (few rows, wide vocabularies); ties go to the lowest column."""
    import cupy

    from cupyspec.sampling.argmax import argmax_logprobs

    rng = np.random.default_rng(rows * vocab)
    x = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)
    x[:, rng.integers(0, vocab)] += 3.0  # a clear winner in some rows, many close ones in others
    if ties:
        x = np.round(x)  # many values equal to the maximum
        x[0, :vocab // 2] = -np.inf  # masked columns first: the sum skips them
    picks, logprobs = (a.get() for a in argmax_logprobs(cupy, cupy.asarray(x)))
    want_picks, want_logprobs = argmax_logprobs(np, x)
    np.testing.assert_array_equal(picks, want_picks)
    np.testing.assert_allclose(logprobs, want_logprobs, rtol=1e-5, atol=1e-5)
    assert logprobs.dtype == np.float32 and (logprobs <= 0).all()


def test_argmax_logprobs_twin_is_the_log_softmax_of_the_pick() -> None:
    from cupyspec.sampling.argmax import argmax_logprobs

    x = np.array([[0.0, 2.0, 1.0], [5.0, 5.0, -1.0]], dtype=np.float32)
    picks, logprobs = argmax_logprobs(np, x)
    np.testing.assert_array_equal(picks, [1, 0])
    log_softmax = x - np.log(np.exp(x.astype(np.float64)).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(logprobs, log_softmax[[0, 1], [1, 0]], rtol=1e-6)
