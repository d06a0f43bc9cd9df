"""`cupyspec-serve` argument handling: sizes, configuration and address errors (exit 2, before the model
loads), start-up errors (exit 1), device selection, BLAS threads on the CPU, and the README's usage block."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits
from tiny_models import tiny_model_paths

from cupyspec import backend
from cupyspec.config import CacheConfig, EngineConfig
from cupyspec.engine import AsyncEngine
from cupyspec.server import cli
from cupyspec.server.cli import build_parser, check_listen_address, engine_config, main, parse_bytes
from cupyspec.spec_decode.speculative_config import SpeculativeConfig


def test_parse_bytes() -> None:
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("1024") == 1024
    assert parse_bytes("4k") == 4096
    for bad in ("", "GiB", "2 parsecs", "-1GiB", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bytes(bad)


def test_engine_config_from_arguments() -> None:
    args = build_parser().parse_args([
        "--model", "m.gguf", "--served-model-name", "m", "--device", "cpu", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "512", "--max-model-len", "1024", "--block-size", "32",
        "--kv-cache-memory", "64MiB", "--no-prefix-caching", "--max-waiting-requests", "5", "--seed", "3",
        "--tensor-parallel-size", "2", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    config = engine_config(args)
    assert (config.model, config.served_model_name, config.device, config.seed) == ("m.gguf", "m", "cpu", 3)
    assert config.tensor_parallel_size == 2
    decode = engine_config(build_parser().parse_args(["--role", "decode", "--prefill-url", "http://a:1",
                                                      "--prefill-url", "http://b:2", "--prefill-timeout", "5"]))
    assert (decode.role, decode.prefill_urls, decode.prefill_timeout_seconds) == (
        "decode", ("http://a:1", "http://b:2"), 5)
    assert (config.cache.block_size, config.cache.kv_cache_memory_bytes, config.cache.enable_prefix_caching) == (
        32, 64 * 2**20, False)
    s = config.scheduler
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.max_model_len, s.max_waiting_requests) == (8, 512, 1024, 5)
    assert (config.speculative.method, config.speculative.num_speculative_tokens) == ("ngram", 3)
    defaults = build_parser().parse_args([])
    assert (defaults.host, defaults.port, defaults.model) == ("127.0.0.1", 8000, "smollm2-135m-instruct")


@pytest.mark.parametrize("argv, message", [
    (["--speculative-config", '{"method": "ngram", "bogus": 1}'], "unknown key(s) bogus"),
    (["--speculative-config", "{not json"], "not valid JSON"),
    (["--speculative-config", '{"method": "warp"}'], "method must be one of"),
    (["--block-size", "12"], "block_size must be a power of two"),
    (["--kv-cache-memory", "lots"], "not a size"),
    (["--cpu-threads", "0"], "cpu_threads must be an integer >= 1"),
    (["--tensor-parallel-size", "0"], "tensor_parallel_size must be an integer >= 1"),
    (["--role", "decode"], "prefill_urls are given to the decode role"),
    (["--prefill-url", "http://127.0.0.1:8001"], "prefill_urls are given to the decode role"),
    (["--role", "decode", "--prefill-url", "http://a:1", "--prefill-timeout", "0"], "prefill_timeout_seconds must be"),
])
def test_bad_configuration_exits_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err and "Traceback" not in err


def speculative_config_of(spec: dict[str, Any] | str) -> SpeculativeConfig:
    text = spec if isinstance(spec, str) else json.dumps(spec)
    return engine_config(build_parser().parse_args(["--speculative-config", text])).speculative


NGRAM: dict[str, Any] = {"method": "ngram"}
SUFFIX: dict[str, Any] = {"method": "suffix"}


@pytest.mark.parametrize("spec, message", [
    ({**NGRAM, "num_speculative_tokens": 9}, "num_speculative_tokens must be an integer from 0 to 8, not 9"),
    ({**NGRAM, "num_speculative_tokens": -1}, "num_speculative_tokens must be an integer from 0 to 8, not -1"),
    ({**NGRAM, "num_speculative_tokens": True}, "num_speculative_tokens must be an integer from 0 to 8, not True"),
    ({**NGRAM, "num_speculative_tokens": 2.0}, "num_speculative_tokens must be an integer from 0 to 8, not 2.0"),
    ({**NGRAM, "num_speculative_tokens": "3"}, "num_speculative_tokens must be an integer from 0 to 8, not '3'"),
    ({"num_speculative_tokens": 3}, "'method' is required"),
    ({**NGRAM, "verify_strategy": "strict"},
     "verify_strategy must be one of rejection, greedy, target_match, topp, not 'strict'"),
    ({**NGRAM, "accept_policy": "sometimes"},
     "accept_policy must be one of normal, accept_all, reject_all, not 'sometimes'"),
    ({**NGRAM, "ngram_min": 3, "ngram_max": 2}, "1 <= ngram_min <= ngram_max, not 3 and 2"),
    ({**NGRAM, "ngram_max": False}, "ngram_min and ngram_max must be integers"),
    ({**NGRAM, "max_draft_tokens_per_step": True}, "max_draft_tokens_per_step must be a non-negative integer"),
    ({**NGRAM, "min_acceptance_rate": -0.1}, "min_acceptance_rate must be a number in [0, 1], not -0.1"),
    ({**NGRAM, "cost_aware_backoff": 1}, "cost_aware_backoff must be true or false, not 1"),
    ({**SUFFIX, "suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth must be a positive integer"),
    ({**SUFFIX, "suffix_decoding_max_cached_requests": -2}, "suffix_decoding_max_cached_requests must be an integer"),
    ({**SUFFIX, "suffix_decoding_max_spec_factor": 0}, "suffix_decoding_max_spec_factor must be a positive number"),
    ({**SUFFIX, "suffix_decoding_max_spec_factor": True}, "suffix_decoding_max_spec_factor must be a positive number"),
    ({**SUFFIX, "suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob must be a number in [0, 1]"),
    ({**SUFFIX, "suffix_decoding_min_token_prob": False}, "suffix_decoding_min_token_prob must be a number in [0, 1]"),
    ('["ngram"]', "must be a JSON object"),
    ({"method": "mtp", "num_speculative_tokens": 1, "model": "head", "quantization": "int4"},
     "quantization must be one of wint8, wint4, not 'int4'"),
    ({"method": "mtp", "num_speculative_tokens": 1, "num_model_steps": 2, "model": "head"},
     "num_speculative_tokens must be at least num_model_steps"),
])
def test_bad_speculative_config_names_the_key_and_the_rule(spec: dict[str, Any] | str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        speculative_config_of(spec)
    assert str(info.value).startswith("speculative config") and message in str(info.value)


def test_mtp_without_a_head_file_takes_the_default_models_shipped_head(tmp_path) -> None:
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 3, "num_model_steps": 3})
    assert engine_config(build_parser().parse_args(["--speculative-config", spec])).speculative.model is None
    with pytest.raises(ValueError, match="method 'mtp' needs 'model'"):
        engine_config(build_parser().parse_args(["--model", str(tmp_path / "other.gguf"), "--speculative-config",
                                                 spec]))


def test_naive_forces_no_drafts_and_limits_are_accepted() -> None:
    naive = speculative_config_of({"method": "naive", "num_speculative_tokens": 5})
    assert (naive.method, naive.num_speculative_tokens) == ("naive", 0)
    edge = speculative_config_of({**SUFFIX, "num_speculative_tokens": 8, "suffix_decoding_min_token_prob": 1,
                                  "suffix_decoding_max_cached_requests": -1, "min_acceptance_rate": 0})
    assert (edge.num_speculative_tokens, edge.verify_strategy, edge.accept_policy) == (8, "rejection", "normal")
    assert not speculative_config_of("").enabled


def test_start_error_exits_1_without_traceback(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit) as info:
        main(["--model", str(tmp_path / "missing.gguf"), "--device", "cpu", "--port", "0"])
    err = capsys.readouterr().err
    assert info.value.code == 1 and err.startswith("error: ") and "Traceback" not in err


def test_readme_usage_lists_every_flag() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    usage = readme.split("## Command line", 1)[1].split("```")[1]
    flags = set(re.findall(r"--[a-z][a-z-]*", build_parser().format_usage())) - {"--help"}
    assert len(flags) > 15 and {flag for flag in flags if f"[{flag}" not in usage} == set()


NO_GPU = "no CUDA device is visible"


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend, "_cuda_unavailable_reason", lambda: NO_GPU)


@pytest.mark.usefixtures("no_gpu")
def test_device_cuda_without_a_gpu_exits_1_with_the_reason(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    _hf, gguf_path = tiny_model_paths(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["--model", str(gguf_path), "--device", "cuda", "--port", "0"])
    assert info.value.code == 1 and capsys.readouterr().err == f"error: --device cuda: {NO_GPU}\n"


@pytest.mark.usefixtures("no_gpu")
def test_device_auto_without_a_gpu_runs_on_the_cpu_with_a_warning(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    _hf, gguf_path = tiny_model_paths(tmp_path)
    config = engine_config(build_parser().parse_args(["--model", str(gguf_path), "--kv-cache-memory", "4MiB"]))
    assert config.device == "auto"

    async def start_and_stop() -> AsyncEngine:
        engine = await AsyncEngine.create(config)
        await engine.shutdown(0)
        return engine

    with caplog.at_level(logging.WARNING, logger="cupyspec"):
        engine = asyncio.run(start_and_stop())
    assert (engine.backend.device, engine.backend.xp, engine.backend.dtype) == ("cpu", np, np.float32)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"no usable GPU ({NO_GPU}): running on the CPU with NumPy"]


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if `main` gets as far as starting the engine."""
    def load(*_args: object) -> None:
        raise AssertionError("the engine started")
    monkeypatch.setattr(cli, "run_loop", load)


