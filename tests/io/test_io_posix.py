"""The POSIX O_DIRECT engine: byte-exact round trips, striping, privacy, backpressure."""

from __future__ import annotations

import ctypes
import glob
import os
import stat
import threading
import time

import pytest
import torch

from megatron_ssd.config import IOConfig, OffloadConfig
from megatron_ssd.errors import CacheStateError, ConfigError, OffloadIOError
from megatron_ssd.io import PosixEngine, SwapHandle
from megatron_ssd.io.base import ALIGN
from megatron_ssd.io.buffers import aligned_empty
from waits import HANG_S  # tests/waits.py

SIZES = [1, 10, 100, 1000, 1024, 4095, 4096, 4097, 40960, 10_000_019]
KiB = 1024
MiB = 1024 * KiB


def _blob(n, seed=0):
    g = torch.Generator().manual_seed(seed + n)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _paths(tmp_path, count):
    out = []
    for i in range(count):
        p = tmp_path / f"ssd{i}"
        p.mkdir()
        out.append(str(p))
    return out


def _engine(paths, fault=None, **io):
    io.setdefault("block_bytes", 64 * KiB)
    return PosixEngine(OffloadConfig(paths=list(paths), io=IOConfig(**io)), fault=fault)


def _on_disk(extent, nbytes):
    """The extent's payload as plain Python reads it from the file."""
    with open(extent.file, "rb") as fh:
        fh.seek(extent.offset + extent.skew)
        return fh.read(nbytes)


# ----------------------------------------------------------------------- round trips


@pytest.mark.parametrize("layout", ["extent", "file"])
@pytest.mark.parametrize("npaths", [1, 2])
def test_round_trip_is_byte_exact(tmp_path, layout, npaths):
    with _engine(_paths(tmp_path, npaths), layout=layout) as engine:
        handles = {n: engine.write(_blob(n)) for n in SIZES}  # all in flight together
        handles = {n: f.get() for n, f in handles.items()}
        for n, h in handles.items():
            assert h.nbytes == n and h.disk_bytes % ALIGN == 0 and h.disk_bytes >= n
            # bytes on disk are the plain payload: readable without the engine
            end = [e.blob_offset for e in h.extents[1:]] + [n]
            disk = b"".join(_on_disk(e, stop - e.blob_offset) for e, stop in zip(h.extents, end))
            assert disk == _blob(n).numpy().tobytes()
            assert torch.equal(engine.read(h, engine.alloc(n, "cpu")).get(), _blob(n))
            unaligned = torch.empty(n + 3, dtype=torch.uint8)[3:]
            assert torch.equal(engine.read(h, unaligned).get(), _blob(n))
        for h in handles.values():
            engine.free(h)
        st = engine.stats()
        assert st.disk_bytes == 0 and st.bytes_written == sum(SIZES) and st.bytes_read == 2 * sum(SIZES)
        assert st.write_busy_s > 0 and st.read_busy_s > 0


def test_empty_blob_and_bad_arguments(offload_dir):
    with _engine([offload_dir]) as engine:
        h = engine.write(torch.empty(0, dtype=torch.uint8)).get()
        assert h == SwapHandle(0, ()) and engine.read(h, torch.empty(0, dtype=torch.uint8)).get().numel() == 0
        engine.free(h)
        with pytest.raises(ValueError, match="1-D uint8"):
            engine.write(torch.zeros(4, dtype=torch.float32))
        with pytest.raises(ValueError, match="1-D uint8"):
            engine.write(torch.zeros(4, 4, dtype=torch.uint8))
        h = engine.write_blocking(_blob(100))
        with pytest.raises(ValueError, match="holds 99 bytes"):
            engine.read(h, torch.empty(99, dtype=torch.uint8))
        engine.free(h)
        with pytest.raises(CacheStateError, match="freed twice"):
            engine.free(h)
        with pytest.raises(CacheStateError, match="does not hold"):
            engine.read(h, torch.empty(100, dtype=torch.uint8))
    with pytest.raises(ConfigError, match="at least one"):
        PosixEngine(OffloadConfig(paths=[]))


