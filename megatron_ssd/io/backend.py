"""Block backends: how one block of a blob moves between memory and a file.

NOTE [Block backends]: :class:`~megatron_ssd.io.striped.StripedEngine` owns everything the
ways of moving bytes share: the layout and its file descriptors (through
:class:`~megatron_ssd.io.descriptors.Descriptors`), striping, the worker pool and its I/O
slots (NOTE [I/O slots]), backpressure (:class:`~megatron_ssd.io.admission.Admission`),
blob completion, failed paths and writes (:class:`~megatron_ssd.io.recovery.Recovery`),
checksum bookkeeping, the stall watchdog and the stats. A backend moves one block, on a
worker thread, with what the engine lends it, :class:`BlockServices` and nothing more:
``io_slots`` (held only around the transfer itself), ``fault`` (the fault-injection
hook, consulted before each transfer), ``watch`` / ``watch_progress`` / ``watch_end`` (the
stall watchdog) and ``count`` (an extra stat). :class:`~megatron_ssd.io.posix.PosixBackend` (O_DIRECT ``pwrite`` /
``preadv``, CUDA memory through pinned staging) and
:class:`~megatron_ssd.io.kvikio_backend.KvikioBackend` (cuFile for CUDA memory, a POSIX
backend of its own for host memory) are peers under it; another
mechanism (io_uring, say) is a third subclass of :class:`BlockBackend` and reuses the
rest unchanged.
"""

from __future__ import annotations

import abc
import threading
from typing import Optional, Protocol

import torch

from ..config import IOConfig
from .blocks import BlobOp, Block
from .cuda import CopyStreams, CudaOps, FreshBuffers
from .layout import Fault, Layout

__all__ = ["BlockBackend", "BlockServices"]


class BlockServices(Protocol):
    """What a backend may use of the engine it serves (NOTE [Block backends]);
    :class:`~megatron_ssd.io.striped.StripedEngine` provides it."""

    io: IOConfig
    """The I/O settings."""
    cuda: CudaOps
    """Every CUDA call (a recording fake in tests)."""
    cuda_offload: bool
    """Whether CUDA tensors may come."""
    streams: CopyStreams
    """The device-to-host and host-to-device copy streams."""
    fresh: FreshBuffers
    """CUDA read buffers not read into yet."""
    fault: Optional[Fault]
    """The fault-injection hook, consulted before each transfer."""
    io_slots: threading.BoundedSemaphore
    """Held around each transfer (NOTE [I/O slots])."""

    @property
    def layout(self) -> Layout:
        """The run directories and files."""

    def watch(self, op: str, file: str, offset: int, nbytes: int) -> Optional[int]:
        """Register a disk request with the stall watchdog; a token, or None."""

    def watch_progress(self, token: Optional[int], offset: int, nbytes: int) -> None:
        """The request ``token`` moved on."""

    def watch_end(self, token: Optional[int]) -> None:
        """The request ``token`` ended."""

    def blocks_staged(self, op: BlobOp, n: int) -> None:
        """``n`` more blocks of the write ``op`` no longer read its source."""

    def keep_bytes(self, op: BlobOp, block: Block, data: torch.Tensor) -> None:
        """``data`` holds ``block``'s bytes and is about to be given back."""

    def count(self, name: str, nbytes: float) -> None:
        """Add to the extra stat ``name``."""


class BlockBackend(abc.ABC):
    """Moves single blocks for a :class:`~megatron_ssd.io.striped.StripedEngine`.

    Args:
        services: what it may use of the engine it serves; built by the engine once its
            layout and workers run.
    """

    def __init__(self, services: BlockServices) -> None:
        self.services = services

    def prepare(self, op: BlobOp) -> None:
        """Called on the submitting thread before any block of ``op`` is queued (e.g. to
        record the caller's CUDA stream position)."""

    def skew(self, src: torch.Tensor) -> int:
        """Bytes the first block of a blob written from ``src`` starts into its first
        disk page (NOTE [Skewed blocks] in ``posix.py``); 0: none."""
        return 0

    @abc.abstractmethod
    def write_block(self, op: BlobOp, block: Block) -> None:
        """Move one block of ``op.tensor`` to ``block.fd`` at ``block.offset``; set
        ``block.checksum`` when ``op.checksum``. Runs on a worker thread."""

    @abc.abstractmethod
    def read_block(self, op: BlobOp, block: Block) -> None:
        """Fill one block of ``op.tensor`` from disk; verify ``block.expected`` when set.
        Runs on a worker thread."""

    def discard_block(self, op: BlobOp, block: Block) -> None:
        """``block`` of ``op`` is skipped (the write was cancelled, or an earlier block
        failed): give back what :meth:`prepare` set aside for it. Runs on a worker thread."""

    def forget_file(self, file: str) -> None:
        """``file`` is about to be unlinked (the ``file`` layout frees a blob): close any
        handle of it the backend keeps. No block of it is in flight."""

    def close(self) -> None:
        """Release what the backend holds; called once, after the workers stopped."""
