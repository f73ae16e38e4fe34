"""The backward side alone (``megatron_ssd/cache/backward.py``): :class:`BackwardReads`
over a table that has only the members of :class:`TableState`, and the three transitions
it is given, so it is shown to need nothing else of the entry table."""

import torch

from megatron_ssd.cache.backward import BackwardReads
from megatron_ssd.cache.policy import PlacementPolicy
from megatron_ssd.cache.record import Entry, EntryState, Record
from megatron_ssd.cache.stats import Counters
from megatron_ssd.config import OffloadConfig, Placement
from megatron_ssd.io.store import BlobStore

from scripted import ScriptedEngine, ScriptedTable

NBYTES = 4096


def reads_over(engine: ScriptedEngine, limit=None):
    """The table, its reads (layer 0 read one layer ahead), and a record whose layer 0
    saved one 4 KiB tensor, now on the drive."""
    config = OffloadConfig(paths=["/unused"], min_tensor_bytes=1024, default_read_ahead=1)
    policy = PlacementPolicy(config, host_available=False)
    policy.layers = [0, 1]
    policy.set_plan({0: "offload", 1: "offload"})
    policy.resident_limit = limit
    table = ScriptedTable()
    reads = BackwardReads(table, policy, table.set_data, table.free_disk, table.cancel_write)
    store = BlobStore(engine, "ssd")
    t = torch.arange(NBYTES // 4, dtype=torch.float32)
    future = store.put(t.view(torch.uint8), block=True)
    engine.complete_writes()
    handle = future.get()
    store.stored(handle)
    record = Record("mb0", layer_order=[0, 1], forward_done=True, live=1)
    entry = Entry(("k",), NBYTES, t.device, 0, Placement.OFFLOAD, record, state=EntryState.ON_DISK,
                  handle=handle, store=store, refs=1, site=0)
    record.add_layer_entry(0, entry)
    return table, reads, record, entry, t


def test_a_read_issued_at_a_backward_start_is_served_and_its_disk_copy_freed():
    engine = ScriptedEngine()
    engine.hold_reads = True
    table, reads, record, entry, t = reads_over(engine)
    assert reads.backward_started(record, 1) is None  # the first backward: none ended
    assert (entry.state, table.resident, engine.reads) == (EntryState.READING, NBYTES, 1)
    with table.lock:
        assert reads.in_flight() == [entry.read_future]
    engine.complete_reads()
    assert (entry.state, engine.freed, table.calls) == (EntryState.LOADED, 1, [("set_data", True), ("free_disk", True)])
    assert reads.backward_started(record, 0) == 1  # layer 1's backward ended
    with table.lock:
        assert reads.in_flight() == []
    data = reads.needed(entry)
    assert torch.equal(data.view(torch.float32), t) and entry.used
    assert (table.counters.late_reads, table.counters.prefetch_deferred) == (0, 0)
    with table.lock:
        reads.retired(record)  # its running backward's clock is closed and forgotten
    assert reads.backward_started(record, 0) is None


def test_a_prefetch_over_the_resident_limit_waits_for_backward_to_need_it():
    engine = ScriptedEngine()
    table, reads, record, entry, t = reads_over(engine, limit=NBYTES - 1)
    reads.backward_started(record, 1)
    assert (entry.state, engine.reads, table.counters.prefetch_deferred) == (EntryState.ON_DISK, 0, 1)
    data = reads.needed(entry)  # a late read: the limit defers prefetches only
    assert torch.equal(data.view(torch.float32), t)
    assert (table.counters.late_reads, engine.reads, entry.state) == (1, 1, EntryState.LOADED)


def test_the_counters_swapped_at_a_step_end_are_the_ones_counted():
    engine = ScriptedEngine()
    table, reads, record, entry, t = reads_over(engine, limit=NBYTES - 1)
    before = table.counters
    table.counters = Counters()  # what ``EntryTable.take_step`` does
    reads.backward_started(record, 1)
    assert (before.prefetch_deferred, table.counters.prefetch_deferred) == (0, 1)
