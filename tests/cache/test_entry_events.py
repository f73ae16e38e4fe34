"""The cache's entry state machine (NOTE [Entry lifetime]) driven by a scripted store:
I/O completes when the test says, in the order it chooses, never by timing."""

import copy
import logging
import sys

import pytest
import torch

from megatron_ssd import OffloadConfig, TensorCache
from megatron_ssd.config import OUTSIDE
from megatron_ssd.cache.record import EntryState
from megatron_ssd.errors import CacheStateError, OffloadIOError

from scripted import ScriptedEngine


def model_and_batch(layers: int = 3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(layers)])
    return model, torch.randn(32, 64)


def reference_grads(model, batch):
    ref = copy.deepcopy(model)
    ref(batch).square().mean().backward()
    return [p.grad for p in ref.parameters()]


def scripted(**flags):
    """A scripted engine with ``flags`` set, a model, its batch and the gradients of
    training it without the cache."""
    engine = ScriptedEngine()
    for name, value in flags.items():
        setattr(engine, name, value)
    model, batch = model_and_batch()
    return engine, model, batch, reference_grads(model, batch)


def make_cache(engine: ScriptedEngine, model) -> TensorCache:
    cache = TensorCache(OffloadConfig(paths=["/unused"], min_tensor_bytes=1024, return_freed_pages=False),
                        engine=engine)
    cache.register_layers(model)
    cache.set_plan({i: "offload" for i in range(len(model))})
    return cache


def entries(record):
    """The record's entries saved inside layers (the loss's, the ``head`` pseudo-layer's, are kept)."""
    return [e for layer, entries in record.layer_entries.items() if layer not in OUTSIDE for e in entries]


def forward(cache, model, batch):
    """One micro-batch's forward: its loss and the entries its layers saved."""
    with cache.microbatch() as record:
        loss = model(batch).square().mean()
    return loss, entries(record)


def test_write_then_read_back_in_order():
    """Writes complete in forward; backward reads every tensor back; all blobs freed."""
    engine, model, batch, expected = scripted()
    with make_cache(engine, model) as cache:
        loss, moved = forward(cache, model, batch)
        assert moved and all(e.state is EntryState.WRITING for e in moved)
        assert engine.complete_writes() == len(moved)
        assert all(e.state is EntryState.ON_DISK and e.data is None for e in moved)
        assert cache.ssd.held_bytes == sum(e.handle.disk_bytes for e in moved)
        loss.backward()
        stats = cache.finish_step()
    assert engine.reads == len(moved) and engine.freed == len(moved) and not engine.blobs
    assert stats.bytes_offloaded == stats.bytes_reloaded == sum(e.nbytes for e in moved)
    assert stats.bytes_forwarded == 0 and stats.peak_ssd_bytes > 0 and cache.ssd.held_bytes == 0
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected))


def test_a_write_still_in_flight_when_backward_needs_it_is_served_from_memory():
    """Late write: backward runs before any write completed; nothing is read, every
    tensor is forwarded, and the blobs are freed as their writes complete."""
    engine, model, batch, expected = scripted()
    with make_cache(engine, model) as cache:
        loss, moved = forward(cache, model, batch)
        loss.backward()
        assert engine.reads == 0
        assert all(e.state is EntryState.RELEASED for e in moved)
        engine.complete_writes()  # the writes land after their tensors were released
        stats = cache.finish_step()
    assert engine.freed == len(moved) and not engine.blobs and cache.ssd.held_bytes == 0
    assert stats.bytes_forwarded == sum(e.nbytes for e in moved) and stats.bytes_reloaded == 0
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected))


def test_a_prefetch_out_of_memory_is_deferred_to_when_backward_needs_the_tensor():
    """NOTE [Prefetch under memory pressure]: the read buffer of a prefetch cannot be
    allocated; backward goes on, and the tensor is read when unpack needs it."""
    engine, model, batch, expected = scripted()
    with make_cache(engine, model) as cache:
        loss, moved = forward(cache, model, batch)
        engine.complete_writes()
        engine.out_of_memory = 1  # the first read buffer asked for (a prefetch) fails
        loss.backward()
        stats = cache.finish_step()
    assert engine.refused_allocs == 1 and stats.prefetch_deferred == 1
    assert stats.late_reads >= 1 and stats.bytes_reloaded == sum(e.nbytes for e in moved)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected))


def test_a_failed_read_raises_naming_the_layer():
    engine = ScriptedEngine()
    model, batch = model_and_batch()
    with make_cache(engine, model) as cache:
        loss, _ = forward(cache, model, batch)
        engine.complete_writes()
        engine.fail_reads = True
        with pytest.raises(OffloadIOError, match=r"scripted read failure .*layer 2"):
            loss.backward()


def test_a_failed_write_keeps_the_tensor_and_training_is_unchanged():
    engine, model, batch, expected = scripted()
    with make_cache(engine, model) as cache:
        loss, moved = forward(cache, model, batch)
        engine.fail_writes()
        assert all(e.state is EntryState.RESIDENT for e in moved)
        loss.backward()
        stats = cache.finish_step()
    assert stats.write_fallbacks == len(moved) and stats.bytes_offloaded == 0 and engine.reads == 0
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected))


