"""accept_runs and accept_matching_runs: each request's run of accepted drafts; the twins against a
per-request loop, and the CUDA kernels against the twins."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from cupyspec.spec.accept_runs import accept_matching_runs, accept_runs


def make_case(rng: np.random.Generator, batch: int, max_drafts: int) -> dict[str, np.ndarray]:
    num_drafts = rng.integers(0, max_drafts + 1, batch)  # [B]
    first_row = np.concatenate([[0], np.cumsum(num_drafts + 1)]).astype(np.int64)  # [B+1]
    rows = int(first_row[-1])
    passed = rng.random(rows) < 0.8  # [R], bonus rows too: they must be ignored
    return {"passed": passed, "emit_at": rng.integers(0, 50_000, rows), "first_row": first_row}


def reference(case: dict[str, np.ndarray]) -> np.ndarray:
    out = []
    for first, end in zip(case["first_row"][:-1], case["first_row"][1:]):
        count = 0
        while first + count < end - 1 and case["passed"][first + count]:
            count += 1
        out.append((count, case["emit_at"][first + count]))
    return np.array(out, dtype=np.int64).reshape(-1, 2).T


def run(xp: Any, case: dict[str, np.ndarray]) -> np.ndarray:
    out = accept_runs(xp, *(xp.asarray(case[k]) for k in ("passed", "emit_at", "first_row")))
    return out if xp is np else out.get()


@pytest.mark.parametrize("batch,max_drafts", [(0, 3), (1, 0), (1, 5), (7, 8), (300, 5)])
def test_twin_matches_a_per_request_loop(batch: int, max_drafts: int) -> None:
    case = make_case(np.random.default_rng(batch), batch, max_drafts)
    out = run(np, case)
    assert out.shape == (2, batch) and out.dtype == np.int64
    np.testing.assert_array_equal(out, reference(case))


def test_a_failed_draft_ends_the_run_and_a_passed_bonus_row_is_ignored() -> None:
    case = {"passed": np.array([True, False, True, True, True, True]), "emit_at": np.arange(10, 16),
            "first_row": np.array([0, 4, 6])}  # request 0: rows 0-3 (3 drafts), request 1: rows 4-5 (1 draft)
    np.testing.assert_array_equal(run(np, case), [[1, 1], [11, 15]])


@pytest.mark.gpu
@pytest.mark.parametrize("batch,max_drafts", [(1, 0), (1, 8), (129, 5), (300, 8)])
def test_kernel_matches_twin(batch: int, max_drafts: int) -> None:
    cupy = pytest.importorskip("cupy")
    case = make_case(np.random.default_rng(batch + 1), batch, max_drafts)
    np.testing.assert_array_equal(run(cupy, case), run(np, case))


def matching_case(rng: np.random.Generator, batch: int, max_drafts: int) -> tuple[np.ndarray, np.ndarray]:
    """(emit_at [R], drafts_then_bounds [R + B + 1]) where most drafts match their row's token."""
    case = make_case(rng, batch, max_drafts)
    emit_at = rng.integers(0, 4, len(case["emit_at"]))  # few distinct tokens: drafts match often
    row_draft = np.where(case["passed"], emit_at, emit_at + 1)  # [R] bonus rows hold anything
    return emit_at, np.concatenate([row_draft, case["first_row"]]).astype(np.int64)


def run_matching(xp: Any, emit_at: np.ndarray, drafts_then_bounds: np.ndarray) -> np.ndarray:
    out = accept_matching_runs(xp, xp.asarray(emit_at), xp.asarray(drafts_then_bounds))
    return out if xp is np else out.get()


@pytest.mark.parametrize("batch,max_drafts", [(0, 3), (1, 0), (1, 5), (7, 8), (300, 5)])
def test_matching_runs_are_the_runs_of_drafts_equal_to_their_rows_token(batch: int, max_drafts: int) -> None:
    emit_at, packed = matching_case(np.random.default_rng(batch + 7), batch, max_drafts)
    rows = len(emit_at)
    passed = packed[:rows] == emit_at
    expected = reference({"passed": passed, "emit_at": emit_at, "first_row": packed[rows:]})
    np.testing.assert_array_equal(run_matching(np, emit_at, packed), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,max_drafts", [(1, 0), (1, 8), (129, 5), (300, 8)])
def test_matching_kernel_matches_twin(batch: int, max_drafts: int) -> None:
    cupy = pytest.importorskip("cupy")
    emit_at, packed = matching_case(np.random.default_rng(batch + 3), batch, max_drafts)
    np.testing.assert_array_equal(run_matching(cupy, emit_at, packed), run_matching(np, emit_at, packed))
