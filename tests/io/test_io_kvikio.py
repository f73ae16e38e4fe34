"""The kvikio engine's CUDA path on a CPU, through a fake ``kvikio`` (``fake_kvikio.py``)
and the fake CUDA calls (``fake_cuda.py``): each file opened once and closed before it is
unlinked, stream-ordered transfers on each worker's own stream (no null-stream
synchronization, no ``.get()`` per block), checksums computed on the device (no
device-to-host copy of a block), and byte-exact round trips."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from megatron_ssd.config import IOConfig, OffloadConfig
from megatron_ssd.errors import ChecksumError, OffloadIOError
from megatron_ssd.io.checksum import DEVICE_ALGORITHM
from megatron_ssd.io.kvikio_backend import KvikioEngine

from fake_cuda import FakeCuda
from fake_kvikio import FakeKvikio
from ondisk import flip_payload_bits
from waits import HANG_S  # tests/waits.py

KiB = 1024
BLOCK = 64 * KiB
SIZES = [1, 10, 4095, 4097, BLOCK, 3 * BLOCK + 5]


def _engine(path, cuda, kvikio, layout="extent", fault=None, threads=2):
    cfg = OffloadConfig(paths=[path], io=IOConfig(block_bytes=BLOCK, threads=threads, layout=layout))
    return KvikioEngine(cfg, fault=fault, cuda=cuda, kvikio=kvikio)


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed + n))


@pytest.mark.parametrize("layout", ["extent", "file"])
def test_round_trip_opens_each_file_once_with_stream_ordered_calls_and_device_checksums(offload_dir, layout):
    cuda = FakeCuda()
    kv = FakeKvikio(cuda)
    with _engine(offload_dir, cuda, kv, layout) as engine:
        handles = {}
        for n in SIZES:
            expected = _bytes(n)
            src = cuda.to_device(torch.zeros(n, dtype=torch.uint8), 1)
            cuda.kernel(1, lambda src=src, expected=expected: src.copy_(expected))  # produced on the compute stream
            handles[n] = (expected, engine.write(src))
        for n, (expected, fut) in handles.items():
            h = fut.get()
            assert {e.checksum_algo for e in h.extents} == {DEVICE_ALGORITHM}
            back = engine.read(h, engine.alloc(n, "cuda:1", h)).get()
            assert torch.equal(back, expected)
            host = engine.read(h, engine.alloc(n, "cpu", h)).get()  # the POSIX peer verifies wsum64 on the host
            assert torch.equal(host, expected)
            engine.free(h)
        files = [e[1] for e in kv.named("open")]
        assert len(files) == len(set(files)), "a file was opened more than once"
        if layout == "file":
            closes = kv.named("close")
            assert sorted(c[1] for c in closes) == sorted(files) and all(c[2] for c in closes), \
                "each blob's CuFile is closed before its file is unlinked"
        else:
            assert files == [os.path.join(engine.paths[0], "extents.bin")]
    assert {c[1] for c in kv.named("close")} == set(files)
    names = {e[0] for e in kv.events}
    assert names <= {"open", "close", "raw_write_async", "raw_read_async", "check_bytes_done"}
    assert len(kv.named("raw_write_async")) == sum(-(-n // BLOCK) for n in SIZES)
    assert cuda.copies == [], "a block was copied between device and host"
    assert cuda.mismatches() == []


def test_each_worker_transfers_on_its_own_stream(offload_dir):
    cuda = FakeCuda()
    kv = FakeKvikio(cuda)
    arrived, opened = threading.Semaphore(0), threading.Event()

    def hold(op, path, offset, nbytes):
        if op == "write":
            arrived.release()
            assert opened.wait(HANG_S)
        return None

    with _engine(offload_dir, cuda, kv, fault=hold, threads=2) as engine:
        fut = engine.write(cuda.to_device(_bytes(4 * BLOCK), 0))
        for _ in range(4):  # four workers each hold one block: their transfers overlap
            assert arrived.acquire(timeout=HANG_S)
        opened.set()
        fut.get()
    streams = {e[2] for e in kv.named("raw_write_async")}
    assert len(streams) == 4
    assert all(cuda.stream_by_handle(s).device == torch.device("cuda", 0) for s in streams)


def test_a_corrupted_block_is_caught_on_gds_and_host_reads(offload_dir):
    cuda = FakeCuda()
    kv = FakeKvikio(cuda)
    with _engine(offload_dir, cuda, kv) as engine:
        n = 2 * BLOCK + 3
        h = engine.write(cuda.to_device(_bytes(n), 0)).get()
        flip_payload_bits(h.extents[1], 17, 0x10)
        with pytest.raises(ChecksumError, match=f"expected {DEVICE_ALGORITHM}"):
            engine.read(h, engine.alloc(n, "cuda:0", h)).get()
        with pytest.raises(ChecksumError, match=f"expected {DEVICE_ALGORITHM}"):
            engine.read(h, engine.alloc(n, "cpu", h)).get()


def test_a_blob_written_from_host_memory_reads_into_a_gpu_verified_with_xxh3(offload_dir):
    cuda = FakeCuda()
    kv = FakeKvikio(cuda)
    with _engine(offload_dir, cuda, kv) as engine:
        n = BLOCK + 77
        blob = _bytes(n)
        h = engine.write(blob).get()  # through the POSIX peer
        assert kv.named("raw_write_async") == []
        assert torch.equal(engine.read(h, engine.alloc(n, "cuda:0", h)).get(), blob)
        assert engine.stats().extra["checksum_copied_bytes"] == n  # digested on the host, as written


def test_a_failed_gds_write_closes_the_blob_file_before_it_is_unlinked(offload_dir):
    cuda = FakeCuda()
    kv = FakeKvikio(cuda)
    fault = lambda op, path, offset, nbytes: OSError(5, "EIO") if op == "write" and offset > 0 else None  # noqa: E731
    with _engine(offload_dir, cuda, kv, layout="file", fault=fault) as engine:
        with pytest.raises(OffloadIOError, match="EIO"):
            engine.write(cuda.to_device(_bytes(3 * BLOCK), 0)).get()
        assert engine.stats().disk_bytes == 0
        opened = {e[1] for e in kv.named("open")}
        assert opened and {c[1] for c in kv.named("close")} == opened
        assert all(exists for _, _, exists in kv.named("close"))
        assert not any(os.path.exists(f) for f in opened)
