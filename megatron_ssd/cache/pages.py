"""Giving the pages of offloaded CPU activations back to the kernel.

NOTE [Returning freed pages]: on a CPU the activations the cache offloads live in
glibc's heap (torch's CPU allocator is ``malloc``). Freeing them does not lower the
process's resident memory: glibc keeps freed chunks resident and returns memory only
from the top of its heap, so the forward of an offloading process left hundreds of MiB
of freed activation pages resident while backward allocated gradients elsewhere, and a
user watching RSS saw much less saved than the cache counted. Two calls put them back:

* :func:`release_pages`, when a write completes and the cache's reference is the only
  one left to the storage: ``madvise(MADV_DONTNEED)`` on the whole pages inside it,
  just before the cache drops it. Only storages that torch's own CPU allocator made
  qualify (:func:`allocator_owned`, checked when the tensor is saved: resizable, i.e.
  memory from an allocator and not ``from_numpy`` or ``frombuffer``; not shared; not
  pinned; torch marks a storage non-resizable for good once it is viewed from numpy, as
  the I/O engine does, so the check cannot wait for the write), and only with a use count
  equal to that of a storage known to have no other owner (measured once,
  :func:`_sole_use_count`, so a torch release that counts differently disables the call
  instead of corrupting memory).
* :func:`trim_heap`, at the end of each micro-batch's forward: ``malloc_trim(0)``,
  which returns every wholly free page of glibc's arenas (the activations freed by
  forward whose other owners let go later); a call costs a small share of a step. And
  when a layer's backward starts after a RECOMPUTE layer's: the rerun forward's
  activations, freed by that backward, sit in glibc's heap between live blocks, and the
  next rerun cannot reuse the holes, so without it the heap grew layer after layer,
  mostly free pages, past what keeping every layer holds (measured:
  docs/performance.md#run-2026-11-24-recompute-heap).

Both are no-ops where they do not apply (another C library, a CUDA device, or
``offload.return_freed_pages: false``). Each lowers the RSS of an offloading process,
both together the most (measured: docs/performance.md#run-2026-11-23-heap-pages).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import time
from typing import Optional

import torch

__all__ = ["allocator_owned", "release_pages", "trim_heap", "heap_trimming_available"]

_MADV_DONTNEED = 4
_PAGE = mmap.PAGESIZE


@functools.lru_cache(maxsize=None)
def _load() -> Optional[ctypes.CDLL]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.gnu_get_libc_version  # glibc only: malloc_trim's semantics are glibc's
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return libc


def heap_trimming_available() -> bool:
    """Whether this process runs on glibc, where both calls do something."""
    return _load() is not None


def _use_count(storage: torch.UntypedStorage) -> int:
    return torch._C._storage_Use_Count(storage._cdata)


@functools.lru_cache(maxsize=None)
def _sole_use_count() -> Optional[int]:
    """The use count :func:`release_pages` sees for a storage nobody else holds, built
    the way the cache holds one (a bytes view made with ``set_``)."""
    if not hasattr(torch._C, "_storage_Use_Count"):
        return None
    from .identity import storage_bytes

    owner = torch.empty(3 * _PAGE, dtype=torch.uint8)
    data = storage_bytes(owner)
    del owner
    storage = data.untyped_storage()
    return _use_count(storage)


def allocator_owned(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory came from torch's CPU allocator and no other process or
    library can see it: what :func:`release_pages` may later give back. Ask before the
    storage is ever viewed from numpy."""
    if t.device.type != "cpu" or _load() is None:
        return False
    storage = t.untyped_storage()
    return storage.resizable() and not storage.is_shared() and not storage.is_pinned()


def release_pages(data: torch.Tensor) -> int:
    """Give back the whole pages of ``data``'s storage if the caller's ``data`` is its only
    owner (NOTE [Returning freed pages]); the caller drops ``data`` right after. Call it
    only for storages :func:`allocator_owned` accepted when they were saved.

    Returns:
        Bytes given back (0 when the storage does not qualify).
    """
    libc = _load()
    if libc is None or data.device.type != "cpu":
        return 0
    storage = data.untyped_storage()
    sole = _sole_use_count()
    if sole is None or _use_count(storage) != sole:
        return 0
    start = storage.data_ptr()
    first = -(-start // _PAGE) * _PAGE
    last = (start + storage.nbytes()) // _PAGE * _PAGE
    if last <= first:
        return 0
    if libc.madvise(first, last - first, _MADV_DONTNEED) != 0:
        return 0
    return last - first


def trim_heap() -> float:
    """``malloc_trim(0)`` on glibc; returns the seconds it took (0.0 elsewhere)."""
    libc = _load()
    if libc is None:
        return 0.0
    started = time.perf_counter()
    libc.malloc_trim(0)
    return time.perf_counter() - started
