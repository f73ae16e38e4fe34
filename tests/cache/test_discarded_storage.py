"""Saved tensors whose owner frees and refills their storage (NOTE [Discarded storages]).

megatron-core's output discarding frees a module's output with ``resize_(0)`` after the
next op saved it, and refills the same storage object before backward; the cache is told
first (``TensorCache.storage_discarded``). Driven by a scripted store, so a write is in
flight or done exactly when the test says.
"""

import torch

from megatron_ssd import OffloadConfig, TensorCache
from megatron_ssd.cache.record import EntryState

from scripted import ScriptedEngine


def _discarding_step(cache, weight, x, complete_before_discard=False, engine=None):
    """One micro-batch of ``out = tanh(x) @ weight`` whose ``tanh(x)`` is discarded after
    the matmul saved it and refilled by a hook before backward, as Megatron does."""
    record_box = {}
    w = weight.detach().requires_grad_(True)
    context = cache.microbatch() if cache is not None else _null()
    with context as record:
        record_box["record"] = record
        scope = cache.layer(0) if cache is not None else _null()
        with scope:
            y = torch.tanh(x)  # computed without a graph: the owner recomputes it
            out = y @ w  # saves y for the weight's gradient
        if cache is not None and complete_before_discard:
            engine.complete_writes()
        if cache is not None:
            cache.storage_discarded(y)
        nbytes = y.untyped_storage().nbytes()
        y.untyped_storage().resize_(0)

        def refill(grad):
            again = torch.tanh(x)
            y.untyped_storage().resize_(nbytes)
            y.untyped_storage().copy_(again.untyped_storage())

        out.register_hook(refill)
        loss = out.square().mean()
    loss.backward()
    return loss.detach(), w.grad, record_box["record"]


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _cache(engine):
    cache = TensorCache(OffloadConfig(paths=["/unused"], min_tensor_bytes=1024, return_freed_pages=False),
                        engine=engine)
    cache.register_layers([torch.nn.Identity()], ids=[0], install_hooks=False)
    cache.set_plan({0: "offload"})
    return cache


def _inputs():
    torch.manual_seed(0)
    return torch.randn(64, 64), torch.randn(32, 64)


def test_a_write_in_flight_is_cancelled_and_settled_before_the_storage_is_freed():
    weight, x = _inputs()
    ref_loss, ref_grad, _ = _discarding_step(None, weight, x)
    engine = ScriptedEngine()
    engine.cancellable = engine.complete_on_cancel = True
    with _cache(engine) as cache:
        loss, grad, record = _discarding_step(cache, weight, x)
        stats = cache.finish_step()
    assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad)
    assert engine.pending == [] and engine.blobs == {}  # nothing written, nothing left
    assert stats.bytes_discarded == x.numel() * 4
    assert stats.bytes_offloaded == 0 and stats.bytes_reloaded == 0
    assert stats.bytes_write_cancelled == x.numel() * 4


def test_a_completed_write_loses_its_disk_copy_and_the_tensor_is_served_by_reference():
    weight, x = _inputs()
    ref_loss, ref_grad, _ = _discarding_step(None, weight, x)
    engine = ScriptedEngine()
    with _cache(engine) as cache:
        loss, grad, _ = _discarding_step(cache, weight, x, complete_before_discard=True, engine=engine)
        stats = cache.finish_step()
        assert cache.resident_bytes == 0
    assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad)
    assert engine.reads == 0 and engine.freed == 1 and engine.blobs == {}
    assert stats.bytes_discarded == x.numel() * 4


def test_discarded_bytes_are_not_counted_as_resident():
    _, x = _inputs()
    engine = ScriptedEngine()
    with _cache(engine) as cache:
        cache.set_plan({0: "keep"})
        with cache.microbatch() as record:
            with cache.layer(0):
                y = torch.tanh(x).requires_grad_(True)
                out = y.exp()  # saves its output
            before = cache.resident_bytes
            cache.storage_discarded(out)
            after = cache.resident_bytes
            entry = next(iter(record.entries.values()))
        assert before >= out.untyped_storage().nbytes()
        assert before - after == out.untyped_storage().nbytes()
        assert entry.state is EntryState.RESIDENT and entry.discarded


def test_a_storage_the_cache_does_not_hold_is_ignored():
    engine = ScriptedEngine()
    with _cache(engine) as cache:
        cache.storage_discarded(torch.randn(128, 128))  # no record open: nothing to do
        assert cache.finish_step().bytes_discarded == 0
