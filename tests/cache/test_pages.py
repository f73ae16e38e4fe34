"""Offloaded CPU activations give their pages back to the kernel (NOTE [Returning freed
pages]), and only when nothing else can still read them.

Resident memory is read from the kernel (``/proc/self/statm``), not from the cache.
"""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest
import torch

from megatron_ssd import OffloadConfig, TensorCache
from megatron_ssd.cache.identity import storage_bytes
from megatron_ssd.cache.pages import allocator_owned, heap_trimming_available, release_pages, trim_heap
from megatron_ssd.memory import current_rss_bytes

from tiny_model import TinyGPT, make_batches

pytestmark = pytest.mark.skipif(not heap_trimming_available(), reason="needs glibc (malloc_trim, madvise)")

MiB = 1 << 20


def test_sole_owner_pages_leave_the_resident_set():
    owner = torch.full((64 * MiB,), 7, dtype=torch.uint8)  # touched: resident
    assert allocator_owned(owner)
    data = storage_bytes(owner)
    del owner
    before = current_rss_bytes()
    given = release_pages(data)
    after = current_rss_bytes()
    assert given >= 64 * MiB - 8192
    assert before - after >= 60 * MiB, f"RSS fell by {(before - after) / MiB:.1f} MiB only"


@pytest.mark.parametrize("other_owner", ["the tensor", "a view", "numpy", "shared memory"])
def test_pages_another_owner_can_read_are_left_alone(other_owner):
    if other_owner == "numpy":
        array = np.full(4 * MiB, 7, dtype=np.uint8)
        keep = torch.from_numpy(array)
    else:
        keep = torch.full((4 * MiB,), 7, dtype=torch.uint8)
        if other_owner == "shared memory":
            keep.share_memory_()
    data = storage_bytes(keep)
    if other_owner in ("numpy", "shared memory"):
        assert not allocator_owned(keep)
        return
    if other_owner == "a view":
        keep = keep[4096:]
    assert release_pages(data) == 0
    assert bool((data == 7).all()), "the bytes must be untouched"


def test_trim_heap_returns_its_time():
    assert trim_heap() >= 0.0


def test_offloading_returns_pages_and_stays_bit_identical(offload_dir):
    """Writes are held until each forward has ended, so the cache holds the last reference
    to every offloaded storage when its write completes (no timing involved)."""
    from megatron_ssd.io import create_engine

    forward_done = threading.Event()

    def after_forward(op, path, offset, nbytes):
        if op == "write":
            forward_done.wait(30)
        return None

    torch.manual_seed(0)
    model = TinyGPT(layers=3, hidden=128, seq=64)
    reference = copy.deepcopy(model)
    batches = make_batches(steps=2, microbatches=2, batch=4, seq=64, vocab=256)
    cfg = OffloadConfig(paths=[offload_dir], min_tensor_bytes=16 << 10, min_free_bytes=0, keep_last_layers=0)
    with TensorCache(cfg, engine=create_engine(cfg, fault=after_forward)) as cache:
        cache.register_layers(model.layers)
        for step in batches:
            for mb in step:
                forward_done.clear()
                with cache.microbatch():
                    loss = model(mb)
                forward_done.set()
                cache.drain()
                (loss / len(step)).backward()
                ref = reference(mb)
                (ref / len(step)).backward()
                assert torch.equal(loss, ref)
            stats = cache.finish_step()
            assert stats.bytes_offloaded > 0
            assert 0 < stats.bytes_returned <= stats.bytes_offloaded
            assert stats.heap_trim_s > 0
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_return_freed_pages_false_turns_both_calls_off(offload_dir):
    model = TinyGPT(layers=2, hidden=128, seq=64)
    cfg = OffloadConfig(paths=[offload_dir], min_tensor_bytes=16 << 10, min_free_bytes=0, keep_last_layers=0,
                        return_freed_pages=False)
    with TensorCache(cfg) as cache:
        cache.register_layers(model.layers)
        with cache.microbatch():
            loss = model(torch.randint(0, 256, (4, 64)))
        loss.backward()
        stats = cache.finish_step()
    assert stats.bytes_offloaded > 0 and stats.bytes_returned == 0 and stats.heap_trim_s == 0



def test_the_heap_is_trimmed_after_each_recomputed_layer(offload_dir, monkeypatch):
    # NOTE [Returning freed pages]: a recomputed layer's backward frees its rerun
    # forward's activations; the heap is trimmed when the next layer's backward starts.
    from megatron_ssd.cache import tensor_cache
    from tiny_model import TinyGPT, make_batches

    torch.manual_seed(0)
    model = TinyGPT(layers=4, hidden=32, seq=32)
    (batch,) = make_batches(steps=1, microbatches=1, batch=2, seq=32, vocab=256)[0]
    trims, running = [], []
    # one trim method serves both points: the end of the forward, then each backward
    monkeypatch.setattr(tensor_cache, "trim_heap", lambda: trims.append(running[-1] if running else "forward") or 0.0)
    for returning, expected in ((True, ["forward", 2, 0]), (False, [])):
        trims.clear()
        with TensorCache(OffloadConfig(paths=[offload_dir], return_freed_pages=returning)) as cache:
            cache.register_layers(model.layers)
            cache.set_plan({0: "keep", 1: "recompute", 2: "keep", 3: "recompute"})
            real = cache.entries.backward_started

            def started(record, layer_id, real=real):
                running.append(layer_id)
                return real(record, layer_id)

            cache.entries.backward_started = started
            with cache.microbatch():
                loss = model(batch)
            loss.backward()
            cache.finish_step()
        assert trims == expected
