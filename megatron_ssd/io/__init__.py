"""I/O engines: the async protocol and its POSIX (O_DIRECT) and kvikio backends."""

from .base import ALIGN, Engine, EngineStats, Extent, IOFuture, SwapHandle, align_up
from .buffers import BufferPool, aligned_empty
from .factory import create_engine, resolve_engine_name
from .kvikio_backend import KvikioEngine, kvikio_available
from .layout import ExtentLayout, FileLayout, Layout
from .mapped import mapped_bytes, mapped_empty
from .posix import PosixEngine
from .rundir import remove_stale_runs

__all__ = [
    "ALIGN",
    "BufferPool",
    "Engine",
    "EngineStats",
    "Extent",
    "ExtentLayout",
    "FileLayout",
    "IOFuture",
    "KvikioEngine",
    "Layout",
    "PosixEngine",
    "SwapHandle",
    "align_up",
    "aligned_empty",
    "create_engine",
    "kvikio_available",
    "mapped_bytes",
    "mapped_empty",
    "remove_stale_runs",
    "resolve_engine_name",
]
