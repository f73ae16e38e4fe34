"""Aligned host buffers for O_DIRECT and a small pool of staging buffers.

O_DIRECT needs buffer addresses, file offsets and request sizes that are multiples of
:data:`~megatron_ssd.io.base.ALIGN`. PyTorch's CPU allocator only aligns to 64 bytes
(large tensors start 64 bytes past a page boundary), so aligned buffers are cut out of
a slightly larger tensor::

    buf = aligned_empty(10_000, pin=False)     # 12288 bytes, data_ptr() % 4096 == 0
    pool = BufferPool.from_config(cfg.io, pin=torch.cuda.is_available())
    staging = pool.acquire()
    try:
        ...
    finally:
        pool.release(staging)
"""

from __future__ import annotations

import threading
import time
from typing import List, Optional

import torch

from ..config import IOConfig
from .base import ALIGN, align_up

__all__ = ["aligned_empty", "is_aligned", "tensor_buffer", "BufferPool"]


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """An uninitialised 1-D ``uint8`` CPU tensor whose address is a multiple of ALIGN.

    Args:
        nbytes: Bytes needed; the tensor holds ``align_up(max(nbytes, 1))`` bytes so
            that a padded O_DIRECT request on its tail stays inside it.
        pin: Allocate page-locked memory (used for CUDA staging). Ignored when CUDA is
            not available.

    Returns:
        A view into a private, over-allocated tensor; the view keeps it alive.
    """
    if nbytes < 0:
        raise ValueError(f"megatron_ssd: aligned_empty(nbytes={nbytes}): must be >= 0")
    capacity = align_up(max(nbytes, 1))
    pin = bool(pin) and torch.cuda.is_available()
    raw = torch.empty(capacity + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip : skip + capacity]


def is_aligned(t: torch.Tensor, offset: int = 0, nbytes: int = 0) -> bool:
    """True when ``t``'s byte ``offset`` is ALIGN-aligned in memory and ``nbytes`` is too."""
    return (t.data_ptr() + offset) % ALIGN == 0 and nbytes % ALIGN == 0


def tensor_buffer(t: torch.Tensor, offset: int, nbytes: int) -> memoryview:
    """A writable memoryview of ``nbytes`` bytes of the CPU ``uint8`` tensor ``t``.

    No copy: ``os.pwrite`` / ``os.preadv`` work on the tensor's memory directly. The
    caller keeps ``t`` alive while the view is in use.
    """
    return memoryview(t[offset : offset + nbytes].numpy()).cast("B")


class BufferPool:
    """A fixed set of equally sized aligned staging buffers.

    ``acquire`` blocks while every buffer is out; buffers are never allocated after
    construction, so the pool bounds staging memory.

    Args:
        count: Number of buffers.
        nbytes: Size of each buffer (rounded up to ALIGN).
        pin: Page-locked buffers (CUDA staging); ignored without CUDA.
    """

    def __init__(self, count: int, nbytes: int, pin: bool = False) -> None:
        if count <= 0 or nbytes <= 0:
            raise ValueError(
                f"megatron_ssd: BufferPool(count={count}, nbytes={nbytes}): both must be > 0"
            )
        self.nbytes = align_up(nbytes)
        self.count = count
        self.pinned = bool(pin) and torch.cuda.is_available()
        self._all: List[torch.Tensor] = [aligned_empty(self.nbytes, self.pinned) for _ in range(count)]
        self._free: List[torch.Tensor] = list(self._all)
        self._cv = threading.Condition()
        self.wait_s = 0.0
        """Total time callers spent blocked in :meth:`acquire`."""

    @classmethod
    def from_config(cls, io: IOConfig, pin: bool = False) -> "BufferPool":
        """One block-sized buffer per engine worker (``2 * io.threads``; each holds one)."""
        return cls(2 * io.threads, io.block_bytes, pin)

    def acquire(self, timeout: Optional[float] = None) -> torch.Tensor:
        """Take a buffer, waiting while none is free.

        Raises:
            TimeoutError: ``timeout`` seconds passed without a free buffer.
        """
        with self._cv:
            if not self._free:
                start = time.perf_counter()
                if not self._cv.wait_for(lambda: bool(self._free), timeout):
                    raise TimeoutError(
                        f"megatron_ssd: no staging buffer free after {timeout}s "
                        f"({self.count} buffers of {self.nbytes} bytes)"
                    )
                self.wait_s += time.perf_counter() - start
            return self._free.pop()

    def release(self, buf: torch.Tensor) -> None:
        """Give back a buffer obtained from :meth:`acquire`."""
        with self._cv:
            if not any(buf is b for b in self._all) or any(buf is b for b in self._free):
                raise ValueError("megatron_ssd: BufferPool.release: buffer is not an acquired buffer of this pool")
            self._free.append(buf)
            self._cv.notify()

    @property
    def available(self) -> int:
        """Buffers free right now."""
        with self._cv:
            return len(self._free)
