"""A step's logprob work replayed as a CUDA graph gives what the eager path gives."""

from __future__ import annotations

import numpy as np
import pytest

from cupyspec.logprobs.logprob_json import LogprobRenderer, VocabJSON
from cupyspec.logprobs.logsoftmax_topk import logprobs_on_device
from cupyspec.sampling.params import SamplingParams
from cupyspec.sampling.sampler import SamplingRow
from cupyspec.spec_decode.verification.verify import PLACEHOLDER_TOKEN_ID, VerifyInput
from cupyspec.spec_decode.verification.verify_step import LogprobRequests, StepVerdict, launch_verify
from cupyspec.text.token_text import TokenText

VOCAB, MAX_DRAFTS = 5000, 5
RENDERED = LogprobRequests((5,), (False,), (True,))
RECORDS = LogprobRequests((3,), (True,))


class NumberTokenizer:
    def token_bytes(self, token_id: int) -> bytes:
        return str(token_id).encode()


def one_request_step(rng: np.random.Generator, num_drafts: int) -> tuple[np.ndarray, VerifyInput]:
    """Logits [1 + d, V] and a greedy request's d drafts, each its row's argmax half of the time."""
    logits = (rng.standard_normal((num_drafts + 1, VOCAB)) * 3).astype(np.float32)
    drafts = np.full((1, MAX_DRAFTS), PLACEHOLDER_TOKEN_ID, np.int64)
    drafts[0, :num_drafts] = rng.integers(0, VOCAB, num_drafts)
    for j in range(num_drafts):
        if rng.random() < 0.5:
            logits[j, drafts[0, j]] = 30.0
    rows = (SamplingRow(SamplingParams(temperature=0.0), 0.0),) * (num_drafts + 1)
    return logits, VerifyInput(drafts, np.array([num_drafts]), None, rows, np.zeros(num_drafts + 1))


def assert_same(got: StepVerdict, want: StepVerdict) -> None:
    assert (got.num_accepted, got.emitted) == (want.num_accepted, want.emitted)
    assert got.logprobs.tokens == want.logprobs.tokens and got.logprobs.drafts == want.logprobs.drafts
    assert [r and r.json() for r in got.logprobs.rendered] == [r and r.json() for r in want.logprobs.rendered]


@pytest.fixture
def device():  # noqa: ANN201
    import cupy

    from cupyspec.logprobs.graphs import LogprobGraphs

    static = cupy.empty((16 * (MAX_DRAFTS + 1), VOCAB), cupy.float32)  # the forward graphs' logits
    renderer = LogprobRenderer(cupy, VocabJSON.build(TokenText(NumberTokenizer()), VOCAB))
    with cupy.cuda.Stream(non_blocking=True):  # capture needs a stream of its own
        yield cupy, static, LogprobGraphs(cupy, static, MAX_DRAFTS), renderer


@pytest.mark.gpu
def test_replayed_steps_equal_eager_ones(device) -> None:  # noqa: ANN001
    cupy, static, graphs, renderer = device
    rng = np.random.default_rng(0)
    accepted = 0
    for num_drafts in (3, 3, 5, 3, 1, 3, 5, 5):  # shapes again and again: captured, then replayed in turn
        logits, inp = one_request_step(rng, num_drafts)
        static[:num_drafts + 1] = cupy.asarray(logits)  # new logits in the static buffer
        for wanted in (RENDERED, RECORDS):
            view = static[:num_drafts + 1]
            got = launch_verify(cupy, view, inp, wanted, "rejection", "normal", None, renderer, graphs,
                                np.array([0])).result()
            want = launch_verify(cupy, view, inp, wanted, "rejection", "normal", None, renderer).result()
            assert_same(got, want)
            accepted += got.num_accepted[0]
    assert accepted > 0


