"""NOTE [Released at staging]: a device tensor's memory goes when the engine has its
bytes in host staging, not when they reach the drive; the STAGED entry's write is never
cancelled, a backward that needs it first waits for the drive and reads it back, and a
write that fails after staging hands back the engine's host copy or fails the unpack by
name. The CUDA device is stood in for by ``release_at_staging`` on a CPU cache; the
scripted store stages and completes writes when the test says."""

import threading

import pytest
import torch

from megatron_ssd import OffloadConfig, TensorCache
from megatron_ssd.cache.record import EntryState
from megatron_ssd.errors import OffloadIOError

from scripted import ScriptedEngine, io_error
from test_entry_events import forward, model_and_batch, reference_grads


def _cache(engine, layers):
    cache = TensorCache(OffloadConfig(paths=["/unused"], min_tensor_bytes=1024, return_freed_pages=False),
                        engine=engine)
    cache.entries.release_at_staging = True  # as on a CUDA device
    cache.register_layers(layers)
    cache.set_plan({i: "offload" for i in range(len(layers))})
    return cache


def test_memory_is_released_at_staging_and_read_back_after_the_write():
    engine = ScriptedEngine()
    engine.cancellable = True
    model, batch = model_and_batch()
    expected = reference_grads(model, batch)
    with _cache(engine, model) as cache:
        loss, moved = forward(cache, model, batch)
        held = cache.resident_bytes
        engine.stage_writes()
        assert all(e.state is EntryState.STAGED and e.data is None for e in moved)
        assert cache.resident_bytes == held - sum(e.nbytes for e in moved)  # freed before the drive has them
        engine.complete_writes()
        assert all(e.state is EntryState.ON_DISK for e in moved)
        loss.backward()
        stats = cache.finish_step()
    assert not engine.cancelled and stats.bytes_reloaded == sum(e.nbytes for e in moved)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected))


def test_backward_needing_a_staged_tensor_waits_for_its_write_and_never_cancels_it():
    engine = ScriptedEngine()
    engine.cancellable = True
    model, batch = model_and_batch()
    expected = reference_grads(model, batch)
    with _cache(engine, model) as cache:
        loss, moved = forward(cache, model, batch)
        engine.stage_writes()
        futures = [e.write_future for e in moved]

        def land_writes_once_waited_for():
            futures[-1].waited.wait()  # backward of the last layer waits for its staged write
            engine.complete_writes()

        lander = threading.Thread(target=land_writes_once_waited_for)
        lander.start()
        loss.backward()
        lander.join()
        stats = cache.finish_step()
    assert not engine.cancelled, "a staged write is the only copy: cancelling it would lose the bytes"
    assert stats.bytes_forwarded == 0 and stats.bytes_reloaded == sum(e.nbytes for e in moved)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected))


def _one_staged_tensor(engine):
    cache = _cache(engine, [torch.nn.Identity()])
    record_cm = cache.microbatch()
    record = record_cm.__enter__()
    with cache.layer(0):
        t = torch.randn(64, 64)
        packed = cache.pack(record, t)
    engine.stage_writes()
    return cache, record_cm, packed, t.clone()


def test_a_write_failing_after_staging_without_a_host_copy_fails_the_unpack_by_name():
    engine = ScriptedEngine()
    cache, record_cm, packed, _ = _one_staged_tensor(engine)
    engine.fail_writes_with(io_error("scripted: no space left", 28))
    with pytest.raises(OffloadIOError, match=r"write failed after its device memory was released.*layer 0"):
        cache.unpack(packed)
    del packed
    record_cm.__exit__(None, None, None)
    cache.close()


def test_a_write_failing_after_staging_with_the_engines_host_copy_keeps_the_tensor():
    engine = ScriptedEngine()
    cache, record_cm, packed, original = _one_staged_tensor(engine)
    error = io_error("scripted: no space left", 28)
    error.host_copy = engine.pending[0][2]  # the scripted engine's copy of the bytes
    engine.fail_writes_with(error)
    assert cache.resident_bytes == 0  # host memory is not the device's
    assert torch.equal(cache.unpack(packed), original)
    del packed
    record_cm.__exit__(None, None, None)
    assert cache.resident_bytes == 0
    cache.close()
