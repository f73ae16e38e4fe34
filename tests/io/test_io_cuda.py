"""The POSIX engine's CUDA data path, on a CPU through a recording fake of the CUDA calls
(``fake_cuda.py``): copy streams, blocking events, the staging ring and "staged", record_stream,
fresh read buffers, device contexts with two devices, exact pinned slabs, and storages that
stay resizable. Nothing here is timed: which disk writes have run is fixed by a fault hook
that holds them."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from megatron_ssd.config import IOConfig, OffloadConfig
from megatron_ssd.errors import OffloadIOError, WriteCancelled
from megatron_ssd.io import PosixEngine
from megatron_ssd.io.buffers import aligned_empty
from megatron_ssd.io.cuda import H2D_PRIORITY

from fake_cuda import FakeCuda
from waits import HANG_S  # tests/waits.py

KiB = 1024
BLOCK = 64 * KiB


class Hold:
    """A fault hook that lets the first ``passing`` disk writes through and holds the
    others until :meth:`open`; counts the writes that reached it."""

    def __init__(self, passing: int = 0) -> None:
        self.passing = passing
        self.opened = threading.Event()
        self.arrived = threading.Semaphore(0)
        self.lock = threading.Lock()
        self.writes = 0

    def __call__(self, op, path, offset, nbytes):
        if op != "write":
            return None
        with self.lock:
            self.writes += 1
            n = self.writes
        if n > self.passing:
            self.arrived.release()
            assert self.opened.wait(HANG_S), "the test never opened the hold"
        return None

    def wait_held(self, n: int) -> None:
        for _ in range(n):
            assert self.arrived.acquire(timeout=HANG_S), "a held write never arrived"

    def open(self) -> None:
        self.opened.set()


def _engine(path, cuda, fault=None, ring_blocks=4, threads=2, **io):
    io.setdefault("max_inflight_bytes", 64 * BLOCK)
    cfg = OffloadConfig(paths=[path], io=IOConfig(block_bytes=BLOCK, threads=threads,
                                                  staging_ring_bytes=ring_blocks * BLOCK, **io))
    return PosixEngine(cfg, fault=fault, cuda=cuda)


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed + n))


def _produced(cuda: FakeCuda, expected: torch.Tensor, index: int) -> torch.Tensor:
    """A device tensor whose bytes a kernel queued on the compute stream produces."""
    src = cuda.to_device(torch.zeros_like(expected), index)
    cuda.kernel(index, lambda: src.copy_(expected))
    return src


def test_write_and_read_on_device_1_order_after_the_producer_on_their_own_streams(offload_dir):
    cuda = FakeCuda()
    n = 3 * BLOCK + 1234
    expected = _bytes(n)
    with _engine(offload_dir, cuda, ring_blocks=2) as engine:
        src = _produced(cuda, expected, 1)  # the caller's current device stays cuda:0
        handle = engine.write(src).get()
        dst = engine.alloc(n, torch.device("cuda", 1), handle)
        assert cuda.device_of(dst) == torch.device("cuda", 1)
        back = engine.read(handle, dst).get()
        assert torch.equal(back, expected)  # the write copied after the producer kernel ran
        stats = engine.stats()
        assert stats.extra["ring_staged_bytes"] == 2 * BLOCK  # two blocks through the ring, two block by block
        assert engine.backend.ring.available == 2 and engine.backend.pool.available == engine.backend.pool.count
    assert cuda.mismatches() == [], "a CUDA call ran under another device than its tensor's"
    d2h = {c.stream for c in cuda.copies if c.kind == "d2h"}
    h2d = {c.stream for c in cuda.copies if c.kind == "h2d"}
    assert len(d2h) == 1 and len(h2d) == 1 and d2h != h2d
    (d2h,), (h2d,) = d2h, h2d
    assert d2h.device == h2d.device == torch.device("cuda", 1)
    assert h2d.priority == H2D_PRIORITY < d2h.priority == 0
    assert sum(c.nbytes for c in cuda.copies if c.kind == "d2h") == n
    assert all(c.target == 1 for c in cuda.calls_named("new_stream"))
    # the read buffer came from the read stream's pool
    assert [(i, s) for i, _, s in cuda.allocations] == [(1, h2d)]
    # the source was marked used by the write stream
    assert (src.untyped_storage()._cdata, d2h) in cuda.record_streams


def test_a_fresh_read_buffer_does_not_wait_for_the_callers_stream_and_a_foreign_one_does(offload_dir):
    cuda = FakeCuda()
    n = 2 * BLOCK + 5
    expected = _bytes(n)
    with _engine(offload_dir, cuda) as engine:
        handle = engine.write(cuda.to_device(expected, 0)).get()
        ran = []
        cuda.kernel(0, lambda: ran.append("kernel"))  # compute work queued before the read
        fresh = engine.read(handle, engine.alloc(n, "cuda:0", handle)).get()
        assert torch.equal(fresh, expected) and ran == []  # filled without waiting for the kernel
        # a destination the caller owns: the read lands after the work queued on it
        foreign = cuda.to_device(torch.zeros(n, dtype=torch.uint8), 0)
        cuda.kernel(0, lambda: foreign.fill_(0xAA))
        back = engine.read(handle, foreign).get()
        assert ran == ["kernel"]
        cuda.finish()  # nothing queued before the read may land after it
        assert torch.equal(back, expected)
        h2d = engine.streams.h2d(torch.device("cuda", 0))
        assert (foreign.untyped_storage()._cdata, h2d) in cuda.record_streams


def test_staged_fires_once_every_block_is_in_the_ring_before_any_disk_write(offload_dir):
    cuda = FakeCuda()
    hold = Hold()
    n = 4 * BLOCK - 100
    expected = _bytes(n)
    with _engine(offload_dir, cuda, fault=hold, ring_blocks=4) as engine:
        src = _produced(cuda, expected, 1)
        source = StorageWeakRef(src.untyped_storage())
        fut = engine.write(src)
        staged = threading.Event()
        fut.add_staged_callback(lambda f: staged.set())
        hold.wait_held(4)  # every worker holds a block's disk write
        assert staged.wait(HANG_S) and fut.staged() and not fut.done()
        del src
        gc.collect()
        assert source.expired(), "the engine still holds the source after staging"
        fired = []
        fut.add_staged_callback(lambda f: fired.append(threading.current_thread()))
        assert fired == [threading.current_thread()]  # added after: runs at once, here
        hold.open()
        handle = fut.get()
        assert torch.equal(engine.read(handle, engine.alloc(n, "cuda:1", handle)).get(), expected)
        assert engine.backend.ring.available == engine.backend.ring.count
    assert cuda.mismatches() == []


def test_a_blob_larger_than_the_ring_stages_at_its_last_blocks_copy(offload_dir):
    cuda = FakeCuda()
    hold = Hold(passing=2)  # threads=1: two workers; blocks 1 (ring) and 2 (worker buffer) reach the disk
    n = 4 * BLOCK
    expected = _bytes(n, seed=1)
    with _engine(offload_dir, cuda, fault=hold, ring_blocks=1, threads=1) as engine:
        fut = engine.write(_produced(cuda, expected, 0))
        hold.wait_held(2)  # blocks 3 and 4 were copied into their workers' buffers, their writes held
        assert fut.staged() and not fut.done()
        hold.open()
        handle = fut.get()
        assert torch.equal(engine.read(handle, engine.alloc(n, "cuda:0", handle)).get(), expected)
        assert engine.stats().extra["ring_staged_bytes"] == BLOCK


def test_a_write_that_finds_the_ring_full_returns_at_once_and_goes_block_by_block(offload_dir):
    cuda = FakeCuda()
    hold = Hold()
    first, second = _bytes(2 * BLOCK, seed=1), _bytes(2 * BLOCK, seed=2)
    with _engine(offload_dir, cuda, fault=hold, ring_blocks=1, threads=1) as engine:
        fut = engine.write(cuda.to_device(first, 0))
        hold.wait_held(2)  # both workers hold a write; the ring's one slice is block 1's
        box = []
        submit = threading.Thread(target=lambda: box.append(engine.write(cuda.to_device(second, 0))))
        submit.start()
        submit.join(HANG_S)
        assert not submit.is_alive() and box[0] is not None and not box[0].staged()
        hold.open()
        for f, want in ((fut, first), (box[0], second)):
            h = f.get()
            assert torch.equal(engine.read(h, engine.alloc(h.nbytes, "cuda:0", h)).get(), want)
        assert engine.stats().extra["ring_staged_bytes"] == BLOCK  # the second blob found no free slice
        assert engine.backend.ring.available == 1


@pytest.mark.parametrize("how", ["cancel", "fail"])
def test_a_cancelled_or_failed_cuda_write_gives_its_ring_slices_back_after_their_copies(offload_dir, how):
    cuda = FakeCuda()
    hold = Hold()
    n = 6 * BLOCK
    with _engine(offload_dir, cuda, fault=hold, ring_blocks=4, threads=1) as engine:
        fut = engine.write(_produced(cuda, _bytes(n), 0))
        hold.wait_held(2)
        if how == "cancel":
            assert fut.cancel()
            hold.open()
            with pytest.raises(WriteCancelled):
                fut.get()
        else:
            engine.fault = lambda op, path, offset, nbytes: OSError(5, "EIO") if op == "write" else None
            hold.open()
            with pytest.raises(OffloadIOError):
                fut.get()
        assert fut.staged()
        assert engine.backend.ring.available == engine.backend.ring.count
        assert engine.backend.pool.available == engine.backend.pool.count
        assert engine.stats().disk_bytes == 0
        engine.fault = None
        again = _bytes(n, seed=3)
        h = engine.write(cuda.to_device(again, 0)).get()  # the ring's slices hold fresh copies
        assert torch.equal(engine.read(h, engine.alloc(n, "cuda:0", h)).get(), again)


def test_pinned_staging_is_one_exact_slab_per_pool_and_unpinned_at_close(offload_dir):
    cuda = FakeCuda()
    engine = _engine(offload_dir, cuda, ring_blocks=3, threads=2)
    assert sorted(cuda.registered_sizes) == sorted([2 * 2 * BLOCK, 3 * BLOCK])  # worker buffers, ring
    engine.close()
    assert cuda.registered == {} and len(cuda.unregistered) == 2
    # the ring never pins more than the in-flight bound lets it fill
    cuda = FakeCuda()
    with _engine(offload_dir, cuda, ring_blocks=16, max_inflight_bytes=5 * BLOCK):
        assert sorted(cuda.registered_sizes) == sorted([2 * 2 * BLOCK, 5 * BLOCK])
    # no ring when it is off, nothing pinned when the offloaded tensors live on the CPU
    cuda = FakeCuda()
    with _engine(offload_dir, cuda, ring_blocks=0):
        assert cuda.registered_sizes == [2 * 2 * BLOCK]
    cuda = FakeCuda()
    with PosixEngine(OffloadConfig(paths=[offload_dir], device="cpu"), cuda=cuda):
        assert cuda.registered_sizes == []


def test_a_pinned_aligned_buffer_pins_exactly_its_size():
    cuda = FakeCuda()
    buf = aligned_empty(4 * 1024 * KiB, pin=True, cuda=cuda)
    assert buf.numel() == 4 * 1024 * KiB and buf.data_ptr() % 4096 == 0
    assert cuda.registered_sizes == [4 * 1024 * KiB]  # torch's pin_memory asked 4 MiB + 4 KiB: pinned 8 MiB
    ptr = buf.data_ptr()
    del buf
    gc.collect()
    assert cuda.unregistered == [ptr] and cuda.registered == {}  # unpinned when its memory goes


def _cpu_engine(path):
    return PosixEngine(OffloadConfig(paths=[path], io=IOConfig(block_bytes=1 << 20)))


def test_storages_written_and_read_stay_resizable(offload_dir):
    """Megatron frees a saved output with ``untyped_storage().resize_(0)``; ``.numpy()`` on
    it had made the storage non-resizable (RuntimeError: Trying to resize storage that is
    not resizable)."""
    with _cpu_engine(offload_dir) as engine:
        for n in (5000, 3 * (1 << 20) + 17):  # staged whole; skewed with in-place pages
            src = _bytes(n)
            handle = engine.write(src).get()
            dst = torch.empty(n, dtype=torch.uint8)
            assert torch.equal(engine.read(handle, dst).get(), src)
            src.untyped_storage().resize_(0)
            dst.untyped_storage().resize_(0)
            engine.free(handle)


def _stage_observer(fut):
    """Records ``done()`` as seen by the staged callback: False when staged early."""
    seen = []
    fut.add_staged_callback(lambda f: seen.append(f.done()))
    return seen


def test_a_write_failing_after_early_staging_hands_its_bytes_back(offload_dir):
    """NOTE [Failed staged writes]: the caller may have freed the source at staging, so
    the engine returns the bytes with the error: kept from staging, or read back."""
    cuda = FakeCuda()
    calls = []

    def second_write_fails(op, path, offset, nbytes):
        if op == "write":
            calls.append(offset)
            if len(calls) == 2:
                return OSError(5, "Input/output error")
        return None

    n = 4 * BLOCK - 7
    expected = _bytes(n, seed=4)
    with _engine(offload_dir, cuda, fault=second_write_fails, ring_blocks=4, threads=1) as engine:
        fut = engine.write(_produced(cuda, expected, 1))
        seen = _stage_observer(fut)
        with pytest.raises(OffloadIOError, match="EIO") as info:
            fut.get()
        assert seen == [False], "every block was in the ring: staged before completion"
        assert torch.equal(info.value.host_copy, expected)
        assert engine.backend.ring.available == 4 and engine.stats().disk_bytes == 0


def test_an_error_before_every_block_was_copied_stages_only_at_completion(offload_dir):
    cuda = FakeCuda()
    every_write_fails = lambda op, path, offset, nbytes: OSError(5, "EIO") if op == "write" else None  # noqa: E731
    with _engine(offload_dir, cuda, fault=every_write_fails, ring_blocks=0, threads=1) as engine:
        fut = engine.write(_produced(cuda, _bytes(4 * BLOCK), 0))
        seen = _stage_observer(fut)
        with pytest.raises(OffloadIOError) as info:
            fut.get()
        assert seen == [True], "staged early although blocks were never copied"
        assert not hasattr(info.value, "host_copy")  # the caller still has its source


def test_a_cancel_after_early_staging_changes_nothing(offload_dir):
    cuda = FakeCuda()
    hold = Hold()
    n = 4 * BLOCK
    expected = _bytes(n, seed=5)
    with _engine(offload_dir, cuda, fault=hold, ring_blocks=4, threads=1) as engine:
        fut = engine.write(_produced(cuda, expected, 0))
        hold.wait_held(2)
        assert fut.staged()
        fut.cancel()  # the staging is the only copy now
        hold.open()
        h = fut.get()
        assert torch.equal(engine.read(h, engine.alloc(n, "cuda:0", h)).get(), expected)
        assert engine.stats().extra["cancelled_write_bytes"] == 0


def test_a_copy_failing_at_submit_fails_the_write_and_drains_before_the_ring_takes_its_slices(offload_dir):
    class FailingCopy(FakeCuda):
        def copy(self, dst, src):
            if len(self.copies) == 2:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            super().copy(dst, src)

    cuda = FailingCopy()
    with _engine(offload_dir, cuda, ring_blocks=4) as engine:
        fut = engine.write(cuda.to_device(_bytes(4 * BLOCK), 0))
        with pytest.raises(OffloadIOError, match="illegal memory access"):
            fut.get()
        d2h = engine.streams.d2h(torch.device("cuda", 0))
        assert d2h._ran == d2h.queued, "slices went back with their copies still queued"
        assert engine.backend.ring.available == 4 and engine.stats().disk_bytes == 0
