"""The write side alone (``megatron_ssd/cache/writes.py``): :class:`ForwardWrites` over a
table that has only the members of :class:`WriteTable`, and the two transitions it is
given, so it is shown to need nothing else of the entry table. Writes complete when the
scripted store says so."""

import torch

from megatron_ssd.cache.policy import PlacementPolicy
from megatron_ssd.cache.record import Entry, EntryState, Record
from megatron_ssd.cache.stats import Counters
from megatron_ssd.cache.writes import ForwardWrites
from megatron_ssd.config import IOConfig, OffloadConfig, Placement
from megatron_ssd.io.store import BlobStore

from scripted import ScriptedEngine, ScriptedWriteTable

NBYTES = 4096


def writes_over(engine: ScriptedEngine, on_backpressure="wait"):
    """The table, its writes, and one 4 KiB entry of layer 0 placed to offload, held in
    memory (counted as resident)."""
    config = OffloadConfig(paths=["/unused"], min_tensor_bytes=1024, io=IOConfig(on_backpressure=on_backpressure))
    policy = PlacementPolicy(config, host_available=False)
    table = ScriptedWriteTable()
    writes = ForwardWrites(table, config, policy, {Placement.OFFLOAD: BlobStore(engine, "ssd")},
                           table.set_data, table.free_disk)
    t = torch.arange(NBYTES // 4, dtype=torch.float32)
    record = Record("mb0", layer_order=[0], live=1)
    entry = Entry(("k",), NBYTES, t.device, 0, Placement.OFFLOAD, record, refs=1, site=0)
    table.set_data(entry, t.view(torch.uint8))
    table.calls.clear()
    return table, writes, entry, t


def test_a_write_that_lands_leaves_the_entry_on_disk_and_its_memory_uncounted():
    engine = ScriptedEngine()
    table, writes, entry, t = writes_over(engine)
    writes.write(entry)
    assert (entry.state, table.layer(0).offloaded_bytes, table.resident) == (EntryState.WRITING, NBYTES, NBYTES)
    with table.lock:
        assert writes.in_flight() == [entry.write_future]
    assert engine.complete_writes() == 1
    assert (entry.state, entry.data, table.resident, table.calls) == (EntryState.ON_DISK, None, 0, [("set_data", False)])
    assert torch.equal(engine.blobs[entry.handle.extents[0].offset].view(torch.float32), t)
    with table.lock:
        assert writes.in_flight() == []


def test_a_failed_write_keeps_the_tensor_and_is_counted_as_a_fallback():
    engine = ScriptedEngine()
    table, writes, entry, t = writes_over(engine)
    writes.write(entry)
    engine.fail_writes()
    assert (entry.state, entry.placement, table.resident) == (EntryState.RESIDENT, Placement.KEEP, NBYTES)
    assert (table.counters.write_fallbacks, table.counters.bytes_fallen_back, table.calls) == (1, NBYTES, [])
    writes.failures.flush()


def test_a_write_the_store_refuses_keeps_the_tensor():
    engine = ScriptedEngine()
    engine.refuse = True
    table, writes, entry, t = writes_over(engine, on_backpressure="keep")
    writes.write(entry)
    assert (entry.state, entry.placement, entry.write_future) == (EntryState.RESIDENT, Placement.KEEP, None)
    assert (table.counters.backpressure_keeps, table.counters.bytes_kept) == (1, NBYTES)


def test_a_cancelled_write_leaves_the_tensor_in_memory():
    engine = ScriptedEngine()
    engine.cancellable = True
    table, writes, entry, t = writes_over(engine)
    writes.write(entry)
    with table.lock:
        writes.cancel(entry)
    engine.complete_writes()
    assert (entry.state, table.resident, table.counters.bytes_write_cancelled) == (EntryState.LOADED, NBYTES, NBYTES)
    assert engine.blobs == {}


def test_released_at_staging_drops_the_memory_before_the_write_lands():
    engine = ScriptedEngine()
    table, writes, entry, t = writes_over(engine)
    table.release_at_staging = True
    writes.write(entry)
    engine.stage_writes()
    assert (entry.state, entry.data, table.resident) == (EntryState.STAGED, None, 0)
    with table.lock:
        writes.cancel(entry)  # the staging is the only copy: not cancelled
    engine.complete_writes()
    assert (entry.state, table.calls) == (EntryState.ON_DISK, [("set_data", False)])


def test_the_counters_swapped_at_a_step_end_are_the_ones_counted():
    engine = ScriptedEngine()
    table, writes, entry, t = writes_over(engine)
    writes.write(entry)
    before = table.counters
    table.counters = Counters()  # what ``EntryTable.take_step`` does
    engine.fail_writes()
    assert (before.write_fallbacks, table.counters.write_fallbacks) == (0, 1)
    writes.failures.flush()