def test_aligned_memory_moves_in_place_and_other_memory_is_staged(offload_dir):
    n = 3 * 64 * KiB + 100
    with _engine([offload_dir], checksum=True) as engine:
        src = aligned_empty(n)[:n]
        src.copy_(_blob(n))
        h = engine.write(src).get()
        extra = engine.stats().extra
        assert extra["zero_copy_bytes"] == n - 100 and extra["staged_bytes"] == 100
        back = engine.read(h, engine.alloc(n, "cpu")).get()
        assert torch.equal(back, src)
        assert engine.stats().extra["zero_copy_bytes"] == 2 * (n - 100)
        # an ordinary tensor 64 bytes past a page, under SKEW_MIN_BYTES: staged whole
        # unless the device accepts 64-byte aligned memory
        raw = torch.empty(n + ALIGN, dtype=torch.uint8)
        odd = raw[(64 - raw.data_ptr()) % ALIGN :][:n]
        assert odd.data_ptr() % ALIGN == 64
        odd.copy_(src)
        before = engine.stats().extra["staged_bytes"]
        h2 = engine.write(odd).get()
        assert engine.stats().extra["staged_bytes"] - before == (n if engine.backend.mem_align > 64 else 100)
        assert all(e.skew == 0 for e in h2.extents)
        assert torch.equal(engine.read(h2, torch.empty(n, dtype=torch.uint8)).get(), src)


def test_large_unaligned_blob_is_skewed_so_only_its_end_pages_are_staged(offload_dir):
    """NOTE [Skewed blocks]: a blob 64 bytes past a page is written with skew 64; only
    its first block is skewed, and only the head (4032 bytes) and the tail are staged,
    on the way out and on the way back into an ``alloc(..., handle)`` destination."""
    n = 3 * MiB + 100
    with _engine([offload_dir], checksum=True) as engine:
        if engine.backend.mem_align <= 64:
            pytest.skip("this device accepts 64-byte aligned memory: nothing to skew")
        raw = torch.empty(n + ALIGN, dtype=torch.uint8)
        odd = raw[(64 - raw.data_ptr()) % ALIGN :][:n]
        odd.copy_(_blob(n))
        before = engine.stats().extra["staged_bytes"]
        h = engine.write(odd).get()
        staged = engine.stats().extra["staged_bytes"] - before
        assert staged == (ALIGN - 64) + (64 + 100)  # head page's payload + the tail page's
        assert [e.skew for e in h.extents] == [64] + [0] * (len(h.extents) - 1)
        assert [e.blob_offset for e in h.extents[:3]] == [0, 64 * KiB - 64, 128 * KiB - 64]
        assert h.extents[0].length == 64 * KiB and h.extents[-1].length == ALIGN
        dst = engine.alloc(n, "cpu", h)
        assert dst.data_ptr() % ALIGN == 64
        before = engine.stats().extra["staged_bytes"]
        assert torch.equal(engine.read(h, dst).get(), odd)
        assert engine.stats().extra["staged_bytes"] - before == staged
        # any other destination works too, through the staging buffers
        assert torch.equal(engine.read(h, torch.empty(n, dtype=torch.uint8)).get(), odd)
        assert torch.equal(engine.read(h, engine.alloc(n, "cpu")).get(), odd)


@pytest.mark.parametrize("offset", [0, 64, 512, 4032, 4095])
@pytest.mark.parametrize("n", [MiB - 1, MiB, MiB + 1, 2 * MiB + 3])
def test_skewed_blobs_round_trip_and_leak_no_memory_to_disk(offload_dir, offset, n):
    """Whatever the source's offset from a page, the bytes come back exactly, and the
    disk holds zeros (never neighbouring memory) around the payload."""
    with _engine([offload_dir], checksum=True, block_bytes=256 * KiB) as engine:
        raw = torch.full((n + 3 * ALIGN,), 0xAB, dtype=torch.uint8)  # neighbours are 0xAB
        base = (-raw.data_ptr()) % ALIGN
        src = raw[base + offset : base + offset + n]
        src.copy_(_blob(n, offset))
        h = engine.write(src).get()
        for dst in (engine.alloc(n, "cpu", h), torch.empty(n, dtype=torch.uint8)):
            assert torch.equal(engine.read(h, dst).get(), src)
        ends = [e.blob_offset for e in h.extents[1:]] + [n]
        for e, end in zip(h.extents, ends):
            with open(e.file, "rb") as fh:
                fh.seek(e.offset)
                page = fh.read(e.length)
            payload = end - e.blob_offset
            assert page[: e.skew] == bytes(e.skew)
            assert page[e.skew : e.skew + payload] == src[e.blob_offset : end].numpy().tobytes()
            assert page[e.skew + payload :] == bytes(e.length - e.skew - payload)


def test_blocks_of_one_blob_are_striped_over_both_paths(tmp_path):
    paths = _paths(tmp_path, 2)
    with _engine(paths, block_bytes=16 * KiB) as engine:
        n = 7 * 16 * KiB + 5
        h = engine.write(_blob(n)).get()
        assert [e.path_index for e in h.extents] == [0, 1, 0, 1, 0, 1, 0, 1]
        assert [e.blob_offset for e in h.extents] == [i * 16 * KiB for i in range(8)]
        for e in h.extents:
            assert e.file.startswith(engine.paths[e.path_index] + os.sep)
            assert e.file.startswith(paths[e.path_index] + os.sep)
        h2 = engine.write(_blob(100)).get()  # the next blob starts on the other path
        assert h2.extents[0].path_index == 1
        assert torch.equal(engine.read(h, engine.alloc(n, "cpu")).get(), _blob(n))


