"""The fused accept-and-gather step: the twin against a per-request reference, the kernel against the twin."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cupyspec.logprobs.accept_gather import GatheredLogprobs, RowLogprobs, accept_and_gather, gathered_on_host
from cupyspec.logprobs.layout import LayoutShape, LogprobLayout, RequestWants, UploadedLayout
from cupyspec.logprobs.logprob_json import LogprobRenderer, VocabJSON
from cupyspec.sampling.params import SamplingParams
from cupyspec.sampling.sampler import SamplingRow
from cupyspec.spec_decode.verification.verify import PLACEHOLDER_TOKEN_ID, VerifyInput, VerifyOutput, verify
from cupyspec.spec_decode.verification.verify_step import LogprobRequests, LogprobStream, launch_verify
from cupyspec.text.token_text import TokenText
from cupyspec.transfer import fetch_arrays, to_device


class NumberTokenizer:
    """Token i is the text of i."""

    def token_bytes(self, token_id: int) -> bytes:
        return str(token_id).encode()


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def random_case(rng: np.random.Generator, batch: int, max_drafts: int, vocab: int, k: int) -> dict:
    num_drafts = rng.integers(0, max_drafts + 1, batch)  # [B]
    drafts = np.full((batch, max(max_drafts, 1)), PLACEHOLDER_TOKEN_ID, np.int64)
    for b, n in enumerate(num_drafts):
        drafts[b, :n] = rng.integers(0, vocab, n)
    first_row = np.concatenate([[0], np.cumsum(num_drafts + 1)])  # [B+1]
    logits = (rng.standard_normal((int(first_row[-1]), vocab)) * 3).astype(np.float32)  # [R, V]
    wants_tokens, wants_drafts = rng.random(batch) < 0.6, rng.random(batch) < 0.5
    wants_tokens[0] = wants_drafts[0] = True
    return dict(num_drafts=num_drafts, drafts=drafts, first_row=first_row, logits=logits, k=k,
                layout=LogprobLayout.build(first_row[:-1], num_drafts, RequestWants.of(wants_tokens, wants_drafts)),
                num_accepted=rng.integers(0, num_drafts + 1), emitted=rng.integers(0, vocab, batch),
                wants_tokens=wants_tokens, wants_drafts=wants_drafts)


def gather(xp, case: dict, rows: RowLogprobs | None = None) -> GatheredLogprobs:  # noqa: ANN001
    """The gathered logprobs of a case, on the host."""
    logits = xp.asarray(case["logits"])
    layout = case["layout"].upload(xp, case["drafts"], case["num_drafts"])
    rows = rows or RowLogprobs.compute(xp, logits, layout.row_target, case["k"])
    runs = xp.asarray(np.stack([case["num_accepted"], case["emitted"]]))  # [2, B]
    return gathered_on_host(fetch_arrays(xp, [accept_and_gather(xp, logits, rows, layout, runs)])[0], layout, case["k"])


def fields(out: GatheredLogprobs) -> list[np.ndarray]:
    """Every output array (the buffer's padding left out)."""
    return [getattr(out, name) for name in GatheredLogprobs.FIELDS]


@pytest.mark.parametrize("batch,max_drafts,k", [(1, 0, 0), (5, 3, 2), (17, 8, 20), (64, 5, 5)])
def test_twin_matches_a_per_request_reference(batch: int, max_drafts: int, k: int) -> None:
    rng = np.random.default_rng(batch * 10 + k)
    case = random_case(rng, batch, max_drafts, vocab=300, k=k)
    out = gather(np, case)
    cu, token_ids, token_lps, draft_lps = out.cu_batch_token_offset, out.token_ids, out.token_lps, out.draft_lps
    token_top_ids, token_top_lps, draft_top_ids = out.token_top_ids, out.token_top_lps, out.draft_top_ids
    np.testing.assert_array_equal(out.runs, [case["num_accepted"], case["emitted"]])
    slot, draft_slot = 0, 0
    for b in range(batch):
        accepted, n = case["num_accepted"][b], case["num_drafts"][b]
        lps = [log_softmax(case["logits"][case["first_row"][b] + j]) for j in range(n + 1)]
        assert cu[b] == slot
        if case["wants_tokens"][b]:
            for j in range(accepted + 1):
                token = case["drafts"][b, j] if j < accepted else case["emitted"][b]
                assert token_ids[slot] == token and abs(token_lps[slot] - lps[j][token]) < 1e-5
                top = np.argsort(-lps[j], kind="stable")[:k]
                np.testing.assert_array_equal(token_top_ids[slot], top)
                np.testing.assert_allclose(token_top_lps[slot], lps[j][top], atol=1e-5)
                slot += 1
        if case["wants_drafts"][b]:
            for j in range(n):
                assert abs(draft_lps[draft_slot] - lps[j][case["drafts"][b, j]]) < 1e-5
                np.testing.assert_array_equal(draft_top_ids[draft_slot], np.argsort(-lps[j], kind="stable")[:k])
                draft_slot += 1
    assert cu[batch] == slot and np.all(token_ids[slot:] == PLACEHOLDER_TOKEN_ID) and draft_slot == len(draft_lps)
    assert not token_lps[slot:].any() and not token_top_ids[slot:].any() and not token_top_lps[slot:].any()


def padded_gather(xp, case: dict, shape: LayoutShape, rows: RowLogprobs | None = None,  # noqa: ANN001
                  verdict_at_address: bool = False) -> GatheredLogprobs:
    """The gathered logprobs of a case whose layout is padded to `shape`, on the host: by the verdict
    passed, or (on a GPU) read where the layout's tail says."""
    logits, drafts, num_drafts = xp.asarray(case["logits"]), case["drafts"], case["num_drafts"]
    runs = xp.asarray(np.stack([case["num_accepted"], case["emitted"]]))  # [2, B]
    verdict_at = runs.data.ptr if verdict_at_address else 0
    layout = UploadedLayout(to_device(xp, case["layout"].packed(shape, drafts, num_drafts, verdict_at)), *shape)
    rows = rows or RowLogprobs.compute(xp, logits, layout.row_target, case["k"])
    buffer = accept_and_gather(xp, logits, rows, layout, None if verdict_at_address else runs)
    return gathered_on_host(fetch_arrays(xp, [buffer])[0], layout, case["k"])


def padding_of(case: dict, extra: tuple[int, int, int, int]) -> LayoutShape:
    """The case's layout shape, each size larger by `extra`."""
    return LayoutShape(*(size + more for size, more in zip(case["layout"].shape(case["drafts"]), extra)))


def assert_padding_asks_nothing(got: GatheredLogprobs, want: GatheredLogprobs) -> None:
    """`got`, of a padded layout, holds `want` (the step's own) and past it what no request asked."""
    batch, rows, slots = want.runs.shape[1], len(want.token_ids), len(want.draft_lps)
    np.testing.assert_array_equal(got.runs[:, :batch], want.runs)
    assert not got.runs[0, batch:].any() and np.all(got.runs[1, batch:] == PLACEHOLDER_TOKEN_ID)
    np.testing.assert_array_equal(got.cu_batch_token_offset[:batch + 1], want.cu_batch_token_offset)
    assert np.all(got.cu_batch_token_offset[batch:] == want.cu_batch_token_offset[-1])
    for name in ("token_ids", "token_lps", "token_top_ids", "token_top_lps"):
        np.testing.assert_array_equal(getattr(got, name)[:rows], getattr(want, name))
    assert np.all(got.token_ids[rows:] == PLACEHOLDER_TOKEN_ID) and not got.token_lps[rows:].any()
    for name in ("draft_lps", "draft_top_ids", "draft_top_lps"):
        np.testing.assert_array_equal(getattr(got, name)[:slots], getattr(want, name))
        assert not getattr(got, name)[slots:].any()


@pytest.mark.parametrize("batch,max_drafts,k,extra", [(1, 2, 3, (0, 2, 0, 0)), (5, 3, 2, (3, 5, 2, 4)),
                                                      (17, 8, 5, (15, 13, 8, 0))])
def test_a_padded_layout_gathers_what_the_step_asks(batch: int, max_drafts: int, k: int,
                                                    extra: tuple[int, int, int, int]) -> None:
    case = random_case(np.random.default_rng(batch + 100), batch, max_drafts, vocab=300, k=k)
    assert_padding_asks_nothing(padded_gather(np, case, padding_of(case, extra)), gather(np, case))


def test_verification_with_logprobs_keeps_the_verdict_and_asks_only_for_what_is_wanted() -> None:
    rng = np.random.default_rng(3)
    vocab = 50
    drafts = [list(rng.integers(0, vocab, n)) for n in (0, 2, 4)]
    num_drafts = np.array([len(d) for d in drafts])
    padded = np.full((3, 4), PLACEHOLDER_TOKEN_ID, np.int64)
    for b, d in enumerate(drafts):
        padded[b, :len(d)] = d
    rows = tuple(SamplingRow(SamplingParams(temperature=0.0), 0.0) for _ in range(int((num_drafts + 1).sum())))
    inp = VerifyInput(padded, num_drafts, None, rows, np.zeros(len(rows)))
    logits = rng.standard_normal((len(rows), vocab)).astype(np.float32)
    plain = verify(np, logits, inp, "rejection")
    step = launch_verify(np, logits, inp, LogprobRequests((None, 2, None), (False, False, True)),
                         "rejection", "normal").result()
    verified = VerifyOutput.of(inp, np.array(step.num_accepted), np.array(step.emitted))
    np.testing.assert_array_equal(verified.output_token_ids, plain.output_token_ids)
    assert step.logprobs.tokens[0] is None and step.logprobs.tokens[2] is None
    assert [lp.token_id for lp in step.logprobs.tokens[1]] == plain.output_token_ids[1, :plain.accept_num[1]].tolist()
    assert step.logprobs.drafts[:2] == (None, None) and len(step.logprobs.drafts[2]) == 4
    assert [d.accepted for d in step.logprobs.drafts[2]] == plain.accepted_mask[2].tolist()
    assert all(d.top == () for d in step.logprobs.drafts[2])  # no top logprobs asked by that request


def test_a_steps_logprobs_are_read_once() -> None:
    """A graph's host copy is launched again once its step's logprobs are read (cupyspec/logprobs/graphs.py):
    a second read must not read that copy again."""
    rng = np.random.default_rng(4)
    inp = VerifyInput(np.array([[3, 7]]), np.array([2]), None, (SamplingRow(SamplingParams(temperature=0.0), 0.0),) * 3,
                      np.zeros(3))
    pending = launch_verify(np, rng.standard_normal((3, 10)).astype(np.float32), inp,
                            LogprobRequests((2,), (True,)), "rejection", "normal")
    first = pending.logprobs()
    assert first.tokens[0] is not None and pending.logprobs() is first and pending.result().logprobs is first


def test_each_request_gets_records_of_its_own_top_k() -> None:
    rng = np.random.default_rng(5)
    vocab, k_asked = 40, (1, 3, None, 0)
    num_drafts = np.array([2, 3, 1, 2])
    padded = np.full((4, 3), PLACEHOLDER_TOKEN_ID, np.int64)
    for b, n in enumerate(num_drafts):
        padded[b, :n] = rng.integers(0, vocab, n)
    rows = tuple(SamplingRow(SamplingParams(temperature=0.0), 0.0) for _ in range(int((num_drafts + 1).sum())))
    logits = rng.standard_normal((len(rows), vocab)).astype(np.float32)
    first_row = np.concatenate([[0], np.cumsum(num_drafts + 1)])
    padded[0, :2] = logits[:2].argmax(axis=1)  # request 0 keeps both drafts: three records
    inp = VerifyInput(padded, num_drafts, None, rows, np.zeros(len(rows)))
    step = launch_verify(np, logits, inp, LogprobRequests(k_asked, (True,) * 4), "rejection", "normal").result()
    assert step.logprobs.tokens[2] is None and step.num_accepted[0] == 2
    for b, k in enumerate(k_asked):
        for entries in (step.logprobs.tokens[b] or (), step.logprobs.drafts[b]):
            for j, entry in enumerate(entries):
                lps = log_softmax(logits[first_row[b] + j])
                top = np.argsort(-lps, kind="stable")[:k or 0].tolist()
                assert isinstance(entry, tuple) and abs(entry.logprob - lps[entry.token_id]) < 1e-5
                assert list(entry.top_ids) == top and np.allclose(entry.top_logprobs, lps[top], atol=1e-5)
    assert [len(e) for e in step.logprobs.tokens if e is not None] == [3, step.num_accepted[1] + 1,
                                                                         step.num_accepted[3] + 1]


# ---------------------------------------------------------------- device


@pytest.mark.gpu
@pytest.mark.parametrize("batch,max_drafts,k", [(1, 0, 0), (3, 1, 1), (17, 8, 20), (256, 5, 5), (300, 8, 3)])
def test_kernel_matches_twin(batch: int, max_drafts: int, k: int) -> None:
    import cupy

    case = random_case(np.random.default_rng(batch + k), batch, max_drafts, vocab=49152, k=k)
    host_rows = RowLogprobs.compute(np, case["logits"], case["layout"].row_target, k)
    device_rows = RowLogprobs(*(cupy.asarray(a) for a in (host_rows.peak, host_rows.log_total, host_rows.top_ids,
                                                          host_rows.top_lps)), k)
    for want, got in zip(fields(gather(np, case, host_rows)), fields(gather(cupy, case, device_rows))):
        np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,max_drafts,k,extra", [(1, 3, 5, (0, 2, 0, 0)), (64, 5, 5, (0, 12, 3, 0)),
                                                      (40, 5, 20, (8, 16, 3, 16))])
