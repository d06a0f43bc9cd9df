"""`include_draft_logprobs` over HTTP: the request field, each choice's `draft_logprobs` in both
endpoints' formats, streamed and whole. Formatting is driven by a scripted engine whose deltas
carry drafts; the last tests run the real engine (tiny model, ngram drafts) on the CPU."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from scripted_streams import scripted_stream
from server_fixtures import LiveServer, sse_events, tiny_config
from tiny_models import TinySpec, random_head_weights, write_head_file

from cupyspec.engine.request_stream import RequestStream
from cupyspec.logprobs.logprob_json import LogprobRenderer, VocabJSON
from cupyspec.outputs import CompletionDelta, DraftLogprob, RequestOutput, TokenLogprob
from cupyspec.sampling.params import SamplingParams
from cupyspec.server.app import create_app
from cupyspec.server.logprobs import completion_draft_logprobs, merge_completion_logprobs, text_offsets
from cupyspec.server.protocol import ChatCompletionRequest, CompletionDraftLogprobs, CompletionRequest
from cupyspec.server.sampling import chat_params, completion_params
from cupyspec.spec_decode.speculative_config import RequestSpeculation, SpeculativeConfig
from cupyspec.text.token_text import TokenText

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
EMPTY_COMPLETION_DRAFTS = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": [], "accepted": []}


class LetterTokenizer:
    """Token i < 256 is byte i; 300 is `<|im_end|>`."""

    def token_bytes(self, token_id: int) -> bytes:
        return b"<|im_end|>" if token_id == 300 else bytes([token_id])

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode()


# One choice's steps: (emitted letters, drafts as (letter, accepted, logprob)); None: nothing proposed.
STEPS: list[tuple[str, list[tuple[str, bool, float]] | None]] = [
    ("a", None),  # the prefill
    ("bcd", [("b", True, -0.25), ("c", True, -0.5), ("x", False, -2.0)]),  # 2 accepted, `d` corrects `x`
    ("g", [("e", False, -1.5), ("f", False, -math.inf)]),  # `f` comes after the first rejection
    ("", [("h", False, -3.0)]),  # drafts, but no token or text in the delta
    ("ij", [("i", True, -0.75)]),  # the last step: finish_reason "length"
]


def top_of(params: SamplingParams) -> tuple[list[int], list[float]]:
    """Ids and logprobs of as many alternatives as asked: `z`, `y`, ... at -3, -4, ..."""
    count = params.logprobs or 0
    return [ord("z") - i for i in range(count)], [-3.0 - i for i in range(count)]


class DraftScriptEngine:
    """Every choice runs STEPS; choice c's letters are shifted by c. The prompt `plain` gets no
    drafts (draft_logprobs None, as from an engine that does not speculate)."""

    def __init__(self) -> None:
        self.tokenizer = LetterTokenizer()
        self.renderer = LogprobRenderer(np, VocabJSON.build(TokenText(self.tokenizer), 256))
        self.model_name, self.max_model_len = "scripted", 64
        self.is_serving = True
        self.drafts_with_model = False

    def _delta(self, choice: int, step: int, params: SamplingParams, speculates: bool) -> CompletionDelta:
        emitted, drafts = STEPS[step]
        tokens = tuple(ord(ch) + choice for ch in emitted)
        logprobs = (tuple(TokenLogprob(t, -1.0, *top_of(params)) for t in tokens)
                    if params.logprobs is not None else None)
        rendered = None
        if params.render_logprobs and logprobs is not None:
            logprobs, rendered = None, self.renderer.render_records(logprobs)
        draft_lps = None
        if params.include_draft_logprobs and speculates:
            draft_lps = tuple(DraftLogprob(ord(ch) + choice, lp, *top_of(params), accepted)
                              for ch, accepted, lp in drafts or ())
        last = step == len(STEPS) - 1
        return CompletionDelta(choice, "".join(map(chr, tokens)), tokens, logprobs, "length" if last else None,
                               draft_logprobs=draft_lps, logprobs_json=rendered)

    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                 speculation: RequestSpeculation | None = None) -> RequestStream:
        return scripted_stream(self._outputs(prompt, params, request_id), request_id)

    def chat(self, messages: list[dict], params: SamplingParams, request_id: str,
             speculation: RequestSpeculation | None = None) -> RequestStream:
        return self.generate(messages[-1]["content"], params, request_id)

    async def _outputs(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        ids = tuple(prompt.encode()) if isinstance(prompt, str) else tuple(prompt)
        emitted = 0
        for step in range(len(STEPS)):
            await asyncio.sleep(0)
            deltas = tuple(self._delta(c, step, params, prompt != "plain") for c in range(params.n))
            emitted += sum(len(d.token_ids) for d in deltas)
            yield RequestOutput(request_id, ids, deltas, len(ids), emitted, step == len(STEPS) - 1)


def with_client(test: Callable[[TestClient], Awaitable[None]]) -> None:
    async def main() -> None:
        async with TestClient(TestServer(create_app(DraftScriptEngine()))) as client:  # type: ignore[arg-type]
            await test(client)
    asyncio.run(main())


def post(client: TestClient, path: str, body: dict) -> Awaitable[Any]:
    """The JSON body, or the list of stream events when `body` streams."""
    async def send() -> Any:
        r = await client.post(path, json=body)
        assert r.status == 200, await r.text()
        return sse_events(await r.text()) if body.get("stream") else await r.json()
    return send()


def completion_drafts_of_choice_0(top: bool) -> dict:
    """STEPS' drafts in the legacy format: a draft sits where the step's token at its position
    does; drafts past the step's tokens sit at the end of the text after the step."""
    tokens = ["b", "c", "x", "e", "f", "h", "i"]
    logprobs = [-0.25, -0.5, -2.0, -1.5, -9999.0, -3.0, -0.75]
    return {"tokens": tokens, "token_logprobs": logprobs,
            "top_logprobs": [({"z": -3.0} if top else {}) | {t: lp} for t, lp in zip(tokens, logprobs)],
            "text_offset": [1, 2, 3, 4, 5, 5, 5], "accepted": [True, True, False, False, False, False, True]}


