"""Each CUDA kernel of cuda/ against its roofline on this GPU.

    python tools/bench_kernels.py                  # every kernel
    python tools/bench_kernels.py --only linear    # the benches whose name starts with "linear"

A bench times one kernel call on given shapes with CUDA events (after a warm-up, averaged over
repeats; `chain` times a graph of dependent kernels, per kernel) and reports the bytes it must move
and the flops it must do; the table shows the achieved bandwidth and throughput against the
device's peaks, so that a kernel far from both bounds is launch- or latency-bound.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

# Peaks by device name: HBM bandwidth (bytes/s), dense fp16 tensor-core throughput with fp32 accumulation
PEAKS = {"H100": (3.35e12, 989e12), "H200": (4.8e12, 989e12)}


def device_peaks() -> tuple[str, float, float]:
    """This GPU's name and its peaks (an H100's where PEAKS does not name it)."""
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())["name"]
    name = name.decode() if isinstance(name, bytes) else name
    known = next((key for key in PEAKS if key in name), "H100")
    return f"{name} (against {known} peaks)", *PEAKS[known]


@dataclass(frozen=True)
class Case:
    """One timed call: its label, what it moves and computes, and the call itself."""

    label: str
    bytes_moved: float  # per kernel
    flops: float  # per kernel
    call: Callable[[], Any]
    kernels: int = 1  # kernels one call runs: the time reported is a kernel's


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


def bench_linear() -> Iterator[Case]:
    """x @ w.T on SmolLM2-135M's matrices (cupyspec.model.linear: gemv to M=8, tensor-core tiles to
    2,048), and cuBLAS on the same products from M=512 (CuPy's matmul), which the tiles replace there.

    Calls cycle through enough copies of the weights to fill the L2 cache twice, so that the weights
    come from HBM as they do in a forward pass over all layers.
    """
    import itertools

    import cupy
    import numpy as np

    from cupyspec.model.linear import linear

    l2_bytes = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())["l2CacheSize"]
    shapes = (("qkv", 960, 576, np.float16), ("o", 576, 576, np.float16), ("gate_up", 3072, 576, np.float16),
              ("down", 576, 1536, np.float16), ("lm_head", 49152, 576, np.float32))
    for name, n, k, out_dtype in shapes:
        rng = cupy.random.default_rng(n + k)
        copies = [(rng.standard_normal((n, k), dtype=np.float32) * k ** -0.5).astype(np.float16)
                  for _ in range(-(-2 * l2_bytes // (2 * n * k)))]  # [N, K] each
        for m in (1, 8, 64, 256, 512, 1024, 2048):
            x = rng.standard_normal((m, k), dtype=np.float32).astype(np.float16)  # [M, K]
            weights = itertools.cycle(copies)
            moved = 2 * (n * k + m * k) + m * n * np.dtype(out_dtype).itemsize
            yield Case(f"{name} M={m} N={n} K={k}", moved, 2 * m * n * k,
                       lambda x=x, weights=weights, d=out_dtype: linear(cupy, x, next(weights), d))
            if m >= 512 and out_dtype == np.float16:
                yield Case(f"{name} cuBLAS M={m} N={n} K={k}", moved, 2 * m * n * k,
                           lambda x=x, weights=weights: x @ next(weights).T)


def bench_packed() -> Iterator[Case]:
    """x @ w.T with weight-only quantization (cupyspec.model.quantized) against fp16, on matrices of an
    8B llama (down [4096, 14336], gate_up [28672, 4096]), from one row, where reading the weights bounds
    a decode step, to 512 (a prefill's); the bytes are the weights in each format. Each format's copies
    fill the L2 cache twice."""
    import dataclasses
    import itertools

    import cupy
    import numpy as np

    from cupyspec.model.linear import linear
    from cupyspec.model.quantized import quantize

    l2_bytes = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())["l2CacheSize"]
    for name, n, k in (("down", 4096, 14336), ("gate_up", 28672, 4096)):
        host = (np.random.default_rng(n).standard_normal((n, k), dtype=np.float32) * k ** -0.5)  # [N, K]
        for method in (None, "wint8", "wint4"):
            packed = None if method is None else quantize(np, host, method, np.float16)
            one = cupy.asarray(host, dtype=np.float16) if packed is None else dataclasses.replace(
                packed, values=cupy.asarray(packed.values), scales=cupy.asarray(packed.scales))
            copies = [one]
            while len(copies) * one.nbytes < 2 * l2_bytes:
                copies.append(one.copy() if packed is None else dataclasses.replace(
                    one, values=one.values.copy(), scales=one.scales.copy()))
            for m in (1, 8, 16, 64, 256, 512):
                x = cupy.asarray(np.random.default_rng(m).standard_normal((m, k)), dtype=np.float16)  # [M, K]
                weights = itertools.cycle(copies)
                yield Case(f"{name} {method or 'fp16'} M={m} N={n} K={k}", one.nbytes + 2 * m * (n + k), 2 * m * n * k,
                           lambda x=x, weights=weights: linear(cupy, x, next(weights)))


def bench_attention() -> Iterator[Case]:
    """Paged attention (cuda/paged_attention.cu) with SmolLM2-135M's heads: 9 query, 3 KV, dim 64.

    Rows sit at the last positions of each request's L cached ones. Calls cycle through block tables
    over disjoint blocks, enough to fill the L2 cache twice, so that K/V come from HBM as they do in
    a forward pass over all layers.
    """
    import itertools

    import cupy
    import numpy as np

    from cupyspec.model.attention import paged_attention_cuda

    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    l2_bytes = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())["l2CacheSize"]
    cases = (("decode", 1, 1, 256), ("decode", 1, 1, 4000), ("decode", 256, 1, 256), ("verify", 64, 6, 512),
             ("prefill", 1, 2048, 2048))  # (kind, requests, rows per request, L)
    for kind, requests, rows, kv_len in cases:
        blocks = -(-kv_len // block_size)  # per request
        kv_bytes = 2 * requests * kv_len * kv_heads * dim * 2  # K and V, once per KV head
        copies = -(-2 * l2_bytes // kv_bytes)
        rng = cupy.random.default_rng(requests * rows + kv_len)
        cache_shape = (copies * requests * blocks, block_size, kv_heads, dim)
        k = rng.standard_normal(cache_shape, dtype=np.float32).astype(np.float16)  # [blocks, bs, Hkv, D]
        v = rng.standard_normal(cache_shape, dtype=np.float32).astype(np.float16)  # [blocks, bs, Hkv, D]
        order = np.random.default_rng(kv_len).permutation(cache_shape[0]).astype(np.int32)
        tables = itertools.cycle(list(cupy.asarray(order.reshape(copies, requests, blocks))))  # [B, blocks] each
        q = rng.standard_normal((requests * rows, heads, dim), dtype=np.float32).astype(np.float16)  # [T, Hq, D]
        batch_ids = cupy.repeat(cupy.arange(requests, dtype=np.int32), rows)  # [T]
        positions = cupy.tile(cupy.arange(kv_len - rows, kv_len, dtype=np.int32), requests)  # [T]
        pairs = requests * (kv_len * (kv_len + 1) - (kv_len - rows) * (kv_len - rows + 1)) // 2  # (row, position)
        label = f"{kind} B={requests}" + (f"x{rows}" if rows > 1 else "") + f" L={kv_len}"
        yield Case(label, kv_bytes + 2 * q.nbytes, 4 * pairs * dim * heads,
                   lambda q=q, k=k, v=v, tables=tables, b=batch_ids, p=positions:
                   paged_attention_cuda(q, k, v, next(tables), b, p, dim ** -0.5))


def bench_logprobs() -> Iterator[Case]:
    """Log-softmax and top-k of a verifying step's rows (cuda/logsoftmax_topk.cu) over SmolLM2's
    49,152-token vocabulary: one request's 6 rows, 64 requests' 298; the bytes are the rows' logits
    read once (the kernel reads each row twice, the second time mostly from L2)."""
    import cupy
    import numpy as np

    from cupyspec.logprobs.logsoftmax_topk import launch_top_logprobs

    vocab = 49152
    logits = cupy.random.default_rng(0).standard_normal((512, vocab), dtype=np.float32) * 3  # [R, V]
    for rows, k in ((6, 5), (298, 0), (298, 5), (298, 20)):
        picked = cupy.arange(rows, dtype=np.int64)  # [L]
        peak, log_total = cupy.empty(rows, np.float32), cupy.empty(rows, np.float64)
        top_ids, top_lps = cupy.empty((rows, k), np.int64), cupy.empty((rows, k), np.float32)
        yield Case(f"top-k rows={rows} k={k}", rows * vocab * 4, 3 * rows * vocab,
                   lambda p=picked, n=rows, k=k, outs=(peak, log_total, top_ids, top_lps):
                   launch_top_logprobs(logits, p, n, k, *outs))


CHAIN = 100  # kernels in bench_chain's graphs


def bench_chain() -> Iterator[Case]:
    """What a kernel costs in a CUDA graph when it waits for the one before, as a decode step's 150 or
    so do: CHAIN products of one row with SmolLM2-135M's o matrix ([576, 576], the gemv of
    cuda/gemv.cuh; its weights stay in L2), each multiplying the row the one before wrote, replayed as
    one graph, with and without programmatic dependent launch (cupyspec/kernels.py)."""
    import contextlib

    import cupy
    import numpy as np

    from cupyspec.kernels import programmatic_launches
    from cupyspec.model.linear import launch_gemv, weight_args

    n = 576
    w = (cupy.random.default_rng(0).standard_normal((n, n), dtype=np.float32) * n ** -0.5).astype(np.float16)
    rows = [cupy.ones((1, n), np.float16), cupy.empty((1, n), np.float16)]  # [1, N] each, read and written in turn
    for programmatic in (False, True):
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream, programmatic_launches() if programmatic else contextlib.nullcontext():
            stream.begin_capture()
            for i in range(CHAIN):
                launch_gemv("gemv_f16", w, (rows[i % 2], *weight_args(cupy, w), rows[1 - i % 2], np.int32(1),
                                            np.int32(n), np.int32(n)))
            graph = stream.end_capture()
        launch = "programmatic" if programmatic else "plain"
        yield Case(f"{CHAIN} o products M=1, {launch} launch", 2 * n * n, 2 * n * n, graph.launch, CHAIN)


BENCHES: dict[str, Callable[[], Iterator[Case]]] = {
    "attention": bench_attention,
    "chain": bench_chain,
    "linear": bench_linear,
    "logprobs": bench_logprobs,
    "packed": bench_packed,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", default=[], help="bench name prefixes")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--json", action="store_true", help="one JSON object per case instead of a table")
    args = p.parse_args()
    device, peak_bytes_per_s, peak_flops = device_peaks()
    if not args.json:
        print(device)
        print(f"{'case':<48}{'us':>10}{'GB/s':>10}{'% HBM':>8}{'TFLOP/s':>10}{'% TC':>7}")
    for name, bench in BENCHES.items():
        if args.only and not any(name.startswith(prefix) for prefix in args.only):
            continue
        for case in bench():
            us = time_call(case.call, args.repeats) / case.kernels
            bandwidth, flops = case.bytes_moved / (us * 1e-6), case.flops / (us * 1e-6)
            row = {"case": f"{name} {case.label}", "us": us, "GB/s": bandwidth / 1e9,
                   "hbm_fraction": bandwidth / peak_bytes_per_s, "TFLOP/s": flops / 1e12,
                   "tc_fraction": flops / peak_flops}
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(f"{row['case']:<48}{us:>10.2f}{row['GB/s']:>10.0f}{100 * row['hbm_fraction']:>7.1f}%"
                      f"{row['TFLOP/s']:>10.1f}{100 * row['tc_fraction']:>6.1f}%", flush=True)


if __name__ == "__main__":
    main()
