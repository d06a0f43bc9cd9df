"""Each CUDA kernel of cuda/ against its roofline on this GPU.

    python tools/bench_kernels.py                  # every kernel
    python tools/bench_kernels.py --only linear    # the benches whose name starts with "linear"

A bench times one kernel call on given shapes with CUDA events (after a warm-up, averaged over
repeats) and reports the bytes it must move and the flops it must do; the table shows the achieved
bandwidth and throughput against the device's peaks, so that a kernel far from both bounds is
launch- or latency-bound.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


# H100 SXM peaks: HBM3 bandwidth, dense fp16 tensor-core throughput with fp32 accumulation
PEAK_BYTES_PER_S = 3.35e12
PEAK_FLOPS = 989e12


@dataclass(frozen=True)
class Case:
    """One timed call: its label, what it moves and computes, and the call itself."""

    label: str
    bytes_moved: float
    flops: float
    call: Callable[[], Any]


def time_call(call: Callable[[], Any], repeats: int) -> float:
    """Device microseconds per call, after one warm-up call."""
    import cupy

    call()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(repeats):
        call()
    end.record()
    end.synchronize()
    return 1e3 * cupy.cuda.get_elapsed_time(start, end) / repeats


# ---------------------------------------------------------------- benches (each yields Cases)


BENCHES: dict[str, Callable[[], Iterator[Case]]] = {
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", default=[], help="bench name prefixes")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--json", action="store_true", help="one JSON object per case instead of a table")
    args = p.parse_args()
    print(f"{'case':<48}{'us':>10}{'GB/s':>10}{'% HBM':>8}{'TFLOP/s':>10}{'% TC':>7}")
    for name, bench in BENCHES.items():
        if args.only and not any(name.startswith(prefix) for prefix in args.only):
            continue
        for case in bench():
            us = time_call(case.call, args.repeats)
            bandwidth, flops = case.bytes_moved / (us * 1e-6), case.flops / (us * 1e-6)
            row = {"case": f"{name} {case.label}", "us": us, "GB/s": bandwidth / 1e9,
                   "hbm_fraction": bandwidth / PEAK_BYTES_PER_S, "TFLOP/s": flops / 1e12,
                   "tc_fraction": flops / PEAK_FLOPS}
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(f"{row['case']:<48}{us:>10.2f}{row['GB/s']:>10.0f}{100 * row['hbm_fraction']:>7.1f}%"
                      f"{row['TFLOP/s']:>10.1f}{100 * row['tc_fraction']:>6.1f}%", flush=True)


if __name__ == "__main__":
    main()
