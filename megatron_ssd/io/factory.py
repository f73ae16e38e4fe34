"""Pick and build the I/O engine named by ``io.engine``.

``auto`` takes kvikio (GPUDirect Storage) when kvikio is installed, CUDA is available
and the offloaded tensors live on a CUDA device; everything else uses the POSIX engine,
which works on every machine::

    engine = create_engine(load_config(OffloadConfig, "configs/io-nvme1.yaml"))
"""

from __future__ import annotations

from typing import Optional

import torch

from ..config import OffloadConfig
from .base import Engine
from .kvikio_engine import KvikioEngine, kvikio_available
from .layout import Fault
from .posix import PosixEngine

__all__ = ["create_engine", "resolve_engine_name"]


def _offload_device_is_cuda(config: OffloadConfig) -> bool:
    if config.device == "auto":
        return torch.cuda.is_available()
    return config.device.startswith("cuda")


def resolve_engine_name(config: OffloadConfig) -> str:
    """``posix`` or ``kvikio``: what ``create_engine`` builds for ``config``."""
    if config.io.engine != "auto":
        return config.io.engine
    if kvikio_available() and torch.cuda.is_available() and _offload_device_is_cuda(config):
        return "kvikio"
    return "posix"


def create_engine(config: OffloadConfig, rank: Optional[int] = None, fault: Optional[Fault] = None) -> Engine:
    """Build the engine for ``config``.

    Args:
        config: Offload settings; ``io.engine`` is ``auto``, ``posix`` or ``kvikio``.
        rank: Rank used in run directory names (default: torch.distributed, ``RANK``, 0).
        fault: Optional fault-injection hook, for tests.

    Raises:
        ConfigError: bad paths, or ``kvikio`` asked for where kvikio or CUDA is missing.
    """
    if resolve_engine_name(config) == "kvikio":
        return KvikioEngine(config, rank, fault)
    return PosixEngine(config, rank, fault)
