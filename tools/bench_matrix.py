"""Start cupyspec-serve once per server setting, run every benchmark against it, print one table.

    python tools/bench_matrix.py --out results \\
        --server 'plain=--device cuda' \\
        --server "ngram5=--device cuda --speculative-config '{\\"method\\":\\"ngram\\",\\"num_speculative_tokens\\":5}'" \\
        --bench 'c1=--dataset random --num-prompts 8 --max-concurrency 1 --max-tokens 256 --ignore-eos' \\
        --bench 'c64=--dataset random --num-prompts 128 --max-concurrency 64 --max-tokens 256 --ignore-eos'

Arguments are split as a shell would (shlex): quote JSON values. Each result goes to
<out>/<server>-<bench>.json (tools/bench_serve.py's result file); the server's log to <out>/<server>.log.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import bench_serve

COLUMNS = ("output_throughput", "p50_tpot_ms", "p50_ttft_ms", "acceptance_rate", "mean_acceptance_length")


def labelled(text: str) -> tuple[str, list[str]]:
    """'label=arguments' -> (label, argument list)."""
    label, sep, args = text.partition("=")
    if not sep or not label.isidentifier():
        raise argparse.ArgumentTypeError(f"expected LABEL=ARGS with LABEL a plain word, got {text!r}")
    return label, shlex.split(args)


def wait_healthy(url: str, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with status {server.returncode}; see its log")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not become healthy within {timeout:.0f} s")


def run_server(label: str, args: list[str], benches: list[tuple[str, list[str]]], out: Path, port: int,
               start_timeout: float) -> list[dict]:
    url = f"http://127.0.0.1:{port}"
    with open(out / f"{label}.log", "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "cupyspec.server.cli", "--port", str(port), *args],
                                  stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(url, server, start_timeout)
            rows = []
            for bench_label, bench_args in benches:
                config = bench_serve.parse_args(["--base-url", url, "--no-progress", "--result-file",
                                                 str(out / f"{label}-{bench_label}.json"), *bench_args])
                summary = asyncio.run(bench_serve.benchmark(config))["summary"]
                rows.append({"server": label, "bench": bench_label} | {c: summary.get(c) for c in COLUMNS})
            return rows
        finally:
            server.terminate()
            server.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", type=labelled, action="append", required=True, help="LABEL=cupyspec-serve args")
    p.add_argument("--bench", type=labelled, action="append", required=True, help="LABEL=bench_serve.py args")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--start-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for label, server_args in args.server:
        rows += run_server(label, server_args, args.bench, args.out, args.port, args.start_timeout)
    print(f"{'server':<12}{'bench':<12}" + "".join(f"{c:>24}" for c in COLUMNS))
    for row in rows:
        cells = ["-" if row[c] is None else f"{row[c]:.2f}" for c in COLUMNS]
        print(f"{row['server']:<12}{row['bench']:<12}" + "".join(f"{c:>24}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
