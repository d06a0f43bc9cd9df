"""The Prometheus registry: values, histogram buckets and a valid text exposition."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import pytest

from cupyspec.metrics import EngineMetrics
from cupyspec.outputs import SpeculateMetrics

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*",?)*\})? (\S+)$')


@dataclass(frozen=True)
class Stats:
    num_running: int = 3
    num_waiting: int = 2
    num_kv_blocks: int = 200
    num_used_kv_blocks: int = 50


def parse_exposition(text: str) -> dict[str, tuple[str, dict[str, float]]]:
    """family -> (type, {sample name with labels: value}); asserts the format's rules on the way."""
    assert text.endswith("\n")
    families: dict[str, tuple[str, dict[str, float]]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split()[2]
            assert name not in families, f"family {name} declared twice"
            current = name
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert name == current and kind in ("counter", "gauge", "histogram")
            families[name] = (kind, {})
        else:
            match = SAMPLE.match(line)
            assert match, f"bad sample line {line!r}"
            sample, labels, value = match.group(1), match.group(2) or "", match.group(3)
            assert current is not None and sample.startswith(current)
            families[current][1][sample + labels] = float(value)
    return families


def test_engine_metrics_render() -> None:
    m = EngineMetrics(model_name='we"ird\\name')
    m.on_request_arrived()
    m.on_request_arrived()
    m.on_prompt_tokens(10)
    m.on_generation_tokens(4)
    m.on_generation_tokens(3)
    for seconds in (0.003, 0.05, 0.05, 100.0):
        m.observe_ttft(seconds)
    m.observe_time_per_output_token(0.02)
    m.observe_e2e_latency(1.2)
    m.on_request_finished("stop")
    m.on_request_finished("length")
    m.on_request_finished("stop")
    families = parse_exposition(m.render(Stats()))
    label = 'model_name="we\\"ird\\\\name"'  # label names come in sorted order, values with their escapes
    assert families["cupyspec:num_requests_running"] == ("gauge", {f"cupyspec:num_requests_running{{{label}}}": 3})
    assert families["cupyspec:kv_cache_usage_perc"][1] == {f"cupyspec:kv_cache_usage_perc{{{label}}}": 0.25}
    assert families["cupyspec:prompt_tokens_total"][1] == {f"cupyspec:prompt_tokens_total{{{label}}}": 10}
    assert families["cupyspec:generation_tokens_total"][1] == {f"cupyspec:generation_tokens_total{{{label}}}": 7}
    assert families["cupyspec:requests_arrived_total"][1] == {f"cupyspec:requests_arrived_total{{{label}}}": 2}
    success = families["cupyspec:request_success_total"]
    assert success == ("counter", {f'cupyspec:request_success_total{{finished_reason="length",{label}}}': 1,
                                   f'cupyspec:request_success_total{{finished_reason="stop",{label}}}': 2})
    kind, ttft = families["cupyspec:time_to_first_token_seconds"]
    name = "cupyspec:time_to_first_token_seconds"
    assert kind == "histogram"
    assert ttft[f'{name}_bucket{{le="0.001",{label}}}'] == 0
    assert ttft[f'{name}_bucket{{le="0.005",{label}}}'] == 1
    assert ttft[f'{name}_bucket{{le="0.04",{label}}}'] == 1
    assert ttft[f'{name}_bucket{{le="0.06",{label}}}'] == 3
    assert ttft[f'{name}_bucket{{le="80.0",{label}}}'] == 3
    assert ttft[f'{name}_bucket{{le="+Inf",{label}}}'] == 4
    assert ttft[f"{name}_count{{{label}}}"] == 4
    assert math.isclose(ttft[f"{name}_sum{{{label}}}"], 100.103)
    buckets = [v for k, v in ttft.items() if "_bucket" in k]
    assert buckets == sorted(buckets)  # cumulative
    assert {"cupyspec:time_per_output_token_seconds", "cupyspec:e2e_request_latency_seconds"} <= set(families)


def test_speculation_counters_sum_finished_requests() -> None:
    m = EngineMetrics(model_name="m")
    m.on_speculation(SpeculateMetrics(4, 8, 6, 10, 0.75, 2.5, (4, 2)))
    m.on_speculation(SpeculateMetrics(3, 9, 1, 4, 1 / 9, 4 / 3, (1, 0, 0)))
    m.on_speculation(SpeculateMetrics(5, 0, 0, 5, 0.0, 1.0, ()))  # speculation off for the request
    families = parse_exposition(m.render(Stats()))
    for name, total in (("num_steps", 12), ("num_draft_tokens", 17), ("num_accepted_tokens", 7),
                        ("num_emitted_tokens", 19)):
        family = f"cupyspec:spec_decode_{name}_total"
        assert families[family] == ("counter", {f'{family}{{model_name="m"}}': total})
    family = "cupyspec:spec_decode_num_accepted_tokens_per_pos_total"
    assert families[family] == ("counter", {f'{family}{{model_name="m",position="{j}"}}': n
                                            for j, n in enumerate((5, 2, 0))})


def test_empty_registry_is_valid() -> None:
    families = parse_exposition(EngineMetrics().render(Stats(0, 0, 0, 0)))
    assert families["cupyspec:kv_cache_usage_perc"][1] == {"cupyspec:kv_cache_usage_perc": 0}
    assert families["cupyspec:request_success_total"] == ("counter", {})
    e2e = families["cupyspec:e2e_request_latency_seconds"][1]
    assert e2e['cupyspec:e2e_request_latency_seconds_bucket{le="+Inf"}'] == 0
    assert not [name for name in families if name.endswith("_created")]


def test_bucket_bounds_are_inclusive() -> None:
    m = EngineMetrics()
    for seconds in (0.001, 0.002, 0.005, 0.006):
        m.observe_ttft(seconds)
    ttft = parse_exposition(m.render(Stats()))["cupyspec:time_to_first_token_seconds"][1]
    name = "cupyspec:time_to_first_token_seconds_bucket"
    assert [ttft[f'{name}{{le="{bound}"}}'] for bound in ("0.001", "0.005", "0.01", "+Inf")] == [1, 3, 4, 4]


def test_counters_read_back_and_never_decrease() -> None:
    m = EngineMetrics(model_name="m")
    m.on_generation_tokens(2)
    m.on_generation_tokens(3)
    assert m.generation_tokens.value() == 5
    with pytest.raises(ValueError):
        m.on_generation_tokens(-1)
    assert m.generation_tokens.value() == 5


def test_engine_metrics_count_apart() -> None:
    first, second = EngineMetrics(model_name="m"), EngineMetrics(model_name="m")
    first.on_request_arrived()
    assert (first.requests_arrived.value(), second.requests_arrived.value()) == (1, 0)
    arrived = parse_exposition(second.render(Stats()))["cupyspec:requests_arrived_total"]
    assert arrived == ("counter", {'cupyspec:requests_arrived_total{model_name="m"}': 0})
