"""Per-request speculation over HTTP: the `speculative` body field and `speculate_metrics` in
responses and stream chunks, with the real engine (tiny model, ngram drafts) on the CPU."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from server_fixtures import LiveServer, tiny_config, tiny_server  # noqa: F401

from cupyspec.outputs import RequestOutput, SpeculateMetrics
from cupyspec.server.speculation import SpeculateMetricsSum
from cupyspec.speculative_config import SpeculativeConfig

openai = pytest.importorskip("openai")  # a test extra; absent on bare GPU hosts

K = 3  # the server's num_speculative_tokens
GREEDY: dict[str, Any] = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
REPEATING = "one two three four five six " * 6  # ngram drafts continue it
# Prompts after which the tiny model's greedy output repeats itself: drafts get accepted at every position.
ACCEPTING_PROMPTS: list[str | list[int]] = [[5] * 20, "The quick brown fox. " * 5]
MESSAGES = [{"role": "user", "content": REPEATING}]
METRIC_KEYS = {"num_steps", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens", "acceptance_rate",
               "mean_acceptance_length", "accepted_per_position"}


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    config = dataclasses.replace(tiny_config(tmp_path_factory.mktemp("tiny-model")),
                                 speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=K))
    server = LiveServer(config).start()
    try:
        yield server
    finally:
        server.stop()


def openai_client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def client(spec_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai_client(spec_server) as c:
        yield c


def with_speculative(num_speculative_tokens: Any) -> dict[str, Any]:
    return {**GREEDY, "extra_body": {**GREEDY["extra_body"],
                                     "speculative": {"num_speculative_tokens": num_speculative_tokens}}}


def metrics_of(response: Any) -> dict[str, Any]:
    """The `speculate_metrics` the openai client kept among a response's unknown fields."""
    metrics = (response.model_extra or {}).get("speculate_metrics")
    assert metrics is not None, response
    return metrics


def check_metrics(m: dict[str, Any], completion_tokens: int, num_choices: int = 1) -> None:
    """Counts and rates agree with each other and with the response's usage."""
    assert set(m) == METRIC_KEYS
    assert 0 <= m["num_accepted_tokens"] <= m["num_draft_tokens"]
    per_position = m["accepted_per_position"]
    assert len(per_position) <= K and sum(per_position) == m["num_accepted_tokens"]
    assert per_position == sorted(per_position, reverse=True)  # draft j counts only after drafts < j
    assert 0.0 <= m["acceptance_rate"] <= 1.0
    if m["num_draft_tokens"]:
        assert m["acceptance_rate"] == pytest.approx(m["num_accepted_tokens"] / m["num_draft_tokens"])
    # the first token of each choice comes from the prefill; each decode step emits 1..K+1 tokens
    assert m["num_emitted_tokens"] == completion_tokens - num_choices
    assert m["num_emitted_tokens"] == m["num_accepted_tokens"] + m["num_steps"]
    assert 1.0 <= m["mean_acceptance_length"] <= K + 1
    assert m["mean_acceptance_length"] == pytest.approx(m["num_emitted_tokens"] / m["num_steps"])


def test_non_streaming_responses_carry_metrics(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=30, **GREEDY)
    check_metrics(metrics_of(chat), chat.usage.completion_tokens)
    assert chat.choices[0].finish_reason == "length"
    completion = client.completions.create(model="tiny-llama", prompt=REPEATING, max_tokens=30, n=2, **GREEDY)
    check_metrics(metrics_of(completion), completion.usage.completion_tokens, num_choices=2)


@pytest.mark.parametrize("prompt", ACCEPTING_PROMPTS)
def test_greedy_text_is_the_same_without_speculation(client: openai.OpenAI, prompt: str | list[int]) -> None:
    on = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=80, **GREEDY)
    off = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=80, **with_speculative(0))
    assert on.choices[0].text == off.choices[0].text
    assert metrics_of(on)["accepted_per_position"][K - 1] > 0  # whole runs of drafts were accepted
    m = metrics_of(off)
    assert (m["num_draft_tokens"], m["num_accepted_tokens"], sum(m["accepted_per_position"])) == (0, 0, 0)
    assert m["num_steps"] == 79 and m["mean_acceptance_length"] == 1.0


def test_fewer_drafts_on_request(client: openai.OpenAI) -> None:
    fewer = client.completions.create(model="tiny-llama", prompt=ACCEPTING_PROMPTS[0], max_tokens=40,
                                      **with_speculative(1))
    m = metrics_of(fewer)
    check_metrics(m, fewer.usage.completion_tokens)
    assert m["accepted_per_position"] == [m["num_accepted_tokens"]] and m["num_accepted_tokens"] > 0
    assert m["num_draft_tokens"] <= m["num_steps"]  # one draft a step at most


