"""Pick and build the I/O engine named by ``io.engine``.

``auto`` builds the POSIX engine, which works on every machine; the kvikio (GPUDirect
Storage) engine is built only when ``io.engine`` names it, until it has been measured
on a GPU (docs/io.md)::

    engine = create_engine(load_config(OffloadConfig, "configs/io-nvme1.yaml"))
"""

from __future__ import annotations

from typing import Optional

from ..config import OffloadConfig
from .base import Engine
from .cuda import CudaOps
from .kvikio_backend import KvikioEngine
from .layout import Fault
from .posix import PosixEngine

__all__ = ["create_engine", "resolve_engine_name"]


def resolve_engine_name(config: OffloadConfig) -> str:
    """``posix`` or ``kvikio``: what ``create_engine`` builds for ``config``.

    ``auto`` resolves to ``posix`` on every machine, GPU or not, kvikio installed or not:
    the kvikio path has not been measured on a GPU, and the POSIX engine's staging ring
    frees device memory at PCIe speed (docs/io.md). ``kvikio`` is built only when asked
    for by name.
    """
    return "kvikio" if config.io.engine == "kvikio" else "posix"


def create_engine(config: OffloadConfig, rank: Optional[int] = None, fault: Optional[Fault] = None,
                  cuda: Optional[CudaOps] = None) -> Engine:
    """Build the engine for ``config``.

    Args:
        config: Offload settings; ``io.engine`` is ``auto``, ``posix`` or ``kvikio``.
        rank: Rank used in run directory names (default: torch.distributed, ``RANK``, 0).
        fault: Optional fault-injection hook, for tests.
        cuda: The CUDA calls to make (default: the real ones), for tests.

    Raises:
        ConfigError: bad paths, or ``kvikio`` asked for where kvikio or CUDA is missing.
    """
    if resolve_engine_name(config) == "kvikio":
        return KvikioEngine(config, rank, fault, cuda)
    return PosixEngine(config, rank, fault, cuda)
