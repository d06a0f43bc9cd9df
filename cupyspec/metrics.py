"""Prometheus metrics of the engine, kept in a prometheus_client registry per engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypeVar

import prometheus_client
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

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


# The `_created` series (a metric's creation time) is an OpenMetrics extra that the text format
# writes as one more gauge family per counter and histogram; the engine exports none.
prometheus_client.disable_created_metrics()


class Counter(prometheus_client.Counter):
    """A prometheus_client counter whose total reads back, for the tools and tests that trace it."""

    def value(self) -> float:
        """The running total of this counter (unlabelled, or the child of one set of label values)."""
        (family,) = self.collect()
        return next(sample.value for sample in family.samples if sample.name == family.name + "_total")


Metric = TypeVar("Metric", Counter, Gauge, Histogram)


class EngineMetrics:
    """The engine's counters and latency histograms, and load gauges that `render` sets from a stats
    snapshot, in a registry of their own; every sample carries `model_name` when a name is given."""

    def __init__(self, model_name: str | None = None) -> None:
        self.registry = CollectorRegistry()
        self.label_names: tuple[str, ...] = ("model_name",) if model_name else ()
        self.label_values: tuple[str, ...] = (model_name,) if model_name else ()
        self.num_running = self._gauge("num_requests_running", "Number of requests being processed.")
        self.num_waiting = self._gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage = self._gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.requests_arrived = self._counter("requests_arrived_total", "Number of requests received.")
        self.prompt_tokens = self._counter("prompt_tokens_total", "Number of prompt tokens processed.")
        self.generation_tokens = self._counter("generation_tokens_total", "Number of generated tokens.")
        self.request_success = Counter(f"{PREFIX}request_success_total",
                                       "Number of finished requests, by finish reason.",
                                       (*self.label_names, "finished_reason"), registry=self.registry)
        self.ttft = self._histogram("time_to_first_token_seconds",
                                    "Time from arrival to the first generated token, in seconds.", TTFT_BUCKETS)
        self.tpot = self._histogram("time_per_output_token_seconds",
                                    "Time between successive output tokens of a request, in seconds.", TPOT_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds",
                                   "Time from arrival to the end of a request, in seconds.", E2E_BUCKETS)
        self.spec_steps = self._counter("spec_decode_num_steps_total", "Decode steps through the verifier.")
        self.spec_drafts = self._counter("spec_decode_num_draft_tokens_total", "Draft tokens proposed.")
        self.spec_accepted = self._counter("spec_decode_num_accepted_tokens_total", "Draft tokens accepted.")
        self.spec_emitted = self._counter("spec_decode_num_emitted_tokens_total",
                                          "Tokens emitted by verify steps (accepted drafts plus bonus tokens).")
        self.spec_accepted_per_position = Counter(f"{PREFIX}spec_decode_num_accepted_tokens_per_pos_total",
                                                  "Draft tokens accepted, by draft position.",
                                                  (*self.label_names, "position"), registry=self.registry)
        # prefill/decode disaggregation: the decode role's fetches, the prefill role's held prompts
        self.kv_fetched_blocks = self._counter("kv_transfer_blocks_total", "KV blocks fetched from prefill servers.")
        self.kv_fetched_bytes = self._counter("kv_transfer_bytes_total", "Bytes of K/V fetched from prefill servers.")
        self.kv_fetch_failures = self._counter("kv_transfer_failures_total",
                                               "Fetches of a prompt's K/V that failed (the prompt was computed here).")
        self.kv_fetch_time = self._histogram("kv_transfer_seconds", "Time to fetch a prompt's K/V, in seconds.",
                                             TTFT_BUCKETS)
        self.held_prompts = self._gauge("prefill_held_prompts",
                                        "Prompts whose K/V waits for a decode server to read it.")

    def _bind(self, metric: Metric) -> Metric:
        """The child of `metric` for this engine's label values; the metric itself when there are none."""
        return metric.labels(*self.label_values) if self.label_values else metric

    def _gauge(self, name: str, help_text: str) -> Gauge:
        return self._bind(Gauge(PREFIX + name, help_text, self.label_names, registry=self.registry))

    def _counter(self, name: str, help_text: str) -> Counter:
        return self._bind(Counter(PREFIX + name, help_text, self.label_names, registry=self.registry))

    def _histogram(self, name: str, help_text: str, buckets: tuple[float, ...]) -> Histogram:
        return self._bind(Histogram(PREFIX + name, help_text, self.label_names, registry=self.registry,
                                    buckets=buckets))

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
        self.request_success.labels(*self.label_values, finish_reason).inc()

    def on_speculation(self, spec: SpeculateMetrics) -> None:
        """Add a finished request's speculation counts."""
        self.spec_steps.inc(spec.num_steps)
        self.spec_drafts.inc(spec.num_draft_tokens)
        self.spec_accepted.inc(spec.num_accepted_tokens)
        self.spec_emitted.inc(spec.num_emitted_tokens)
        for position, count in enumerate(spec.accepted_per_position):
            self.spec_accepted_per_position.labels(*self.label_values, str(position)).inc(count)

    def on_kv_fetched(self, blocks: int, nbytes: int, seconds: float, ok: bool) -> None:
        """A decode-role fetch of a prompt's K/V: `blocks` blocks of `nbytes` bytes in all."""
        if not ok:
            self.kv_fetch_failures.inc()
            return
        self.kv_fetched_blocks.inc(blocks)
        self.kv_fetched_bytes.inc(nbytes)
        self.kv_fetch_time.observe(seconds)

    def render(self, stats: StatsLike) -> str:
        """All metrics in the Prometheus text format, the load gauges set from `stats`."""
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.num_used_kv_blocks / stats.num_kv_blocks if stats.num_kv_blocks else 0.0)
        return generate_latest(self.registry).decode()
