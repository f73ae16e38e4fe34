"""The write side of the entry table: the write of each moved tensor, from its queueing to
its completion.

:class:`ForwardWrites` handles the events of NOTE [Entry lifetime] (``record.py``) that
belong to a write: a moved entry's write is queued to its placement's store as forward
saves it (the capacity guard's wait included, NOTE [Capacity guard] in ``policy.py``),
the engine stages its bytes (NOTE [Released at staging]), and the write completes, lands
or falls back (an engine thread). It cancels a write no longer worth finishing, and warns
about failed ones (NOTE [Failed write warnings] in ``failures.py``).

It is built like :class:`~megatron_ssd.cache.backward.BackwardReads`, with the narrow
state it works on: :class:`WriteTable`, what it reads of the
:class:`~megatron_ssd.cache.entries.EntryTable`, the placement policy (the capacity
guard's limit), the blob stores, and two of the table's transitions (set an entry's
data, free its disk copy). It owns the writes in flight. Every method runs under the
table's lock, taken where noted.
"""

from __future__ import annotations

import threading
from functools import partial
from typing import Callable, List, Mapping, Optional, Protocol, Set

import torch

from ..config import OffloadConfig
from ..errors import WriteCancelled
from ..io.base import IOFuture
from ..io.store import BlobStore
from ..placement import Placement
from .backward import TableState
from .failures import WriteFailures
from .pages import release_pages
from .policy import PlacementPolicy
from .record import Entry, EntryState
from .stats import add_seconds

__all__ = ["ForwardWrites", "WriteTable"]


class WriteTable(TableState, Protocol):
    """What :class:`ForwardWrites` reads of the entry table: what backward reads, and
    whether a written tensor's memory goes at staging."""

    release_at_staging: bool
    """Drop a written tensor's memory once the engine has staged its bytes (NOTE
    [Released at staging])."""