def shifted(letters: list[str], by: int) -> list[str]:
    return [chr(ord(ch) + by) for ch in letters]


def concat_lists(parts: list[dict]) -> dict:
    """Legacy (draft) logprobs of consecutive chunks joined, list by list."""
    return {key: [x for p in parts for x in p[key]] for key in parts[0]}


# ------------------------------------------------------------------------- conversion functions

def test_draft_text_offsets_follow_the_emitted_tokens() -> None:
    texts = TokenText(LetterTokenizer())
    offsets = text_offsets(texts, [ord("a"), 300], 5)
    assert offsets == [5, 6, 16]
    drafts = [DraftLogprob(ord("a"), -0.5, [ord("a")], [-0.5], True), DraftLogprob(ord("q"), -math.inf, [], [], False),
              DraftLogprob(ord("r"), -7.0, [], [], False)]
    lp = completion_draft_logprobs(texts, drafts, offsets)
    assert msgspec.to_builtins(lp) == {"tokens": ["a", "q", "r"], "token_logprobs": [-0.5, -9999.0, -7.0],
                                       "top_logprobs": [{"a": -0.5}, {"q": -9999.0}, {"r": -7.0}],
                                       "text_offset": [5, 6, 16], "accepted": [True, False, False]}
    assert completion_draft_logprobs(texts, drafts[:1], text_offsets(texts, [], 9)).text_offset == [9]
    merged = merge_completion_logprobs([lp, completion_draft_logprobs(texts, (), offsets), lp], CompletionDraftLogprobs)
    assert merged.accepted == [True, False, False] * 2 and merged.text_offset == [5, 6, 16] * 2
    assert msgspec.to_builtins(merge_completion_logprobs([], CompletionDraftLogprobs)) == EMPTY_COMPLETION_DRAFTS


