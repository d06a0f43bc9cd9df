"""Golden greedy outputs of the default model, pinned on the CPU (fp32) path."""

from __future__ import annotations

import asyncio

from cupyspec.config import EngineConfig
from cupyspec.engine import AsyncEngine
from cupyspec.sampling.params import SamplingParams

MAX_TOKENS = 24

# (user message, the greedy answer's first MAX_TOKENS tokens as text)
GOLDEN_PROMPTS: list[tuple[str, str]] = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Write a haiku about the sea.",
     "The waves of the sea, a silent beauty,\nA gentle lapping of the shore,\nA reminder of the"),
    ("List three primary colors.", "The primary colors are:\n\nRed: YELLOW\nBlue: WHITE"),
    ("Explain what a CPU does in one sentence.",
     "The CPU (Central Processing Unit) is the brain of a computer that executes instructions and performs "
     "calculations."),
    ("Translate 'good morning' into Spanish.", "Hoy, buen hora!"),
]


async def generate_greedy(model_path: str, device: str, prompts: list[str],
                          quantization: str | None = None) -> list[str]:
    """Greedy chat answers to each prompt, run concurrently on one engine."""
    engine = await AsyncEngine.create(EngineConfig(model=model_path, device=device, quantization=quantization))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

    async def answer(prompt: str) -> str:
        text = []
        async for out in engine.chat([{"role": "user", "content": prompt}], params):
            text += [d.text for d in out.deltas]
        return "".join(text)

    try:
        return list(await asyncio.gather(*(answer(p) for p in prompts)))
    finally:
        await engine.shutdown()