# --------------------------------------------------------------------- backpressure


def test_inflight_bound_is_respected(offload_dir):
    bound = 64 * KiB

    def slow(op, path, offset, nbytes):
        time.sleep(0.002)

    with _engine([offload_dir], fault=slow, max_inflight_bytes=bound, block_bytes=16 * KiB) as engine:
        futs = [engine.write(_blob(20 * KiB, i)) for i in range(24)]
        handles = [f.get() for f in futs]
        st = engine.stats()
        assert 40 * KiB <= st.extra["inflight_peak_bytes"] <= bound
        assert st.backpressure_wait_s > 0
        for i, h in enumerate(handles):
            assert torch.equal(engine.read(h, engine.alloc(h.nbytes, "cpu")).get(), _blob(20 * KiB, i))


def test_non_blocking_write_returns_none_when_full(offload_dir):
    gate = threading.Event()

    def held(op, path, offset, nbytes):
        if op == "write":
            gate.wait(HANG_S)

    with _engine([offload_dir], fault=held, max_inflight_bytes=64 * KiB) as engine:
        big = engine.write(_blob(200 * KiB), block=False)  # over the bound, admitted: nothing in flight
        assert big is not None
        assert engine.write(_blob(100), block=False) is None
        gate.set()
        big.get(timeout=HANG_S)
        first = engine.write(_blob(64 * KiB), block=False)
        assert first is not None and first.get(timeout=HANG_S).nbytes == 64 * KiB
        assert engine.stats().extra["inflight_bytes"] == 0


# -------------------------------------------------------------------- disk space


def test_free_recycles_extents(offload_dir):
    sizes = [100 * KiB, 5000, 300 * KiB, 64 * KiB, 1]
    with _engine([offload_dir], file_grow_bytes=1 << 20) as engine:
        file_sizes = []
        for rnd in range(8):
            handles = [engine.write(_blob(n, rnd)).get() for n in sizes]
            for h, n in zip(handles, sizes):
                assert torch.equal(engine.read(h, engine.alloc(n, "cpu")).get(), _blob(n, rnd))
            for h in handles:
                engine.free(h)
            assert engine.stats().disk_bytes == 0
            file_sizes.append(engine.layout.disk_size())
        assert file_sizes == [1 << 20] * 8


def test_close_removes_files_and_run_dirs(tmp_path):
    paths = _paths(tmp_path, 2)
    for layout in ("extent", "file"):
        engine = _engine(paths, layout=layout)
        run_dirs = engine.paths
        engine.write(_blob(300 * KiB)).get()
        assert all(os.listdir(d) for d in run_dirs)
        engine.close()
        engine.close()
        assert [os.listdir(p) for p in paths] == [[], []]
        with pytest.raises(OffloadIOError, match="closed"):
            engine.write(_blob(10))


# ----------------------------------------------------------------------- privacy


@pytest.mark.parametrize("layout", ["extent", "file"])
def test_modes_are_private(offload_dir, layout):
    old = os.umask(0)
    try:
        engine = _engine([offload_dir], layout=layout)
    finally:
        os.umask(old)
    with engine:
        engine.write(_blob(5000)).get()
        run_dir = engine.paths[0]
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
        files = os.listdir(run_dir)
        assert files and all(stat.S_IMODE(os.stat(os.path.join(run_dir, f)).st_mode) == 0o600 for f in files)


