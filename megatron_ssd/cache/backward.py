"""The backward side of the entry table: reads issued as backward nears each layer, the
bytes backward unpacks, and backward's times.

:class:`BackwardReads` handles three events of NOTE [Entry lifetime] (``record.py``):
a layer's backward starts (the reads due are issued, needed-first), backward unpacks a
tensor (its bytes, waiting for its read, or issuing a late one), and a read completes (an
engine thread). It times each layer's backward, the stalls backward spends waiting, and
the first use of each site.

It is built with the narrow state it works on: :class:`TableState`, what it reads of the
:class:`~megatron_ssd.cache.entries.EntryTable` (its lock, clock, step counters, resident
bytes, whether it is closed), the placement policy (read-aheads, the capacity guard's
limit), and three of the table's transitions (set an entry's data, free its disk copy,
cancel its write). It owns the reads in flight and the clock of each open record's
running backward. Every method runs under the table's lock, taken where noted.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, Hashable, List, Optional, Protocol, Set, Tuple

import torch

from ..errors import CacheStateError, OffloadIOError
from ..io.base import IOFuture
from ..placement import MOVED
from .device import HostClock
from .policy import PlacementPolicy
from .record import Entry, EntryState, Record
from .stats import Counters, LayerCounters, add_seconds, time_site

__all__ = ["BackwardReads", "TableState"]


class TableState(Protocol):
    """What :class:`BackwardReads` reads of the entry table it serves. Read afresh at each
    use: the table swaps its counters each step and its clock may be replaced."""

    lock: Any
    """The table's lock (a ``threading.RLock``): guards every entry, record and counter."""
    clock: HostClock
    """Times backward, stalls and site uses (NOTE [Device time] in ``device.py``)."""
    counters: Counters
    """The step's counters."""
    resident: int
    """Bytes of saved tensors held in memory now."""
    closed: bool
    """The cache is closed: its files are gone."""

    def layer(self, layer_id: Hashable) -> LayerCounters:
        """The step's counters of ``layer_id`` (created on first use). Caller holds the lock."""


class _NoRoom(Exception):
    """A prefetch would take the resident bytes over the capacity guard's limit."""


