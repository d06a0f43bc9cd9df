"""Shared fixtures: the default model file, and skipping GPU tests without a GPU."""

from __future__ import annotations

import pytest

from cupyspec.backend import _cuda_unavailable_reason


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if "gpu" in item.keywords:
            reason = reason or _cuda_unavailable_reason() or ""
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"needs a GPU: {reason}"))


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """The default model's GGUF (fetched once into the cache folder, or $CUPYSPEC_MODEL)."""
    from cupyspec.loader.default_model import resolve_model

    return str(resolve_model("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def tiny_mtp(tmp_path_factory) -> tuple[str, str]:
    """A tiny llama GGUF and a random MTP head file for it: (model path, head path)."""
    from tiny_models import TinySpec, random_head_weights, tiny_model_paths, write_head_file

    folder = tmp_path_factory.mktemp("tiny_mtp")
    gguf_path = tiny_model_paths(folder, "llama")[1]
    head = write_head_file(folder / "head.safetensors", random_head_weights(TinySpec()))
    return str(gguf_path), str(head)
