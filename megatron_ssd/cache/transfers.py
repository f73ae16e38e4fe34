"""The tensor cache's I/O transitions: writes, reads, forwarding, disk release.

Split from :mod:`megatron_ssd.cache.tensor_cache` so the state machine of
NOTE [Entry lifetime] (``record.py``) reads in one place. :class:`TransferMixin` is mixed
into :class:`~megatron_ssd.cache.TensorCache`, which provides ``config``, ``stores``,
``_return_pages``, ``_lock``, ``_counters``, ``_writes`` and ``_set_data``. An entry goes
to the :class:`~megatron_ssd.io.store.BlobStore` its placement names (``stores``: the SSD
engine's for ``offload``, the host pool's for ``host``) and remembers it in
``entry.store``; the store counts the bytes (NOTE [Blob stores]).
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Hashable

from ..config import MOVED, Placement
from ..io.base import IOFuture
from .pages import release_pages
from .record import Entry, EntryState, Record

__all__ = ["TransferMixin"]

logger = logging.getLogger("megatron_ssd")


class TransferMixin:
    """Moves cache entries between memory and the I/O engine (see NOTE [Entry lifetime])."""

    def _submit_write(self, entry: Entry) -> None:
        # Called without the lock: a blocking write waits for engine threads whose
        # completion callbacks take the lock.
        store = self.stores[entry.placement]
        block = self.config.io.on_backpressure == "wait"
        started = time.perf_counter()
        future = store.put(entry.data, block=block)  # the host pool never blocks (NOTE [Host pool bound])
        waited = time.perf_counter() - started
        with self._lock:
            lc = self._counters.layers.get(entry.layer)
            if lc is not None:
                lc.write_wait_s += waited
            if future is None:
                entry.placement = Placement.KEEP
                self._counters.backpressure_keeps += 1
                self._counters.bytes_kept += entry.nbytes
                return
            lc = self._counters.layers.get(entry.layer)
            if lc is not None:
                lc.add_queued(store.kind, entry.nbytes)
            entry.store = store
            entry.state = EntryState.WRITING
            entry.write_future = future
            self._writes.add(future)
        future.add_done_callback(partial(self._write_done, entry))

    def _write_done(self, entry: Entry, future: IOFuture) -> None:
        # See NOTE [Entry lifetime]. Runs on an engine thread.
        error = future.error()
        with self._lock:
            entry.write_future = None
            self._writes.discard(future)
            if error is not None:
                self._counters.write_fallbacks += 1
                self._counters.bytes_fallen_back += entry.nbytes
                logger.warning(
                    "megatron_ssd: write of %d bytes (layer %r) failed, kept in memory instead: %s",
                    entry.nbytes, entry.layer, error,
                )
                if entry.state is not EntryState.RELEASED:
                    entry.state = EntryState.RESIDENT
                    entry.placement = Placement.KEEP
                return
            entry.handle = future.get()
            entry.store.stored(entry.handle)
            c = self._counters
            if entry.state is EntryState.RELEASED:
                self._free_disk(entry)
            elif entry.pinned or entry.wanted:
                entry.state = EntryState.LOADED
                self._free_disk(entry)
            else:
                entry.state = EntryState.ON_DISK
                if entry.releasable:  # NOTE [Returning freed pages]
                    c.bytes_returned += release_pages(entry.data)
                self._set_data(entry, None)

    def _submit_read(self, entry: Entry) -> None:
        # Caller holds the lock.
        dst, entry.read_future = entry.store.get(entry.handle, entry.device)
        self._set_data(entry, dst)
        entry.state = EntryState.READING
        entry.reloaded = True
        entry.read_future.add_done_callback(partial(self._read_done, entry))

    def _read_done(self, entry: Entry, future: IOFuture) -> None:
        with self._lock:
            if future.error() is None:
                entry.store.fetched(entry.handle)
            if entry.state is EntryState.RELEASED:
                self._free_disk(entry)
                self._set_data(entry, None)
                return
            if future.error() is None:
                entry.state = EntryState.LOADED
                entry.read_future = None
                self._free_disk(entry)

    def _note_forwarded(self, entry: Entry) -> None:
        if entry.placement in MOVED and not entry.wanted:
            entry.wanted = True
            if entry.state in (EntryState.WRITING, EntryState.LOADED) and not entry.reloaded:
                self._counters.bytes_forwarded += entry.nbytes

    def _free_disk(self, entry: Entry) -> None:
        if entry.handle is not None:
            entry.store.discard(entry.handle)
            entry.handle = None

    def _prefetch(self, record: Record, layer_id: Hashable) -> None:
        # Last saved first: a layer's backward uses its saved tensors roughly in reverse
        # save order, so the engine's queue gets them in the order they are needed.
        for entry in reversed(record.layer_entries.get(layer_id, ())):
            if entry.state is EntryState.ON_DISK:
                self._submit_read(entry)
            elif entry.state in (EntryState.WRITING, EntryState.LOADED):
                self._note_forwarded(entry)

    def drain(self) -> None:
        """Wait until every queued write has completed (or failed)."""
        with self._lock:
            pending = list(self._writes)
        for future in pending:
            _wait(future)


def _wait(future: IOFuture) -> None:
    """Wait for ``future`` without raising its error (callbacks handle errors)."""
    try:
        future.get()
    except Exception:  # noqa: BLE001 - the write callback already recorded the failure
        pass
