"""Failures: ENOSPC / EIO through the fault hook and a real full filesystem, checksums."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest
import torch

from megatron_ssd.config import IOConfig, OffloadConfig
from megatron_ssd.errors import CacheStateError, ChecksumError, OffloadIOError
from megatron_ssd.io import PosixEngine, striped
from ondisk import flip_payload_bits
from waits import HANG_S  # tests/waits.py

KiB = 1024
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _blob(n, seed=0):
    g = torch.Generator().manual_seed(seed + n)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


class Faults:
    """A fault hook whose answers the test changes as it goes."""

    def __init__(self):
        self.rules = []  # (op, nth call of that op or None for all, error)
        self.calls = {"allocate": 0, "write": 0, "read": 0}
        self.lock = threading.Lock()

    def __call__(self, op, path, offset, nbytes):
        with self.lock:
            self.calls[op] += 1
            for rule_op, nth, err in self.rules:
                if rule_op == op and (nth is None or nth == self.calls[op]):
                    return err
        return None


def _engine(path, fault, **io):
    io.setdefault("block_bytes", 16 * KiB)
    return PosixEngine(OffloadConfig(paths=[path], io=IOConfig(**io)), fault=fault)


@pytest.mark.parametrize("layout", ["extent", "file"])
def test_enospc_on_write_fails_the_blob_and_frees_its_space(offload_dir, layout):
    faults = Faults()
    with _engine(offload_dir, faults, layout=layout, threads=1) as engine:
        faults.rules.append(("write", 2, OSError(errno.ENOSPC, "No space left on device")))
        fut = engine.write(_blob(100 * KiB))
        with pytest.raises(OffloadIOError) as info:
            fut.get()
        msg = str(info.value)
        assert msg.startswith("megatron_ssd: write of ") and "ENOSPC" in msg and " at offset " in msg
        assert engine.paths[0] in msg and info.value.errno == errno.ENOSPC
        st = engine.stats()
        assert st.disk_bytes == 0 and st.write_errors == 1 and st.bytes_written == 0
        assert st.extra["inflight_bytes"] == 0
        if layout == "file":
            assert os.listdir(engine.paths[0]) == [".megatron_ssd_run"]
        # the space is reusable: the same write now fits without the file growing
        size_before = engine.layout.disk_size()
        faults.rules.clear()
        h = engine.write(_blob(100 * KiB)).get()
        assert torch.equal(engine.read(h, engine.alloc(h.nbytes, "cpu")).get(), _blob(100 * KiB))
        if layout == "extent":
            assert engine.layout.disk_size() == size_before


def test_enospc_when_growing_the_extent_file(offload_dir):
    faults = Faults()
    faults.rules.append(("allocate", None, OSError(errno.ENOSPC, "No space left on device")))
    with _engine(offload_dir, faults) as engine:
        fut = engine.write(_blob(10 * KiB))
        with pytest.raises(OffloadIOError, match="allocate of .* ENOSPC"):
            fut.get()
        assert engine.stats().disk_bytes == 0 and engine.stats().write_errors == 1
        faults.rules.clear()
        assert engine.write(_blob(10 * KiB)).get().nbytes == 10 * KiB


def test_eio_on_read(offload_dir):
    faults = Faults()
    with _engine(offload_dir, faults) as engine:
        h = engine.write(_blob(50 * KiB)).get()
        faults.rules.append(("read", None, OSError(errno.EIO, "Input/output error")))
        with pytest.raises(OffloadIOError, match="read of .* EIO"):
            engine.read(h, engine.alloc(h.nbytes, "cpu")).get()
        assert engine.stats().read_errors == 1
        faults.rules.clear()
        assert torch.equal(engine.read(h, engine.alloc(h.nbytes, "cpu")).get(), _blob(50 * KiB))
        engine.free(h)
        assert engine.stats().disk_bytes == 0


def test_unexpected_exception_becomes_offload_io_error(offload_dir):
    def broken(op, path, offset, nbytes):
        if op == "write":
            raise ValueError("hook bug")

    with _engine(offload_dir, broken) as engine:
        with pytest.raises(OffloadIOError, match="hook bug") as info:
            engine.write(_blob(10)).get()
        assert isinstance(info.value.__cause__, ValueError)
        assert engine.stats().disk_bytes == 0


@pytest.mark.parametrize("layout", ["extent", "file"])
def test_corrupted_byte_is_detected(offload_dir, layout):
    with _engine(offload_dir, None, layout=layout) as engine:
        n = 40 * KiB + 7
        h = engine.write(_blob(n)).get()
        assert all(e.checksum is not None for e in h.extents)
        bad = h.extents[1]
        flip_payload_bits(bad, at=5, mask=0xFF)
        with pytest.raises(ChecksumError) as info:
            engine.read(h, engine.alloc(n, "cpu")).get()
        msg = str(info.value)
        assert bad.file in msg and f"offset {bad.offset}" in msg and f"{bad.checksum:#018x}" in msg
        assert "expected xxh3_64" in msg and "got 0x" in msg
        assert engine.stats().read_errors == 1


def test_checksums_off_store_none(offload_dir):
    with _engine(offload_dir, None, checksum=False) as engine:
        h = engine.write(_blob(40 * KiB)).get()
        assert all(e.checksum is None for e in h.extents)
        assert torch.equal(engine.read(h, engine.alloc(h.nbytes, "cpu")).get(), _blob(40 * KiB))


def test_done_callback_runs_once_and_may_free(offload_dir):
    with _engine(offload_dir, None) as engine:
        h = engine.write(_blob(30 * KiB)).get()
        seen = []
        done = threading.Event()

        def on_read(fut):
            seen.append(fut.get())
            engine.free(h)
            done.set()

        engine.read(h, engine.alloc(h.nbytes, "cpu")).add_done_callback(on_read)
        assert done.wait(HANG_S) and len(seen) == 1 and torch.equal(seen[0], _blob(30 * KiB))
        assert engine.stats().disk_bytes == 0



def test_free_after_the_run_directory_is_deleted_forgets_the_blob_once(offload_dir, caplog):
    """NOTE [Freed once]: with the ``file`` layout, freeing a blob whose file went with its
    run directory (``rm -rf`` under the run) succeeds quietly and forgets the handle; a
    second free is the bookkeeping error it is. Before, the unlink's ENOENT was raised
    after the engine had forgotten the handle, so its owner kept it and freed it again."""
    with _engine(offload_dir, None, layout="file") as engine:
        h = engine.write(_blob(40 * KiB)).get()
        shutil.rmtree(engine.paths[0])
        caplog.set_level(logging.DEBUG, logger="megatron_ssd")
        engine.free(h)
        stats = engine.stats()
        assert (stats.extra["live_blobs"], stats.disk_bytes, caplog.records) == (0, 0, [])
        with pytest.raises(CacheStateError, match=r"freed twice"):
            engine.free(h)


def test_free_whose_unlink_fails_warns_once_and_forgets_the_blob(offload_dir, caplog, monkeypatch):
    """NOTE [Freed once]: an unlink that fails otherwise (EIO) leaves the file to the run
    directory's removal at close, with one warning (later ones at debug level), and the
    handle is forgotten all the same."""
    with _engine(offload_dir, None, layout="file") as engine:
        handles = [engine.write(_blob(n * KiB)).get() for n in (10, 20)]

        def eio(name):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(engine.layout.run_dirs[0], "unlink", eio)
        caplog.set_level(logging.DEBUG, logger="megatron_ssd")
        for h in handles:
            engine.free(h)
        assert engine.stats().extra["live_blobs"] == 0
        told = [(r.levelno, r.getMessage()) for r in caplog.records if "could not be deleted" in r.getMessage()]
        assert [level for level, _ in told] == [logging.WARNING, logging.DEBUG]
        assert "unlink of" in told[0][1] and "EIO" in told[0][1] and "at close" in told[0][1]
        monkeypatch.undo()
    assert os.listdir(offload_dir) == []


def test_reads_overtake_queued_writes(offload_dir):
    gate = threading.Event()
    held_now = threading.Semaphore(0)

    def held(op, path, offset, nbytes):
        if op == "write" and not gate.is_set():
            held_now.release()
            gate.wait(HANG_S)

    with _engine(offload_dir, held, threads=1) as engine:
        gate.set()
        h = engine.write(_blob(10 * KiB)).get()
        gate.clear()
        writes = [engine.write(_blob(10 * KiB, i)) for i in range(8)]
        for _ in range(2):  # the two workers are now held inside writes 0 and 1; 2-7 queue
            assert held_now.acquire(timeout=HANG_S)
        read = engine.read(h, engine.alloc(h.nbytes, "cpu"))
        gate.set()
        assert torch.equal(read.get(HANG_S), _blob(10 * KiB))
        last = [w.get(HANG_S) for w in writes]
        assert read.finished < writes[-1].finished and len(last) == 8


def test_busy_time_is_the_union_of_intervals(offload_dir, monkeypatch):
    """Two writes in flight together over 2 s of the engine's clock are 2 busy seconds,
    not 4. The clock is the test's own (moved only inside the writes), so nothing here
    depends on how fast the machine runs."""
    now = [100.0]
    lock = threading.Lock()
    both = threading.Barrier(2, timeout=HANG_S)
    clock = {name: getattr(time, name) for name in dir(time) if not name.startswith("_")}
    monkeypatch.setattr(striped, "time", types.SimpleNamespace(**dict(clock, perf_counter=lambda: now[0])))

    def slow(op, path, offset, nbytes):
        if op == "write":
            both.wait()  # both writes are in flight together, however late a worker starts
            with lock:
                now[0] += 1.0
            both.wait()  # neither ends before both moved the clock

    with _engine(offload_dir, slow, threads=2) as engine:
        futs = [engine.write(_blob(4 * KiB, i)) for i in range(2)]
        [f.get(HANG_S) for f in futs]
        assert engine.stats().write_busy_s == 2.0  # one interval [100, 102]; the sum would be 4


# -------------------------------------------------------------- a real, tiny filesystem

_TINY = textwrap.dedent(
    """
    import errno, sys, torch
    from megatron_ssd.config import IOConfig, OffloadConfig
    from megatron_ssd.errors import ConfigError, OffloadIOError
    from megatron_ssd.io import PosixEngine
    path = sys.argv[1]
    for layout in ("file", "extent"):
        io = dict(layout=layout, block_bytes=256 << 10, file_grow_bytes=256 << 10)
        try:
            engine = PosixEngine(OffloadConfig(paths=[path], io=IOConfig(**io)))
        except ConfigError:  # tmpfs before Linux 6.6 refuses O_DIRECT
            engine = PosixEngine(OffloadConfig(paths=[path], io=IOConfig(direct=False, **io)))
        with engine:
            fut = engine.write(torch.ones(4 << 20, dtype=torch.uint8))
            try:
                fut.get()
                raise SystemExit(layout + ": a 4 MiB write into a 1 MiB filesystem succeeded")
            except OffloadIOError as e:
                if e.errno != errno.ENOSPC or "ENOSPC" not in str(e):
                    raise SystemExit(layout + ": wrong error " + str(e))
            if engine.stats().disk_bytes != 0:
                raise SystemExit(layout + ": disk_bytes not back to 0")
            small = torch.arange(100_000).to(torch.uint8)
            h = engine.write(small).get()
            if not torch.equal(engine.read(h, engine.alloc(h.nbytes, "cpu")).get(), small):
                raise SystemExit(layout + ": round trip after ENOSPC failed")
    print("TINY-OK")
    """
)


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) for a private tmpfs")
def test_real_enospc_on_a_tiny_filesystem(tmp_path):
    """A 1 MiB tmpfs mounted in a user namespace (no root needed where those are allowed).

    Both layouts reserve space with posix_fallocate before writing, so a full disk is
    reported when the blob is placed, not halfway through its writes.
    """
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    script = tmp_path / "tiny.py"
    script.write_text(_TINY)
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"unprivileged user namespaces unavailable: {probe.stderr.strip()}")
    cmd = f"mount -t tmpfs -o size=1m tmpfs {mnt} && exec {sys.executable} {script} {mnt}"
    env = dict(os.environ, PYTHONPATH=REPO)
    res = subprocess.run(["unshare", "-rm", "sh", "-c", cmd], capture_output=True, text=True, env=env, timeout=HANG_S)
    if res.returncode != 0 and "mount" in res.stderr and "TINY" not in res.stdout:
        pytest.skip(f"cannot mount a tmpfs in a user namespace: {res.stderr.strip()[-200:]}")
    assert res.returncode == 0 and "TINY-OK" in res.stdout, res.stdout + res.stderr


@pytest.mark.parametrize("fail_at", [0, 3])
def test_worker_start_failure_closes_the_run_directory_and_stops_started_threads(offload_dir, monkeypatch, fail_at):
    """The thread limit is hit after ``fail_at`` of the 4 workers started: the engine
    constructor raises one clear error, and leaves no run directory and no thread."""
    real_start = threading.Thread.start
    starts = []

    def start(self):
        if self.name.startswith("megatron_ssd-io-"):
            if len(starts) == fail_at:
                raise RuntimeError("can't start new thread")
            starts.append(self)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    config = OffloadConfig(paths=[offload_dir], io=IOConfig(engine="posix", threads=2))
    with pytest.raises(OffloadIOError) as info:
        PosixEngine(config)
    assert str(info.value) == ("megatron_ssd: cannot start the I/O engine's 4 worker threads (io.threads = 2): "
                               "can't start new thread")
    assert os.listdir(offload_dir) == []
    assert len(starts) == fail_at and not any(t.is_alive() for t in starts)


EMFILE_CHILD = textwrap.dedent(
    """
    import logging, os, resource, sys, threading
    import torch
    from megatron_ssd.config import IOConfig, OffloadConfig
    from megatron_ssd.io import PosixEngine

    path = sys.argv[1]
    io = IOConfig(engine="posix", layout="file", threads=2, block_bytes=16384, max_inflight_bytes=64 << 20)
    engine = PosixEngine(OffloadConfig(paths=[path], io=io))
    blobs = [torch.randint(0, 256, (65536 + i,), dtype=torch.uint8) for i in range(32)]
    handles = [f.get() for f in [engine.write(b) for b in blobs]]
    dsts = [engine.alloc(h.nbytes, torch.device("cpu"), h) for h in handles]

    waiting = threading.Event()

    class Seen(logging.Handler):
        def emit(self, record):
            if "no file descriptor left" in record.getMessage():
                waiting.set()

    logging.getLogger("megatron_ssd").addHandler(Seen())
    spare = os.dup(1)
    # No descriptor left (the spare is the last): the 32 reads must wait, not fail.
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) - 1,
                                                resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    futures = [engine.read(h, d) for h, d in zip(handles, dsts)]
    print("waited" if waiting.wait(600) else "never-waited", flush=True)
    os.close(spare)  # one descriptor for 4 workers and 32 blobs in flight
    ok = all(torch.equal(f.get()[: b.numel()], b) for f, b in zip(futures, blobs))
    print("OK" if ok else "DIFFERENT", engine.stats().read_errors, flush=True)
    engine.close()
    """
)


@pytest.mark.e2e
def test_reads_under_a_tiny_descriptor_limit_wait_and_succeed(tmp_path, offload_dir):
    """``file`` layout, 32 blobs read at once with no descriptor left, then one
    (RLIMIT_NOFILE in a child): the reads wait on EMFILE instead of failing, and once a
    descriptor is free they all complete, every byte right."""
    script = tmp_path / "emfile.py"
    script.write_text(EMFILE_CHILD)
    res = subprocess.run([sys.executable, str(script), offload_dir], capture_output=True, text=True, timeout=HANG_S,
                         env=dict(os.environ, PYTHONPATH=REPO))
    assert res.returncode == 0 and res.stdout.split() == ["waited", "OK", "0"], res.stdout + res.stderr[-3000:]
    assert os.listdir(offload_dir) == []
