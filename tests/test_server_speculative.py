"""Per-request speculation over HTTP: the `speculative` body field, `speculate_metrics` in responses
and stream chunks and their Prometheus counters, and logprobs equal to those without speculation, with
the real engine (tiny model, ngram drafts) on the CPU."""

from __future__ import annotations

import dataclasses
import urllib.request
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from server_fixtures import LiveServer, tiny_config, tiny_server  # noqa: F401

from cupyspec.outputs import RequestOutput, SpeculateMetrics
from cupyspec.server.speculation import SpeculateMetricsSum
from cupyspec.spec_decode.speculative_config import SpeculativeConfig

openai = pytest.importorskip("openai")  # a test extra; absent on bare GPU hosts

K = 3  # the server's num_speculative_tokens
GREEDY: dict[str, Any] = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
REPEATING = "one two three four five six " * 6  # ngram drafts continue it
# Prompts after which the tiny model's greedy output repeats itself: drafts get accepted at every position.
ACCEPTING_PROMPTS: list[str | list[int]] = [[5] * 20, "The quick brown fox. " * 5]
MESSAGES = [{"role": "user", "content": REPEATING}]
# Text prompts and chat messages whose first 40 greedy tokens accept drafts at every position.
ACCEPTING_TEXTS = ["1 2 3 1 2 3 1 2 3", "Hello " * 10]
ACCEPTING_MESSAGES = [{"role": "user", "content": "The quick brown fox. " * 5}]
METRIC_KEYS = {"num_steps", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens", "acceptance_rate",
               "mean_acceptance_length", "accepted_per_position"}


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    config = dataclasses.replace(tiny_config(tmp_path_factory.mktemp("tiny-model")),
                                 speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=K,
                                                                 cost_aware_backoff=False))
    with LiveServer(config) as server:
        yield server


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


SPEC_COUNTERS = {key: f"cupyspec:spec_decode_{key}_total"
                 for key in ("num_steps", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens")}


def scrape(server: LiveServer) -> dict[str, float]:
    """The samples of `GET /metrics`, by name with labels."""
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return {name: float(value) for name, value in
            (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))}


def test_prometheus_counters_add_up_the_responses_metrics(client: openai.OpenAI, spec_server: LiveServer) -> None:
    before = scrape(spec_server)
    chat = client.chat.completions.create(model="tiny-llama", messages=ACCEPTING_MESSAGES, max_tokens=40, **GREEDY)
    completion = client.completions.create(model="tiny-llama", prompt=ACCEPTING_TEXTS, max_tokens=40, **GREEDY)
    stream = stream_chunks(client, "completions", False, prompt=REPEATING, max_tokens=20)
    fewer = client.completions.create(model="tiny-llama", prompt=REPEATING, max_tokens=20, **with_speculative(1))
    responses = [metrics_of(r) for r in (chat, completion, stream[-1], fewer)]
    after = scrape(spec_server)

    def added(sample: str) -> float:
        return after[sample] - before.get(sample, 0.0)

    label = 'model_name="tiny-llama"'
    for key, name in SPEC_COUNTERS.items():
        assert added(f"{name}{{{label}}}") == sum(m[key] for m in responses), key
    per_position = [sum(m["accepted_per_position"][j] for m in responses if j < len(m["accepted_per_position"]))
                    for j in range(K)]
    name = "cupyspec:spec_decode_num_accepted_tokens_per_pos_total"
    assert [added(f'{name}{{{label},position="{j}"}}') for j in range(K)] == per_position
    assert per_position[K - 1] > 0 and added(f"{SPEC_COUNTERS['num_steps']}{{{label}}}") > 0


def chat_entries(logprobs: dict[str, Any]) -> list[tuple[Any, ...]]:
    """(token, bytes, logprob, [(token, bytes, logprob) of the top alternatives]) per emitted token."""
    return [(e["token"], e["bytes"], e["logprob"], [(t["token"], t["bytes"], t["logprob"]) for t in e["top_logprobs"]])
            for e in logprobs["content"]]


def completion_entries(logprobs: dict[str, Any]) -> list[tuple[Any, ...]]:
    """(token, text offset, logprob, [(token, logprob) of the top alternatives]) per emitted token."""
    return [(token, offset, logprob, list(top.items())) for token, offset, logprob, top in
            zip(logprobs["tokens"], logprobs["text_offset"], logprobs["token_logprobs"], logprobs["top_logprobs"],
                strict=True)]


def logprobs_by_choice(c: openai.OpenAI, endpoint: str, stream: bool) -> tuple[list[list[tuple[Any, ...]]], Any]:
    """Each choice's logprob entries, concatenated over the stream's chunks; and the response or last chunk."""
    if endpoint == "chat":
        body: dict[str, Any] = {"messages": ACCEPTING_MESSAGES, "logprobs": True, "top_logprobs": 5}
        create, entries = c.chat.completions.create, chat_entries
    else:
        body = {"prompt": ACCEPTING_TEXTS, "logprobs": 5}
        create, entries = c.completions.create, completion_entries
    result = create(model="tiny-llama", max_tokens=40, stream=stream, **body, **GREEDY)
    chunks = list(result) if stream else [result]
    by_choice: dict[int, list[tuple[Any, ...]]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            logprobs = choice.model_dump()["logprobs"]
            by_choice.setdefault(choice.index, []).extend(entries(logprobs) if logprobs else [])
    return [by_choice[i] for i in sorted(by_choice)], chunks[-1]


def assert_same_entries(want: Any, got: Any, where: str = "") -> None:
    """Equal tokens, offsets and ranks; floats within 1e-4."""
    if isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-4), where
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, type(want)) and len(got) == len(want), where
        for i, (w, g) in enumerate(zip(want, got)):
            assert_same_entries(w, g, f"{where}[{i}]")
    else:
        assert got == want, where


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_logprobs_equal_those_of_a_server_without_speculation(
        client: openai.OpenAI, tiny_server: LiveServer, endpoint: str, stream: bool) -> None:  # noqa: F811
    with openai_client(tiny_server) as plain:
        want, _ = logprobs_by_choice(plain, endpoint, stream)
    got, last = logprobs_by_choice(client, endpoint, stream)
    assert len(want) == (1 if endpoint == "chat" else len(ACCEPTING_TEXTS))
    assert all(len(entries) == 40 and all(len(e[3]) >= 5 for e in entries) for entries in want)
    assert_same_entries(want, got)
    assert metrics_of(last)["accepted_per_position"][K - 1] > 0  # whole runs of drafts and bonus tokens


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
