"""tools/profile_server.py: the default model's engine with a modeled GPU serves the same requests
in-process and over HTTP, and each mode reports its throughput and host time per token."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def test_both_modes_serve_every_requested_token_in_alternating_order(default_model_path) -> None:
    run = subprocess.run([sys.executable, str(TOOLS / "profile_server.py"), "--model", default_model_path,
                          "--concurrency", "3", "--prompts-per-stream", "2", "--max-tokens", "5",
                          "--input-words", "8", "--event-loop", "asyncio", "--rounds", "2"],
                         capture_output=True, text=True, timeout=300, cwd=TOOLS)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    rows, summary = lines[:-1], lines[-1]
    assert [row["mode"] for row in rows] == ["in-process", "http", "http", "in-process"]
    for row in rows:
        assert row["output_tokens"] == 3 * 2 * 5  # ignore_eos: every request its max_tokens
        assert row["tok_per_s"] > 0 and row["host_us_per_token"] > 0
    assert all(0 < row["client_cpu_share"] <= 1.5 for row in rows if row["mode"] == "http")
    rates = {(row["round"], row["mode"]): row["tok_per_s"] for row in rows}
    shares = [rates[r, "http"] / rates[r, "in-process"] for r in (0, 1)]
    assert summary == {"concurrency": 3, "rounds": 2, "http_over_in_process": summary["http_over_in_process"]}
    assert abs(summary["http_over_in_process"] - np.median(shares)) < 0.01
