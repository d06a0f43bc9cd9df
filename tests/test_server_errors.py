"""Hostile and malformed request bodies over HTTP (tiny model on the CPU): invalid UTF-8, deep nesting,
stop token ids outside the vocabulary or of the wrong type, and the 503 of a full queue with its
Retry-After. Each is answered with an OpenAI error body, and the server keeps serving."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from server_fixtures import TINY_MAX_WAITING, LiveServer, tiny_server  # noqa: F401

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = [COMPLETIONS, CHAT]
DEEP = 1000  # nesting levels of the deep bodies


def post(server: LiveServer, path: str, raw: bytes) -> tuple[int, dict[str, str], str]:
    """(status, headers, body text) of one POST."""
    request = urllib.request.Request(server.base_url + path, data=raw, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read().decode()


def body_for(path: str, **fields: object) -> dict[str, object]:
    """A short request to `path` with these fields added."""
    base: dict[str, object] = ({"prompt": "hi"} if path == COMPLETIONS
                               else {"messages": [{"role": "user", "content": "hi"}]})
    return {**base, "max_tokens": 2, **fields}


def assert_error(status: int, headers: dict[str, str], text: str, expected_status: int,
                 param: str | None) -> dict[str, object]:
    assert status == expected_status and headers["Content-Type"].startswith("application/json"), text
    body = json.loads(text)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert error["message"] and error["param"] == param
    assert error["type"] == ("invalid_request_error" if expected_status == 400 else "server_error")
    return error


def assert_still_serving(server: LiveServer) -> None:
    status, _, text = post(server, COMPLETIONS, json.dumps(
        {"prompt": "hi", "max_tokens": 2, "ignore_eos": True}).encode())
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 2
    assert server.wait_idle().num_used_kv_blocks == 0


def with_raw_field(path: str, name: str, raw_value: bytes) -> bytes:
    """A request body whose field `name` holds `raw_value` verbatim (bytes no JSON encoder writes)."""
    head = json.dumps(body_for(path)).encode()[:-1]
    return head + b', "' + name.encode() + b'": ' + raw_value + b"}"


@pytest.mark.parametrize("path, field", [(COMPLETIONS, "prompt"), (COMPLETIONS, "stop"), (CHAT, "user"),
                                         (CHAT, "stop")])
def test_invalid_utf8_in_a_string_is_a_400(tiny_server: LiveServer, path: str, field: str) -> None:  # noqa: F811
    status, headers, text = post(tiny_server, path, with_raw_field(path, field, b'"\xff\xfe"'))
    error = assert_error(status, headers, text, 400, None)
    assert "UTF-8" in str(error["message"]) and error["code"] == "invalid_json"
    assert_still_serving(tiny_server)


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize("opening, closing", [(b"[", b"]"), (b'{"a": ', b"}")])
def test_deeply_nested_unknown_field_is_a_400(tiny_server: LiveServer, path: str,  # noqa: F811
                                              opening: bytes, closing: bytes) -> None:
    raw = with_raw_field(path, "junk", opening * DEEP + b"1" + closing * DEEP)
    error = assert_error(*post(tiny_server, path, raw), 400, None)
    assert "nests" in str(error["message"]) and error["code"] == "invalid_json"
    assert_still_serving(tiny_server)


def test_deeply_nested_any_typed_field_is_a_400(tiny_server: LiveServer) -> None:  # noqa: F811
    raw = with_raw_field(CHAT, "tool_choice", b"[" * DEEP + b"]" * DEEP)
    assert_error(*post(tiny_server, CHAT, raw), 400, None)
    assert_still_serving(tiny_server)


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("outside", ["negative", "vocab_size"])
def test_stop_token_ids_outside_the_vocabulary_are_a_400(tiny_server: LiveServer, path: str,  # noqa: F811
                                                         stream: bool, outside: str) -> None:
    token_id = -1 if outside == "negative" else tiny_server.engine.model_config.vocab_size
    raw = json.dumps(body_for(path, stop_token_ids=[token_id], stream=stream)).encode()
    error = assert_error(*post(tiny_server, path, raw), 400, "stop_token_ids")
    assert str(token_id) in str(error["message"])
    assert_still_serving(tiny_server)


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize("value", ["a", 1.5, True, None, [1]])
def test_stop_token_ids_of_the_wrong_type_are_a_400(tiny_server: LiveServer, path: str,  # noqa: F811
                                                    value: object) -> None:
    raw = json.dumps(body_for(path, stop_token_ids=[value])).encode()
    assert_error(*post(tiny_server, path, raw), 400, "stop_token_ids[0]")
    assert_still_serving(tiny_server)


def test_stop_token_ids_inside_the_vocabulary_are_served(tiny_server: LiveServer) -> None:  # noqa: F811
    last = tiny_server.engine.model_config.vocab_size - 1
    for path in ENDPOINTS:
        status, _, text = post(tiny_server, path, json.dumps(body_for(path, stop_token_ids=[0, last])).encode())
        assert status == 200, text


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize("stream", [False, True])
def test_full_queue_503_carries_retry_after(tiny_server: LiveServer, path: str, stream: bool) -> None:  # noqa: F811
    raw = json.dumps(body_for(path, n=TINY_MAX_WAITING + 1, stream=stream)).encode()
    status, headers, text = post(tiny_server, path, raw)
    error = assert_error(status, headers, text, 503, None)
    assert error["code"] == "overloaded" and int(headers["Retry-After"]) >= 1
    assert_still_serving(tiny_server)
