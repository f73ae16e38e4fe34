"""Host memory slabs of an exact size, page-locked for CUDA copies when asked.

NOTE [Pinned slabs]: ``torch.empty(n, pin_memory=True)`` takes memory from torch's caching
host allocator, which rounds every request up to the next power of two
(``CachingHostAllocatorImpl::allocate`` in ``ATen/core/CachingHostAllocator.h``:
``c10::llvm::PowerOf2Ceil(size)``, unless ``pinned_max_round_threshold`` in
``PYTORCH_CUDA_ALLOC_CONF`` says otherwise) and keeps the rounded block cached for reuse.
A 4 MiB staging buffer over-allocated by one page for alignment (4 MiB + 4 KiB) pinned
8 MiB, and a pool of them twice its size. A slab is instead an anonymous ``mmap`` of
exactly the bytes asked for (rounded to the page size, so it is page-aligned and needs no
over-allocation to align), page-locked with ``cudaHostRegister``: the bytes pinned are
the bytes used. It is carved into slices by its owner (a staging pool, the staging ring,
the host tier), pinned once at construction, never per buffer::

    slab = HostSlab(64 << 20, pin=True)     # 64 MiB, page-locked when CUDA is available
    block = slab.tensor[4 << 20 : 8 << 20]   # an aligned slice
    slab.close()                             # unpinned; the memory goes with the last slice

Unpinning happens at :meth:`HostSlab.close`, or when the memory itself is freed (the last
slice of it gone), and must come after every copy into or out of it completed (the
engines close their slabs after their workers stopped, and workers wait for every copy
they queue).
"""

from __future__ import annotations

import mmap
import threading
import weakref
from typing import Optional

import torch

from .base import ALIGN, align_up
from .cuda import CUDA, CudaOps

__all__ = ["HostSlab"]


class _Mapping(mmap.mmap):
    """An anonymous mapping that can carry a finalizer (plain ``mmap`` has no weakrefs).
    Its weakref callbacks run before the base class unmaps it."""


def _unregister(cuda: CudaOps, ptr: int) -> None:
    try:
        cuda.host_unregister(ptr)
    except Exception:  # noqa: BLE001 - at exit CUDA may be gone already; the memory is freed anyway
        pass


class HostSlab:
    """``nbytes`` of host memory in one private anonymous mapping (NOTE [Pinned slabs]).

    Args:
        nbytes: Bytes needed (> 0); the mapping holds them rounded up to the page size.
        pin: Page-lock it for CUDA copies (ignored when ``cuda`` has no device).
        cuda: The CUDA calls to use.

    Attributes:
        tensor: The slab as a 1-D ``uint8`` tensor, page-aligned.
        pinned: Whether it is page-locked.
    """

    def __init__(self, nbytes: int, pin: bool = False, cuda: Optional[CudaOps] = None) -> None:
        if nbytes <= 0:
            raise ValueError(f"megatron_ssd: HostSlab(nbytes={nbytes}): must be > 0")
        self.cuda = cuda if cuda is not None else CUDA
        self.nbytes = align_up(nbytes, max(ALIGN, mmap.PAGESIZE))
        mapping = _Mapping(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
        # frombuffer keeps the mapping alive as long as the storage (and any slice of it)
        self.tensor = torch.frombuffer(mapping, dtype=torch.uint8)
        self.pinned = bool(pin) and self.cuda.is_available()
        self._lock = threading.Lock()
        self._finalizer: Optional[weakref.finalize] = None
        if self.pinned:
            self.cuda.host_register(self.tensor)
            # unpinned when the memory goes (the mapping dies with the last slice), or at close()
            self._finalizer = weakref.finalize(mapping, _unregister, self.cuda, self.tensor.data_ptr())

    def close(self) -> None:
        """Unpin the slab now (idempotent); its memory stays valid while slices of it live."""
        with self._lock:
            finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None:
            finalizer()