@pytest.mark.gpu
def test_a_graph_whose_results_are_unread_is_not_launched_again(device) -> None:  # noqa: ANN001
    cupy, static, graphs, renderer = device
    rng = np.random.default_rng(1)
    pending, wants = [], []
    for _ in range(4):  # one shape, four steps, none read before the last is launched
        logits, inp = one_request_step(rng, 4)
        static[:5] = cupy.asarray(logits)
        wants.append(launch_verify(cupy, static[:5], inp, RENDERED, "rejection", "normal", None, renderer).result())
        pending.append(launch_verify(cupy, static[:5], inp, RENDERED, "rejection", "normal", None, renderer, graphs,
                                     np.array([0])))
    for got, want in zip(pending, wants):  # a third launch into a graph still lent would have overwritten one
        assert_same(got.result(), want)


def many_request_step(rng: np.random.Generator, num_drafts: np.ndarray) -> tuple[np.ndarray, VerifyInput,
                                                                                  LogprobRequests]:
    """Logits, the greedy drafts of requests with num_drafts [B] each (each draft its row's argmax half
    of the time) and what they ask: records or rendered entries of various top k, drafts."""
    batch = len(num_drafts)
    drafts = np.full((batch, num_drafts.max()), PLACEHOLDER_TOKEN_ID, np.int64)
    logits = (rng.standard_normal((int((num_drafts + 1).sum()), VOCAB)) * 3).astype(np.float32)
    row = 0
    for b, n in enumerate(num_drafts):
        drafts[b, :n] = rng.integers(0, VOCAB, n)
        for j in range(n):
            if rng.random() < 0.5:
                logits[row + j, drafts[b, j]] = 30.0
        row += n + 1
    rows = (SamplingRow(SamplingParams(temperature=0.0), 0.0),) * len(logits)
    requests = range(batch)
    wanted = LogprobRequests(tuple((5, None, 3, 0)[b % 4] for b in requests), tuple(b % 3 == 0 for b in requests),
                             tuple(b % 2 == 0 for b in requests))
    return logits, VerifyInput(drafts, num_drafts, None, rows, np.zeros(len(logits))), wanted


def first_rows(inp: VerifyInput) -> np.ndarray:
    """[B] each request's first row in logits that hold the requests' rows in turn."""
    return np.cumsum(inp.num_drafts + 1) - (inp.num_drafts + 1)


@pytest.mark.gpu
def test_replayed_steps_of_many_requests_equal_eager_ones(device) -> None:  # noqa: ANN001
    cupy, static, graphs, renderer = device
    rng = np.random.default_rng(5)
    accepted = 0
    for batch in (7, 7, 5, 7, 12, 7):  # steps of other sizes padded alike share a graph
        num_drafts = rng.integers(0, MAX_DRAFTS + 1, batch)
        num_drafts[0] = max(num_drafts[0], 1)  # a verifying step
        logits, inp, wanted = many_request_step(rng, num_drafts)
        static[:len(logits)] = cupy.asarray(logits)
        view = static[:len(logits)]
        got = launch_verify(cupy, view, inp, wanted, "rejection", "normal", None, renderer, graphs,
                            first_rows(inp)).result()
        want = launch_verify(cupy, view, inp, wanted, "rejection", "normal", None, renderer).result()
        assert_same(got, want)
        assert any(got.logprobs.rendered) and any(got.logprobs.tokens) and any(got.logprobs.drafts)
        accepted += sum(got.num_accepted)
    assert accepted > 0


@pytest.mark.gpu
def test_steps_padded_alike_share_a_graph(device) -> None:  # noqa: ANN001
    cupy, static, graphs, renderer = device
    rng = np.random.default_rng(6)
    found = []
    for num_drafts in ([3] * 5, [3, 2] * 3, [2] * 5, [3] * 9):  # 5 and 6 requests padded to 8, any drafts
        _, inp, wanted = many_request_step(rng, np.array(num_drafts))
        found.append(graphs.find_verifying(len(num_drafts), inp.draft_token_ids.shape[1], 5, renderer))
    assert found[0] is found[1] is found[2]
    assert found[0].on_device.shape == (8, 8 * (MAX_DRAFTS + 1), MAX_DRAFTS, 8 * MAX_DRAFTS)  # every row and slot
    assert found[3] is not found[0] and found[3].on_device.num_seqs == 16
    assert graphs.find_verifying(2, 2, 21, None) is None  # more top logprobs than the kernel gives
    assert graphs.find_verifying(2, MAX_DRAFTS + 1, 5, None) is None  # more drafts than a request may verify


