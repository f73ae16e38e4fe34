"""Read-back buffers mapped straight from the kernel, returned to it when freed.

``mapped_empty(n)`` is what the I/O engines read CPU blobs into. Its memory is an
anonymous private ``mmap`` of its own, so it never lands in glibc's heap::

    buf = mapped_empty(10_000)   # 12288 bytes, page-aligned, untouched (no RSS yet)
    del buf                      # the last reference gone: munmap, the RSS drops

NOTE [Mapped read buffers]: torch's CPU allocator takes memory from glibc's
``malloc``. glibc serves a request from ``mmap`` only above its mmap threshold, and that
threshold is dynamic: it starts at 128 KiB and rises to the size of every mmap-served
block freed, up to 32 MiB. After the first freed activation, every read-back buffer
below 32 MiB therefore came from the heap, and a heap only gives memory back from its
top. Read-back buffers are allocated during backward and freed one layer later, between
gradients and activations that live longer, so their pages stayed resident as holes:
with the default allocator an offloading process grew larger than one that kept
everything. An ``mmap`` of our own is unmapped when the tensor's storage dies (the
storage holds the only reference to the ``mmap`` object), whatever the allocator's
thresholds; it is page-aligned, so O_DIRECT needs no over-allocation either. The page
faults that fill it are the ones any new allocation of that size takes.

Live bytes are counted here (``mapped_bytes``), and listeners registered with
:func:`add_listener` see every map and unmap, timestamped with ``time.time_ns()`` like
the PyTorch profiler's memory events (used by :mod:`megatron_ssd.memory.allocator_timeline`).
"""

from __future__ import annotations

import itertools
import mmap
import threading
import time
import weakref
from typing import Callable, List

import torch

from .base import ALIGN, align_up

__all__ = ["mapped_empty", "mapped_bytes", "add_listener", "remove_listener"]

Listener = Callable[[int, int, int], None]
"""Called with ``(time_ns, delta_bytes, token)``: positive on map, negative on unmap;
``token`` names the mapping, the same on its map and its unmap."""

# Reentrant: a mapping's finalizer runs _event on whatever thread drops its last view,
# which can be this one inside _event itself (``list(_listeners)`` can trigger a garbage
# collection that frees a mapping); a plain Lock deadlocked the thread there.
_lock = threading.RLock()
_live = 0
_tokens = itertools.count(1)
_listeners: List[Listener] = []


class _Mapping(mmap.mmap):
    """An anonymous mapping that can carry a finalizer (plain ``mmap`` has no weakrefs)."""


def _event(delta: int, token: int) -> None:  # on map, and from the mapping's finalizer
    global _live
    now = time.time_ns()
    with _lock:
        _live += delta
        listeners = list(_listeners)
    for fn in listeners:
        fn(now, delta, token)


def mapped_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised 1-D ``uint8`` CPU tensor in a private anonymous mapping.

    Args:
        nbytes: Bytes needed; the mapping holds ``align_up(max(nbytes, 1))`` bytes so
            that a padded O_DIRECT request on its tail stays inside it.

    Returns:
        A tensor of that many bytes whose address is a multiple of the page size (and of
        ALIGN); the mapping is unmapped when the tensor's storage is freed
        (NOTE [Mapped read buffers]).
    """
    if nbytes < 0:
        raise ValueError(f"megatron_ssd: mapped_empty(nbytes={nbytes}): must be >= 0")
    capacity = align_up(max(nbytes, 1), max(ALIGN, mmap.PAGESIZE))
    mapping = _Mapping(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE)
    token = next(_tokens)
    weakref.finalize(mapping, _event, -capacity, token)
    _event(capacity, token)
    # frombuffer keeps a reference to ``mapping`` in the storage's deleter: the mapping
    # lives exactly as long as the storage, and is unmapped when the storage is freed.
    return torch.frombuffer(mapping, dtype=torch.uint8)[:capacity]


def mapped_bytes() -> int:
    """Bytes in read-back mappings alive now."""
    with _lock:
        return _live


def add_listener(fn: Listener) -> None:
    """Call ``fn(time_ns, delta_bytes, token)`` on every map and unmap from now on."""
    with _lock:
        _listeners.append(fn)


def remove_listener(fn: Listener) -> None:
    """Stop calling ``fn``; a listener not registered is ignored."""
    with _lock:
        if fn in _listeners:
            _listeners.remove(fn)
