"""The official `openai` client against the server on a real socket (tiny model on the CPU)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from server_fixtures import LiveServer, tiny_server  # noqa: F401

openai = pytest.importorskip("openai")  # a test extra; absent on bare GPU hosts

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fox."}]


@pytest.fixture(scope="module")
def client(tiny_server: LiveServer) -> Iterator[openai.OpenAI]:  # noqa: F811
    with openai.OpenAI(base_url=tiny_server.base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    (card,) = client.models.list().data
    return card.id


def test_the_model_list_names_the_served_model_and_others_are_not_found(
        client: openai.OpenAI, model: str, tiny_server: LiveServer) -> None:  # noqa: F811
    assert model == tiny_server.model_name == "tiny-llama"
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_stream_matches_non_stream(client: openai.OpenAI, model: str) -> None:
    whole = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, **GREEDY)
    (choice,) = whole.choices
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_completion_stream_matches_non_stream(client: openai.OpenAI, model: str) -> None:
    whole = client.completions.create(model=model, prompt="The quick brown", max_tokens=10, **GREEDY)
    assert whole.object == "text_completion" and whole.usage.completion_tokens == 10
    stream = client.completions.create(model=model, prompt="The quick brown", max_tokens=10, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in stream) == whole.choices[0].text
    echoed = client.completions.create(model=model, prompt="The quick brown", max_tokens=10, echo=True, **GREEDY)
    assert echoed.choices[0].text == "The quick brown" + whole.choices[0].text


def test_chat_logprobs_list_the_top_tokens_in_order(client: openai.OpenAI, model: str) -> None:
    response = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, logprobs=True,
                                              top_logprobs=3, **GREEDY)
    content = response.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert abs(entry.logprob - entry.top_logprobs[0].logprob) < 1e-5  # greedy takes the most likely token
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token or entry.token.startswith("bytes:")
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_with_echo_cover_prompt_and_output(client: openai.OpenAI, model: str) -> None:
    response = client.completions.create(model=model, prompt="Hello world", max_tokens=4, logprobs=2, echo=True,
                                         **GREEDY)
    logprobs = response.choices[0].logprobs
    n_prompt = response.usage.prompt_tokens
    assert len(logprobs.tokens) == n_prompt + 4 == len(logprobs.token_logprobs) == len(logprobs.text_offset)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert all(2 <= len(top) <= 3 for top in logprobs.top_logprobs[1:])
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0


def test_n_choices_are_indexed_per_prompt_and_counted_in_usage(client: openai.OpenAI, model: str) -> None:
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, n=2, temperature=1.0,
                                          seed=1, extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 10
    completion = client.completions.create(model=model, prompt=["One", "Two"], max_tokens=3, n=2, **GREEDY)
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    texts = [c.text for c in completion.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: the choices of one prompt agree
    assert completion.usage.completion_tokens == 12


def test_errors_raise_client_exceptions(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=MESSAGES, temperature=-1)
    assert info.value.status_code == 400 and "temperature" in str(info.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", max_tokens=10_000, stream=True)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other-model", prompt="x")


def test_concurrent_greedy_streams_match_solo_runs(tiny_server: LiveServer, model: str) -> None:  # noqa: F811
    prompts = [f"Item {i}: the {'quick ' * (i % 5)}fox number {i * 7}" for i in range(32)]

    async def stream(client: openai.AsyncOpenAI, prompt: str) -> str:
        chunks = await client.completions.create(model=model, prompt=prompt, max_tokens=16, stream=True, **GREEDY)
        return "".join([c.choices[0].text async for c in chunks])

    async def main() -> tuple[list[str], list[str]]:
        async with openai.AsyncOpenAI(base_url=tiny_server.base_url + "/v1", api_key="unused",
                                      max_retries=0) as client:
            solo = [await stream(client, p) for p in prompts]
            together = await asyncio.gather(*(stream(client, p) for p in prompts))
        return solo, list(together)

    solo, together = asyncio.run(main())
    assert together == solo
    assert len(set(solo)) > 1  # the prompts do lead to different texts