@pytest.mark.gpu
def test_a_step_whose_logits_are_a_gather_of_the_static_rows_replays_them(device) -> None:  # noqa: ANN001
    """In a step that also runs prompts, the target rows are some of the static rows."""
    cupy, static, graphs, renderer = device
    rng = np.random.default_rng(7)
    for batch in (6, 6, 9):
        num_drafts = rng.integers(1, MAX_DRAFTS + 1, batch)
        logits, inp, wanted = many_request_step(rng, num_drafts)
        gaps = rng.integers(0, 3, batch)  # prompt rows before each request's rows
        static_rows = np.cumsum(gaps + num_drafts + 1) - (num_drafts + 1)  # [B] each request's first row
        target_rows = np.concatenate([np.arange(n + 1) + first for first, n in zip(static_rows, num_drafts)])
        static[:] = cupy.asarray(rng.standard_normal((len(static), VOCAB)).astype(np.float32))
        static[cupy.asarray(target_rows)] = cupy.asarray(logits)
        gathered = static[cupy.asarray(target_rows)]
        got = launch_verify(cupy, gathered, inp, wanted, "rejection", "normal", None, renderer, graphs,
                            static_rows).result()
        want = launch_verify(cupy, gathered, inp, wanted, "rejection", "normal", None, renderer).result()
        assert_same(got, want)
        assert any(got.logprobs.rendered) and any(got.logprobs.tokens)
    assert graphs.find_verifying(len(inp.num_drafts), inp.draft_token_ids.shape[1], 5,
                                 renderer).free_slot() is not None  # replayed, and read


def eager_plain_step(cupy, logits, tokens, k: int, renderer: LogprobRenderer | None,  # noqa: ANN001
                     render_k: np.ndarray) -> list[np.ndarray]:
    """The eager path's arrays of a plain step: tokens, their logprobs, top ids and logprobs (, entries)."""
    arrays = [tokens, *logprobs_on_device(cupy, logits, tokens, k)]
    if renderer is not None:
        rows = len(render_k)
        arrays.append(renderer.render(cupy, *arrays, k, cupy.asarray(render_k), rows, rows))
    return [a.get() for a in arrays]


@pytest.mark.gpu
def test_replayed_plain_steps_equal_eager_ones(device) -> None:  # noqa: ANN001
    """Steps of 1 to 17 requests, whose rows are anywhere in the static logits, some asking entries."""
    cupy, static, graphs, renderer = device
    rng = np.random.default_rng(3)
    for step in range(12):  # shapes captured, then replayed by both of their graphs in turn
        num_seqs = (1, 3, 16, 9, 17, 2)[step % 6]  # 9 after 16 (both padded to 16): padding that rendered before
        static[:] = cupy.asarray((rng.standard_normal((len(static), VOCAB)) * 3).astype(np.float32))
        rows = np.sort(rng.choice(len(static), num_seqs, replace=False))  # [n] prompt rows between them
        tokens = cupy.asarray(rng.integers(0, VOCAB, num_seqs))  # any token: a drawn one need not be the argmax
        for k, render in ((5, True), (3, False), (0, False)):
            render_k = np.where(rng.random(num_seqs) < 0.5, k, -1) if render else np.full(num_seqs, -1)
            graph = graphs.find_plain(num_seqs, k, renderer if render else None)
            got = graph.launch(graph.free_slot(), tokens, rows, render_k).result()
            want = eager_plain_step(cupy, static[cupy.asarray(rows)], tokens, k, renderer if render else None,
                                    render_k)
            assert len(got) == len(want)
            for g, w in zip(got[:4], want[:4]):
                assert g.dtype == w.dtype and g.shape == w.shape
                np.testing.assert_array_equal(g, w)
            if render:  # each request's entries (past them the render's buffer is not written)
                bounds = [(s, s + 1) if r >= 0 else None for s, r in enumerate(render_k)]
                mine, eager = (renderer.entries(r, num_seqs, bounds, None) for r in (got[4], want[4]))
                assert mine == eager
                assert all(bytes(e.data).startswith(b'{"token":') for e in mine if e is not None)


