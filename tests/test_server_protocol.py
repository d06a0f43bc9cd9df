"""The HTTP layer without a model: request validation into SamplingParams, logprob and response
formatting, error bodies. Responses are driven by a scripted token source, not the engine."""

from __future__ import annotations

import asyncio
import json
import math

import msgspec
import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from scripted_streams import scripted_stream
from server_fixtures import sse_events

from cupyspec.errors import EngineClosedError, EngineOverloadedError, InvalidRequestError
from cupyspec.logprobs.logprob_json import LogprobRenderer, VocabJSON
from cupyspec.outputs import CompletionDelta, RequestOutput, TokenLogprob
from cupyspec.server.app import create_app
from cupyspec.server.errors import APIError, to_api_error
from cupyspec.server.logprobs import completion_logprobs
from cupyspec.server.protocol import ChatCompletionRequest, CompletionRequest
from cupyspec.server.sampling import chat_messages, chat_params, completion_params, completion_prompts
from cupyspec.text.token_text import TokenText


def completion(**body: object) -> CompletionRequest:
    return msgspec.json.decode(json.dumps(body), type=CompletionRequest)


def chat(**body: object) -> ChatCompletionRequest:
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return msgspec.json.decode(json.dumps(body), type=ChatCompletionRequest)


def api_error(fn, *args) -> APIError:  # noqa: ANN001
    with pytest.raises(Exception) as info:
        fn(*args)
    error = to_api_error(info.value)
    assert error is not None, f"unmapped {info.value!r}"
    return error


# ------------------------------------------------------------------------- request validation

def test_completion_defaults_and_fields() -> None:
    p = completion_params(completion(prompt="x"))
    assert (p.n, p.temperature, p.top_p, p.max_tokens, p.logprobs, p.prompt_logprobs) == (1, 1.0, 1.0, 16, None, None)
    p = completion_params(completion(prompt="x", max_tokens=None, stop="END", temperature=0, top_k=5, seed=7,
                                     logprobs=3, echo=True, ignore_eos=True, stop_token_ids=[4], best_of=1,
                                     unknown_field={"a": 1}))
    assert (p.max_tokens, p.stop, p.temperature, p.top_k, p.seed) == (None, ("END",), 0.0, 5, 7)
    assert (p.logprobs, p.prompt_logprobs, p.ignore_eos, p.stop_token_ids) == (3, 3, True, (4,))
    assert completion_params(completion(prompt="x", logprobs=2)).prompt_logprobs is None  # echo off


@pytest.mark.parametrize("body, param, status", [
    ({"suffix": "tail"}, "suffix", 400),
    ({"best_of": 3, "n": 2}, "best_of", 400),
    ({"logit_bias": {"5": 1.0}}, "logit_bias", 400),
    ({"stream_options": {"include_usage": True}}, "stream_options", 400),
    ({"temperature": -1}, "temperature", 400),
    ({"top_p": 0}, "top_p", 400),
    ({"n": 0}, "n", 400),
    ({"max_tokens": 0}, "max_tokens", 400),
    ({"logprobs": 21}, "logprobs", 400),
    ({"presence_penalty": 3}, "presence_penalty", 400),
    ({"stop": ["ok", ""]}, "stop", 400),
])
def test_completion_bad_values(body: dict, param: str, status: int) -> None:
    error = api_error(completion_params, completion(prompt="x", **body))
    assert (error.status, error.param, error.type) == (status, param, "invalid_request_error")


def test_completion_prompt_forms() -> None:
    assert completion_prompts(completion(prompt="a")) == ["a"]
    assert completion_prompts(completion(prompt=["a", "b"])) == ["a", "b"]
    assert completion_prompts(completion(prompt=[1, 2])) == [[1, 2]]
    assert completion_prompts(completion(prompt=[[1], [2, 3]])) == [[1], [2, 3]]
    for bad in ([], ["a", 1], [[1], []], [[1], "a"]):
        assert api_error(completion_prompts, completion(prompt=bad)).param == "prompt"


