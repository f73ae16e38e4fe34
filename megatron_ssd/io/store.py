"""Blob stores: where a moved tensor's bytes live between forward and backward.

A :class:`BlobStore` puts blobs into one :class:`~megatron_ssd.io.base.Engine` (the SSD
engine, or the host pool of ``Placement.HOST``), gets them back into fresh buffers,
discards them, and owns their accounting: the bytes it holds now and at its peak (disk
bytes with their padding on the SSDs, payload bytes in the host pool), and the bytes put
and got each step. The tensor cache moves an entry through whichever store its placement
names and never asks which one it is::

    store = BlobStore(engine, "ssd")
    fut = store.put(blob, block=True)          # None: refused (backpressure)
    handle = fut.get(); store.stored(handle)   # a put counts once it completed
    dst, fut = store.get(handle, blob.device)  # a fresh buffer, filled when fut completes
    fut.get(); store.fetched(handle)
    store.discard(handle)                      # frees the blob and its bytes

NOTE [Blob stores]: the engine owns the files (and their cleanup at close and at exit,
:meth:`remove_files_now`) and the checksums; the store owns the counts. Nothing else
adds up blob sizes, so the SSD footprint is counted once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .base import Engine, IOFuture, SwapHandle
from .rundir import remove_run_dir

__all__ = ["BlobStore", "StoreStep"]


@dataclass(frozen=True)
class StoreStep:
    """What one store did during a step (:meth:`BlobStore.take_step`)."""

    put_bytes: int
    """Payload bytes of completed puts."""
    got_bytes: int
    """Payload bytes of completed gets."""
    peak_bytes: int
    """Most bytes held at once (disk bytes on the SSDs, payload in host memory)."""


class BlobStore:
    """One engine and the accounting of the blobs in it (NOTE [Blob stores]).

    Args:
        engine: the engine the blobs go to.
        kind: ``ssd`` (footprint: disk bytes with padding) or ``host`` (payload bytes).
    """

    KINDS = ("ssd", "host")

    def __init__(self, engine: Engine, kind: str) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"BlobStore: kind = {kind!r}: must be one of {list(self.KINDS)}")
        self.engine = engine
        self.kind = kind
        self.tier: Optional[str] = None
        """The name of the storage tier it serves when that is not the SSDs or the host
        pool (NOTE [Tiers] in ``tier.py``); None: ``kind`` names it."""
        self._lock = threading.Lock()
        self._held = 0
        self._peak = 0
        self._put = 0
        self._got = 0

    def _footprint(self, handle: SwapHandle) -> int:
        return handle.disk_bytes if self.kind == "ssd" else handle.nbytes

    # ------------------------------------------------------------------ blobs

    def put(self, data: torch.Tensor, block: bool) -> Optional[IOFuture[SwapHandle]]:
        """Start storing ``data`` (flat uint8); None when the engine refuses it now."""
        return self.engine.write(data, block=block)

    def stored(self, handle: SwapHandle) -> None:
        """A put completed: its blob counts from now on."""
        with self._lock:
            self._put += handle.nbytes
            self._held += self._footprint(handle)
            self._peak = max(self._peak, self._held)

    def get(self, handle: SwapHandle, device: torch.device) -> Tuple[torch.Tensor, IOFuture[torch.Tensor]]:
        """A fresh buffer of ``handle.nbytes`` on ``device`` and the read filling it."""
        dst = self.engine.alloc(handle.nbytes, device, handle)[: handle.nbytes]
        return dst, self.engine.read(handle, dst)

    def fetched(self, handle: SwapHandle) -> None:
        """A get completed."""
        with self._lock:
            self._got += handle.nbytes

    def discard(self, handle: SwapHandle) -> None:
        """Free a stored blob."""
        self.engine.free(handle)
        with self._lock:
            self._held -= self._footprint(handle)

    # ------------------------------------------------------------------ accounting

    @property
    def held_bytes(self) -> int:
        """Bytes of stored blobs not yet discarded."""
        return self._held

    def take_step(self) -> StoreStep:
        """The step's counts; the next step's start from zero and from the bytes held."""
        with self._lock:
            step = StoreStep(self._put, self._got, self._peak)
            self._put = self._got = 0
            self._peak = self._held
        return step

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Close the engine (waits for its I/O, removes its files)."""
        self.engine.close()

    def remove_files_now(self) -> None:
        """Delete the engine's run directories at once, no waiting for I/O (NOTE [Exit
        cleanup]); the host pool has none."""
        for run_dir in self.engine.paths:
            remove_run_dir(run_dir)
