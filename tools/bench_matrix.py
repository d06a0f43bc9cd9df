"""Run every benchmark against every cupyspec-serve setting, print one table.

    python tools/bench_matrix.py --out results \\
        --server 'plain=--device cuda' \\
        --server "ngram5=--device cuda --speculative-config '{\\"method\\":\\"ngram\\",\\"num_speculative_tokens\\":5}'" \\
        --bench 'c1=--dataset random --num-prompts 8 --max-concurrency 1 --max-tokens 256 --ignore-eos' \\
        --bench 'c64=--dataset random --num-prompts 128 --max-concurrency 64 --max-tokens 256 --ignore-eos'

By default each server is started in turn and runs every benchmark. With `--rounds N` (N > 1)
every server runs at once, on consecutive ports, and each round runs each benchmark on every
server, the servers' order turning by one each round: a machine whose speed drifts between runs
(on a shared host, by tens of percent at load) then weighs on every setting alike. Give each
server its share of GPU memory (`--kv-cache-memory`). The table has each column's mean over the
rounds, and the lowest and highest output throughput.

Arguments are split as a shell would (shlex): quote JSON values. Each result goes to
<out>/<server>-<bench>.json (with rounds, <out>/<server>-<bench>-<round>.json: tools/bench_serve.py's
result file); the server's log to <out>/<server>.log.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from statistics import mean

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


@contextlib.contextmanager
def running_servers(servers: list[tuple[str, list[str]]], out: Path, port: int,
                    start_timeout: float) -> Iterator[dict[str, str]]:
    """Start the servers on ports port, port + 1, ...; yield label -> base URL once all are healthy;
    stop them on exit."""
    started: list[subprocess.Popen] = []
    try:
        urls = {}
        for i, (label, args) in enumerate(servers):
            with open(out / f"{label}.log", "w") as log:
                started.append(subprocess.Popen(
                    [sys.executable, "-m", "cupyspec.server.cli", "--port", str(port + i), *args],
                    stdout=log, stderr=subprocess.STDOUT))
            urls[label] = f"http://127.0.0.1:{port + i}"
        for server, url in zip(started, urls.values()):
            wait_healthy(url, server, start_timeout)
        yield urls
    finally:
        for server in started:
            server.terminate()
        for server in started:
            server.wait(timeout=60)


def run_bench(url: str, bench_args: list[str], result_file: Path) -> dict:
    """One bench_serve.py run; its summary."""
    config = bench_serve.parse_args(["--base-url", url, "--no-progress", "--result-file", str(result_file),
                                     *bench_args])
    return asyncio.run(bench_serve.benchmark(config))["summary"]


def run_order(servers: list[str], benches: list[str], rounds: int) -> list[tuple[int, str, str]]:
    """(round, bench, server) in the order they run: each round runs each bench on every server,
    the servers' order turned by one more each round."""
    order = []
    for r in range(rounds):
        turned = servers[r % len(servers):] + servers[:r % len(servers)]
        order += [(r, bench, server) for bench in benches for server in turned]
    return order


def table(rows: list[dict]) -> list[dict]:
    """Rows of one (server, bench, summary) per run -> one per (server, bench), in first-run order:
    each column's mean over the runs that report it, the runs, and the throughput's range."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["server"], row["bench"]), []).append(row)
    out = []
    for (server, bench), runs in groups.items():
        means = {c: mean(v) if (v := [r[c] for r in runs if r.get(c) is not None]) else None for c in COLUMNS}
        throughput = [r["output_throughput"] for r in runs]
        out.append({"server": server, "bench": bench, "runs": len(runs), **means,
                    "lowest": min(throughput), "highest": max(throughput)})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", type=labelled, action="append", required=True, help="LABEL=cupyspec-serve args")
    p.add_argument("--bench", type=labelled, action="append", required=True, help="LABEL=bench_serve.py args")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--port", type=int, default=8000, help="the first server's (with --rounds, the others follow)")
    p.add_argument("--rounds", type=int, default=1, help="above 1: every server at once, benchmarks alternating")
    p.add_argument("--start-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    benches = dict(args.bench)
    rows = []
    if args.rounds == 1:
        for label, server_args in args.server:
            with running_servers([(label, server_args)], args.out, args.port, args.start_timeout) as urls:
                for bench, bench_args in args.bench:
                    summary = run_bench(urls[label], bench_args, args.out / f"{label}-{bench}.json")
                    rows.append({"server": label, "bench": bench} | summary)
    else:
        with running_servers(args.server, args.out, args.port, args.start_timeout) as urls:
            for r, bench, label in run_order(list(urls), list(benches), args.rounds):
                summary = run_bench(urls[label], benches[bench], args.out / f"{label}-{bench}-{r + 1}.json")
                rows.append({"server": label, "bench": bench} | summary)
    extra = ("runs", "lowest", "highest") if args.rounds > 1 else ()
    print(f"{'server':<12}{'bench':<12}" + "".join(f"{c:>24}" for c in COLUMNS + extra))
    for row in table(rows):
        cells = ["-" if row[c] is None else f"{row[c]:.2f}" for c in COLUMNS + extra]
        print(f"{row['server']:<12}{row['bench']:<12}" + "".join(f"{c:>24}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
