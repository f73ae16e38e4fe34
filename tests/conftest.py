"""Shared fixtures and the skip rules of the GPU / optional-package markers."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


_SKIPS = {
    "gpu": (lambda: torch.cuda.is_available(), "needs a CUDA device; none is visible"),
    "kvikio": (
        lambda: torch.cuda.is_available() and _has("kvikio"),
        "needs kvikio (pip install -e .[gpu]) and a CUDA device",
    ),
    "te": (
        lambda: torch.cuda.is_available() and _has("transformer_engine"),
        "needs Transformer Engine (pip install -e .[gpu]) and a CUDA device",
    ),
    "megatron_lm": (
        lambda: bool(os.environ.get("MEGATRON_LM_PATH"))
        and os.path.isfile(os.path.join(os.environ["MEGATRON_LM_PATH"], "pretrain_gpt.py")),
        "needs a Megatron-LM checkout: set MEGATRON_LM_PATH to a directory holding pretrain_gpt.py",
    ),
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker, (available, reason) in _SKIPS.items():
            if marker in item.keywords and not available():
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def offload_dir(tmp_path):
    """A fresh offload directory on the same disk as the test's tmp_path."""
    d = tmp_path / "offload"
    d.mkdir()
    return str(d)