def test_chat_params() -> None:
    p = chat_params(chat(max_tokens=5, max_completion_tokens=9, logprobs=True, top_logprobs=4,
                         response_format={"type": "text"}, tool_choice="none"))
    assert (p.max_tokens, p.logprobs) == (9, 4)
    p = chat_params(chat(logprobs=True))
    assert (p.max_tokens, p.logprobs, p.prompt_logprobs) == (None, 0, None)
    assert chat_params(chat(logprobs=False)).logprobs is None
    for body, param in [({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                        ({"max_completion_tokens": 0}, "max_completion_tokens"), ({"max_tokens": 0}, "max_tokens"),
                        ({"response_format": {"type": "json_object"}}, "response_format"),
                        ({"tools": [{"type": "function"}]}, "tools"), ({"tool_choice": "required"}, "tool_choice")]:
        assert api_error(chat_params, chat(**body)).param == param


def test_chat_messages() -> None:
    req = chat(messages=[{"role": "developer", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                         {"role": "assistant", "content": None}, {"role": "user", "content": "c", "name": "x"}])
    assert chat_messages(req) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"},
                                  {"role": "assistant", "content": ""}, {"role": "user", "content": "c"}]
    for messages, param in [([], "messages"), ([{"role": "robot", "content": "x"}], "messages[0].role"),
                            ([{"role": "tool", "content": "x"}], "messages[0].role"),
                            ([{"role": "user", "content": "x"}, {"role": "user", "content": None}],
                             "messages[1].content"),
                            ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
                             "messages[0].content[0].type")]:
        error = api_error(chat_messages, chat(messages=messages))
        assert (error.status, error.param) == (400, param)


@pytest.mark.parametrize("raw, kind, param", [
    (b'{"prompt": "x", "max_tokens": "9"}', CompletionRequest, "max_tokens"),
    (b'{"prompt": "x", "n": true}', CompletionRequest, "n"),
    (b'{"max_tokens": 3}', CompletionRequest, "prompt"),
    (b'{"messages": [{"content": "x"}]}', ChatCompletionRequest, "messages[0].role"),
    (b'{"messages": [{"role": "user", "content": 5}]}', ChatCompletionRequest, "messages[0].content"),
    (b'[1, 2]', CompletionRequest, None),
    (b'{"prompt": "x",', CompletionRequest, None),
])
def test_decode_errors_name_the_field(raw: bytes, kind: type, param: str | None) -> None:
    with pytest.raises(msgspec.DecodeError) as info:
        msgspec.json.decode(raw, type=kind)
    error = to_api_error(info.value)
    assert error is not None and (error.status, error.param) == (400, param)


def test_error_mapping() -> None:
    cases = [(InvalidRequestError("too long", "max_tokens"), 400, "invalid_request_error", "max_tokens"),
             (EngineOverloadedError("full"), 503, "server_error", None),
             (EngineClosedError("closed"), 503, "server_error", None)]
    for exc, status, kind, param in cases:
        error = to_api_error(exc)
        assert error is not None and (error.status, error.type, error.param) == (status, kind, param)
        body = json.loads(error.body())
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
    assert to_api_error(RuntimeError("bug")) is None


# ---------------------------------------------------------------------------- logprobs format

class ByteTokenizer:
    """Token i < 256 is byte i; 300 is `<|im_end|>`; `é` is two tokens (0xC3, 0xA9)."""

    def token_bytes(self, token_id: int) -> bytes:
        return b"<|im_end|>" if token_id == 300 else bytes([token_id])

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")


def test_token_text_marks_partial_utf8() -> None:
    texts = TokenText(ByteTokenizer())
    assert texts.text(0xC3) == "bytes:\\xc3" and texts.bytes(0xC3) == [0xC3]
    assert texts.text(300) == "<|im_end|>" and texts.text(ord("a")) == "a"


def test_completion_logprobs_format() -> None:
    texts = TokenText(ByteTokenizer())
    entries = [None, TokenLogprob(ord("b"), -0.25, [ord("c"), ord("d")], [-0.1, -math.inf]),
               TokenLogprob(300, -2.0, [], [])]
    lp, end = completion_logprobs(texts, [ord("a"), ord("b"), 300], entries, offset=5)
    assert lp.tokens == ["a", "b", "<|im_end|>"] and lp.text_offset == [5, 6, 7] and end == 17
    assert lp.token_logprobs == [None, -0.25, -2.0]
    assert lp.top_logprobs == [None, {"c": -0.1, "d": -9999.0, "b": -0.25}, {"<|im_end|>": -2.0}]
    json.loads(msgspec.json.encode(lp))  # finite numbers only: valid JSON


RENDERER = LogprobRenderer(np, VocabJSON.build(TokenText(ByteTokenizer()), 256))


def test_chat_logprobs_format() -> None:
    record = TokenLogprob(0xC3, -1.5, [0xC3, ord("x")], [-1.5, -2.5])
    (entry,) = json.loads(RENDERER.render_records([record]).json())
    assert entry == {"token": "bytes:\\xc3", "logprob": -1.5, "bytes": [0xC3],
                     "top_logprobs": [{"token": "bytes:\\xc3", "logprob": -1.5, "bytes": [0xC3]},
                                      {"token": "x", "logprob": -2.5, "bytes": [120]}]}


# ------------------------------------------------------------------------ responses over HTTP

class ScriptedEngine:
    """Choice c emits letters from `a` + c, one per step, `max_tokens` of them. Prompts `bad`,
    `full` and `crash` fail on the first iteration, `late` after the first output; `slow` takes
    20 ms a step."""

    def __init__(self) -> None:
        self.tokenizer = ByteTokenizer()
        self.model_name, self.max_model_len = "scripted", 64
        self.aborted: list[str] = []
        self.is_serving = True
        self.drafts_with_model = False

    def generate(self, prompt, params, request_id, speculation=None):  # noqa: ANN001, ANN201
        return scripted_stream(self._outputs(prompt, params, request_id), request_id, self.aborted.append)

    def chat(self, messages, params, request_id, speculation=None):  # noqa: ANN001, ANN201
        return self.generate(messages[-1]["content"], params, request_id)

    async def _outputs(self, prompt, params, request_id):  # noqa: ANN001, ANN202
        errors = {"bad": InvalidRequestError("prompt is bad", "prompt"), "full": EngineOverloadedError("full"),
                  "crash": RuntimeError("bug")}
        if isinstance(prompt, str) and prompt in errors:
            raise errors[prompt]
        ids = tuple(prompt.encode()) if isinstance(prompt, str) else tuple(prompt)
        prompt_lps = None
        if params.prompt_logprobs is not None:
            prompt_lps = (None, *(TokenLogprob(t, -3.0, [], []) for t in ids[1:]))
        for step in range(params.max_tokens):
            await asyncio.sleep(0.02 if prompt == "slow" else 0)
            last = step == params.max_tokens - 1
            deltas = []
            for c in range(params.n):
                token = ord("a") + (c + step) % 26
                lps = (TokenLogprob(token, -1.0, [token], [-1.0]),) if params.logprobs is not None else None
                if params.render_logprobs:
                    deltas.append(CompletionDelta(c, chr(token), (token,), None, "length" if last else None,
                                                  logprobs_json=RENDERER.render_records(lps)))
                else:
                    deltas.append(CompletionDelta(c, chr(token), (token,), lps, "length" if last else None))
            yield RequestOutput(request_id, ids, tuple(deltas), len(ids), (step + 1) * params.n, last,
                                prompt_lps if step == 0 else None)
            if prompt == "late":
                raise EngineClosedError("the engine failed")

    def metrics_text(self) -> str:
        return "# TYPE x counter\nx 1\n"


def with_client(test):  # noqa: ANN001, ANN201
    """Run `test(client, engine)` against the app on a test server."""
    async def main() -> None:
        engine = ScriptedEngine()
        async with TestClient(TestServer(create_app(engine))) as client:  # type: ignore[arg-type]
            await test(client, engine)
    asyncio.run(main())


def test_completions_choices_per_prompt_and_usage() -> None:
    async def test(client: TestClient, engine: ScriptedEngine) -> None:
        r = await client.post("/v1/completions", json={"prompt": ["ab", "cde"], "n": 2, "max_tokens": 3})
        body = await r.json()
        assert r.status == 200 and body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
            (0, "abc", "length"), (1, "bcd", "length"), (2, "abc", "length"), (3, "bcd", "length")]
        assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}
        assert body["model"] == "scripted" and engine.aborted == []
    with_client(test)