@pytest.mark.parametrize("logprobs", [None, 1])
def test_completion_draft_logprobs_whole(logprobs: int | None) -> None:
    async def test(client: TestClient) -> None:
        body = await post(client, COMPLETIONS, {"prompt": "p", "n": 2, "logprobs": logprobs,
                                                "include_draft_logprobs": True})
        first, second = body["choices"]
        assert first["text"] == "abcdgij" and first["draft_logprobs"] == completion_drafts_of_choice_0(logprobs == 1)
        if logprobs is not None:  # drafts' offsets are those of the emitted tokens
            assert first["logprobs"]["text_offset"] == [0, 1, 2, 3, 4, 5, 6]
        else:
            assert first["logprobs"] is None
        assert second["draft_logprobs"]["tokens"] == shifted(first["draft_logprobs"]["tokens"], 1)
        assert second["draft_logprobs"]["text_offset"] == first["draft_logprobs"]["text_offset"]
    with_client(test)


def test_completion_draft_offsets_count_the_echoed_prompt() -> None:
    async def test(client: TestClient) -> None:
        body = await post(client, COMPLETIONS, {"prompt": "pq", "echo": True, "include_draft_logprobs": True})
        (choice,) = body["choices"]
        assert choice["text"] == "pqabcdgij"
        assert choice["draft_logprobs"]["text_offset"] == [3, 4, 5, 6, 7, 7, 7]
    with_client(test)


@pytest.mark.parametrize("include_usage", [False, True])
def test_completion_draft_logprobs_streamed(include_usage: bool) -> None:
    async def test(client: TestClient) -> None:
        request = {"prompt": "p", "n": 2, "logprobs": 1, "include_draft_logprobs": True}
        whole = await post(client, COMPLETIONS, request)
        options = {"stream_options": {"include_usage": True}} if include_usage else {}
        events = await post(client, COMPLETIONS, {**request, "stream": True, **options})
        choices = [c for e in events for c in e["choices"]]
        assert all("draft_logprobs" in c for c in choices) and len(choices) == 2 * len(STEPS)
        for index in (0, 1):
            mine = [c for c in choices if c["index"] == index]
            assert [c["text"] for c in mine] == shifted(["a"], index) + ["".join(shifted(list(e), index))
                                                                         for e, _ in STEPS[1:]]
            assert concat_lists([c["draft_logprobs"] for c in mine]) == whole["choices"][index][
                "draft_logprobs"]
            assert mine[0]["draft_logprobs"] == EMPTY_COMPLETION_DRAFTS  # the prefill proposed nothing
            assert mine[3]["text"] == "" and mine[3]["draft_logprobs"]["tokens"] == shifted(["h"], index)
        if include_usage:
            assert events[-1]["choices"] == [] and "draft_logprobs" not in json.dumps(events[-1])
    with_client(test)


def chat_drafts_of_choice_0(top: bool) -> list[dict]:
    legacy = completion_drafts_of_choice_0(top)
    alternatives = [{"token": "z", "logprob": -3.0, "bytes": [ord("z")]}] if top else []
    return [{"token": t, "logprob": lp, "bytes": [ord(t)], "top_logprobs": alternatives, "accepted": ok}
            for t, lp, ok in zip(legacy["tokens"], legacy["token_logprobs"], legacy["accepted"])]


@pytest.mark.parametrize("logprobs", [{}, {"logprobs": True, "top_logprobs": 1}])
def test_chat_draft_logprobs_whole(logprobs: dict) -> None:
    async def test(client: TestClient) -> None:
        body = await post(client, CHAT, {"messages": USER, "n": 2, "include_draft_logprobs": True, **logprobs})
        first, second = body["choices"]
        assert first["message"]["content"] == "abcdgij"
        assert first["draft_logprobs"] == {"content": chat_drafts_of_choice_0(bool(logprobs))}
        assert (first["logprobs"] is None) == (not logprobs)
        assert [d["token"] for d in second["draft_logprobs"]["content"]] == shifted(list("bcxefhi"), 1)
    with_client(test)


