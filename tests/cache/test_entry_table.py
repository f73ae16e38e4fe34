"""The entry table alone (``megatron_ssd/cache/entries.py``): each event of NOTE [Entry
lifetime] called directly, I/O completed by a scripted store in the order each test
chooses (late write, early read, release mid-read or mid-write, failure mid-read), and
the entry's state, the resident bytes and the store's blobs checked after every event."""

import threading

import pytest
import torch

from megatron_ssd.cache.entries import EntryTable
from megatron_ssd.cache.identity import storage_key
from megatron_ssd.cache.policy import PlacementPolicy
from megatron_ssd.cache.record import EntryState
from megatron_ssd.config import OffloadConfig, Placement
from megatron_ssd.errors import OffloadIOError
from megatron_ssd.io.store import BlobStore

from scripted import ScriptedEngine

NBYTES = 4096


def table_with(engine: ScriptedEngine, plan=None) -> EntryTable:
    """A table over one scripted SSD store; layer 0 offloads, layer 1 keeps."""
    config = OffloadConfig(paths=["/unused"], min_tensor_bytes=1024, default_read_ahead=1)
    policy = PlacementPolicy(config, host_available=False)
    policy.layers = [0, 1]
    policy.set_plan(plan or {0: "offload", 1: "keep"})
    return EntryTable(config, policy, {Placement.OFFLOAD: BlobStore(engine, "ssd")}, return_pages=False)


