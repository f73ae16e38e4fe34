"""Fixtures of the Megatron tests: running the CPU/gloo comparisons on any machine."""

from __future__ import annotations

import pytest

from megatron_ssd.megatron.cpu_mode import hide_cuda


@pytest.fixture(scope="module")
def cpu_only():
    """The CPU development path for the whole module, even where CUDA is available
    (NOTE [Hidden CUDA] in ``megatron_ssd/megatron/cpu_mode.py``): gloo, CPU models,
    CPU mode without ``force``. Tensor caches in these modules are given
    ``device="cpu"``, since a cache's ``auto`` device follows torch."""
    with hide_cuda():
        yield
