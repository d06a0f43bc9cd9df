"""Speculation per request: the body's `speculative` object in, `speculate_metrics` out.

A response's `speculate_metrics` sums the metrics of its engine requests (a completions call
with several prompts makes one per prompt). Responses carry it only when the engine sends
metrics, that is when the server speculates; plain OpenAI clients see nothing new.
"""

from __future__ import annotations

from itertools import zip_longest

from cupyspec.outputs import RequestOutput, SpeculateMetrics
from cupyspec.server.protocol import SamplingFields, SpeculateMetricsInfo
from cupyspec.spec_decode.speculative_config import RequestSpeculation


def request_speculation(req: SamplingFields) -> RequestSpeculation | None:
    """The body's `speculative` object as the engine's per-request setting; None when absent.
    A negative number raises InvalidRequestError (HTTP 400)."""
    if req.speculative is None:
        return None
    return RequestSpeculation(req.speculative.num_speculative_tokens)


class SpeculateMetricsSum:
    """The metrics of a response's engine requests, collected from their final outputs."""

    def __init__(self, num_requests: int) -> None:
        self._unfinished = num_requests
        self._parts: list[SpeculateMetrics] = []

    def update(self, output: RequestOutput) -> None:
        if output.finished:
            self._unfinished -= 1
        if output.speculate_metrics is not None:
            self._parts.append(output.speculate_metrics)

    @property
    def complete(self) -> bool:
        """Every engine request has sent its final output: the response's last output is in."""
        return self._unfinished == 0

    def result(self) -> SpeculateMetricsInfo | None:
        """Counts summed (per position elementwise) and rates recomputed; None without metrics."""
        if not self._parts:
            return None
        steps = sum(m.num_steps for m in self._parts)
        drafts = sum(m.num_draft_tokens for m in self._parts)
        accepted = sum(m.num_accepted_tokens for m in self._parts)
        emitted = sum(m.num_emitted_tokens for m in self._parts)
        per_position = [sum(counts) for counts in zip_longest(*(m.accepted_per_position for m in self._parts),
                                                                fillvalue=0)]
        return SpeculateMetricsInfo(
            num_steps=steps, num_draft_tokens=drafts, num_accepted_tokens=accepted, num_emitted_tokens=emitted,
            acceptance_rate=accepted / drafts if drafts else 0.0,
            mean_acceptance_length=emitted / steps if steps else 0.0, accepted_per_position=per_position)