def test_metrics_of_several_prompts_are_summed(client: openai.OpenAI) -> None:
    prompts = [REPEATING, "The quick brown fox. " * 5, "a a a a a a a a"]
    alone = [metrics_of(client.completions.create(model="tiny-llama", prompt=p, max_tokens=20, **GREEDY))
             for p in prompts]
    together = client.completions.create(model="tiny-llama", prompt=prompts, max_tokens=20, **GREEDY)
    m = metrics_of(together)
    check_metrics(m, together.usage.completion_tokens, num_choices=len(prompts))
    for key in ("num_steps", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens"):
        assert m[key] == sum(a[key] for a in alone), key
    padded = [a["accepted_per_position"] + [0] * (K - len(a["accepted_per_position"])) for a in alone]
    longest = max(len(a["accepted_per_position"]) for a in alone)
    assert m["accepted_per_position"] == [sum(counts) for counts in zip(*padded)][:longest]


def stream_chunks(client: openai.OpenAI, endpoint: str, include_usage: bool, **body: Any) -> list[Any]:
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    create = client.chat.completions.create if endpoint == "chat" else client.completions.create
    return list(create(model="tiny-llama", stream=True, **options, **body, **GREEDY))


@pytest.mark.parametrize("endpoint, include_usage", [("chat", True), ("chat", False), ("completions", True),
                                                     ("completions", False)])
def test_last_stream_chunk_carries_metrics(client: openai.OpenAI, endpoint: str, include_usage: bool) -> None:
    body: dict[str, Any] = ({"messages": MESSAGES} if endpoint == "chat" else {"prompt": [REPEATING, "Hello"]})
    chunks = stream_chunks(client, endpoint, include_usage, max_tokens=16, **body)
    carrying = [i for i, c in enumerate(chunks) if "speculate_metrics" in (c.model_extra or {})]
    assert carrying == [len(chunks) - 1]
    last = chunks[-1]
    num_choices = 1 if endpoint == "chat" else 2
    if include_usage:
        assert last.choices == [] and last.usage.completion_tokens == 16 * num_choices
    else:
        assert last.choices[0].finish_reason == "length" and last.usage is None
    check_metrics(metrics_of(last), 16 * num_choices, num_choices)


@pytest.mark.parametrize("speculative, param", [
    ({"num_speculative_tokens": K + 1}, "speculative.num_speculative_tokens"),  # above the server's setting
    ({"num_speculative_tokens": -1}, "speculative.num_speculative_tokens"),
    ({"num_speculative_tokens": "2"}, "speculative.num_speculative_tokens"),
    ({"num_speculative_tokens": True}, "speculative.num_speculative_tokens"),
    ({"num_speculative_tokens": 1.5}, "speculative.num_speculative_tokens"),
    ({"num_draft_tokens": 2}, "speculative.num_draft_tokens"),
    (2, "speculative"),
])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_bad_speculative_field_is_a_400(client: openai.OpenAI, spec_server: LiveServer, endpoint: str,
                                        speculative: Any, param: str) -> None:
    create = client.chat.completions.create if endpoint == "chat" else client.completions.create
    body = {"messages": MESSAGES} if endpoint == "chat" else {"prompt": REPEATING}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            create(model="tiny-llama", max_tokens=4, stream=stream, extra_body={"speculative": speculative}, **body)
        assert info.value.status_code == 400 and info.value.param == param
        assert param.split(".")[-1] in info.value.message
    assert spec_server.wait_idle().num_used_kv_blocks == 0


def test_server_without_speculation_adds_no_field(tiny_server: LiveServer) -> None:  # noqa: F811
    with openai_client(tiny_server) as plain:
        chat = plain.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=5, **GREEDY)
        assert "speculate_metrics" not in (chat.model_extra or {})
        completion = plain.completions.create(model="tiny-llama", prompt=["a", "b"], max_tokens=5,
                                              **with_speculative(0))
        assert "speculate_metrics" not in (completion.model_extra or {}) and len(completion.choices) == 2
        chunks = stream_chunks(plain, "chat", True, messages=MESSAGES, max_tokens=5)
        assert all("speculate_metrics" not in (c.model_extra or {}) for c in chunks) and chunks[-1].usage
        with pytest.raises(openai.BadRequestError) as info:
            plain.completions.create(model="tiny-llama", prompt="a", max_tokens=5, **with_speculative(1))
        assert info.value.param == "speculative.num_speculative_tokens"


def engine_output(metrics: SpeculateMetrics | None, finished: bool = True) -> RequestOutput:
    return RequestOutput("r", (1,), (), 1, 1, finished, speculate_metrics=metrics)


def test_metrics_sum_adds_counts_and_recomputes_rates() -> None:
    total = SpeculateMetricsSum(3)
    total.update(engine_output(None, finished=False))
    assert total.result() is None and not total.complete
    total.update(engine_output(SpeculateMetrics(4, 8, 6, 10, 0.75, 2.5, (4, 2))))
    total.update(engine_output(SpeculateMetrics(2, 6, 0, 2, 0.0, 1.0, (0, 0, 0))))
    assert not total.complete
    total.update(engine_output(SpeculateMetrics(5, 0, 0, 5, 0.0, 1.0, ())))
    assert total.complete
    assert msgspec.to_builtins(total.result()) == {
        "num_steps": 11, "num_draft_tokens": 14, "num_accepted_tokens": 6, "num_emitted_tokens": 17,
        "acceptance_rate": 6 / 14, "mean_acceptance_length": 17 / 11, "accepted_per_position": [4, 2, 0]}
