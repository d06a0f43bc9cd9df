"""The wheel that `pip install .` builds: every module and CUDA source under `cupyspec/`, nothing else
at the top level. Built offline from a copy of the checkout, so stale `build/` folders cannot hide a gap."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Where each source folder lands in the wheel (pyproject's [tool.setuptools.package-dir]).
INSTALLED_AS = {"cupyspec": "cupyspec", "server": "cupyspec/server", "cuda": "cupyspec/cuda"}


def expected_files() -> set[str]:
    """Wheel paths of the checkout's Python modules and CUDA sources."""
    files = set()
    for folder, target in INSTALLED_AS.items():
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".cu", ".cuh") and "__pycache__" not in path.parts:
                files.add(f"{target}/{path.relative_to(ROOT / folder).as_posix()}")
    return files


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[zipfile.ZipFile]:
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source)
    for folder in INSTALLED_AS:
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "-q", "-w", str(out), str(source)], capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, f"the wheel did not build (setuptools>=77 comes with '.[test]'):\n{build.stderr}"
    (path,) = out.glob("cupyspec-*.whl")
    with zipfile.ZipFile(path) as archive:
        yield archive


def test_wheel_holds_every_module_and_cuda_source(wheel: zipfile.ZipFile) -> None:
    expected = expected_files()
    assert {"cupyspec/server/cli.py", "cupyspec/cuda/paged_attention.cu"} <= expected
    assert expected - set(wheel.namelist()) == set()


def test_wheel_installs_only_cupyspec_and_its_command(wheel: zipfile.ZipFile) -> None:
    top_level = {name.split("/")[0] for name in wheel.namelist()}
    (dist_info,) = top_level - {"cupyspec"}
    assert top_level == {"cupyspec", dist_info} and dist_info.endswith(".dist-info")
    assert wheel.read(f"{dist_info}/top_level.txt").decode().split() == ["cupyspec"]
    assert "cupyspec-serve = cupyspec.server.cli:main" in wheel.read(f"{dist_info}/entry_points.txt").decode()
