"""The entry table: the state machine of the tensor cache's saved tensors.

:class:`EntryTable` owns every entry and record, the lock all their transitions happen
under, the step's counters and the count of resident bytes. It has one method per
event of NOTE [Entry lifetime] (``record.py``); those of a write are handled by the
:class:`~megatron_ssd.cache.writes.ForwardWrites` it composes (``writes.py``), those of
backward by its :class:`~megatron_ssd.cache.backward.BackwardReads` (``backward.py``):

=====================  ==================================================================
event                  method
=====================  ==================================================================
micro-batch opens      :meth:`EntryTable.open`
tensor saved           :meth:`EntryTable.saved` (then :meth:`EntryTable.write` outside the
                       lock, when the entry moves: :meth:`ForwardWrites.write`)
write staged           ``ForwardWrites._write_staged`` (an engine thread)
write done             ``ForwardWrites._write_done`` (an engine thread)
layer backward starts  :meth:`EntryTable.backward_started` (issues the reads due)
tensor needed          :meth:`EntryTable.needed` (backward unpacks it)
read done              ``BackwardReads._read_done`` (an engine thread)
tensor released        :meth:`EntryTable.released` (autograd dropped its last use)
forward ends           :meth:`EntryTable.forward_ended`
step ends              :meth:`EntryTable.take_step`
=====================  ==================================================================

It decides no placement: :class:`~megatron_ssd.cache.policy.PlacementPolicy` does
(NOTE [One placement policy]). It moves no bytes itself: each moved entry goes to the
:class:`~megatron_ssd.io.store.BlobStore` its placement names (NOTE [Blob stores]).
``tests/cache/test_entry_events.py`` drives it through a scripted store that completes
I/O in chosen orders.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Hashable, List, Mapping, Optional, Tuple

import torch

from ..config import OffloadConfig
from ..placement import HEAD, MOVED, OUTSIDE, Placement
from ..errors import CacheStateError
from ..io.base import IOFuture
from ..io.store import BlobStore
from .backward import BackwardReads
from .device import HostClock
from .memory_cap import MemoryObserver
from .identity import held_bytes, is_plain, storage_bytes, storage_weakref
from .pages import allocator_owned
from .policy import PlacementPolicy
from .record import Entry, EntryState, Record
from .stats import Counters, LayerCounters, time_site
from .writes import ForwardWrites

__all__ = ["EntryTable"]


class EntryTable:
    """Entries and records of the micro-batches in flight, and their transitions.

    Args:
        config: ``io.on_backpressure``, for its writes.
        policy: decides each new entry's placement and read-aheads.
        stores: the blob store of each moved placement, for its writes.
        return_pages: give a written entry's pages back to the system (NOTE [Returning
            freed pages]).
    """

    def __init__(self, config: OffloadConfig, policy: PlacementPolicy, stores: Mapping[Placement, BlobStore],
                 return_pages: bool, clock: Optional[HostClock] = None) -> None:
        self.policy = policy
        self.return_pages = return_pages
        self.clock = clock or HostClock()
        """Times backward, stalls, write waits and site uses (NOTE [Device time] in
        ``device.py``)."""
        self.lock = threading.RLock()
        """Guards every field below and every entry and record."""
        self.counters = Counters()
        """The step's counters, swapped by :meth:`take_step`."""
        self.resident = 0
        """Bytes of saved tensors held in memory now."""
        self.observer: Optional[MemoryObserver] = None
        """Told each tensor packed and each phase change while a step's working set is
        measured (NOTE [Working set by phase] in ``adaptive.py``); None: nobody."""
        self.live = 0
        """Bytes of every saved tensor alive now, wherever its bytes are (memory, a drive,
        the host pool): what keeping everything would hold."""
        self.release_at_staging = False
        """Drop a written tensor's memory once the engine has staged its bytes, not when
        they reach the drive (a device tensor; NOTE [Released at staging] in ``writes.py``)."""
        self.records: Dict[Hashable, Record] = {}
        """Records whose forward or backward is not finished, by key."""
        self.closed = False
        self.writes = ForwardWrites(self, config, policy, stores, self._set_data, self._free_disk)
        """Queues, completes and cancels the writes; owns the writes in flight."""
        self.backward = BackwardReads(self, policy, self._set_data, self._free_disk, self.writes.cancel)
        """Issues, serves and times the reads backward needs; owns the reads in flight."""

    # ------------------------------------------------------------------ records

    def open(self, key: Hashable) -> Record:
        """A micro-batch forward starts: its new record.

        Raises:
            CacheStateError: a record with ``key`` is still open.
        """
        record = Record(key)
        with self.lock:
            self.counters.microbatches += 1
            if key in self.records:
                raise CacheStateError(f"microbatch key {key!r} is already open; keys must be unique in flight")
            self.records[key] = record
            self.counters.peak_open_records = max(self.counters.peak_open_records, len(self.records))
        return record

    def forward_ended(self, record: Record) -> None:
        """The record's forward is over; it retires when its last entry is released."""
        with self.lock:
            record.forward_done = True
            for outside in OUTSIDE:  # NOTE [Sites outside the layers] in tensor_cache.py
                if outside in record.layer_entries:
                    self.layer(outside).microbatches += 1
            self._maybe_retire(record)

    def layer(self, layer_id: Hashable) -> LayerCounters:
        """The step's counters of ``layer_id`` (created on first use). Caller holds the lock."""
        lc = self.counters.layers.get(layer_id)
        if lc is None:
            lc = self.counters.layers[layer_id] = LayerCounters()
        return lc

    # ------------------------------------------------------------------ saved

    def saved(self, record: Record, key: Hashable, t: torch.Tensor, layer_id: Hashable,
              unmovable: bool = False, group: Optional[str] = None, started: Any = None) -> Tuple[Entry, bool]:
        """``t`` is saved for backward in ``layer_id``: its entry, and whether it is new
        and moves (then call :meth:`write` outside the lock). A storage the record holds
        already gains a use (NOTE [Dedup identity]). An ``unmovable`` tensor (NOTE
        [Unmovable saved tensors] in ``identity.py``) is held as it is and never moves.
        ``group``: the module group it was saved in, for a peer's rule (``peer_rules.py``).
        ``started``: the clock mark of the layer forward saving it, which times a new
        site's save (NOTE [Site save times] in ``planner/profile.py``)."""
        with self.lock:
            self.counters.tensors_packed += 1
            entry = self._lookup(record, key)
            if entry is not None:
                self._add_use(entry, layer_id)
                return entry, False
            entry = self._new_entry(record, key, t, layer_id, unmovable, group)
            if started is not None and entry.site is not None:
                lc = self.layer(layer_id)
                time_site(self.clock, started, lc.site_save_s, lc.site_saves, entry.site)
            return entry, entry.placement in MOVED

    def skipped(self) -> None:
        """A saved tensor the cache leaves alone (a parameter, another device)."""
        with self.lock:
            self.counters.tensors_skipped += 1
            self.counters.tensors_packed += 1

    def _lookup(self, record: Record, key: Any) -> Optional[Entry]:
        # See NOTE [Dedup identity].
        entry = record.entries.get(key)
        if entry is None or entry.state is EntryState.RELEASED:
            return None
        if entry.weak is not None and entry.weak.expired():
            del record.entries[key]
            return None
        return entry

    def _add_use(self, entry: Entry, layer_id: Hashable) -> None:
        entry.refs += 1
        self.counters.bytes_deduplicated += entry.nbytes
        if layer_id != entry.layer and layer_id not in entry.also_layers:
            entry.also_layers.append(layer_id)
            entry.record.add_layer_entry(layer_id, entry)
            if self.policy.layer(layer_id) not in MOVED:
                entry.pinned = True
                self.writes.cancel(entry)
            if entry.site is not None:  # NOTE [Sites]: it keeps its place here, with no bytes of this layer's
                taken = entry.record.sites.get(layer_id, 0)
                entry.record.sites[layer_id] = taken + 1
                sites = self.layer(layer_id).site_bytes
                sites.extend([0] * (taken + 1 - len(sites)))

    def _new_entry(self, record: Record, key: Any, t: torch.Tensor, layer_id: Hashable, unmovable: bool,
                   group: Optional[str] = None) -> Entry:
        plain = is_plain(t)
        data = storage_bytes(t) if plain else t  # a subclass is held whole (NOTE [Unmovable saved tensors])
        nbytes = data.numel() if plain else held_bytes(t)
        # NOTE [One placement policy]: whether it may move (its site) and where it goes
        site = self.policy.site_of(nbytes, unmovable, record.sites.get(layer_id, 0))  # NOTE [Sites]
        if site is not None:
            record.sites[layer_id] = site + 1
        placement = self.policy.tensor(layer_id, site, self.resident + nbytes, group, t.numel())
        entry = Entry(key, nbytes, t.device, layer_id, placement, record, weak=storage_weakref(t) if plain else None,
                      refs=1, site=site)
        entry.releasable = self.return_pages and placement is Placement.OFFLOAD and allocator_owned(t)
        if self.observer is not None and layer_id != HEAD:  # NOTE [Working set by phase] in adaptive.py
            self.observer.saved(t, layer_id)
        self._set_data(entry, data)
        self.live += nbytes
        self.counters.peak_live_bytes = max(self.counters.peak_live_bytes, self.live)
        record.entries[key] = entry
        record.live += 1
        record.add_layer_entry(layer_id, entry)
        lc = self.layer(layer_id)
        if unmovable:
            lc.unmovable_bytes += nbytes
        elif site is None:
            lc.small_bytes += nbytes
        else:
            lc.saved_bytes += nbytes
            if site < len(lc.site_bytes):
                lc.site_bytes[site] += nbytes
            else:
                lc.site_bytes.append(nbytes)
        if placement is Placement.KEEP:
            self.counters.bytes_kept += nbytes
        return entry

    def _set_data(self, entry: Entry, data: Optional[torch.Tensor]) -> None:
        counted = not (entry.discarded or entry.on_host)  # NOTE [Discarded storages]: the owner holds those bytes
        old = entry.nbytes if entry.data is not None and counted else 0
        new = entry.nbytes if data is not None and counted else 0
        entry.data = data
        self.resident += new - old
        if self.resident > self.counters.peak_resident_bytes:
            self.counters.peak_resident_bytes = self.resident
        if new < old:
            self.writes.resident_dropped()

    # ------------------------------------------------------------------ writes

    def write(self, entry: Entry) -> None:
        """Queue a new moved entry's write (:meth:`ForwardWrites.write`); called without
        the lock."""
        self.writes.write(entry)

    def drain(self) -> None:
        """Wait until every queued write, and every read in flight, has completed (or
        failed). At a step's end the reads left are those of tensors autograd released
        unneeded; their blobs are freed when they complete, so the step's disk bytes are
        counted after them."""
        with self.lock:
            pending = self.writes.in_flight() + self.backward.in_flight()
        for future in pending:
            future.wait_settled()  # its callback records a failure and frees what it leaves

    # ------------------------------------------------------------------ discarded storages

    # NOTE [Discarded storages]
    # megatron-core's selective recompute with output discarding (``CheckpointWithoutOutput``:
    # recompute_modules ``layernorm``, ``moe_act``, ``mla_up_proj``) runs a module without
    # saving its inputs, lets the next op save the module's output for backward, then frees
    # that output's storage with ``untyped_storage().resize_(0)`` and, just before backward
    # needs it, recomputes the module and refills the same storage object in place. The
    # cache has by then packed that output like any saved tensor, and a write of it may be
    # queued: freed under the write, its bytes would be a reused block's (on a GPU: another
    # tensor's, with a matching checksum) and the gradients silently wrong. So the owner
    # tells the cache first (``TensorCache.storage_discarded``): every entry of that storage
    # has its write cancelled and waited for (nothing reads the storage once the call
    # returns), loses its disk copy, and from then on is served by reference to the storage
    # object, which the owner refills before backward unpacks it: KEEP, with its bytes not
    # counted as resident (the owner frees them until it recomputes them).

    def discard_storage(self, cdata: int) -> List[IOFuture]:
        """Entries of the storage ``cdata`` (its ``_cdata``) are about to be freed by their
        owner (NOTE [Discarded storages]): cancel their writes; the writes in flight,
        to wait for before :meth:`serve_by_reference`."""
        pending = []
        with self.lock:
            for entry in self._entries_of_storage(cdata):
                if entry.write_future is not None:
                    self.writes.cancel(entry)
                    pending.append(entry.write_future)
        return pending

    def serve_by_reference(self, cdata: int, data: torch.Tensor) -> int:
        """After :meth:`discard_storage`'s writes settled: the entries of ``cdata`` keep
        ``data`` (a byte view of the storage object) and no disk copy; their bytes."""
        moved = 0
        with self.lock:
            for entry in self._entries_of_storage(cdata):
                if entry.discarded:
                    continue
                self._set_data(entry, None)  # uncount what the cache counted
                self._free_disk(entry)
                entry.placement = Placement.KEEP
                entry.state = EntryState.RESIDENT
                entry.releasable = False
                entry.discarded = True
                entry.data = data
                self.live -= entry.nbytes  # the owner holds them, as it would without the cache
                moved += entry.nbytes
            self.counters.bytes_discarded += moved
        return moved

    def _entries_of_storage(self, cdata: int) -> List[Entry]:
        """Live entries of the open records whose storage is ``cdata``. Caller holds the lock."""
        found = []
        for record in self.records.values():
            for key, entry in record.entries.items():
                if key[0] == cdata and entry.state is not EntryState.RELEASED and not (
                        entry.weak is not None and entry.weak.expired()):
                    found.append(entry)
        return found

    # ------------------------------------------------------------------ backward

    def backward_started(self, record: Record, layer_id: Hashable) -> Optional[Hashable]:
        """``layer_id``'s backward begins in ``record``: issue the reads due now
        (:meth:`BackwardReads.backward_started`).

        Returns:
            The layer whose backward just ended in ``record`` (None: the first)."""
        return self.backward.backward_started(record, layer_id)

    def needed(self, entry: Entry, name: str = "") -> torch.Tensor:
        """Backward unpacks ``entry``: its bytes, once read (:meth:`BackwardReads.needed`).
        An entry of the head's tells the memory observer the head's backward runs (NOTE
        [Working set of the head's backward] in ``memory_cap.py``)."""
        if self.observer is not None and entry.layer == HEAD:
            self.observer.phase(True, HEAD, backward=True)
        return self.backward.needed(entry, name)

    # ------------------------------------------------------------------ release

    def released(self, entry: Entry) -> None:
        """One use of ``entry`` is gone (autograd dropped a ``Packed``); the last frees
        its memory and disk copy (NOTE [Entry lifetime])."""
        if self.closed:
            return
        with self.lock:
            entry.refs -= 1
            if entry.refs > 0 or entry.state is EntryState.RELEASED:
                return
            reading = entry.state is EntryState.READING
            if not entry.discarded:
                self.live -= entry.nbytes
            entry.state = EntryState.RELEASED
            entry.weak = None  # NOTE [No reference cycles]: frees the storage's C++ object now
            # See NOTE [Entry lifetime]: a read in flight still fills ``data`` (its
            # callback drops it); a write in flight keeps its own reference to the
            # source and its callback frees the disk copy.
            if not reading:
                self._set_data(entry, None)
                if entry.write_future is None:
                    self._free_disk(entry)
                else:
                    self.writes.cancel(entry)
            record = entry.record
            if record.entries.get(entry.key) is entry:
                del record.entries[entry.key]
            record.live -= 1
            self._maybe_retire(record)

    def _free_disk(self, entry: Entry) -> None:
        handle, entry.handle = entry.handle, None  # NOTE [Freed once] in io/recovery.py: off the entry first
        if handle is not None:
            entry.store.discard(handle)

    def _maybe_retire(self, record: Record) -> None:
        if record.forward_done and record.live <= 0 and self.records.get(record.key) is record:
            del self.records[record.key]
            # NOTE [No reference cycles]: entries point back at the record.
            record.entries.clear()
            record.layer_entries.clear()
            record.prefetched.clear()
            self.backward.retired(record)

    # ------------------------------------------------------------------ step / close

    def take_step(self) -> Counters:
        """The step's counters; new ones start, their peaks at what is resident and alive
        now. Caller holds the lock."""
        counters = self.counters
        self.counters = Counters(peak_resident_bytes=self.resident, peak_live_bytes=self.live,
                                 peak_open_records=len(self.records))
        return counters

    def close(self) -> None:
        """Forget every record; later events are ignored (the stores are closed by the
        cache)."""
        with self.lock:
            self.closed = True
            self.records.clear()
        self.writes.failures.flush()
