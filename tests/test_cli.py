"""`cupyspec-serve` argument handling: sizes, configuration errors (exit 2) and start-up errors (exit 1)."""

from __future__ import annotations

import argparse

import pytest

from cupyspec.server.cli import build_parser, engine_config, main, parse_bytes


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


def test_start_error_exits_1_without_traceback(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit) as info:
        main(["--model", str(tmp_path / "missing.gguf"), "--device", "cpu", "--port", "0"])
    err = capsys.readouterr().err
    assert info.value.code == 1 and err.startswith("error: ") and "Traceback" not in err
