"""Log-softmax logprobs of chosen tokens and the top-k alternatives, for NumPy and CuPy alike."""

from __future__ import annotations

from typing import Any

import numpy as np


def to_host(xp: Any, array: Any) -> np.ndarray:
    """A host NumPy array: one device-to-host copy for CuPy, a no-op for NumPy."""
    return np.asarray(array) if xp is np else array.get()


def fetch_columns(xp: Any, columns: list[Any]) -> list[np.ndarray]:
    """Bring several [R, c_i] device arrays to the host in ONE transfer.

    They travel stacked as float64, which holds int32/int64 token ids (< 2**53) and float32
    values exactly; each comes back as float64 [R, c_i] for the caller to cast.
    """
    widths = [c.shape[1] for c in columns]
    packed = to_host(xp, xp.concatenate([c.astype(xp.float64) for c in columns], axis=1))  # [R, sum c_i]
    bounds = np.cumsum([0] + widths)
    return [packed[:, lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]


def stable_argsort(xp: Any, values: Any) -> Any:
    """Ascending argsort along the last axis that keeps equal values in index order.

    CuPy's sort is always stable and, depending on the version, refuses a `kind` argument.
    """
    return np.argsort(values, axis=-1, kind="stable") if xp is np else values.argsort(axis=-1)


def top_k_indices(xp: Any, values: Any, k: int) -> Any:
    """Indices [R, k] of the k largest entries of each row of values [R, V], largest first.

    Ties are broken by the lower index (also at the k-th place), without sorting the rows.
    """
    rows, vocab = values.shape
    if k == 0:
        return xp.zeros((rows, 0), dtype=xp.int64)
    kth = -xp.partition(-values, k - 1, axis=1)[:, k - 1:k]  # [R, 1] the k-th largest value
    greater = values > kth  # [R, V]
    equal = values == kth  # [R, V]
    missing = k - greater.sum(axis=1, keepdims=True)  # [R, 1] how many ties at the k-th value to take
    chosen = greater | (equal & (xp.cumsum(equal, axis=1) <= missing))  # [R, V] exactly k per row
    slot = xp.where(chosen, xp.cumsum(chosen, axis=1) - 1, k)  # [R, V] column k collects the rest
    ids = xp.empty((rows, k + 1), dtype=xp.int64)
    ids[xp.arange(rows)[:, None], slot] = xp.arange(vocab, dtype=xp.int64)[None, :]
    ids = ids[:, :k]  # [R, k] ascending index order
    order = stable_argsort(xp, -xp.take_along_axis(values, ids, axis=1))  # [R, k]
    return xp.take_along_axis(ids, order, axis=1)


def logprobs_on_device(xp: Any, logits: Any, token_ids: Any, k: int) -> tuple[Any, Any, Any]:
    """Device arrays (logprob [R] f32, top ids [R, k] int64, top logprobs [R, k] f32) of log_softmax(logits).

    logits [R, V]; token_ids [R] are the tokens whose logprobs are wanted.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be 2-D [R, V], got shape {logits.shape}")
    rows, vocab = logits.shape
    if not 0 <= k <= vocab:
        raise ValueError(f"k must lie in [0, {vocab}] (the vocabulary size), got {k}")
    token_ids = xp.asarray(token_ids, dtype=xp.int64).reshape(-1)  # [R]
    if token_ids.shape[0] != rows:
        raise ValueError(f"token_ids has {token_ids.shape[0]} entries for {rows} logits rows")
    x = logits.astype(xp.float32, copy=False)  # [R, V]
    peak = x.max(axis=1, keepdims=True)  # [R, 1]
    log_total = xp.log(xp.exp(x - peak).sum(axis=1, keepdims=True, dtype=xp.float64))  # [R, 1] f64

    def logprob_of(ids: Any) -> Any:  # ids [R, c] -> [R, c] f32
        return ((xp.take_along_axis(x, ids, axis=1) - peak).astype(xp.float64) - log_total).astype(xp.float32)

    top_ids = top_k_indices(xp, x, k)  # [R, k]
    return logprob_of(token_ids[:, None])[:, 0], top_ids, logprob_of(top_ids)


def compute_logprobs(xp: Any, logits: Any, token_ids: Any, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host arrays (logprob [R] f32, top ids [R, k] int64, top logprobs [R, k] f32), in one transfer.

    For prompt logprobs pass the logits of positions i and token_ids the prompt tokens i + 1.
    """
    chosen, top_ids, top_lps = logprobs_on_device(xp, logits, token_ids, k)
    chosen, top_ids, top_lps = fetch_columns(xp, [chosen[:, None], top_ids, top_lps])
    return chosen[:, 0].astype(np.float32), top_ids.astype(np.int64), top_lps.astype(np.float32)
