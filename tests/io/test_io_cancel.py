"""Cancelled writes (NOTE [Cancelled writes] in ``io/recovery.py``): a blob's blocks not
started when the write is cancelled are skipped, and the blob leaves nothing behind.
Which blocks have started is fixed by a fault hook that holds the first transfers until
the test lets them go, never by timing."""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_ssd.config import IOConfig, OffloadConfig
from megatron_ssd.errors import WriteCancelled
from megatron_ssd.io import PosixEngine
from waits import HANG_S  # tests/waits.py

KiB = 1024
BLOCK = 16 * KiB


class Gate:
    """A fault hook that holds every write transfer until :meth:`open` and counts the
    transfers that reached it."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.arrived = threading.Semaphore(0)
        self.writes = 0
        self.lock = threading.Lock()

    def __call__(self, op, path, offset, nbytes):
        if op == "write":
            with self.lock:
                self.writes += 1
            self.arrived.release()
            assert self.opened.wait(HANG_S), "the test never opened the gate"
        return None

    def wait_arrivals(self, n: int) -> None:
        for _ in range(n):
            assert self.arrived.acquire(timeout=HANG_S), "a write transfer never started"

    def open(self) -> None:
        self.opened.set()


def _engine(path, gate, threads: int = 1):
    # io.threads = n: 2n workers, so exactly 2n blocks start while the gate is closed
    # (the fault hook runs before a transfer takes its I/O slot).
    return PosixEngine(OffloadConfig(paths=[path], io=IOConfig(threads=threads, block_bytes=BLOCK)), fault=gate)


def _blob(n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))


def test_a_cancelled_write_skips_the_blocks_not_started_and_frees_its_space(offload_dir):
    gate = Gate()
    with _engine(offload_dir, gate) as engine:
        fut = engine.write(_blob(8 * BLOCK))
        gate.wait_arrivals(2)  # both workers hold a block; six wait in the queue
        assert fut.cancel()
        gate.open()
        with pytest.raises(WriteCancelled, match="cancelled"):
            fut.get()
        assert fut.wait_settled(30)
        stats = engine.stats()
    assert gate.writes == 2, "blocks queued behind the cancel were written"
    assert stats.extra["cancelled_write_bytes"] == 6 * BLOCK
    assert stats.bytes_written == 2 * BLOCK and stats.write_errors == 0  # what did reach the disk
    assert stats.disk_bytes == 0 and stats.extra["inflight_bytes"] == 0 and stats.extra["live_blobs"] == 0


def test_a_cancel_after_every_block_started_leaves_a_readable_blob(offload_dir):
    gate = Gate()
    data = _blob(2 * BLOCK)
    with _engine(offload_dir, gate, threads=2) as engine:
        fut = engine.write(data)
        gate.wait_arrivals(2)
        assert fut.cancel()  # both blocks are in their transfers already
        gate.open()
        handle = fut.get()
        out = engine.read_blocking(handle, engine.alloc(handle.nbytes, torch.device("cpu"), handle))
        assert torch.equal(out[: data.numel()], data)
        stats = engine.stats()
        engine.free(handle)
    assert stats.extra["cancelled_write_bytes"] == 0 and stats.bytes_written == data.numel()


def test_cancel_of_a_completed_write_does_nothing(offload_dir):
    gate = Gate()
    gate.open()
    with _engine(offload_dir, gate) as engine:
        fut = engine.write(_blob(3 * BLOCK))
        handle = fut.get()
        assert fut.wait_settled(30)
        assert not fut.cancel()
        assert engine.stats().bytes_written == 3 * BLOCK
        engine.free(handle)