def test_completion_echo_with_logprobs() -> None:
    async def test(client: TestClient, engine: ScriptedEngine) -> None:
        r = await client.post("/v1/completions", json={"prompt": [104, 105], "max_tokens": 2, "echo": True,
                                                        "logprobs": 1})
        (choice,) = (await r.json())["choices"]
        assert choice["text"] == "hiab"
        assert choice["logprobs"] == {"tokens": ["h", "i", "a", "b"], "token_logprobs": [None, -3.0, -1.0, -1.0],
                                      "top_logprobs": [None, {"i": -3.0}, {"a": -1.0}, {"b": -1.0}],
                                      "text_offset": [0, 1, 2, 3]}
    with_client(test)


def test_stream_formats() -> None:
    async def test(client: TestClient, engine: ScriptedEngine) -> None:
        r = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": True})
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        events = sse_events(await r.text())
        assert {e["object"] for e in events} == {"chat.completion.chunk"} and len({e["id"] for e in events}) == 1
        assert [e["choices"][0]["delta"] for e in events[:2]] == [{"role": "assistant", "content": ""}] * 2
        content = [c for e in events[2:-1] for c in e["choices"]]
        assert "".join(c["delta"].get("content", "") for c in content if c["index"] == 1) == "bc"
        assert [c["finish_reason"] for c in content if c["index"] == 0] == [None, "length"]
        assert content[0]["logprobs"]["content"][0]["token"] == "a"
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True})
        events = sse_events(await r.text())
        assert "".join(e["choices"][0]["text"] for e in events) == "abc" and "usage" not in events[-1]
        r = await client.post("/v1/completions", json={"prompt": "late", "max_tokens": 3, "stream": True})
        events = sse_events(await r.text())
        assert r.status == 200 and events[0]["choices"][0]["text"] == "a"
        assert events[1] == {"error": {"message": "the engine failed", "type": "server_error", "param": None,
                                       "code": "engine_closed"}}
    with_client(test)


