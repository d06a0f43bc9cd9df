"""Run every benchmark against every cupyspec-serve setting, print one table.

    python tools/bench_matrix.py --out results \\
        --server 'plain=--device cuda' \\
        --server "ngram5=--device cuda --speculative-config '{\\"method\\":\\"ngram\\",\\"num_speculative_tokens\\":5}'" \\
        --bench 'c1=--dataset random --num-prompts 8 --max-concurrency 1 --max-tokens 256 --ignore-eos' \\
        --bench 'c64=--dataset random --num-prompts 128 --max-concurrency 64 --max-tokens 256 --ignore-eos'

By default each server is started in turn and runs every benchmark. With `--rounds N` (N > 1)
every server runs at once, on consecutive ports, and each round runs each benchmark on every
server, the servers' order turning by one each round: a machine whose speed drifts between runs
(a shared host under load) then weighs on every setting alike. Give each
server its share of GPU memory (`--kv-cache-memory`); the benchmarks' order turns too. The table has
each column's mean over the rounds, the output throughput's median, lowest and highest, and its
change against the first benchmark on the same server: the median over the rounds of each round's
ratio (the two ran back to back, so the drift of the machine weighs less than on the medians),
with the ratios' quartiles.
`--warm-rounds` runs rounds first that the table leaves out (CUDA graphs captured, caches filled).

To measure what a request option costs, give it as a second benchmark:

    python tools/bench_matrix.py --out results --rounds 9 --warm-rounds 1 \\
        --server "ngram5=--device cuda --speculative-config '{\\"method\\":\\"ngram\\",\\"num_speculative_tokens\\":5}'" \\
        --bench 'none=--dataset code-rewrite --num-prompts 256 --max-concurrency 64' \\
        --bench "lp=--dataset code-rewrite --num-prompts 256 --max-concurrency 64 \\
                 --extra-body '{\\"logprobs\\":true,\\"top_logprobs\\":5}'"

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
from statistics import mean, median, quantiles

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
    the benches' and the servers' orders turned by one more each round."""
    order = []
    for r in range(rounds):
        order += [(r, bench, server) for bench in _turned(benches, r) for server in _turned(servers, r)]
    return order


def _turned(labels: list[str], by: int) -> list[str]:
    return labels[by % len(labels):] + labels[:by % len(labels)]


def table(rows: list[dict], servers: list[str], benches: list[str]) -> list[dict]:
    """Rows of one (server, bench, round, summary) per run -> one per (server, bench), in the order
    given: each column's mean over the runs that report it, the runs, the throughput's median and
    range, and its change against the first bench's on the same server (the median of the rounds'
    ratios, minus 1, and their quartiles, `change_spread`; None for the first bench)."""
    first_bench = benches[0]
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in sorted(rows, key=lambda row: (servers.index(row["server"]), benches.index(row["bench"]))):
        groups.setdefault((row["server"], row["bench"]), []).append(row)
    out = []
    for (server, bench), runs in groups.items():
        means = {c: mean(v) if (v := [r[c] for r in runs if r.get(c) is not None]) else None for c in COLUMNS}
        throughput = [r["output_throughput"] for r in runs]
        base = {r["round"]: r["output_throughput"] for r in groups.get((server, first_bench), [])}
        ratios = [r["output_throughput"] / base[r["round"]] for r in runs if base.get(r["round"])]
        changed = bench != first_bench and ratios
        quartiles = (quantiles(ratios, n=4)[::2] if len(ratios) > 1 else ratios * 2) if changed else ()
        out.append({"server": server, "bench": bench, "runs": len(runs), **means, "median": median(throughput),
                    "lowest": min(throughput), "highest": max(throughput),
                    "change": median(ratios) - 1 if changed else None,
                    "change_spread": tuple(q - 1 for q in quartiles) if changed else None})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", type=labelled, action="append", required=True, help="LABEL=cupyspec-serve args")
    p.add_argument("--bench", type=labelled, action="append", required=True, help="LABEL=bench_serve.py args")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--port", type=int, default=8000, help="the first server's (with --rounds, the others follow)")
    p.add_argument("--rounds", type=int, default=1, help="above 1: every server at once, benchmarks alternating")
    p.add_argument("--warm-rounds", type=int, default=0, help="rounds run first, left out of the table")
    p.add_argument("--start-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.warm_rounds < 0:
        p.error("--rounds must be at least 1, --warm-rounds at least 0")
    args.out.mkdir(parents=True, exist_ok=True)
    benches = dict(args.bench)
    rows = []

    def run(url: str, label: str, bench: str, r: int) -> None:
        measured = r - args.warm_rounds
        suffix = f"-warm-{r + 1}" if measured < 0 else f"-{measured + 1}" if args.rounds > 1 else ""
        summary = run_bench(url, benches[bench], args.out / f"{label}-{bench}{suffix}.json")
        if measured >= 0:
            rows.append({"server": label, "bench": bench, "round": measured} | summary)

    if args.rounds == 1:  # one server at a time
        for label, server_args in args.server:
            with running_servers([(label, server_args)], args.out, args.port, args.start_timeout) as urls:
                for r, bench, _ in run_order([label], list(benches), args.warm_rounds + 1):
                    run(urls[label], label, bench, r)
    else:
        with running_servers(args.server, args.out, args.port, args.start_timeout) as urls:
            for r, bench, label in run_order(list(urls), list(benches), args.warm_rounds + args.rounds):
                run(urls[label], label, bench, r)
    extra = ("runs", "median", "lowest", "highest") if args.rounds > 1 else ()
    print(f"{'server':<12}{'bench':<12}" + "".join(f"{c:>24}" for c in COLUMNS + extra) + f"{'change':>10}"
          + f"{'quartiles':>18}")
    for row in table(rows, [label for label, _ in args.server], list(benches)):
        cells = ["-" if row[c] is None else f"{row[c]:.2f}" for c in COLUMNS + extra]
        change, spread = ("-", "-") if row["change"] is None else (
            f"{row['change']:+.1%}", "{:+.1%} {:+.1%}".format(*row["change_spread"]))
        print(f"{row['server']:<12}{row['bench']:<12}" + "".join(f"{c:>24}" for c in cells) + f"{change:>10}"
              + f"{spread:>18}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
