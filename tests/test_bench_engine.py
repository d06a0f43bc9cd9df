"""tools/bench_engine.py: the decode figure counts only the tokens that arrive once every request
has its first token, over the time after that."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import bench_engine


class ScriptedEngine:
    """Each request's outputs arrive at the times of its script, a token each."""

    model_config = SimpleNamespace(vocab_size=1000)

    def __init__(self, clock: list[float], scripts: list[list[float]]) -> None:
        self.clock, self.scripts = clock, iter(scripts)

    async def generate(self, prompt, params):
        for arrival in next(self.scripts):
            self.clock[0] = arrival
            yield SimpleNamespace(deltas=[SimpleNamespace(token_ids=[7])])


def test_decode_counts_the_tokens_after_the_last_first_token(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(bench_engine.time, "perf_counter", lambda: clock[0])
    # request 0 decodes twice (at 2 and 3) while request 1 still waits for its first token (at 3.5)
    engine = ScriptedEngine(clock, [[1.0, 2.0, 3.0, 4.0, 5.0], [3.5, 4.5, 5.5]])
    report = asyncio.run(bench_engine.run_batch(engine, batch=2, prompt_len=4, gen_len=5, seed=0))
    assert report["generated"] == 8
    assert report["prefill_s"] == 3.5
    assert report["decode_tok_per_s"] == 4 / (5.5 - 3.5)  # 4.0, 5.0, 4.5 and 5.5
    assert report["total_tok_per_s"] == 8 / 5.5
