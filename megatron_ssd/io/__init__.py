"""I/O engines: the async protocol and its POSIX (O_DIRECT) and kvikio backends."""

from .base import ALIGN, Engine, EngineStats, Extent, IOFuture, SwapHandle, align_up

__all__ = ["ALIGN", "Engine", "EngineStats", "Extent", "IOFuture", "SwapHandle", "align_up"]