class BackwardReads:
    """Issues, serves and times the reads backward needs.

    Args:
        table: the entry table's lock, clock, counters, resident bytes and ``closed``.
        policy: the read-ahead of each layer and site, and the capacity guard's limit.
        set_data: sets an entry's data, counting its bytes as resident (caller holds the lock).
        free_disk: frees an entry's disk copy, if any (caller holds the lock).
        cancel_write: cancels an entry's write in flight, if any and not staged (caller
            holds the lock).
    """

    def __init__(self, table: TableState, policy: PlacementPolicy,
                 set_data: Callable[[Entry, Optional[torch.Tensor]], None],
                 free_disk: Callable[[Entry], None], cancel_write: Callable[[Entry], None]) -> None:
        self.table = table
        self.policy = policy
        self._set_data = set_data
        self._free_disk = free_disk
        self._cancel_write = cancel_write
        self._reads: Set[IOFuture] = set()
        self._bwd_clock: Dict[int, Tuple[Hashable, Any]] = {}
        """Per open record: the layer whose backward runs, and the clock's mark of its start."""

    def in_flight(self) -> List[IOFuture]:
        """The reads in flight. Caller holds the lock."""
        return list(self._reads)

    def retired(self, record: Record) -> None:
        """``record`` retired: close its running layer's backward time. Caller holds the lock."""
        last = self._bwd_clock.pop(id(record), None)
        if last is not None and last[0] in self.table.counters.layers:
            self.table.clock.since(last[1], partial(add_seconds, self.table.counters.layers[last[0]], "backward_s"))

    def backward_started(self, record: Record, layer_id: Hashable) -> Optional[Hashable]:
        """``layer_id``'s backward begins in ``record``: issue the reads due now,
        needed-first (this layer's, then those of earlier layers whose sites' read-aheads
        reach it, NOTE [Write and read issue points] in ``planner/step_timeline.py``).

        Returns:
            The layer whose backward just ended in ``record`` (None: the first)."""
        table = self.table
        now = table.clock.mark()
        with table.lock:
            finished = self._clock_backward(record, layer_id, now)
            order = record.layer_order
            if layer_id not in order:
                return finished
            i = order.index(layer_id)
            for k in range(i, -1, -1):
                target = order[k]
                if target in record.prefetched or (k != i and k + self.policy.read_ahead(target) < i):
                    continue
                try:
                    if self._prefetch(record, target, i - k):
                        record.prefetched.add(target)
                except (torch.OutOfMemoryError, _NoRoom):  # NOTE [Prefetch under memory pressure]
                    table.counters.prefetch_deferred += 1
                    break
            return finished

    # NOTE [Prefetch under memory pressure]
    # A prefetch allocates its read buffer when backward reaches the layer whose read-ahead
    # is due, which can be while this layer's backward is at its own peak (gradients,
    # temporaries). If that allocation fails, the read is not needed yet: the entry stays
    # on the drive, the reads still due now are left for later (another layer's backward
    # start issues them again, or backward's unpack reads the tensor when it needs it, a
    # late read, when the peak has passed), and the step goes on. Raising from here would
    # abort backward, because this runs in a gradient hook. Counted in
    # ``prefetch_deferred``; an allocation that fails when the tensor is needed raises.
    # A prefetch that would take the resident bytes over the capacity guard's limit (NOTE
    # [Capacity guard] in ``policy.py``) is deferred the same way, before allocating.

    def _clock_backward(self, record: Record, layer_id: Hashable, now: Any) -> Optional[Hashable]:
        """Close the running layer's backward time, start ``layer_id``'s; the layer whose
        backward ended (None: none ran yet)."""
        last = self._bwd_clock.get(id(record))
        if last is not None:
            lc = self.table.counters.layers.get(last[0])
            if lc is not None:
                self.table.clock.add(last[1], now, partial(add_seconds, lc, "backward_s"))
        self._bwd_clock[id(record)] = (layer_id, now)
        return None if last is None else last[0]

    def _prefetch(self, record: Record, layer_id: Hashable, distance: int) -> bool:
        """Issue the reads of ``layer_id``'s entries whose read-ahead reaches
        ``distance`` layers (0: its own backward starts: all); True when none is left.

        Last saved first: a layer's backward uses its saved tensors roughly in reverse
        save order, so the engine's queue gets them in the order they are needed. Issuing
        is idempotent per entry (a read in flight or a forwarded entry is left alone), so
        an entry due earlier is skipped when its layer is visited again."""
        done = True
        for entry in reversed(record.layer_entries.get(layer_id, ())):
            if distance and self.policy.read_ahead(layer_id, entry.site if entry.layer == layer_id else None) < distance:
                done = False
                continue
            if entry.state is EntryState.ON_DISK:
                limit = self.policy.resident_limit  # NOTE [Capacity guard] in policy.py
                if limit is not None and self.table.resident + entry.nbytes > limit:
                    raise _NoRoom()
                self._submit_read(entry)
            elif entry.state is EntryState.STAGED:  # read once written (NOTE [Released at staging] in writes.py)
                done = False
            elif entry.state in (EntryState.WRITING, EntryState.LOADED):
                self._note_forwarded(entry)
        return done

    def _submit_read(self, entry: Entry) -> IOFuture:
        """Read ``entry`` back into a fresh buffer; the read. Caller holds the lock."""
        dst, future = entry.store.get(entry.handle, entry.device)
        entry.read_future = future
        self._set_data(entry, dst)
        entry.state = EntryState.READING
        entry.reloaded = True
        self._reads.add(future)
        future.add_done_callback(partial(self._read_done, entry))  # may run now: the read may be done
        return future

    # NOTE [Failed reads]: a read that fails leaves the bytes where they were: the entry
    # is ON_DISK again with its handle, its read buffer dropped, so the next unpack reads
    # it again (and raises if that fails too) and its release frees the blob like any
    # other. Before, it stayed READING with the buffer counted as resident, and its
    # release, which leaves a READING entry to its read's callback, never freed the blob.

    def _read_done(self, entry: Entry, future: IOFuture) -> None:
        # See NOTE [Entry lifetime]. Runs on an engine thread.
        with self.table.lock:
            self._reads.discard(future)
            if future.error() is None:
                entry.store.fetched(entry.handle)
            if entry.state is EntryState.RELEASED:
                self._free_disk(entry)
                self._set_data(entry, None)
                return
            entry.read_future = None
            if future.error() is None:
                entry.state = EntryState.LOADED
                self._free_disk(entry)
            else:  # NOTE [Failed reads]
                entry.state = EntryState.ON_DISK
                self._set_data(entry, None)

    def _time_use(self, entry: Entry) -> None:
        """Time the first unpack of a site from its layer's backward start (NOTE [Site use
        times] in ``planner/profile.py``). Caller holds the lock."""
        running = self._bwd_clock.get(id(entry.record))
        if entry.site is None or running is None or running[0] != entry.layer:
            return
        lc = self.table.layer(entry.layer)
        time_site(self.table.clock, running[1], lc.site_use_s, lc.site_uses, entry.site)

    def _note_forwarded(self, entry: Entry) -> None:
        if entry.placement in MOVED and not entry.wanted:
            entry.wanted = True
            if entry.state in (EntryState.WRITING, EntryState.LOADED) and not entry.reloaded:
                self.table.counters.bytes_forwarded += entry.nbytes
            self._cancel_write(entry)

    def needed(self, entry: Entry, name: str = "") -> torch.Tensor:
        """Backward unpacks ``entry``: its bytes, after waiting for its read (issued
        now when none was: a late read), or first for its staged write (NOTE [Released at
        staging] in ``writes.py``).

        Raises:
            CacheStateError: the cache is closed, or the entry has no data.
            OffloadIOError: the read failed, or the write of a staged entry did (named
                with ``name``, else the entry's layer).
        """
        table = self.table
        while True:
            future: Optional[IOFuture] = None
            staged: Optional[IOFuture] = None
            with table.lock:
                if table.closed:
                    raise CacheStateError("unpack after close(): the cache's files are gone")
                if not entry.used:
                    entry.used = True
                    self._time_use(entry)
                if entry.state is EntryState.LOST:
                    raise self._named(OffloadIOError(f"its write failed after its device memory was released: "
                                                     f"{entry.lost}"), entry, name)
                if entry.state is EntryState.STAGED:
                    staged = entry.write_future
                elif entry.state is EntryState.ON_DISK:
                    table.counters.late_reads += 1
                    future = self._submit_read(entry)  # done already, failed or not, with some engines
                elif entry.state is EntryState.READING:
                    future = entry.read_future
                if future is None and staged is None:
                    self._note_forwarded(entry)
                    data = entry.data
            if staged is not None:  # wait for the drive, then read it back
                self._waited(entry, staged.wait_settled)
                continue
            break
        if future is not None:
            try:
                self._waited(entry, future.get)
            except OffloadIOError as err:
                raise self._named(err, entry, name) from err
            data = entry.data
        if data is None:
            raise CacheStateError(f"saved tensor of layer {entry.layer!r} has no data (state {entry.state.value})")
        if entry.on_host:
            data = data.to(entry.device)
        return data

    def _waited(self, entry: Entry, wait: Any) -> None:
        """``wait()``, its time added to the stalls of the layer whose backward runs."""
        table = self.table
        started = table.clock.mark()
        try:
            wait()
        finally:
            ended = table.clock.mark()
            with table.lock:
                running = self._bwd_clock.get(id(entry.record))
                lc = table.counters.layers.get(running[0] if running else entry.layer)
                table.clock.add(started, ended, partial(_add_stall, table.counters, lc))

    @staticmethod
    def _named(err: OffloadIOError, entry: Entry, name: str) -> OffloadIOError:
        named = type(err)(f"{err} ({name or f'layer {entry.layer!r}'})")
        named.errno = getattr(err, "errno", None)
        return named


def _add_stall(counters: Counters, layer: Optional[LayerCounters], seconds: float) -> None:
    counters.stall_s += seconds
    if layer is not None:
        layer.stall_s += seconds