def test_chat_draft_logprobs_streamed() -> None:
    async def test(client: TestClient) -> None:
        request = {"messages": USER, "n": 2, "logprobs": True, "top_logprobs": 1, "include_draft_logprobs": True}
        whole = await post(client, CHAT, request)
        events = await post(client, CHAT, {**request, "stream": True})
        roles, content = events[:2], [c for e in events[2:] for c in e["choices"]]
        assert all("draft_logprobs" not in c for e in roles for c in e["choices"])
        assert all("draft_logprobs" in c for c in content) and len(content) == 2 * len(STEPS)
        for index in (0, 1):
            mine = [c for c in content if c["index"] == index]
            drafts = [d for c in mine for d in c["draft_logprobs"]["content"]]
            assert drafts == whole["choices"][index]["draft_logprobs"]["content"]
            assert mine[0]["draft_logprobs"] == {"content": []}
            assert mine[3]["delta"] == {} and [d["token"] for d in mine[3]["draft_logprobs"]["content"]] == shifted(
                ["h"], index)
            assert mine[-1]["finish_reason"] == "length"
    with_client(test)


@pytest.mark.parametrize("flag", [{}, {"include_draft_logprobs": False}, {"include_draft_logprobs": None}])
def test_no_draft_logprobs_unless_asked(flag: dict) -> None:
    async def test(client: TestClient) -> None:
        for path, body in ((COMPLETIONS, {"prompt": "p", "logprobs": 1}), (CHAT, {"messages": USER, "logprobs": True})):
            for stream in (False, True):
                answer = await post(client, path, {**body, **flag, "stream": stream})
                assert "draft_logprobs" not in json.dumps(answer) and "logprobs" in json.dumps(answer)
    with_client(test)


def test_no_drafts_proposed_gives_empty_lists() -> None:
    async def test(client: TestClient) -> None:
        completion = await post(client, COMPLETIONS, {"prompt": "plain", "n": 2, "include_draft_logprobs": True})
        assert [c["draft_logprobs"] for c in completion["choices"]] == [EMPTY_COMPLETION_DRAFTS] * 2
        events = await post(client, COMPLETIONS, {"prompt": "plain", "include_draft_logprobs": True, "stream": True})
        # the step that emits nothing and proposes nothing has no chunk
        assert [e["choices"][0]["draft_logprobs"] for e in events] == [EMPTY_COMPLETION_DRAFTS] * (len(STEPS) - 1)
        chat = await post(client, CHAT, {"messages": [{"role": "user", "content": "plain"}],
                                         "include_draft_logprobs": True})
        assert chat["choices"][0]["draft_logprobs"] == {"content": []}
    with_client(test)


# --------------------------------------------------------------------------- request validation

def test_the_field_reaches_sampling_params() -> None:
    def completion(**body: object) -> SamplingParams:
        return completion_params(msgspec.json.decode(json.dumps({"prompt": "x", **body}), type=CompletionRequest))

    def chat(**body: object) -> SamplingParams:
        return chat_params(msgspec.json.decode(json.dumps({"messages": USER, **body}), type=ChatCompletionRequest))

    for params in (completion, chat):
        assert params(include_draft_logprobs=True).include_draft_logprobs is True
        assert params(include_draft_logprobs=None).include_draft_logprobs is False
        assert params().include_draft_logprobs is False