class ForwardWrites:
    """Queues, completes and cancels the writes of moved entries.

    Args:
        table: the entry table's lock, clock, counters, resident bytes, ``closed`` and
            ``release_at_staging``.
        config: ``io.on_backpressure`` (wait for the in-flight bound, or keep the tensor).
        policy: the capacity guard's limit.
        stores: the blob store of each moved placement.
        set_data: sets an entry's data, counting its bytes as resident (caller holds the lock).
        free_disk: frees an entry's disk copy, if any (caller holds the lock).
    """

    def __init__(self, table: WriteTable, config: OffloadConfig, policy: PlacementPolicy,
                 stores: Mapping[Placement, BlobStore], set_data: Callable[[Entry, Optional[torch.Tensor]], None],
                 free_disk: Callable[[Entry], None]) -> None:
        self.table = table
        self.config = config
        self.policy = policy
        self.stores = stores
        self._set_data = set_data
        self._free_disk = free_disk
        self._writes: Set[IOFuture] = set()
        self._room = threading.Condition(table.lock)
        """Notified when resident bytes may have dropped (NOTE [Capacity guard] in ``policy.py``)."""
        self.failures = WriteFailures()
        """Warnings about failed writes, once per path then periodically (NOTE [Failed
        write warnings] in ``failures.py``)."""

    def in_flight(self) -> List[IOFuture]:
        """The writes in flight. Caller holds the lock."""
        return list(self._writes)

    def resident_dropped(self) -> None:
        """Resident bytes dropped: wake a forward waiting for room. Caller holds the lock."""
        self._room.notify_all()

    def write(self, entry: Entry) -> None:
        """Queue a new moved entry's write to its placement's store.

        Called without the lock: a blocking write waits for engine threads whose
        completion callbacks take it. A write the store refuses (backpressure) keeps the
        entry in memory.
        """
        table = self.table
        store = self.stores[entry.placement]
        block = self.config.io.on_backpressure == "wait"
        started = table.clock.mark()
        future = store.put(entry.data, block=block)  # the host pool never blocks (NOTE [Host pool bound])
        with table.lock:
            lc = table.layer(entry.layer)
            if future is None:
                table.clock.add(started, table.clock.mark(), partial(add_seconds, lc, "write_wait_s"))
                entry.placement = Placement.KEEP
                table.counters.backpressure_keeps += 1
                table.counters.bytes_kept += entry.nbytes
                return
            lc.add_queued(store.tier or store.kind, entry.nbytes)
            entry.store = store
            entry.state = EntryState.WRITING
            entry.write_future = future
            self._writes.add(future)
        if table.release_at_staging:
            future.add_staged_callback(partial(self._write_staged, entry))
        future.add_done_callback(partial(self._write_done, entry))
        self._wait_for_room()
        with table.lock:
            table.clock.add(started, table.clock.mark(), partial(add_seconds, lc, "write_wait_s"))

    def _wait_for_room(self) -> None:
        """Block while the resident bytes exceed the policy's limit and writes are in
        flight that would lower them (NOTE [Capacity guard] in ``policy.py``)."""
        limit = self.policy.resident_limit
        if limit is None:
            return
        with self.table.lock:  # not ``with self._room``: NOTE [Signals and condition locks] in interruptible.py
            while self.table.resident > limit and self._writes and not self.table.closed:
                self.table.counters.capacity_waits += 1
                self._room.wait()

    # NOTE [Released at staging]
    # A device tensor's write first copies its bytes to pinned host staging on a copy
    # stream, then writes them to the drives at the drives' speed. Its device memory can
    # go as soon as the copy is done (the engine *stages* the write, NOTE [Staged writes]
    # in ``io/base.py``), so device memory is freed at PCIe speed and the in-flight bytes
    # that count against the device are those not yet copied. The entry is then STAGED:
    # no data, write in flight. Nothing may cancel that write any more (the staging is
    # the only copy) until autograd releases the entry; a backward that wants the tensor
    # before the write completes waits for it and reads it back (the bytes are not in
    # device memory to forward); a later layer that saves the same storage again does
    # not pin it (its bytes come back from the drive like any other). If the write then
    # fails, the bytes are lost unless the engine hands back its host copy (the error's
    # ``host_copy``), which the entry then keeps and copies back to the device when
    # backward needs it; without one the entry is LOST and its unpack raises, naming the
    # write's error. CPU tensors are written in place, so for them staging is completion.

    def _write_staged(self, entry: Entry, future: IOFuture) -> None:
        """The engine staged ``entry``'s bytes (NOTE [Released at staging]). Runs on an
        engine thread, before the write's completion."""
        with self.table.lock:
            if entry.state is not EntryState.WRITING or entry.wanted or future.done():
                return
            entry.state = EntryState.STAGED
            self._set_data(entry, None)

    def _write_done(self, entry: Entry, future: IOFuture) -> None:
        # See NOTE [Entry lifetime]. Runs on an engine thread.
        error = future.error()
        with self.table.lock:
            counters = self.table.counters  # read under the lock: a step's end swaps them
            entry.write_future = None
            self._writes.discard(future)
            self._room.notify_all()
            if entry.state is EntryState.STAGED:
                self._staged_write_done(entry, future, error)
                return
            if isinstance(error, WriteCancelled):  # NOTE [Cancelled writes] in io/recovery.py
                counters.bytes_write_cancelled += entry.nbytes
                if entry.state is not EntryState.RELEASED:
                    entry.state = EntryState.LOADED  # wanted or pinned: its data stays in memory
                return
            if error is not None:
                counters.write_fallbacks += 1
                counters.bytes_fallen_back += entry.nbytes
                self.failures.failed(entry.store, entry.nbytes, entry.layer, "kept in memory instead", error)
                if entry.state is not EntryState.RELEASED:
                    entry.state = EntryState.RESIDENT
                    entry.placement = Placement.KEEP
                return
            entry.handle = future.get()
            entry.store.stored(entry.handle)
            if entry.state is EntryState.RELEASED:
                self._free_disk(entry)
            elif entry.pinned or entry.wanted:
                entry.state = EntryState.LOADED
                self._free_disk(entry)
            else:
                entry.state = EntryState.ON_DISK
                if entry.releasable:  # NOTE [Returning freed pages]
                    counters.bytes_returned += release_pages(entry.data)
                self._set_data(entry, None)

    def _staged_write_done(self, entry: Entry, future: IOFuture, error: Optional[BaseException]) -> None:
        """A STAGED entry's write completed (NOTE [Released at staging]). Caller holds the lock."""
        if error is None:
            entry.handle = future.get()
            entry.store.stored(entry.handle)
            entry.state = EntryState.ON_DISK
            return
        self.table.counters.write_fallbacks += 1
        self.table.counters.bytes_fallen_back += entry.nbytes
        host_copy = getattr(error, "host_copy", None)
        if isinstance(host_copy, torch.Tensor):
            self.failures.failed(entry.store, entry.nbytes, entry.layer,
                                 "after its device memory was released; kept in host memory instead", error)
            entry.on_host = True  # host memory: not counted as resident on the device
            entry.data = host_copy
            entry.state = EntryState.RESIDENT
            entry.placement = Placement.KEEP
            return
        self.failures.failed(entry.store, entry.nbytes, entry.layer,
                             "after its device memory was released; lost, backward cannot have it", error)
        entry.state = EntryState.LOST
        entry.lost = error

    def cancel(self, entry: Entry) -> None:
        """``entry``'s write in flight is no longer worth finishing: its bytes stay in
        memory until released, or nobody needs them (NOTE [Cancelled writes] in
        ``io/recovery.py``). Caller holds the lock; the write's callback completes it."""
        if entry.write_future is not None and (entry.state is not EntryState.STAGED):
            entry.write_future.cancel()  # a STAGED write is the only copy (NOTE [Released at staging])
