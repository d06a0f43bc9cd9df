"""Prometheus metrics of the engine, rendered in the text exposition format (no dependency)."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from cupyspec.outputs import SpeculateMetrics

PREFIX = "cupyspec:"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 10.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0)


class StatsLike(Protocol):
    """What `EngineMetrics.render` reads (an `EngineStats`)."""

    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_used_kv_blocks: int


def format_value(value: float) -> str:
    """A sample value as Prometheus writes it: integers without a fraction, +Inf/-Inf/NaN spelled out."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def format_labels(labels: Sequence[tuple[str, str]]) -> str:
    """`{a="x",b="y"}` with values escaped; empty when there are no labels."""
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _header(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


class Counter:
    """A monotonically increasing count, optionally split by the value of one label."""

    def __init__(self, name: str, help_text: str, label: str | None = None) -> None:
        self.name, self.help_text, self.label = name, help_text, label
        self._values: dict[str, float] = {} if label else {"": 0.0}

    def inc(self, amount: float = 1.0, label_value: str = "") -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter cannot decrease (amount={amount})")
        self._values[label_value] = self._values.get(label_value, 0.0) + amount

    def value(self, label_value: str = "") -> float:
        return self._values.get(label_value, 0.0)

    def render(self, const_labels: Sequence[tuple[str, str]]) -> list[str]:
        lines = _header(self.name, "counter", self.help_text)
        for label_value, value in sorted(self._values.items()):
            labels = [*const_labels, (self.label, label_value)] if self.label else list(const_labels)
            lines.append(f"{self.name}{format_labels(labels)} {format_value(value)}")
        return lines


class Histogram:
    """Observations counted into cumulative buckets, with their sum and count."""

    def __init__(self, name: str, help_text: str, buckets: Iterable[float]) -> None:
        self.name, self.help_text = name, help_text
        self.buckets = tuple(sorted(float(b) for b in buckets))
        if not self.buckets or len(set(self.buckets)) != len(self.buckets):
            raise ValueError(f"{name}: buckets must be non-empty and distinct")
        self._counts = [0] * (len(self.buckets) + 1)  # last: above every bound (+Inf only)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self.buckets, value)] += 1  # `le` is inclusive
        self.sum += value
        self.count += 1

    def render(self, const_labels: Sequence[tuple[str, str]]) -> list[str]:
        lines = _header(self.name, "histogram", self.help_text)
        cumulative = 0
        for bound, count in zip((*self.buckets, math.inf), self._counts, strict=True):
            cumulative += count
            labels = format_labels([*const_labels, ("le", format_value(bound))])
            lines.append(f"{self.name}_bucket{labels} {cumulative}")
        plain = format_labels(const_labels)
        lines.append(f"{self.name}_sum{plain} {format_value(self.sum)}")
        lines.append(f"{self.name}_count{plain} {self.count}")
        return lines


class EngineMetrics:
    """The engine's counters and latency histograms; `render` adds the load gauges of a stats snapshot."""

    def __init__(self, model_name: str | None = None) -> None:
        self.const_labels: tuple[tuple[str, str], ...] = (("model_name", model_name),) if model_name else ()
        self.requests_arrived = Counter(f"{PREFIX}requests_arrived_total", "Number of requests received.")
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens_total", "Number of prompt tokens processed.")
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens_total", "Number of generated tokens.")
        self.request_success = Counter(f"{PREFIX}request_success_total",
                                       "Number of finished requests, by finish reason.", label="finished_reason")
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds",
                              "Time from arrival to the first generated token, in seconds.", TTFT_BUCKETS)
        self.tpot = Histogram(f"{PREFIX}time_per_output_token_seconds",
                              "Time between successive output tokens of a request, in seconds.", TPOT_BUCKETS)
        self.e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds",
                             "Time from arrival to the end of a request, in seconds.", E2E_BUCKETS)
        self.spec_steps = Counter(f"{PREFIX}spec_decode_num_steps_total", "Decode steps through the verifier.")
        self.spec_drafts = Counter(f"{PREFIX}spec_decode_num_draft_tokens_total", "Draft tokens proposed.")
        self.spec_accepted = Counter(f"{PREFIX}spec_decode_num_accepted_tokens_total", "Draft tokens accepted.")
        self.spec_emitted = Counter(f"{PREFIX}spec_decode_num_emitted_tokens_total",
                                    "Tokens emitted by verify steps (accepted drafts plus bonus tokens).")
        self.spec_accepted_per_position = Counter(f"{PREFIX}spec_decode_num_accepted_tokens_per_pos_total",
                                                  "Draft tokens accepted, by draft position.", label="position")

    def on_request_arrived(self) -> None:
        self.requests_arrived.inc()

    def on_prompt_tokens(self, n: int) -> None:
        self.prompt_tokens.inc(n)

    def on_generation_tokens(self, n: int) -> None:
        self.generation_tokens.inc(n)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_time_per_output_token(self, seconds: float) -> None:
        self.tpot.observe(seconds)

    def observe_e2e_latency(self, seconds: float) -> None:
        self.e2e.observe(seconds)

    def on_request_finished(self, finish_reason: str) -> None:
        self.request_success.inc(1, finish_reason)

    def on_speculation(self, spec: SpeculateMetrics) -> None:
        """Add a finished request's speculation counts."""
        self.spec_steps.inc(spec.num_steps)
        self.spec_drafts.inc(spec.num_draft_tokens)
        self.spec_accepted.inc(spec.num_accepted_tokens)
        self.spec_emitted.inc(spec.num_emitted_tokens)
        for position, count in enumerate(spec.accepted_per_position):
            self.spec_accepted_per_position.inc(count, str(position))

    def render(self, stats: StatsLike) -> str:
        """All metrics in the Prometheus text format (version 0.0.4), ending with a newline."""
        labels = format_labels(self.const_labels)
        usage = stats.num_used_kv_blocks / stats.num_kv_blocks if stats.num_kv_blocks else 0.0
        gauges = (
            ("num_requests_running", "Number of requests being processed.", stats.num_running),
            ("num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", usage),
        )
        lines: list[str] = []
        for name, help_text, value in gauges:
            lines += _header(PREFIX + name, "gauge", help_text)
            lines.append(f"{PREFIX}{name}{labels} {format_value(value)}")
        for metric in (self.requests_arrived, self.prompt_tokens, self.generation_tokens, self.request_success,
                       self.ttft, self.tpot, self.e2e, self.spec_steps, self.spec_drafts, self.spec_accepted,
                       self.spec_emitted, self.spec_accepted_per_position):
            lines += metric.render(self.const_labels)
        return "\n".join(lines) + "\n"