@pytest.mark.parametrize("version", ["1.0", "1.1"])
def test_a_stream_written_from_the_engine_step_is_framed_for_the_client_http_version(version: str) -> None:
    """HTTP/1.1 gets the events as chunks (chunked transfer encoding), HTTP/1.0 unframed until the
    connection closes; the events are the same."""
    async def test(client: TestClient, engine: ScriptedEngine) -> None:
        body = json.dumps({"prompt": "x", "max_tokens": 3, "stream": True}).encode()
        reader, writer = await asyncio.open_connection(client.host, client.port)
        writer.write(f"POST /v1/completions HTTP/{version}\r\nHost: test\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        raw = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        head, _, payload = raw.partition(b"\r\n\r\n")
        chunked = b"transfer-encoding: chunked" in head.lower()
        assert head.startswith(f"HTTP/{version} 200".encode()) and chunked == (version == "1.1")
        if chunked:
            text, rest = b"", payload
            while True:
                size, _, rest = rest.partition(b"\r\n")
                if int(size, 16) == 0:
                    break
                text, rest = text + rest[:int(size, 16)], rest[int(size, 16) + 2:]
            payload = text
        events = sse_events(payload.decode())
        assert "".join(e["choices"][0]["text"] for e in events) == "abc" and engine.aborted == []
    with_client(test)


def test_errors_over_http_and_server_keeps_serving() -> None:
    async def test(client: TestClient, engine: ScriptedEngine) -> None:
        cases = [("GET", "/nope", None, 404, "not_found_error"), ("GET", "/v1/completions", None, 405, None),
                 ("POST", "/v1/completions", b"{", 400, "invalid_request_error"),
                 ("POST", "/v1/completions", {"prompt": "bad", "stream": True}, 400, "invalid_request_error"),
                 ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "full"}]}, 503,
                  "server_error"),
                 ("POST", "/v1/completions", {"prompt": "crash"}, 500, "server_error"),
                 ("POST", "/v1/completions", {"prompt": "x", "model": "other"}, 404, "not_found_error")]
        for method, path, body, status, kind in cases:
            data = body if isinstance(body, bytes) else json.dumps(body) if body else None
            r = await client.request(method, path, data=data)
            error = (await r.json())["error"]
            assert r.status == status and r.content_type == "application/json", (path, body)
            assert error["message"] and (kind is None or error["type"] == kind)
            r = await client.get("/health")
            assert r.status == 200
        r = await client.get("/v1/chat/completions")
        assert r.headers["Allow"] == "POST"
        r = await client.get("/metrics")
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        models = await (await client.get("/v1/models")).json()
        assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["scripted"]
    with_client(test)


def test_overloaded_503_carries_retry_after_and_other_errors_do_not() -> None:
    async def test(client: TestClient, engine: ScriptedEngine) -> None:
        for path, body in [("/v1/completions", {"prompt": "full"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "full"}]})]:
            r = await client.post(path, json=body)
            assert r.status == 503 and (await r.json())["error"]["code"] == "overloaded"
            assert int(r.headers["Retry-After"]) >= 1
        for prompt in ("bad", "crash"):
            r = await client.post("/v1/completions", json={"prompt": prompt})
            assert r.status in (400, 500) and "Retry-After" not in r.headers
    with_client(test)


def test_client_disconnect_aborts_the_request() -> None:
    async def test(client: TestClient, engine: ScriptedEngine) -> None:
        r = await client.post("/v1/completions", json={"prompt": "slow", "max_tokens": 50, "stream": True})
        assert (await r.content.readline()).startswith(b"data: ")
        r.close()
        for _ in range(100):
            if engine.aborted:
                break
            await asyncio.sleep(0.01)
        assert len(engine.aborted) == 1 and engine.aborted[0].startswith("cmpl-")
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert (await r.json())["choices"][0]["text"] == "ab" and len(engine.aborted) == 1
    with_client(test)
