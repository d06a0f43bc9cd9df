"""`cupyspec-serve` in a process of its own on a free port of 127.0.0.1, for the benchmarks and the
tests that need a server outside their own process."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path


class ServeProcess:
    """One server process, its output in `log_path`; `wait_ready` gives its `base_url`."""

    def __init__(self, args: Sequence[str], log_path: Path) -> None:
        self.log_path = log_path
        with log_path.open("w") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "cupyspec.server.cli", "--port", "0", *args],
                                            stdout=log, stderr=subprocess.STDOUT)
        self.base_url = ""

    def wait_ready(self, timeout: float = 120.0) -> ServeProcess:
        """Wait until it listens; RuntimeError with the end of its log if it exits or takes longer."""
        deadline = time.monotonic() + timeout
        while not self.base_url:
            match = re.search(r"on (http://127\.0\.0\.1:\d+)", self.log_path.read_text())
            if match:
                self.base_url = match.group(1)
            elif self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server of {self.log_path} did not start:\n{self.log_path.read_text()[-3000:]}")
            else:
                time.sleep(0.1)
        return self

    def metrics(self) -> dict[str, float]:
        """Its Prometheus metrics, by name without the `cupyspec:` prefix (each summed over its labels)."""
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=30) as response:
            text = response.read().decode()
        values: dict[str, float] = {}
        for name, value in re.findall(r"^cupyspec:(\w+)(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE):
            values[name] = values.get(name, 0.0) + float(value)
        return values

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Wait until no request runs or waits and no KV block is held; returns the last metrics."""
        deadline = time.monotonic() + timeout
        while True:
            values = self.metrics()
            busy = values["num_requests_running"], values["num_requests_waiting"], values["kv_cache_usage_perc"]
            if not any(busy) or time.monotonic() > deadline:
                return values
            time.sleep(0.05)

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM (a graceful shutdown), then SIGKILL if it has not exited within `timeout` s."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
