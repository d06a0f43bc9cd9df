"""cupyspec: a speculative-decoding LLM inference engine on CuPy, with a NumPy fallback."""

from pathlib import Path as _Path

# In a source checkout `server/` and `cuda/` sit beside this package and are installed as
# `cupyspec.server` and `cupyspec.cuda`; let the same import names work without installing.
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "server" / "__init__.py").is_file():
    __path__.append(str(_checkout))  # type: ignore[name-defined]  # noqa: F821

__version__ = "0.1.0"
