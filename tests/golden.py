"""Golden greedy outputs of the default model, pinned on the CPU (fp32) path."""

from __future__ import annotations

from cupyspec.config import EngineConfig
from cupyspec.engine import AsyncEngine
from cupyspec.sampling.params import SamplingParams

MAX_TOKENS = 24

# (user message, the greedy answer's first MAX_TOKENS tokens as text)
GOLDEN_PROMPTS: list[tuple[str, str]] = [
]


async def generate_greedy(model_path: str, device: str, prompts: list[str]) -> list[str]:
    """Greedy chat answers to each prompt, run concurrently on one engine."""
    engine = await AsyncEngine.create(EngineConfig(model=model_path, device=device))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

    async def answer(prompt: str) -> str:
        text = []
        async for out in engine.chat([{"role": "user", "content": prompt}], params):
            text += [d.text for d in out.deltas]
        return "".join(text)

    try:
        import asyncio

        return list(await asyncio.gather(*(answer(p) for p in prompts)))
    finally:
        await engine.shutdown()
