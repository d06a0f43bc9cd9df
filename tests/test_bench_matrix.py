"""tools/bench_matrix.py: the order of alternating runs, the table, and two live CPU servers side by side."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
from tiny_models import tiny_model_paths

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import bench_matrix as bm  # noqa: E402


def test_each_round_runs_every_bench_on_every_server_in_a_turned_order():
    order = bm.run_order(["a", "b", "c"], ["x", "y"], 3)
    assert order[:6] == [(0, "x", "a"), (0, "x", "b"), (0, "x", "c"), (0, "y", "a"), (0, "y", "b"), (0, "y", "c")]
    assert [s for r, b, s in order if b == "x"] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert sorted(order) == sorted((r, b, s) for r in range(3) for b in "xy" for s in "abc")
    assert [b for r, b, s in order if s == "a"] == ["x", "y", "y", "x", "x", "y"]  # the benches alternate too


def test_the_table_has_means_over_rounds_and_the_throughput_range():
    rows = [{"server": "a", "bench": "x", "round": r, "output_throughput": t, "p50_tpot_ms": 1.0,
             "mean_acceptance_length": None} for r, t in enumerate((100.0, 140.0, 130.0))]
    rows += [{"server": "b", "bench": "x", "round": 0, "output_throughput": 90.0}]
    a, b = bm.table(rows, ["a", "b"], ["x"])
    assert (a["server"], a["runs"], a["output_throughput"], a["median"], a["lowest"], a["highest"]) == (
        "a", 3, 123.33333333333333, 130.0, 100.0, 140.0)
    assert a["p50_tpot_ms"] == 1.0 and a["mean_acceptance_length"] is None and a["acceptance_rate"] is None
    assert (b["server"], b["runs"], b["output_throughput"]) == ("b", 1, 90.0)
    assert a["change"] is None and b["change"] is None  # the first bench is the reference


def test_the_change_against_the_first_bench_is_the_median_of_the_rounds_ratios():
    """Round 1's machine was slow for both: its ratio counts, its drop does not."""
    throughput = {"none": (100.0, 60.0, 110.0), "lp": (90.0, 57.0, 104.0)}
    rows = [{"server": "a", "bench": bench, "round": r, "output_throughput": t}
            for bench, values in throughput.items() for r, t in enumerate(values)]
    none, lp = bm.table(rows, ["a"], ["none", "lp"])
    assert none["change"] is None
    assert lp["change"] == pytest.approx(104 / 110 - 1)  # the middle of the ratios 0.9, 0.95, 0.945
    assert lp["change_spread"] == pytest.approx((-0.1, -0.05))  # their quartiles (exclusive method)
    assert lp["median"] / none["median"] - 1 == pytest.approx(-0.1)


def _free_ports(count: int) -> int:
    """A first port with `count` consecutive free ones."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + count > 65535:
            continue
        try:
            probes = []
            for port in range(first, first + count):
                probe = socket.socket()
                probes.append(probe)
                probe.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    pytest.skip("no consecutive free ports")


def test_rounds_run_the_servers_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    model = tiny_model_paths(tmp_path, "llama")[1]
    server = f"--model {model} --device cpu --max-model-len 256"
    bench = "--dataset random --random-input-len 6 --num-prompts 2 --max-concurrency 1 --max-tokens 3 --ignore-eos"
    out = tmp_path / "results"
    assert bm.main(["--out", str(out), "--port", str(_free_ports(2)), "--rounds", "2", "--warm-rounds", "1",
                    "--server", f"one={server}", "--server", f"two={server} --no-overlap-scheduling",
                    "--bench", f"c1={bench}", "--bench", f"c1lp={bench} --extra-body '{{\"logprobs\":2}}'"]) == 0
    assert sorted(p.name for p in out.glob("one-*.json")) == [
        "one-c1-1.json", "one-c1-2.json", "one-c1-warm-1.json", "one-c1lp-1.json", "one-c1lp-2.json",
        "one-c1lp-warm-1.json"]
    assert len(list(out.glob("two-*.json"))) == 6
    lines = capsys.readouterr().out.splitlines()  # bench_serve.py's reports, then the table
    lines = lines[max(i for i, line in enumerate(lines) if line.startswith("server")):]
    assert lines[0].split()[-6:] == ["runs", "median", "lowest", "highest", "change", "quartiles"]
    assert [line.split()[:2] for line in lines[1:]] == [["one", "c1"], ["one", "c1lp"], ["two", "c1"], ["two", "c1lp"]]
    runs = lines[0].split().index("runs")
    assert all(line.split()[runs] == "2.00" for line in lines[1:])  # the warm round left out
    assert [line.split()[-1] == "-" for line in lines[1:]] == [True, False, True, False]
