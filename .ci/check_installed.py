"""Run from outside the source tree: the installed cupyspec comes from site-packages, holds every CUDA
source of the checkout and the shipped MTP heads with their checksums, and installs no top-level
module besides `cupyspec`."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import sysconfig
from pathlib import Path

import cupyspec
from cupyspec.kernels import cuda_source_dir
from cupyspec.loader.default_model import KNOWN_MODELS, shipped_mtp_head

checkout = Path(sys.argv[1])
site_packages = Path(sysconfig.get_paths()["purelib"]).resolve()
location = Path(cupyspec.__file__).resolve()
assert location.is_relative_to(site_packages), f"cupyspec imported from {location}, not from {site_packages}"
want = sorted(p.name for p in (checkout / "cuda").iterdir() if p.suffix in (".cu", ".cuh"))
got = sorted(p.name for p in cuda_source_dir().iterdir() if p.suffix in (".cu", ".cuh"))
assert got == want, f"installed CUDA sources {got}, checkout {want}"
for name in KNOWN_MODELS:
    shipped = shipped_mtp_head(name)
    if shipped is not None:
        path, sha256 = shipped
        assert path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == sha256, f"{path} missing or changed"
for stray in ("server", "cuda"):
    assert importlib.util.find_spec(stray) is None, f"a top-level {stray!r} module is installed"
print(f"installed package OK: {location.parent}, {len(got)} CUDA sources")
