"""Chat logprob entries rendered as JSON: the number format, the twin against a reference built from
Python objects, the kernel against the twin, and the host slices."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cupyspec.logprobs.logprob_json import LogprobRenderer, LogprobsJSON, VocabJSON, format_logprob
from cupyspec.text.token_text import TokenText


class WordTokenizer:
    """Token i is the text `w<i>`, but 3 is a quote and a backslash, 4 half of `é` and 5 a newline."""

    def token_bytes(self, token_id: int) -> bytes:
        return {3: b'"\\', 4: b"\xc3", 5: b"\n"}.get(token_id, f"w{token_id}".encode())


@pytest.mark.parametrize("value, text", [
    (0.0, "0.0"), (-0.0, "0.0"), (-1.0, "-1.0"), (-12.5, "-12.5"), (-0.5, "-0.5"), (-9998.5, "-9998.5"),
    (-9999.0, "-9999.0"), (-1e6, "-9999.0"), (float("-inf"), "-9999.0"), (float("nan"), "-9999.0"),
    (-1e-4, "-9.99999975e-05"), (-2.0 ** -14, "-6.10351562e-05"), (-2.0 ** -13, "-0.000122070312"),
    (-1e-45, "-1.40129846e-45"), (-0.1, "-0.100000001"), (-1234.5678, "-1234.56775"),
])
def test_logprobs_render_with_nine_significant_digits_and_clamp_at_minus_9999(value: float, text: str) -> None:
    assert format_logprob(float(np.float32(value))) == text.encode()


def test_every_formatted_logprob_reads_back_as_the_same_float32() -> None:
    rng = np.random.default_rng(0)
    values = np.concatenate([-np.exp(rng.uniform(-100, 9.2, 20_000)), -rng.random(2_000),
                             -np.float32(10.0) ** np.arange(-44, 4)]).astype(np.float32)
    for value in values.tolist():
        text = format_logprob(value)
        assert len(text) <= 16 and np.float32(float(text)) == np.float32(value), (value, text)
        assert json.loads(text) == float(text)


def reference(texts: TokenText, token_id: int, logprob: float, top: list[tuple[int, float]]) -> dict:
    def entry(t: int, lp: float) -> dict:
        return {"token": texts.text(t), "logprob": float(format_logprob(lp)), "bytes": texts.bytes(t)}
    return entry(token_id, logprob) | {"top_logprobs": [entry(t, lp) for t, lp in top]}


def random_rows(rng: np.random.Generator, rows: int, width: int, vocab: int) -> tuple[np.ndarray, ...]:
    token_ids = rng.integers(0, vocab, rows)
    logprobs = -rng.exponential(2.0, rows).astype(np.float32)
    top_ids = rng.integers(0, vocab, (rows, width))
    top_lps = -np.sort(rng.exponential(2.0, (rows, width)), axis=1).astype(np.float32)
    return token_ids, logprobs, top_ids, top_lps


@pytest.mark.parametrize("with_cu", [False, True])
def test_twin_renders_each_request_its_own_entries(with_cu: bool) -> None:
    rng = np.random.default_rng(1)
    texts, vocab = TokenText(WordTokenizer()), 12
    renderer = LogprobRenderer(np, VocabJSON.build(texts, vocab))
    width = 4
    request_k = np.array([2, -1, 0, 4, 1])  # request 1 wants records, not entries
    cu = np.array([0, 3, 5, 5, 8, 9]) if with_cu else None  # request 2 emitted nothing
    rows = 10 if with_cu else len(request_k)  # with cu: the rows past cu[B] are padding
    token_ids, logprobs, top_ids, top_lps = random_rows(rng, rows, width, vocab)
    args = (token_ids, logprobs, top_ids, top_lps, width, request_k, len(request_k), rows, cu)
    rendered = renderer.render(np, *args)
    rows_of = [(int(cu[b]), int(cu[b + 1])) if with_cu else (b, b + 1) for b in range(len(request_k))]
    bounds = [None if k < 0 else r for k, r in zip(request_k, rows_of)]
    pieces = renderer.entries(rendered, rows, bounds, lambda: args)
    # a device's output cut short at its capacity: the host renders the entries again
    assert renderer.entries(rendered[:rows + 5], rows, bounds, lambda: args) == pieces
    assert pieces[1] is None
    for b, (k, (lo, hi)) in enumerate(zip(request_k, rows_of)):
        if k < 0:
            continue
        expected = [reference(texts, token_ids[r], logprobs[r], list(zip(top_ids[r, :k], top_lps[r, :k])))
                    for r in range(lo, hi)]
        assert json.loads(pieces[b].json()) == expected and len(pieces[b]) == hi - lo
        for n in range(hi - lo + 1):
            assert json.loads(pieces[b].head(n).json()) == expected[:n]
    both = LogprobsJSON.concat([pieces[0], pieces[3]])
    assert json.loads(both.json()) == json.loads(pieces[0].json()) + json.loads(pieces[3].json())
    assert json.loads(both.head(4).json()) == json.loads(both.json())[:4]


def test_entries_are_equal_wherever_their_ends_were_counted_from() -> None:
    cut = LogprobsJSON(b'{"a":1},{"b":2},', [108, 116], start=100)  # as cut from a whole step's render
    assert cut == LogprobsJSON(b'{"a":1},{"b":2},', (8, 16)) and cut.head(1) == LogprobsJSON(b'{"a":1},', [8])
    assert cut != LogprobsJSON(b'{"a":1},{"b":2},', (9, 16))
    assert LogprobsJSON.concat([cut.head(1), cut]).json() == b'[{"a":1},{"a":1},{"b":2}]'


def test_the_vocabulary_table_holds_escaped_text_and_bytes() -> None:
    vocab = VocabJSON.build(TokenText(WordTokenizer()), 6)
    assert vocab.token_json(3) == (b'"\\"\\\\"', b"[34,92]")
    assert vocab.token_json(4) == (b'"bytes:\\\\xc3"', b"[195]")
    assert vocab.token_json(5) == (b'"\\n"', b"[10]")


# ---------------------------------------------------------------- device

@pytest.mark.gpu
@pytest.mark.parametrize("requests, max_rows, width", [(1, 1, 0), (3, 8, 5), (64, 6, 20), (300, 8, 5)])
def test_kernel_matches_twin(requests: int, max_rows: int, width: int) -> None:
    import cupy as cp

    rng = np.random.default_rng(requests)
    texts, vocab_size = TokenText(WordTokenizer()), 5000
    vocab = VocabJSON.build(texts, vocab_size)
    counts = rng.integers(0, max_rows + 1, requests)
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    rows = int(cu[-1]) + 3
    request_k = np.where(rng.random(requests) < 0.2, -1, rng.integers(0, width + 1, requests)).astype(np.int64)
    arrays = random_rows(rng, rows, width, vocab_size)
    arrays[1][:3] = [0.0, -np.inf, np.nan]
    want = LogprobRenderer(np, vocab).render(np, *arrays, width, request_k, requests, rows, cu)
    got = LogprobRenderer(cp, vocab).render(cp, *map(cp.asarray, arrays), width, cp.asarray(request_k), requests,
                                            rows, cp.asarray(cu)).get()
    used = int(cu[-1])
    np.testing.assert_array_equal(got[:used], want[:used])  # where each row's entry ends
    end = int(want[used - 1]) if used else 0
    assert got[rows:].view(np.uint8)[:end].tobytes() == want[rows:].view(np.uint8)[:end].tobytes()


class OneLongTokenizer:
    """Token 0 is 300 letters, every other a letter: the mean token is short."""

    def token_bytes(self, token_id: int) -> bytes:
        return b"x" * 300 if token_id == 0 else b"y"


@pytest.mark.gpu
def test_kernel_drops_what_outgrows_its_capacity_and_the_host_renders_it() -> None:
    import cupy as cp

    vocab = VocabJSON.build(TokenText(OneLongTokenizer()), 1000)
    rows, width = 64, 5
    arrays = (np.zeros(rows, np.int64), np.full(rows, -0.5, np.float32), np.zeros((rows, width), np.int64),
              np.full((rows, width), -1.0, np.float32))  # every token the long one
    args = (*arrays, width, np.full(rows, width, np.int64), rows, rows)
    want = LogprobRenderer(np, vocab).render(np, *args)
    device = LogprobRenderer(cp, vocab)
    got = device.render(cp, *map(cp.asarray, arrays), width, cp.asarray(args[5]), rows, rows).get()
    capacity = vocab.capacity(rows, width)
    assert len(got) == rows + capacity // 8 and capacity < want[rows - 1]
    np.testing.assert_array_equal(got[:rows], want[:rows])
    assert got[rows:].tobytes() == want[rows:].tobytes()[:capacity]
    bounds = [(r, r + 1) for r in range(rows)]
    assert device.entries(got, rows, bounds, lambda: args) == \
        LogprobRenderer(np, vocab).entries(want, rows, bounds, lambda: args)