@pytest.mark.gpu
def test_a_plain_graph_whose_results_are_unread_is_not_launched_again(device) -> None:  # noqa: ANN001
    cupy, static, graphs, renderer = device
    static[:1] = cupy.asarray(np.random.default_rng(4).standard_normal((1, VOCAB)).astype(np.float32))
    graph = graphs.find_plain(1, 2, renderer)

    def launch(token: int):  # noqa: ANN202
        return graph.launch(graph.free_slot(), cupy.asarray([token]), np.array([0]), np.array([2]))

    first, second = launch(7), launch(9)
    assert graph.free_slot() is None  # both lent
    assert second.result()[0].tolist() == [9]
    third = launch(11)  # into second's graph, read
    assert first.result()[0].tolist() == [7] and third.result()[0].tolist() == [11]
    unread = [launch(t) for t in (13, 15)]
    assert graph.free_slot() is None
    del unread[0]  # dropped unread: nobody will read it
    assert graph.free_slot() is not None and unread[0].result()[0].tolist() == [15]


@pytest.mark.gpu
def test_plain_steps_past_the_static_rows_or_the_kernels_k_are_not_replayed(device) -> None:  # noqa: ANN001
    cupy, static, graphs, renderer = device
    assert graphs.find_plain(len(static), 5, renderer) is not None
    assert graphs.find_plain(len(static) + 1, 5, renderer) is None  # padded past the static rows
    assert graphs.find_plain(1, 21, None) is None  # more than the kernel gives


async def _one_stream(model_path: str, cuda_graphs: bool) -> list[tuple]:
    """Each request's tokens, logprob records, rendered entries and draft logprobs, one request at a time."""
    from cupyspec.config import CacheConfig, EngineConfig
    from cupyspec.engine import AsyncEngine
    from cupyspec.spec_decode.speculative_config import SpeculativeConfig

    speculative = SpeculativeConfig(method="ngram", num_speculative_tokens=5, cost_aware_backoff=False)
    engine = await AsyncEngine.create(EngineConfig(model=model_path, device="cuda", cuda_graphs=cuda_graphs,
                                                   speculative=speculative,
                                                   cache=CacheConfig(kv_cache_memory_bytes=1 << 30)))
    prompt = [{"role": "user", "content": "Repeat this list exactly: " + ", ".join(map(str, range(30)))}]
    answers = []
    try:
        for render in (True, False):
            params = SamplingParams(temperature=0.0, max_tokens=80, logprobs=5, include_draft_logprobs=True,
                                    render_logprobs=render)
            deltas = [d async for out in engine.chat(prompt, params) for d in out.deltas]
            answers.append(([t for d in deltas for t in d.token_ids], [e for d in deltas for e in d.logprobs or ()],
                            b"".join(d.logprobs_json.data for d in deltas if d.logprobs_json is not None),
                            [e for d in deltas for e in d.draft_logprobs or ()]))
    finally:
        await engine.shutdown()
    return answers


@pytest.mark.gpu
def test_one_stream_with_logprobs_equals_the_engine_without_graphs(default_model_path) -> None:  # noqa: ANN001
    import asyncio

    eager = asyncio.run(_one_stream(default_model_path, False))
    graphed = asyncio.run(_one_stream(default_model_path, True))
    assert graphed == eager
    (_, _, entries, drafts), (_, records, _, _) = eager
    assert entries and records and any(d.accepted for d in drafts)  # drafts verified, and accepted