def exit_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int | str | None, str, float]:
    """`main(argv)`'s exit status, its stderr's last line, and the seconds it took."""
    started = time.monotonic()
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return info.value.code, err.strip().splitlines()[-1], time.monotonic() - started


@pytest.mark.usefixtures("no_model_load")
@pytest.mark.parametrize("argv, message", [
    (["--port", "70000"], "argument --port: the port must be from 0 to 65535, not 70000"),
    (["--port", "-1"], "argument --port: the port must be from 0 to 65535, not -1"),
    (["--port", "http"], "argument --port: not a port number: 'http'"),
    (["--host", "no-such-host.invalid"], "--host 'no-such-host.invalid' does not resolve to an address"),
    (["--host", "192.0.2.1", "--port", "0"], "cannot listen on --host '192.0.2.1' --port 0"),
])
def test_bad_address_exits_2_before_the_model_loads(argv: list[str], message: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, last_line, seconds = exit_of(argv, capsys)
    assert code == 2 and last_line.startswith("cupyspec-serve: error: ") and message in last_line
    assert seconds < 1.0


@pytest.mark.usefixtures("no_model_load")
def test_address_in_use_exits_2_before_the_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, last_line, seconds = exit_of(["--host", "127.0.0.1", "--port", str(port)], capsys)
    assert code == 2 and f"cannot listen on --host '127.0.0.1' --port {port}: Address already in use" in last_line
    assert seconds < 1.0


def test_free_addresses_pass_the_check() -> None:
    check_listen_address("127.0.0.1", 0)
    check_listen_address("localhost", 0)
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    check_listen_address("127.0.0.1", port)
    assert build_parser().parse_args(["--port", "0"]).port == 0
    assert "0 picks a free one" in build_parser().format_help()


def test_cpu_threads_reaches_the_config() -> None:
    assert engine_config(build_parser().parse_args(["--cpu-threads", "3"])).cpu_threads == 3
    assert engine_config(build_parser().parse_args([])).cpu_threads is None
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="cpu_threads"):
            EngineConfig(cpu_threads=bad)  # type: ignore[arg-type]


