"""The logprob layout: rows of the requests that ask, packed with padding; expanded on the device as on the host."""

from __future__ import annotations

import numpy as np
import pytest

from cupyspec.logprobs.layout import PAD_POSITION, PAD_ROW, LayoutShape, LogprobLayout, RequestWants, UploadedLayout
from cupyspec.spec_decode.verification.verify import PLACEHOLDER_TOKEN_ID


def random_step(rng: np.random.Generator, batch: int, max_drafts: int) -> tuple[np.ndarray, np.ndarray, RequestWants]:
    """Drafts [B, K], num_drafts [B] and the wants of a step in which some requests ask nothing."""
    num_drafts = rng.integers(0, max_drafts + 1, batch)
    drafts = np.full((batch, max(int(num_drafts.max()), 1)), PLACEHOLDER_TOKEN_ID, np.int64)
    for b, n in enumerate(num_drafts):
        drafts[b, :n] = rng.integers(0, 1000, n)
    tokens, wanted_drafts = rng.random(batch) < 0.6, rng.random(batch) < 0.4
    render_k = np.where(tokens & (rng.random(batch) < 0.5), 5, -1)
    return drafts, num_drafts, RequestWants.of(tokens, wanted_drafts, render_k)


def layout_of(num_drafts: np.ndarray, wants: RequestWants, gap: int = 2) -> LogprobLayout:
    """The layout of a step whose logits have `gap` rows (a prompt's, say) before each request's rows."""
    return LogprobLayout.build(np.cumsum(num_drafts + 1 + gap) - (num_drafts + 1), num_drafts, wants)


@pytest.mark.parametrize("batch,max_drafts", [(1, 3), (9, 5), (70, 8)])
def test_rows_are_those_of_the_requests_that_ask(batch: int, max_drafts: int) -> None:
    drafts, num_drafts, wants = random_step(np.random.default_rng(batch), batch, max_drafts)
    layout = layout_of(num_drafts, wants)
    rows, slots, first_row = [], [0], 2
    for b, n in enumerate(num_drafts):
        if wants.asks[b]:
            rows += [(first_row + j, b, j) for j in range(n + 1)]
        slots.append(slots[-1] + (n if wants.drafts[b] else 0))
        first_row += n + 1 + 2
    assert list(zip(layout.row_target.tolist(), layout.row_seq.tolist(), layout.row_pos.tolist())) == rows
    assert layout.draft_offset.tolist() == slots
    assert layout.shape(drafts) == (batch, len(rows), drafts.shape[1], slots[-1])


def test_padding_asks_nothing() -> None:
    drafts, num_drafts, wants = random_step(np.random.default_rng(3), 6, 4)
    layout = layout_of(num_drafts, wants)
    exact = layout.shape(drafts)
    shape = LayoutShape(exact.num_seqs + 2, exact.num_rows + 3, exact.max_drafts + 1, exact.num_draft_slots + 4)
    packed = layout.packed(shape, drafts, num_drafts, verdict_at=1234)
    uploaded = UploadedLayout(packed, *shape)
    arrays, live_rows, live = uploaded.arrays(), exact.num_rows, len(drafts)
    for name in ("row_target", "row_seq", "row_pos"):
        np.testing.assert_array_equal(getattr(arrays, name)[:live_rows], getattr(layout, name))
    assert np.all(arrays.row_target[live_rows:] == PAD_ROW) and np.all(arrays.row_pos[live_rows:] == PAD_POSITION)
    np.testing.assert_array_equal(arrays.wants_tokens, [*wants.tokens, 0, 0])
    np.testing.assert_array_equal(arrays.draft_offset, [*layout.draft_offset, *[layout.draft_offset[-1]] * 2])
    np.testing.assert_array_equal(arrays.drafts[:live, :drafts.shape[1]], drafts)
    assert np.all(arrays.drafts[live:] == PLACEHOLDER_TOKEN_ID) and np.all(arrays.drafts[:, -1] == PLACEHOLDER_TOKEN_ID)
    np.testing.assert_array_equal(arrays.num_drafts, [*num_drafts, 0, 0])
    np.testing.assert_array_equal(uploaded.render_k, [*wants.render_k, -1, -1])
    np.testing.assert_array_equal(packed[-2 * shape.num_seqs - 2:], [*wants.drafts, 0, 0, *layout.first_row, 0, 0,
                                                                     1234, live])
    assert len(packed) == shape.packed_size


@pytest.mark.gpu
@pytest.mark.parametrize("batch,max_drafts,extra", [(1, 5, (0, 2, 0, 0)), (64, 5, (0, 13, 3, 4)),
                                                    (300, 8, (20, 40, 0, 8))])
def test_the_device_expands_the_requests_fields_as_the_host_does(batch: int, max_drafts: int,
                                                                 extra: tuple[int, int, int, int]) -> None:
    import cupy

    from cupyspec.logprobs.layout import expand_on_device

    drafts, num_drafts, wants = random_step(np.random.default_rng(batch + 1), batch, max_drafts)
    layout = layout_of(num_drafts, wants)
    shape = LayoutShape(*(size + more for size, more in zip(layout.shape(drafts), extra)))
    staged = np.full(shape.packed_size, -7, np.int64)  # what the rows and offsets held before
    staged = wants.packed(shape, drafts, num_drafts, layout.first_row, 99, out=staged)
    on_device = UploadedLayout(cupy.asarray(staged), *shape)
    expand_on_device(cupy, on_device)
    np.testing.assert_array_equal(on_device.packed.get(), layout.packed(shape, drafts, num_drafts, 99))