def test_a_refused_write_keeps_the_tensor():
    engine, model, batch, expected = scripted(refuse=True)
    with make_cache(engine, model) as cache:
        loss, saved = forward(cache, model, batch)
        assert all(e.placement.value == "keep" for e in saved)
        loss.backward()
        stats = cache.finish_step()
    assert stats.backpressure_keeps > 0 and stats.bytes_offloaded == 0
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected))


def test_a_graph_dropped_before_its_writes_land_frees_every_blob():
    """Released during the write: the blob is discarded when the write completes."""
    engine = ScriptedEngine()
    model, batch = model_and_batch()
    with make_cache(engine, model) as cache:
        loss, moved = forward(cache, model, batch)
        del loss  # no backward: autograd frees the saved tensors
        assert all(e.state is EntryState.RELEASED for e in moved)
        engine.complete_writes()
        assert engine.freed == len(moved) and cache.ssd.held_bytes == 0
        assert cache.open_records == []


def test_a_write_that_raises_leaves_no_record_open():
    """A store whose ``put`` raises (not a refused or failed write: an exception) fails the
    forward, and the entry it was for is released with its ``Packed``: no record stays
    open and nothing stays resident."""
    engine = ScriptedEngine()
    model, batch = model_and_batch()

    def broken(src, block=True):
        raise OffloadIOError("the I/O engine is closed")

    engine.write = broken
    with make_cache(engine, model) as cache:
        with pytest.raises(OffloadIOError, match="the I/O engine is closed"):
            forward(cache, model, batch)
        assert cache.open_records == [] and cache.resident_bytes == 0


def test_a_write_still_in_flight_when_backward_needs_it_is_cancelled():
    """NOTE [Cancelled writes]: backward runs before any write completed, so every write
    is cancelled: nothing reaches the store, no write counts as failed, the tensors are
    served from memory and the gradients are unchanged."""
    engine, model, batch, expected = scripted(cancellable=True)
    with make_cache(engine, model) as cache:
        loss, moved = forward(cache, model, batch)
        loss.backward()
        assert len(engine.cancelled) == len(moved)
        engine.complete_writes()
        stats = cache.finish_step()
    assert not engine.blobs and engine.reads == 0 and engine.freed == 0 and cache.ssd.held_bytes == 0
    assert stats.bytes_write_cancelled == stats.bytes_forwarded == sum(e.nbytes for e in moved)
    assert stats.bytes_offloaded == 0 and stats.write_fallbacks == 0
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected))


def test_a_cancelled_write_leaves_a_needed_tensor_in_memory_until_released():
    """Early need: backward asks for one tensor before its write completed; its write is
    cancelled and it stays in memory (LOADED) until backward releases it, while the other
    tensors' writes land and are read back."""
    engine, model, batch, expected = scripted(cancellable=True)
    with make_cache(engine, model) as cache:
        loss, moved = forward(cache, model, batch)
        first = moved[0]
        data = cache.entries.needed(first)
        assert len(engine.cancelled) == 1
        engine.complete_writes()
        assert first.state is EntryState.LOADED and first.data is data and first.handle is None
        assert all(e.state is EntryState.ON_DISK for e in moved[1:])
        loss.backward()
        stats = cache.finish_step()
    assert engine.reads == len(moved) - 1 and not engine.blobs and cache.ssd.held_bytes == 0
    assert stats.bytes_write_cancelled == first.nbytes and stats.write_fallbacks == 0
    assert stats.bytes_offloaded == stats.bytes_reloaded == sum(e.nbytes for e in moved[1:])
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected))


def test_a_graph_dropped_before_its_writes_land_cancels_them():
    engine = ScriptedEngine()
    engine.cancellable = True
    model, batch = model_and_batch()
    with make_cache(engine, model) as cache:
        loss, moved = forward(cache, model, batch)
        del loss
        assert len(engine.cancelled) == len(moved)
        engine.complete_writes()
        stats = cache.finish_step()
        assert cache.open_records == [] and cache.resident_bytes == 0
    assert not engine.blobs and engine.freed == 0
    assert stats.bytes_write_cancelled == sum(e.nbytes for e in moved) and stats.bytes_offloaded == 0


@pytest.mark.parametrize("error, level", [(OffloadIOError("megatron_ssd: unlink of f failed: EIO"), logging.DEBUG),
                                          (CacheStateError("megatron_ssd: free of a handle ..."), logging.WARNING)],
                         ids=["io", "bookkeeping"])
def test_a_release_that_fails_is_logged_and_never_raised_from_the_finaliser(monkeypatch, caplog, error, level):
    """NOTE [Quiet finalisers] in record.py: autograd dropping a saved tensor runs
    ``Packed.__del__``; an error there was printed as "Exception ignored in ... Packed.__del__"
    with a traceback. Now an I/O error is logged at debug level (the fault was reported
    where it happened) and anything else as one warning line."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    caplog.set_level(logging.DEBUG, logger="megatron_ssd")
    engine, model, batch, _ = scripted()
    with make_cache(engine, model) as cache:
        loss, _ = forward(cache, model, batch)

        def fails(entry):
            raise error

        cache._unref = fails
        del loss  # every Packed goes
        del cache._unref
    assert unraisable == []
    told = [r for r in caplog.records if "releasing a saved tensor" in r.getMessage()]
    assert told and {r.levelno for r in told} == {level} and all(str(error) in r.getMessage() for r in told)