def blas_threads() -> set[int]:
    return {pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"}


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_engine_limits_the_blas_threads(tmp_path: Path, threads: int, caplog: pytest.LogCaptureFixture) -> None:
    _hf, gguf_path = tiny_model_paths(tmp_path)
    config = EngineConfig(model=str(gguf_path), device="cpu", cpu_threads=threads,
                          cache=CacheConfig(kv_cache_memory_bytes=4 * 2**20))

    async def start_and_stop() -> set[int]:
        engine = await AsyncEngine.create(config)
        limits = blas_threads()
        await engine.shutdown(0)
        return limits

    # the limit holds for the whole process: the test gives the previous one back
    with threadpool_limits(limits=None, user_api="blas"), caplog.at_level(logging.INFO, logger="cupyspec"):
        assert asyncio.run(start_and_stop()) == {threads}
    assert f"CPU: BLAS threads {threads}" in caplog.text


def test_cpu_threads_default_to_the_cpus_the_process_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in backend.BLAS_THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with threadpool_limits(limits=None, user_api="blas"):
        threadpool_limits(limits=backend.available_cpus() + 1, user_api="blas")
        backend.limit_cpu_threads(None)
        assert blas_threads() == {backend.available_cpus()}


def test_a_blas_thread_variable_keeps_its_number(monkeypatch: pytest.MonkeyPatch) -> None:
    with threadpool_limits(limits=None, user_api="blas"):
        for threads in (2, 1):
            monkeypatch.setenv("OPENBLAS_NUM_THREADS", str(threads))
            threadpool_limits(limits=threads, user_api="blas")  # as the variable does when BLAS loads
            backend.limit_cpu_threads(None)
            assert blas_threads() == {threads}


@pytest.mark.parametrize("cpu_max,bound", [("max 100000", None), ("300000 100000", 3), ("50000 100000", 1)])
def test_available_cpus_follow_a_cgroup_quota(tmp_path: Path, cpu_max: str, bound: int | None) -> None:
    path = tmp_path / "cpu.max"
    path.write_text(cpu_max + "\n")
    affinity = backend.available_cpus(str(tmp_path / "missing"))
    assert backend.available_cpus(str(path)) == (affinity if bound is None else min(affinity, bound))