def saved_in_layer_0(table: EntryTable):
    """A record whose layer 0 saved one 4 KiB tensor, its write queued."""
    record = table.open("mb0")
    record.layer_order += [0, 1]  # what the layer scopes record during forward
    t = torch.arange(NBYTES // 4, dtype=torch.float32)
    entry, moves = table.saved(record, storage_key(t), t, 0)
    assert moves and entry.placement is Placement.OFFLOAD and entry.site == 0
    table.write(entry)
    return record, entry, t


def test_write_done_then_read_ahead_then_needed_then_released():
    engine = ScriptedEngine()
    engine.hold_reads = True
    table = table_with(engine)
    record, entry, t = saved_in_layer_0(table)
    assert (entry.state, table.resident) == (EntryState.WRITING, NBYTES)
    engine.complete_writes()
    assert (entry.state, entry.data, table.resident) == (EntryState.ON_DISK, None, 0)
    table.forward_ended(record)
    table.backward_started(record, 1)  # layer 0's read is due one layer ahead
    assert (entry.state, table.resident, engine.reads) == (EntryState.READING, NBYTES, 1)
    engine.complete_reads()
    assert entry.state is EntryState.LOADED and engine.freed == 1  # the disk copy goes once read
    data = table.needed(entry)
    assert torch.equal(data.view(torch.float32), t)
    table.released(entry)
    assert (entry.state, table.resident, table.records) == (EntryState.RELEASED, 0, {})
    counters = table.take_step()
    assert (counters.late_reads, counters.bytes_forwarded, counters.peak_resident_bytes) == (0, 0, NBYTES)
    assert counters.layers[0].offloaded_bytes == counters.layers[0].saved_bytes == NBYTES


def test_needed_before_any_read_is_a_late_read():
    engine = ScriptedEngine()
    table = table_with(engine)
    record, entry, t = saved_in_layer_0(table)
    engine.complete_writes()
    data = table.needed(entry)  # no backward_started: the read is issued now
    assert torch.equal(data.view(torch.float32), t) and entry.state is EntryState.LOADED
    assert table.counters.late_reads == 1 and engine.reads == 1


def test_needed_while_the_write_is_in_flight_is_served_from_memory():
    engine = ScriptedEngine()
    table = table_with(engine)
    record, entry, t = saved_in_layer_0(table)
    data = table.needed(entry)  # late write: forwarded, nothing read
    assert torch.equal(data.view(torch.float32), t) and entry.wanted
    assert table.counters.bytes_forwarded == NBYTES
    engine.complete_writes()
    assert (entry.state, table.resident, engine.freed) == (EntryState.LOADED, NBYTES, 1)
    table.released(entry)
    assert table.resident == 0 and engine.reads == 0 and not engine.blobs


def test_released_mid_read_frees_the_buffer_when_the_read_lands():
    engine = ScriptedEngine()
    engine.hold_reads = True
    table = table_with(engine)
    record, entry, _ = saved_in_layer_0(table)
    engine.complete_writes()
    table.backward_started(record, 0)
    table.released(entry)  # the graph is dropped while its read is in flight
    assert (entry.state, table.resident) == (EntryState.RELEASED, NBYTES)
    # a step's end drains the read too, so the blob it frees is not counted in the step
    drained = threading.Event()
    waiter = threading.Thread(target=lambda: (table.drain(), drained.set()))
    waiter.start()
    assert not drained.wait(0.2)
    engine.complete_reads()
    waiter.join(10)
    assert drained.is_set()
    assert (entry.data, table.resident, engine.freed, engine.blobs) == (None, 0, 1, {})


def test_released_mid_write_frees_the_blob_when_the_write_lands():
    engine = ScriptedEngine()
    table = table_with(engine)
    record, entry, _ = saved_in_layer_0(table)
    table.released(entry)
    assert (entry.state, table.resident, engine.freed) == (EntryState.RELEASED, 0, 0)
    engine.complete_writes()
    assert engine.freed == 1 and not engine.blobs


def test_a_read_that_fails_is_raised_with_the_name_given():
    engine = ScriptedEngine()
    engine.fail_reads = True
    table = table_with(engine)
    record, entry, _ = saved_in_layer_0(table)
    engine.complete_writes()
    with pytest.raises(OffloadIOError, match=r"scripted read failure \(tensor \[1024\], layer 0\)"):
        table.needed(entry, "tensor [1024], layer 0")



def test_a_failed_read_leaves_the_entry_on_disk_and_its_release_frees_it_once():
    """NOTE [Failed reads] in backward.py: the bytes are still on the drive, so the entry
    is ON_DISK again, its read buffer dropped; the next unpack reads it again, and its
    release frees the blob once. Before, it stayed READING with the buffer counted as
    resident, and its release never freed the blob."""
    engine = ScriptedEngine()
    engine.fail_reads = True
    table = table_with(engine)
    record, entry, t = saved_in_layer_0(table)
    engine.complete_writes()
    table.forward_ended(record)
    table.backward_started(record, 1)  # layer 0's read is due one layer ahead: it fails
    assert (entry.state, entry.data, entry.read_future, table.resident) == (EntryState.ON_DISK, None, None, 0)
    with pytest.raises(OffloadIOError, match=r"scripted read failure"):
        table.needed(entry)  # read again: fails again
    assert (entry.state, engine.reads, engine.freed) == (EntryState.ON_DISK, 2, 0)
    engine.fail_reads = False
    assert torch.equal(table.needed(entry).view(torch.float32), t)  # a drive that answers again
    table.released(entry)
    assert (entry.state, entry.handle, engine.freed, table.resident) == (EntryState.RELEASED, None, 1, 0)
    assert not engine.blobs and table.records == {}


def test_a_kept_layer_saving_the_storage_again_pins_it():
    engine = ScriptedEngine()
    table = table_with(engine)
    record, entry, t = saved_in_layer_0(table)
    again, moves = table.saved(record, storage_key(t), t, 1)
    assert again is entry and not moves and entry.pinned and entry.refs == 2
    assert entry.also_layers == [1] and table.counters.bytes_deduplicated == NBYTES
    engine.complete_writes()
    assert (entry.state, table.resident, engine.freed) == (EntryState.LOADED, NBYTES, 1)


def test_a_refused_write_keeps_the_entry():
    engine = ScriptedEngine()
    engine.refuse = True
    table = table_with(engine)
    record, entry, _ = saved_in_layer_0(table)
    assert (entry.state, entry.placement, table.resident) == (EntryState.RESIDENT, Placement.KEEP, NBYTES)
    assert table.counters.backpressure_keeps == 1
