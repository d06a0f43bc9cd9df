"""`stream_interval`: a request's outputs every N tokens (the first and the last at once), the same
text, tokens and logprobs in fewer deliveries; in the engine, on the command line and over HTTP."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator

import aiohttp
import pytest
from server_fixtures import LiveServer, tiny_config, tiny_server  # noqa: F401
from tiny_models import tiny_model_paths

from cupyspec.config import CacheConfig, EngineConfig
from cupyspec.engine import AsyncEngine
from cupyspec.outputs import CompletionDelta, RequestOutput, merge_deltas
from cupyspec.sampling.params import SamplingParams
from cupyspec.server.cli import build_parser, engine_config, main
from cupyspec.spec_decode.speculative_config import SpeculativeConfig

PROMPT = [5, 17, 42, 9, 88, 3]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tiny_model_paths(tmp_path_factory.mktemp("stream-interval"), "llama")[1])


async def outputs_of(path: str, interval: int, params: SamplingParams,
                     speculative: SpeculativeConfig | None = None, prompt: list[int] = PROMPT) -> list[RequestOutput]:
    engine = await AsyncEngine.create(EngineConfig(model=path, device="cpu", cache=CacheConfig(block_size=4),
                                                   stream_interval=interval,
                                                   speculative=speculative or SpeculativeConfig()))
    try:
        return [out async for out in engine.generate(prompt, params)]
    finally:
        await engine.shutdown()


def per_choice(outputs: list[RequestOutput]) -> dict[int, tuple]:
    """Each choice's whole text, tokens, logprobs and finish, joined over the outputs."""
    joined = {}
    for index in {d.index for out in outputs for d in out.deltas}:
        d = CompletionDelta.concat([d for out in outputs for d in out.deltas if d.index == index])
        joined[index] = (d.text, d.token_ids, d.logprobs, d.finish_reason)
    return joined


def token_counts(outputs: list[RequestOutput]) -> list[int]:
    return [sum(len(d.token_ids) for d in out.deltas) for out in outputs]


def test_outputs_come_every_interval_tokens_with_the_same_content(tiny_gguf: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True, logprobs=2)
    every, grouped = (asyncio.run(outputs_of(tiny_gguf, n, params)) for n in (1, 4))
    assert token_counts(every) == [1] * 11
    assert token_counts(grouped) == [1, 4, 4, 2]  # the first token at once, then every 4, the end at once
    assert [out.finished for out in grouped] == [False, False, False, True]
    assert all(len(out.deltas) == 1 for out in grouped)
    assert per_choice(grouped) == per_choice(every)
    assert [out.num_output_tokens for out in grouped] == [1, 5, 9, 11]


def test_choices_and_speculation_keep_their_content(tiny_gguf: str) -> None:
    params = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=14, ignore_eos=True, logprobs=1)
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3, verify_strategy="target_match")
    prompt = PROMPT * 4  # repeats: ngram drafts, some accepted
    every = asyncio.run(outputs_of(tiny_gguf, 1, params, ngram, prompt))
    grouped = asyncio.run(outputs_of(tiny_gguf, 6, params, ngram, prompt))
    assert per_choice(grouped) == per_choice(every)
    assert len(grouped) < len(every)
    assert all(len({d.index for d in out.deltas}) == len(out.deltas) for out in grouped)  # one delta per choice
    assert grouped[-1].speculate_metrics is not None and grouped[-1].speculate_metrics.num_steps > 0


def test_a_stop_string_ends_the_stream_at_once(tiny_gguf: str) -> None:
    probe = asyncio.run(outputs_of(tiny_gguf, 1, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)))
    text = "".join(d.text for out in probe for d in out.deltas)
    stop = text[len(text) // 2:][:2]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=(stop,))
    every, grouped = (asyncio.run(outputs_of(tiny_gguf, n, params)) for n in (1, 100))
    assert len(grouped) == 2 and grouped[-1].finished  # the first token, then everything up to the stop
    assert per_choice(grouped) == per_choice(every)
    assert per_choice(grouped)[0][3] == "stop"


def test_an_abort_delivers_what_was_held_back(tiny_gguf: str) -> None:
    async def main() -> list[RequestOutput]:
        engine = await AsyncEngine.create(EngineConfig(model=tiny_gguf, device="cpu", stream_interval=1000))
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        outputs = []
        try:
            async for out in engine.generate(PROMPT, params, request_id="r"):
                outputs.append(out)
                if len(outputs) == 1:  # the first token came at once; let a few more be held back
                    while engine.outputs.requests["r"].num_output_tokens < 5:
                        await asyncio.sleep(0.001)
                    await engine.abort("r")
        finally:
            await engine.shutdown()
        return outputs

    outputs = asyncio.run(main())
    assert len(outputs) == 2 and outputs[1].finished
    assert outputs[1].deltas[0].finish_reason == "abort" and len(outputs[1].deltas[0].token_ids) >= 4
    assert outputs[1].num_output_tokens == 1 + len(outputs[1].deltas[0].token_ids)


def test_merge_deltas_joins_each_choice_in_order() -> None:
    a1, b1 = CompletionDelta(0, "a", (1,), None), CompletionDelta(1, "x", (7,), None)
    a2 = CompletionDelta(0, "b", (2, 3), None, "length")
    assert merge_deltas([a1]) == (a1,)
    assert merge_deltas([a1, b1]) == (a1, b1)
    assert merge_deltas([a1, b1, a2]) == (CompletionDelta(0, "ab", (1, 2, 3), None, "length"), b1)


def test_the_interval_is_validated_and_taken_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert engine_config(build_parser().parse_args(["--stream-interval", "8"])).stream_interval == 8
    assert engine_config(build_parser().parse_args([])).stream_interval == 1
    with pytest.raises(ValueError, match="stream_interval must be an integer >= 1"):
        EngineConfig(stream_interval=0)
    with pytest.raises(SystemExit) as info:
        main(["--stream-interval", "0"])
    assert info.value.code == 2 and "stream_interval must be an integer >= 1" in capsys.readouterr().err


@pytest.fixture(scope="module")
def grouped_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    config = dataclasses.replace(tiny_config(tmp_path_factory.mktemp("tiny-model")), stream_interval=5)
    with LiveServer(config) as server:
        yield server


async def stream_chunks(server: LiveServer) -> list[dict]:
    body = {"prompt": "hello", "max_tokens": 20, "ignore_eos": True, "temperature": 0, "stream": True}
    async with aiohttp.ClientSession(base_url=server.base_url) as session:
        async with session.post("/v1/completions", json=body) as response:
            lines = [line async for line in response.content if line.startswith(b"data: {")]
    return [json.loads(line[len(b"data: "):]) for line in lines]


def test_a_stream_sends_fewer_chunks_with_the_same_text(tiny_server: LiveServer,  # noqa: F811
                                                        grouped_server: LiveServer) -> None:
    every, grouped = (asyncio.run(stream_chunks(s)) for s in (tiny_server, grouped_server))
    assert len(every) == 20 and len(grouped) == 5  # tokens 1, 2-6, 7-11, 12-16, 17-20 and the finish
    assert "".join(c["choices"][0]["text"] for c in grouped) == "".join(c["choices"][0]["text"] for c in every)
    assert grouped[-1]["choices"][0]["finish_reason"] == every[-1]["choices"][0]["finish_reason"] == "length"
