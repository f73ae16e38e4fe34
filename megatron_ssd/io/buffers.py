"""Aligned host buffers for O_DIRECT and fixed pools of staging buffers.

O_DIRECT needs buffer addresses, file offsets and request sizes that are multiples of
:data:`~megatron_ssd.io.base.ALIGN`. PyTorch's CPU allocator only aligns to 64 bytes
(large tensors start 64 bytes past a page boundary), so aligned buffers are cut out of
a slightly larger tensor, or out of a page-aligned slab (:mod:`megatron_ssd.io.pinned`)
when they are page-locked::

    buf = aligned_empty(10_000, pin=False)     # 12288 bytes, data_ptr() % 4096 == 0
    pool = BufferPool.from_config(cfg.io, pin=True)
    staging = pool.acquire()
    try:
        ...
    finally:
        pool.release(staging)

NOTE [Caller's memory]: the engines read and write the caller's tensors through
:func:`tensor_buffer` (a ``memoryview`` built from ``data_ptr()`` with ``ctypes``) and
:func:`copy_bytes` (``memmove``), never through ``Tensor.numpy()``: torch marks a
storage non-resizable once ``.numpy()`` has been called on it, and Megatron later frees
saved tensors with ``untyped_storage().resize_(0)`` (selective recompute discarding its
output), which then raised ``RuntimeError: Trying to resize storage that is not
resizable``.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import List, Optional

import torch

from ..config import IOConfig
from .base import ALIGN, align_up
from .cuda import CudaOps
from .pinned import HostSlab

__all__ = ["aligned_empty", "is_aligned", "tensor_buffer", "copy_bytes", "BufferPool"]


def aligned_empty(nbytes: int, pin: bool = False, cuda: Optional[CudaOps] = None) -> torch.Tensor:
    """An uninitialised 1-D ``uint8`` CPU tensor whose address is a multiple of ALIGN.

    Args:
        nbytes: Bytes needed; the tensor holds ``align_up(max(nbytes, 1))`` bytes so
            that a padded O_DIRECT request on its tail stays inside it.
        pin: Page-locked memory (for CUDA staging), from a slab of exactly that size
            (NOTE [Pinned slabs]). Ignored when CUDA is not available.
        cuda: The CUDA calls to use (default: the real ones).

    Returns:
        A view into a private tensor; the view keeps it alive.
    """
    if nbytes < 0:
        raise ValueError(f"megatron_ssd: aligned_empty(nbytes={nbytes}): must be >= 0")
    capacity = align_up(max(nbytes, 1))
    if pin:
        slab = HostSlab(capacity, pin=True, cuda=cuda)
        if slab.pinned:
            return slab.tensor[:capacity]  # pinned until the memory is freed (NOTE [Pinned slabs])
    raw = torch.empty(capacity + ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip : skip + capacity]


def is_aligned(t: torch.Tensor, offset: int = 0, nbytes: int = 0) -> bool:
    """True when ``t``'s byte ``offset`` is ALIGN-aligned in memory and ``nbytes`` is too."""
    return (t.data_ptr() + offset) % ALIGN == 0 and nbytes % ALIGN == 0


