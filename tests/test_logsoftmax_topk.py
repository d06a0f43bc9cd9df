"""cuda/logsoftmax_topk.cu against its twin: normalizers and top-k with ties, row subsets, small vocabularies,
both kernels (up to 8 candidates a thread, and 20)."""

from __future__ import annotations

import numpy as np
import pytest

from cupyspec.logprobs.logsoftmax_topk import top_logprobs_on_device

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("num_rows,vocab,k", [(1, 49152, 0), (7, 49152, 5), (300, 49152, 20), (4, 100, 20),
                                              (3, 20, 20), (65, 151936, 3), (9, 49152, 8), (9, 49152, 9),
                                              (2, 8, 8)])  # the kernel of 8 candidates up to k = 8, then of 20
@pytest.mark.parametrize("ties", [False, True])
def test_kernel_matches_twin(num_rows: int, vocab: int, k: int, ties: bool) -> None:
    import cupy

    rng = np.random.default_rng(num_rows + vocab + k)
    logits = (rng.standard_normal((num_rows + 3, vocab)) * 4).astype(np.float32)
    if ties:  # coarse values: many equal entries, also at the k-th place
        logits = np.round(logits).astype(np.float32)
        logits[:, ::7] = -np.inf
    rows = rng.permutation(num_rows + 3)[:num_rows]
    want = top_logprobs_on_device(np, logits, k, rows)
    got = [a.get() for a in top_logprobs_on_device(cupy, cupy.asarray(logits), k, cupy.asarray(rows))]
    np.testing.assert_array_equal(got[0], want[0])  # peak
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)  # log_total
    np.testing.assert_array_equal(got[2], want[2])  # top ids: same order, same tie breaks
    np.testing.assert_allclose(got[3], want[3], atol=1e-5)


@pytest.mark.parametrize("num_rows,k", [(1, 5), (64, 0), (33, 20)])
def test_chosen_token_logprobs_match_twin(num_rows: int, k: int) -> None:
    import cupy

    from cupyspec.logprobs.logsoftmax_topk import logprobs_on_device

    rng = np.random.default_rng(num_rows + k)
    logits = (rng.standard_normal((num_rows, 49152)) * 4).astype(np.float32)
    chosen = rng.integers(0, 49152, num_rows)
    want = logprobs_on_device(np, logits, chosen, k)
    got = [a.get() for a in logprobs_on_device(cupy, cupy.asarray(logits), cupy.asarray(chosen), k)]
    np.testing.assert_allclose(got[0], want[0], atol=1e-5)  # the chosen tokens' logprobs
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[2], want[2], atol=1e-5)


def test_without_a_row_list_every_row_is_computed() -> None:
    import cupy

    logits = (np.random.default_rng(5).standard_normal((9, 1000)) * 4).astype(np.float32)
    want = top_logprobs_on_device(np, logits, 4)
    got = [a.get() for a in top_logprobs_on_device(cupy, cupy.asarray(logits), 4)]
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
    np.testing.assert_array_equal(got[2], want[2])
    np.testing.assert_allclose(got[3], want[3], atol=1e-5)


@pytest.mark.parametrize("k", [5, 20])  # both kernels
def test_negative_rows_are_skipped_and_their_outputs_left_as_they_are(k: int) -> None:
    """A logprob layout's padding rows (row_target PAD_ROW) read no logits."""
    import cupy

    from cupyspec.logprobs.logsoftmax_topk import launch_top_logprobs

    logits = (np.random.default_rng(6).standard_normal((5, 3000)) * 4).astype(np.float32)
    rows = np.array([3, -1, 0, -1])
    want = top_logprobs_on_device(np, logits, k, rows[rows >= 0])
    outputs = [cupy.full(4, 7, cupy.float32), cupy.full(4, 7, cupy.float64), cupy.full((4, k), 7, cupy.int64),
               cupy.full((4, k), 7, cupy.float32)]  # peak, log_total, top ids, top logprobs
    launch_top_logprobs(cupy.asarray(logits), cupy.asarray(rows), len(rows), k, *outputs)
    got = [a.get() for a in outputs]
    assert all(np.all(g[rows < 0] == 7) for g in got)  # untouched
    np.testing.assert_array_equal(got[0][rows >= 0], want[0])
    np.testing.assert_allclose(got[1][rows >= 0], want[1], rtol=1e-6)
    np.testing.assert_array_equal(got[2][rows >= 0], want[2])
    np.testing.assert_allclose(got[3][rows >= 0], want[3], atol=1e-5)
