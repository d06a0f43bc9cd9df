"""`cupyspec-serve`: start the engine and serve the OpenAI-compatible API until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import signal
import socket
import sys
from collections.abc import Coroutine
from contextlib import ExitStack
from typing import Any

from cupyspec.config import CacheConfig, EngineConfig, SchedulerConfig
from cupyspec.model.quantized import METHODS as QUANTIZATION_METHODS
from cupyspec.spec_decode.proposers.mtp import head_file
from cupyspec.spec_decode.speculative_config import SpeculativeConfig

log = logging.getLogger("cupyspec.server")

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_bytes(text: str) -> int:
    """A size such as `2GiB`, `512MiB`, `1.5GB` or `1073741824` in bytes (K/M/G/T alone are binary)."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 2GiB, 512MiB, 1.5GB, 1073741824)")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"the size must be positive, not {text!r}")
    return size


def parse_port(text: str) -> int:
    """A TCP port number from 0 to 65535 (0: any free port)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"the port must be from 0 to 65535, not {port}")
    return port


def check_listen_address(host: str, port: int) -> None:
    """Raise ValueError unless `host` resolves and every address it names can be bound with `port`,
    as the server binds them later (all at once, IPv6 sockets IPv6-only, addresses reusable); the
    sockets are closed again."""
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"--host {host!r} does not resolve to an address: {exc}") from None
    with ExitStack() as sockets:
        for family, kind, proto, _name, address in dict.fromkeys(addresses):
            sock = sockets.enter_context(socket.socket(family, kind, proto))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                raise ValueError(f"cannot listen on --host {host!r} --port {port}: {exc.strerror}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cupyspec-serve", description="Serve an OpenAI-compatible API with "
                                "speculative decoding on CuPy (GPU) or NumPy (CPU).")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="a known model name, a .gguf file or a Hugging Face llama/qwen2 directory")
    p.add_argument("--served-model-name", help="the name clients use in `model` (default: --model)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; the default accepts local clients only, 0.0.0.0 accepts all")
    p.add_argument("--port", type=parse_port, default=8000, help="TCP port to listen on; 0 picks a free one")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--cpu-threads", type=int, metavar="N",
                   help="CPU: threads of the BLAS library that runs the model's matrix products (default: the "
                        "CPUs this process may use, unless OPENBLAS_NUM_THREADS or OMP_NUM_THREADS is set); "
                        "fewer where other busy processes share the cores")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split the model's heads, MLP and vocabulary across GPUs 0..N-1 (on the CPU, threads)")
    p.add_argument("--role", choices=("both", "prefill", "decode"), default="both",
                   help="prefill/decode disaggregation: prefill runs prompts for decode servers, decode hands "
                        "each prompt to a prefill server (--prefill-url) and decodes it; both serves alone")
    p.add_argument("--prefill-url", action="append", default=[], metavar="URL",
                   help="decode role: a prefill server, e.g. http://10.0.0.2:8001 (repeat for several)")
    p.add_argument("--prefill-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="decode role: the most a prefill server's answer, or the read of a prompt's K/V, may "
                        "take before the next server is tried or the prompt is computed here")
    p.add_argument("--quantization", choices=QUANTIZATION_METHODS, type=str.lower,
                   help="weight-only quantization of the decoder's matrices, packed on the device: wint8 or wint4 "
                        "(8 or 4 bits, a scale and minimum per 32 weights); default: fp16")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    p.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (a power of two)")
    p.add_argument("--kv-cache-memory", type=parse_bytes,
                   help="bytes for the KV cache, e.g. 2GiB (default: a share of free GPU memory, 1GiB on CPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                   help="share of free GPU memory after the weights that the KV cache may take")
    p.add_argument("--no-prefix-caching", action="store_true", help="do not reuse KV blocks of shared prefixes")
    p.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="queue length beyond which new requests get HTTP 503")
    p.add_argument("--speculative-config", help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    p.add_argument("--no-logprobs-overlap", action="store_true",
                   help="compute a speculative step's logprobs after verification, not beside it on a "
                        "second CUDA stream")
    p.add_argument("--no-overlap-scheduling", action="store_true",
                   help="form each step after the host has the tokens of the one before (for measurement)")
    p.add_argument("--no-warm-up", action="store_true",
                   help="GPU: skip the start-up requests that compile every kernel (the first requests pay instead)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="GPU: launch every kernel from Python instead of replaying captured CUDA graphs")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="send a request's streamed output every N tokens (the first and the last at once)")
    p.add_argument("--seed", type=int, default=0, help="seeds requests that give no seed")
    p.add_argument("--event-loop", default="uvloop", choices=("uvloop", "asyncio"),
                   help="the asyncio event loop: uvloop's (half the host time per turn of the loop, which the "
                        "engine and every stream take each step) or the standard library's")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests may take to finish on SIGINT/SIGTERM before they are aborted")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's configuration from the command line; invalid values raise ValueError."""
    speculative = SpeculativeConfig.from_json(args.speculative_config)
    if speculative.method == "mtp":
        head_file(speculative, args.model)  # an MTP head is given or ships for the model
    return EngineConfig(
        model=args.model, device=args.device, served_model_name=args.served_model_name, seed=args.seed,
        cpu_threads=args.cpu_threads, tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization,
        role=args.role, prefill_urls=tuple(args.prefill_url), prefill_timeout_seconds=args.prefill_timeout,
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory_bytes=args.kv_cache_memory,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          enable_prefix_caching=not args.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=args.max_model_len, max_waiting_requests=args.max_waiting_requests),
        speculative=speculative,
        overlap_logprobs=not args.no_logprobs_overlap,
        cuda_graphs=not args.enforce_eager,
        overlap_scheduling=not args.no_overlap_scheduling,
        warm_up=False if args.no_warm_up else None,
        stream_interval=args.stream_interval,
    )