@pytest.mark.parametrize("value", [1, 0, "true", [True], {"on": True}])
def test_non_boolean_is_a_400(value: Any) -> None:
    async def test(client: TestClient) -> None:
        for path, body in ((COMPLETIONS, {"prompt": "p"}), (CHAT, {"messages": USER})):
            for stream in (False, True):
                r = await client.post(path, json={**body, "stream": stream, "include_draft_logprobs": value})
                error = (await r.json())["error"]
                assert r.status == 400 and error["param"] == "include_draft_logprobs", error
                assert error["type"] == "invalid_request_error" and "bool" in error["message"]
    with_client(test)


# ------------------------------------------------------------------------ the real engine, live

K = 3  # the server's num_speculative_tokens
TOP = 2  # alternatives asked for each token
LIVE_BODY = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 40, "include_draft_logprobs": True}
LIVE_PROMPT = [5] * 20  # the tiny model's greedy output repeats: ngram drafts get accepted


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    config = dataclasses.replace(tiny_config(tmp_path_factory.mktemp("tiny-model")),
                                 speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=K,
                                                                 cost_aware_backoff=False))
    with LiveServer(config) as server:
        yield server


def live_post(server: LiveServer, path: str, body: dict) -> Any:
    """The JSON body, or the list of stream events when `body` streams."""
    request = urllib.request.Request(server.base_url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            text = response.read().decode()
    except urllib.error.HTTPError as error:
        raise AssertionError(error.read().decode()) from None
    return sse_events(text) if body.get("stream") else json.loads(text)


def live_choices(server: LiveServer, endpoint: str, stream: bool) -> tuple[dict[int, list[dict]], dict]:
    """Per choice index, its choices (those of its content chunks) in order; the speculate_metrics."""
    if endpoint == "chat":
        body = {"messages": [{"role": "user", "content": "one two three " * 8}], "logprobs": True,
                "top_logprobs": TOP, "n": 2}
    else:
        body = {"prompt": LIVE_PROMPT, "logprobs": TOP, "n": 2}
    answer = live_post(server, CHAT if endpoint == "chat" else COMPLETIONS, {**LIVE_BODY, **body, "stream": stream})
    events = answer if stream else [answer]
    choices: dict[int, list[dict]] = {0: [], 1: []}
    for event in events:
        for choice in event["choices"]:
            if "delta" not in choice or "role" not in choice["delta"]:
                choices[choice["index"]].append(choice)
    return choices, events[-1]["speculate_metrics"]


def test_live_draft_logprobs_agree_with_speculate_metrics(spec_server: LiveServer) -> None:
    """Meaningful once the engine fills CompletionDelta.draft_logprobs (fails while it sends None)."""
    check_live_drafts(spec_server, model_drafts=False)


def check_live_drafts(server: LiveServer, model_drafts: bool) -> None:
    """Both endpoints, streamed and whole: every content chunk has draft_logprobs, each draft's
    logprob and alternatives are in order, and the drafts and accepted ones add up to the metrics;
    model_drafts: every draft carries the draft model's own logprob (else none does)."""
    vocab = TinySpec().vocab
    for endpoint in ("completions", "chat"):
        for stream in (False, True):
            choices, metrics = live_choices(server, endpoint, stream)
            assert metrics["num_draft_tokens"] > 0 and metrics["num_accepted_tokens"] > 0, metrics
            drafts_of_choices = []
            for parts in choices.values():
                assert parts and all("draft_logprobs" in p for p in parts)
                if endpoint == "chat":
                    entries = [d for p in parts for d in p["draft_logprobs"]["content"]]
                    drafts = [(d["token"], d["logprob"], d["accepted"], len(d["top_logprobs"]) == TOP)
                              for d in entries]
                    model_lps = [d.get("draft_logprob") for d in entries]
                else:
                    drafts = check_completion_drafts(parts)
                    model_lps = concat_lists([p["draft_logprobs"] for p in parts]).get(
                        "draft_token_logprobs", [None] * len(drafts))
                assert all(lp <= 0.0 and top_ok for _t, lp, _a, top_ok in drafts), drafts
                if model_drafts:  # the head's logprob of its greedy draft: its most likely token's
                    in_range = [lp is not None and -np.log(vocab) <= lp <= 0.0 for lp in model_lps]
                    assert all(in_range), (endpoint, stream, model_lps)
                else:
                    assert model_lps == [None] * len(drafts)
                drafts_of_choices.append(drafts)
            assert sum(len(d) for d in drafts_of_choices) == metrics["num_draft_tokens"], (endpoint, stream)
            assert sum(a for d in drafts_of_choices for _t, _lp, a, _ok in d) == metrics["num_accepted_tokens"]


@pytest.fixture(scope="module")
def mtp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """MTP with a random head: its drafts are rarely right, so every draft is taken (accept_all)
    and the accepted ones show in the token logprobs."""
    folder = tmp_path_factory.mktemp("tiny-mtp")
    head = write_head_file(folder / "head.safetensors", random_head_weights(TinySpec()))
    config = dataclasses.replace(tiny_config(folder), speculative=SpeculativeConfig(
        method="mtp", model=str(head), num_model_steps=K, num_speculative_tokens=K, accept_policy="accept_all",
        cost_aware_backoff=False))
    with LiveServer(config) as server:
        yield server


def test_live_mtp_draft_logprobs_agree_with_speculate_metrics(mtp_server: LiveServer) -> None:
    check_live_drafts(mtp_server, model_drafts=True)


def check_completion_drafts(parts: list[dict]) -> list[tuple[str, float, bool, bool]]:
    """One choice's legacy drafts: lists of one length, offsets in order inside the text; an
    accepted draft is the emitted token at its offset, with that token's logprob. Returns
    (token, logprob, accepted, top_logprobs holds the TOP alternatives plus the draft)."""
    drafts = concat_lists([p["draft_logprobs"] for p in parts])
    assert len({len(v) for v in drafts.values()}) == 1, drafts
    emitted = concat_lists([p["logprobs"] for p in parts])
    at = {o: (t, lp) for t, lp, o in zip(emitted["tokens"], emitted["token_logprobs"], emitted["text_offset"])}
    text_length = emitted["text_offset"][-1] + len(emitted["tokens"][-1])  # offsets count the tokens' strings
    assert drafts["text_offset"] == sorted(drafts["text_offset"]) and max(drafts["text_offset"]) <= text_length
    result = []
    for token, lp, top, offset, accepted in zip(drafts["tokens"], drafts["token_logprobs"], drafts["top_logprobs"],
                                                drafts["text_offset"], drafts["accepted"]):
        if accepted and offset < text_length:  # not cut off by max_tokens
            assert at[offset][0] == token and at[offset][1] == pytest.approx(lp, abs=1e-4)
        # the draft is among the TOP most likely, or below all of them
        top_ok = token in top and (len(top) == TOP or (len(top) == TOP + 1 and lp <= min(top.values())))
        result.append((token, lp, accepted, top_ok))
    return result


def test_live_drafts_off_for_the_request_gives_empty_lists(spec_server: LiveServer) -> None:
    off = {**LIVE_BODY, "speculative": {"num_speculative_tokens": 0}, "max_tokens": 8}
    completion = live_post(spec_server, COMPLETIONS, {**off, "prompt": LIVE_PROMPT, "n": 2})
    assert [c["draft_logprobs"] for c in completion["choices"]] == [EMPTY_COMPLETION_DRAFTS] * 2
    assert completion["speculate_metrics"]["num_draft_tokens"] == 0
    events = live_post(spec_server, CHAT, {**off, "messages": USER, "stream": True})
    assert all(c["draft_logprobs"] == {"content": []} for e in events[1:] for c in e["choices"])
    plain = live_post(spec_server, CHAT, {**off, "messages": USER, "include_draft_logprobs": False})
    assert "draft_logprobs" not in plain["choices"][0]