def test_planted_symlink_is_not_followed(offload_dir, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    with _engine([offload_dir], layout="file") as engine:
        os.symlink(victim, os.path.join(engine.paths[0], "blob-00000000.bin"))
        fut = engine.write(_blob(10_000))
        with pytest.raises(OffloadIOError, match="EEXIST"):
            fut.get()
        assert victim.read_bytes() == b"precious"
        assert engine.stats().disk_bytes == 0 and engine.stats().write_errors == 1
        h = engine.write(_blob(10_000)).get()  # the next file name is free
        assert torch.equal(engine.read(h, engine.alloc(10_000, "cpu")).get(), _blob(10_000))
    assert victim.read_bytes() == b"precious"


def _fd_flags(directory):
    """open(2) flags of this process's fds on files inside ``directory``."""
    out = []
    for fd_path in glob.glob("/proc/self/fd/*"):
        try:
            target = os.readlink(fd_path)
        except OSError:
            continue
        if target.startswith(directory + os.sep):
            with open(f"/proc/self/fdinfo/{os.path.basename(fd_path)}") as fh:
                flags = next(line for line in fh if line.startswith("flags:"))
            out.append(int(flags.split()[1], 8))
    return out


@pytest.mark.parametrize("direct", [True, False])
def test_o_direct_is_used(offload_dir, direct):
    with _engine([offload_dir], direct=direct) as engine:
        flags = _fd_flags(engine.paths[0])
        assert flags and all(bool(f & os.O_DIRECT) == direct for f in flags)


def _resident_pages(path):
    """Pages of ``path`` in the page cache (mincore on a shared mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        if addr in (None, ctypes.c_void_p(-1).value):
            pytest.skip("mmap failed")
        vec = (ctypes.c_ubyte * ((size + 4095) // 4096))()
        rc = libc.mincore(addr, size, vec)
        libc.munmap(addr, size)
    finally:
        os.close(fd)
    if rc != 0:
        pytest.skip("mincore is not available")
    return sum(v & 1 for v in vec)


@pytest.mark.parametrize("direct", [True, False])
def test_page_cache_is_bypassed(offload_dir, direct):
    with _engine([offload_dir], direct=direct, file_grow_bytes=4 << 20) as engine:
        h = engine.write(_blob(2 << 20)).get()
        engine.read(h, engine.alloc(h.nbytes, "cpu")).get()
        resident = _resident_pages(h.extents[0].file)
        if direct:
            assert resident == 0
        else:  # the control: buffered I/O leaves the bytes in the page cache
            assert resident >= (2 << 20) // 4096


def test_worker_cpu_time_is_counted_per_direction(offload_dir):
    """``cpu_s`` sums the workers' CPU time; ``write_cpu_s`` / ``read_cpu_s`` split it."""
    n = 8 << 20
    with _engine([offload_dir], checksum=True) as engine:
        assert engine.stats().cpu_s == 0.0
        h = engine.write(_blob(n)).get()
        after_write = engine.stats()
        assert after_write.extra["write_cpu_s"] > 0 and after_write.extra["read_cpu_s"] == 0
        engine.read(h, engine.alloc(n, "cpu")).get()
        s = engine.stats()
        assert s.extra["read_cpu_s"] > 0
        assert s.cpu_s >= after_write.cpu_s
        assert s.cpu_s >= s.extra["write_cpu_s"] + s.extra["read_cpu_s"] - 1e-6


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="thread priorities are applied on Linux only")
@pytest.mark.parametrize("priority", ["normal", "low", "idle"])
def test_io_priority_is_applied_to_every_worker_thread(offload_dir, priority):
    with _engine([offload_dir], priority=priority) as engine:
        threads = engine._workers._threads  # each set its priority before the engine was returned
        nice = [os.getpriority(os.PRIO_PROCESS, t.native_id) for t in threads]
        policy = [os.sched_getscheduler(t.native_id) for t in threads]
        assert engine.write(_blob(4096)).get().nbytes == 4096
        main_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        if priority == "low":
            assert nice == [19] * len(threads) and main_nice != 19
        elif priority == "idle":
            assert policy == [os.SCHED_IDLE] * len(threads)
            assert os.sched_getscheduler(threading.get_native_id()) != os.SCHED_IDLE
        else:
            assert nice == [main_nice] * len(threads)


def test_bad_io_priority_is_refused():
    with pytest.raises(ConfigError, match=r"IOConfig\.priority = 'nice'.*must be one of \['normal', 'low', 'idle'\]"):
        IOConfig(priority="nice")


def test_io_priority_that_cannot_be_applied_warns_and_runs(offload_dir, monkeypatch, caplog):
    from megatron_ssd.io import workers

    def refuse(tid, *args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(workers.os, "setpriority", refuse)
    with caplog.at_level("WARNING", logger="megatron_ssd.io.workers"):
        with _engine([offload_dir], priority="low") as engine:
            h = engine.write(_blob(4096)).get()
            assert torch.equal(engine.read(h, engine.alloc(4096, "cpu")).get(), _blob(4096))
    assert "io.priority = 'low' could not be applied" in caplog.text


def test_close_removes_the_files_when_the_wait_for_the_workers_is_interrupted(tmp_path, monkeypatch):
    """A signal handler may raise into the wait for the I/O threads (PyTorch's DataLoader
    does, from SIGCHLD, when a job's SIGTERM reached its workers too): the exception
    propagates, and the run directories are still deleted."""
    from interrupted_wait import interrupt_the_wait  # tests/interrupted_wait.py

    paths = _paths(tmp_path, 2)
    engine = _engine(paths)
    engine.write(_blob(300 * KiB)).get()
    interrupt_the_wait(monkeypatch)
    with pytest.raises(RuntimeError, match="killed by signal"):
        engine.close()
    assert [os.listdir(p) for p in paths] == [[], []]
