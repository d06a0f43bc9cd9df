"""The step loop: requests in, outputs out; each step schedules, runs the model, and processes its outputs."""

from cupyspec.engine.async_engine import AsyncEngine, EngineStats

__all__ = ["AsyncEngine", "EngineStats"]