def test_a_padded_kernel_reads_the_verdict_where_the_layout_says(batch: int, max_drafts: int, k: int,
                                                                 extra: tuple[int, int, int, int]) -> None:
    import cupy

    case = random_case(np.random.default_rng(batch + k + 7), batch, max_drafts, vocab=49152, k=k)
    shape = padding_of(case, extra)
    host_layout = UploadedLayout(case["layout"].packed(shape, case["drafts"], case["num_drafts"]), *shape)
    host_rows = RowLogprobs.compute(np, case["logits"], host_layout.row_target, k)
    device_rows = RowLogprobs(*(cupy.asarray(a) for a in (host_rows.peak, host_rows.log_total, host_rows.top_ids,
                                                          host_rows.top_lps)), k)
    want = padded_gather(np, case, shape, host_rows)
    got = padded_gather(cupy, case, shape, device_rows, verdict_at_address=True)
    for w, g in zip(fields(want), fields(got)):
        np.testing.assert_array_equal(g, w)
    assert_padding_asks_nothing(got, gather(np, case))


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
def test_overlapped_step_equals_the_host_step(overlap: bool) -> None:
    import cupy

    rng = np.random.default_rng(8)
    vocab, batch = 49152, 64
    drafts = [list(rng.integers(0, vocab, n)) for n in rng.integers(0, 6, batch)]
    num_drafts = np.array([len(d) for d in drafts])
    padded = np.full((batch, 5), PLACEHOLDER_TOKEN_ID, np.int64)
    for b, d in enumerate(drafts):
        padded[b, :len(d)] = d
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9)]
    rows = tuple(SamplingRow(kinds[i % 2], float(rng.random())) for i in range(int((num_drafts + 1).sum())))
    inp = VerifyInput(padded, num_drafts, None, rows, rng.random(len(rows)))
    logits = (rng.standard_normal((len(rows), vocab)) * 3).astype(np.float32)
    for b in range(batch):  # make drafts likely: the draft is each row's argmax half of the time
        for j, d in enumerate(drafts[b]):
            if rng.random() < 0.5:
                logits[int((num_drafts[:b] + 1).sum()) + j, d] = 30.0
    wanted = LogprobRequests(tuple(5 if b % 3 else None for b in range(batch)), tuple(b % 2 == 0 for b in range(batch)),
                             tuple(b % 4 == 1 for b in range(batch)))  # some requests' entries rendered
    vocab_json = VocabJSON.build(TokenText(NumberTokenizer()), vocab)
    host = launch_verify(np, logits, inp, wanted, "rejection", "normal", None, LogprobRenderer(np, vocab_json)).result()
    stream = LogprobStream(cupy.cuda) if overlap else None
    device = launch_verify(cupy, cupy.asarray(logits), inp, wanted, "rejection", "normal", stream,
                           LogprobRenderer(cupy, vocab_json)).result()
    assert (device.num_accepted, device.emitted) == (host.num_accepted, host.emitted)
    assert sum(host.num_accepted) > 0 and any(host.logprobs.rendered)
    for want, got in zip(host.logprobs.rendered, device.logprobs.rendered):
        assert (want is None) == (got is None)
        if want is not None:
            w, g = json.loads(want.json()), json.loads(got.json())
            assert [e["token"] for e in w] == [e["token"] for e in g]
            assert np.allclose([e["logprob"] for e in w], [e["logprob"] for e in g], atol=1e-4)
    for want, got in [(host.logprobs.tokens, device.logprobs.tokens), (host.logprobs.drafts, device.logprobs.drafts)]:
        for w, g in zip(want, got):
            assert (w is None) == (g is None)
            for a, b in zip(w or (), g or ()):
                assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