def tensor_buffer(t: torch.Tensor, offset: int, nbytes: int) -> memoryview:
    """A writable memoryview of ``nbytes`` bytes of the CPU ``uint8`` tensor ``t`` from
    byte ``offset`` (NOTE [Caller's memory]: no ``.numpy()``, so ``t`` stays resizable).

    No copy: ``os.pwrite`` / ``os.preadv`` work on the tensor's memory directly. The
    caller keeps ``t`` alive while the view is in use.
    """
    if offset < 0 or nbytes < 0 or offset + nbytes > t.numel():
        raise ValueError(f"megatron_ssd: tensor_buffer: bytes [{offset}, {offset + nbytes}) outside a "
                         f"{t.numel()}-byte tensor")
    if nbytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr() + offset)).cast("B")


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the CPU ``uint8`` tensor ``src`` into ``dst`` (same length) with ``memmove``:
    as fast as ``np.copyto`` for bytes, without the GIL, and without ``.numpy()`` (NOTE
    [Caller's memory])."""
    n = src.numel()
    if dst.numel() != n:
        raise ValueError(f"megatron_ssd: copy_bytes: {n} bytes into {dst.numel()}")
    if n:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)


class BufferPool:
    """A fixed set of equally sized aligned staging buffers, slices of one slab.

    ``acquire`` blocks while every buffer is out, ``try_acquire`` never does; buffers
    are never allocated after construction, so the pool bounds staging memory. The slab
    holds exactly ``count * nbytes`` bytes (NOTE [Pinned slabs]).

    Args:
        count: Number of buffers.
        nbytes: Size of each buffer (rounded up to ALIGN).
        pin: Page-locked buffers (CUDA staging); ignored without CUDA.
        cuda: The CUDA calls to use (default: the real ones).
    """

    def __init__(self, count: int, nbytes: int, pin: bool = False, cuda: Optional[CudaOps] = None) -> None:
        if count <= 0 or nbytes <= 0:
            raise ValueError(
                f"megatron_ssd: BufferPool(count={count}, nbytes={nbytes}): both must be > 0"
            )
        self.nbytes = align_up(nbytes)
        self.count = count
        self.slab = HostSlab(count * self.nbytes, pin=pin, cuda=cuda)
        """The memory the buffers are cut from."""
        self.pinned = self.slab.pinned
        self._all: List[torch.Tensor] = [self.slab.tensor[i * self.nbytes : (i + 1) * self.nbytes]
                                         for i in range(count)]
        self._free: List[torch.Tensor] = list(self._all)
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)  # entered as self._lock: NOTE [Signals and condition locks] in interruptible.py
        self.wait_s = 0.0
        """Total time callers spent blocked in :meth:`acquire`."""
        self.peak_in_use = 0
        """Most buffers out at once."""

    @classmethod
    def from_config(cls, io: IOConfig, pin: bool = False, cuda: Optional[CudaOps] = None) -> "BufferPool":
        """One block-sized buffer per engine worker (``2 * io.threads``; each holds one)."""
        return cls(2 * io.threads, io.block_bytes, pin, cuda)

    def _take(self) -> torch.Tensor:
        buf = self._free.pop()
        self.peak_in_use = max(self.peak_in_use, self.count - len(self._free))
        return buf

    def acquire(self, timeout: Optional[float] = None) -> torch.Tensor:
        """Take a buffer, waiting while none is free.

        Raises:
            TimeoutError: ``timeout`` seconds passed without a free buffer.
        """
        with self._lock:
            if not self._free:
                start = time.perf_counter()
                if not self._cv.wait_for(lambda: bool(self._free), timeout):
                    raise TimeoutError(
                        f"megatron_ssd: no staging buffer free after {timeout}s "
                        f"({self.count} buffers of {self.nbytes} bytes)"
                    )
                self.wait_s += time.perf_counter() - start
            return self._take()

    def try_acquire(self, n: int) -> List[torch.Tensor]:
        """Take up to ``n`` buffers, as many as are free now; never waits."""
        with self._lock:
            return [self._take() for _ in range(min(n, len(self._free)))]

    def release(self, buf: torch.Tensor) -> None:
        """Give back a buffer obtained from :meth:`acquire` or :meth:`try_acquire`."""
        with self._lock:
            if not any(buf is b for b in self._all) or any(buf is b for b in self._free):
                raise ValueError("megatron_ssd: BufferPool.release: buffer is not an acquired buffer of this pool")
            self._free.append(buf)
            self._cv.notify()

    @property
    def available(self) -> int:
        """Buffers free right now."""
        with self._lock:
            return len(self._free)

    def close(self) -> None:
        """Unpin the slab (after every copy into or out of the buffers completed)."""
        self.slab.close()
