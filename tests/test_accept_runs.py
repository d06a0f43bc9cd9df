"""accept_runs and greedy_runs: each request's run of accepted drafts; the twins against a
per-request loop, and the CUDA kernels against the twins."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from cupyspec.model.device_tokens import DeviceTokens
from cupyspec.spec_decode.verification.accept_runs import accept_runs, greedy_runs


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


def greedy_case(rng: np.random.Generator, batch: int, max_drafts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logits [R, V] f32, drafts [B, K], num_drafts [B]) where most drafts are their row's argmax;
    drafts past num_drafts hold the placeholder -1."""
    case = make_case(rng, batch, max_drafts)
    first_row = case["first_row"]
    rows, vocab = int(first_row[-1]), 3000
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    logits[:, 7] = np.where(rng.random(rows) < 0.5, logits.max(axis=1), logits[:, 7])  # ties: the lower index wins
    best = logits.argmax(axis=1)  # [R]
    num_drafts = np.diff(first_row) - 1  # [B]
    drafts = np.full((batch, max_drafts), -1, np.int64)
    for b in range(batch):
        rows_b = best[first_row[b]:first_row[b] + num_drafts[b]]
        drafts[b, :num_drafts[b]] = np.where(case["passed"][first_row[b]:first_row[b] + num_drafts[b]], rows_b,
                                             (rows_b + 1) % vocab)
    return logits, drafts, num_drafts.astype(np.int64)


def run_greedy(xp: Any, logits: np.ndarray, drafts: np.ndarray, num_drafts: np.ndarray,
               tokens: DeviceTokens | None = None) -> np.ndarray:
    """The runs [2, B] (then, with `tokens`, the drafts resolved [B, K] and the tokens' slots and
    accepted counts, flat)."""
    batch = len(num_drafts)
    out = greedy_runs(xp, xp.asarray(logits), drafts, num_drafts, tokens)
    out = out if xp is np else out.get()
    if tokens is None:
        return out[:2 * batch].reshape(2, batch)
    slots, accepted = (a if xp is np else a.get() for a in (tokens.slots, tokens.accepted))
    return np.concatenate([out, slots, accepted])


def with_placeholders(xp: Any, drafts: np.ndarray, num_drafts: np.ndarray) -> tuple[np.ndarray, DeviceTokens]:
    """The drafts with every other one replaced by the placeholder of a DeviceTokens slot holding it."""
    tokens = DeviceTokens(xp, max(1, len(num_drafts)), drafts.shape[1])
    slots = np.zeros(tokens.slots.shape, np.int32)
    placed = drafts.copy()
    for b, n in enumerate(num_drafts):
        for j in range(0, n, 2):
            slot = b * tokens.width + 1 + j
            slots[slot], placed[b, j] = drafts[b, j], ~slot
    tokens.slots[:] = xp.asarray(slots)
    return placed, tokens


@pytest.mark.parametrize("batch,max_drafts", [(0, 3), (1, 0), (1, 5), (7, 8), (300, 5)])
def test_greedy_runs_are_the_runs_of_drafts_equal_to_their_rows_argmax(batch: int, max_drafts: int) -> None:
    logits, drafts, num_drafts = greedy_case(np.random.default_rng(batch + 7), batch, max_drafts)
    first_row = np.concatenate([[0], np.cumsum(num_drafts + 1)]).astype(np.int64)
    best = logits.argmax(axis=1)
    row_draft = np.concatenate([np.append(drafts[b, :n], -2) for b, n in enumerate(num_drafts)] or [np.zeros(0)])
    expected = reference({"passed": row_draft == best, "emit_at": best, "first_row": first_row})
    np.testing.assert_array_equal(run_greedy(np, logits, drafts, num_drafts), expected)


@pytest.mark.parametrize("batch,max_drafts", [(1, 3), (7, 8), (300, 5)])
def test_greedy_runs_resolve_placeholder_drafts_and_leave_the_verdict_in_the_device_tokens(batch, max_drafts):
    logits, drafts, num_drafts = greedy_case(np.random.default_rng(batch), batch, max_drafts)
    placed, tokens = with_placeholders(np, drafts, num_drafts)
    assert (placed < -1).any()
    out = greedy_runs(np, logits, placed, num_drafts, tokens)
    runs = run_greedy(np, logits, drafts, num_drafts)
    np.testing.assert_array_equal(out[:2 * batch].reshape(2, batch), runs)
    resolved = out[2 * batch:].reshape(batch, max_drafts)
    np.testing.assert_array_equal(np.where(np.arange(max_drafts) < num_drafts[:, None], resolved, -1), drafts)
    np.testing.assert_array_equal(tokens.by_seq[:batch, 0], runs[1])
    np.testing.assert_array_equal(tokens.accepted[:batch], runs[0])


@pytest.mark.gpu
@pytest.mark.parametrize("batch,max_drafts", [(1, 0), (1, 8), (129, 5), (300, 8), (700, 3)])
def test_greedy_kernel_matches_twin(batch: int, max_drafts: int) -> None:
    cupy = pytest.importorskip("cupy")
    logits, drafts, num_drafts = greedy_case(np.random.default_rng(batch + 3), batch, max_drafts)
    for _ in range(3):  # the counter of finished blocks starts at 0 in every launch
        np.testing.assert_array_equal(run_greedy(cupy, logits, drafts, num_drafts),
                                      run_greedy(np, logits, drafts, num_drafts))
    if batch and max_drafts:
        placed, tokens = with_placeholders(np, drafts, num_drafts)
        want = run_greedy(np, logits, placed, num_drafts, tokens)
        placed, tokens = with_placeholders(cupy, drafts, num_drafts)
        np.testing.assert_array_equal(run_greedy(cupy, logits, placed, num_drafts, tokens), want)
