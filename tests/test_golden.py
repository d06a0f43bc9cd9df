"""The default model's greedy answers on the CPU, pinned."""

from __future__ import annotations

import asyncio

from golden import GOLDEN_PROMPTS, generate_greedy


def test_default_model_greedy_golden_outputs(default_model_path):
    outputs = asyncio.run(generate_greedy(default_model_path, "cpu", [p for p, _ in GOLDEN_PROMPTS]))
    assert "Paris" in outputs[0]
    for (prompt, expected), got in zip(GOLDEN_PROMPTS, outputs):
        assert got == expected, prompt
