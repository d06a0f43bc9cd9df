"""`cupyspec-serve` argument handling: sizes, configuration errors (exit 2), start-up errors (exit 1),
device selection, and the README's usage block."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tiny_models import tiny_model_paths

from cupyspec import backend
from cupyspec.engine import AsyncEngine
from cupyspec.server.cli import build_parser, engine_config, main, parse_bytes
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
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    config = engine_config(args)
    assert (config.model, config.served_model_name, config.device, config.seed) == ("m.gguf", "m", "cpu", 3)
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
])
def test_bad_speculative_config_names_the_key_and_the_rule(spec: dict[str, Any] | str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        speculative_config_of(spec)
    assert str(info.value).startswith("speculative config") and message in str(info.value)


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
