"""Repetition, frequency and presence penalties on a batch of logits rows (NumPy or CuPy)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from cupyspec.transfer import to_device


def scatter_add(xp: Any, target: Any, indices: tuple[Any, ...], values: Any) -> None:
    """target[indices] += values in place, accumulating repeated indices."""
    if hasattr(xp.add, "at"):  # NumPy; CuPy 13 and later
        xp.add.at(target, indices, values)
    else:
        import cupyx

        cupyx.scatter_add(target, indices, values)


def _flat_ids(groups: Sequence[np.ndarray | None], vocab: int, param: str) -> tuple[np.ndarray, np.ndarray]:
    """Host (row [N], token [N]) int64 pairs from per-row token id lists (None counts as empty)."""
    ids = [np.asarray(g if g is not None else (), dtype=np.int64).reshape(-1) for g in groups]
    tokens = np.concatenate(ids) if ids else np.zeros(0, np.int64)  # [N]
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        raise ValueError(f"{param} holds a token id outside the vocabulary [0, {vocab})")
    rows = np.repeat(np.arange(len(ids), dtype=np.int64), [len(i) for i in ids])  # [N]
    return rows, tokens


def _counts(xp: Any, groups: Sequence[np.ndarray | None], vocab: int, param: str) -> Any:
    """Occurrences [len(groups), V] float32 of each token in each row's ids, on xp's device."""
    rows, tokens = _flat_ids(groups, vocab, param)
    counts = xp.zeros((len(groups), vocab), dtype=xp.float32)
    if tokens.size:
        scatter_add(xp, counts, (to_device(xp, rows), to_device(xp, tokens)), xp.ones(tokens.size, dtype=xp.float32))
    return counts


def apply_penalties(xp: Any, logits: Any, params: Sequence[Any], prompt_ids: Sequence[np.ndarray | None],
                    output_ids: Sequence[np.ndarray | None]) -> Any:
    """Penalized copy of logits [R, V] f32; one SamplingParams and id lists (host, or None) per row.

    Repetition (HF): a logit of a token seen in prompt or output is divided by p when positive,
    multiplied by p otherwise. Frequency: minus f times the token's count in the output.
    Presence: minus p once for every token present in the output.
    """
    vocab = logits.shape[1]
    repetition = to_device(xp, np.array([p.repetition_penalty for p in params], np.float32))[:, None]  # [R, 1]
    frequency = to_device(xp, np.array([p.frequency_penalty for p in params], np.float32))[:, None]  # [R, 1]
    presence = to_device(xp, np.array([p.presence_penalty for p in params], np.float32))[:, None]  # [R, 1]
    out_counts = _counts(xp, output_ids, vocab, "output_token_ids")  # [R, V]
    in_output = out_counts > 0  # [R, V]
    x = logits
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = in_output | (_counts(xp, prompt_ids, vocab, "prompt_token_ids") > 0)  # [R, V]
        x = xp.where(seen, xp.where(x > 0, x / repetition, x * repetition), x)
    return x - frequency * out_counts - presence * in_output.astype(xp.float32)