async def serve(config: EngineConfig, host: str, port: int, shutdown_timeout: float) -> None:
    """Run until SIGINT or SIGTERM; then stop accepting, let the engine finish or abort its requests."""
    from cupyspec.engine import AsyncEngine
    from cupyspec.engine.gc_policy import settle_garbage_collector
    from cupyspec.server.app import create_app, start_server

    engine = await AsyncEngine.create(config)
    app = create_app(engine, config.role == "prefill")
    settle_garbage_collector()

    async def stop_engine(_app: object) -> None:  # runs after the listening sockets are closed
        await engine.shutdown(shutdown_timeout)

    app.on_shutdown.append(stop_engine)
    try:
        runner, bound_port = await start_server(app, host, port, shutdown_timeout)
    except BaseException:
        await engine.shutdown(0)
        raise
    shown_host = f"[{host}]" if ":" in host else host
    log.info("serving %s on http://%s:%d (OpenAI API under /v1)", engine.model_name, shown_host, bound_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    loop.remove_signal_handler(signal.SIGINT)  # a second Ctrl-C interrupts the graceful shutdown
    log.info("shutting down: no new connections; running requests get %.0f s to finish", shutdown_timeout)
    await runner.cleanup()


def run_loop(kind: str, main: Coroutine[Any, Any, None]) -> None:
    """Run `main` to its end on a new event loop of `kind` ("uvloop" or "asyncio")."""
    if kind == "uvloop":
        import uvloop

        uvloop.run(main)
    else:
        asyncio.run(main)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = engine_config(args)
        check_listen_address(args.host, args.port)  # before the model loads, which takes a while
    except ValueError as exc:
        parser.error(str(exc))  # exits with status 2
    try:
        run_loop(args.event_loop, serve(config, args.host, args.port, args.shutdown_timeout))
    except (OSError, RuntimeError, ValueError, ImportError) as exc:
        log.debug("start-up failed", exc_info=True)
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C while loading, or a second one while shutting down
        sys.exit(130)


if __name__ == "__main__":
    main()
