"""Block backends (NOTE [Block backends]): the striping, backpressure, completion and
checksum layer serves any backend. A plain buffered backend written here in a few lines
round-trips striped blobs with checksums; the kvikio engine's host tensors go through its
POSIX peer (its cuFile path runs on a CPU through fakes in tests/io/test_io_kvikio.py, and
for real on a GPU in tests/io/test_io_factory.py)."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_ssd.config import IOConfig, OffloadConfig
from megatron_ssd.errors import ChecksumError
from megatron_ssd.io import kvikio_backend
from megatron_ssd.io.backend import BlockBackend
from megatron_ssd.io.checksum import digest
from megatron_ssd.io.posix import PosixBackend
from megatron_ssd.io.striped import StripedEngine

KiB = 1024


class PlainBackend(BlockBackend):
    """Buffered ``pwrite`` / ``pread`` through a bytes copy: all a new backend must say."""

    def write_block(self, op, block):
        data = op.tensor[block.blob_offset : block.blob_offset + block.nbytes].numpy().tobytes()
        with self.services.io_slots:
            assert os.pwrite(block.fd, data, block.offset + block.skew) == len(data)
        if op.checksum:
            block.checksum = digest(op.tensor[block.blob_offset : block.blob_offset + block.nbytes].numpy())
        self.services.count("plain_bytes", len(data))

    def read_block(self, op, block):
        with self.services.io_slots:
            data = os.pread(block.fd, block.nbytes, block.offset + block.skew)
        part = op.tensor[block.blob_offset : block.blob_offset + block.nbytes]
        part.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        if block.expected is not None:
            PosixBackend.verify(block, digest(part.numpy()))


def config(tmp_path, n_paths=2):
    paths = []
    for i in range(n_paths):
        (tmp_path / f"ssd{i}").mkdir()
        paths.append(str(tmp_path / f"ssd{i}"))
    return OffloadConfig(paths=paths, io=IOConfig(direct=False, block_bytes=64 * KiB, threads=2,
                                                   max_inflight_bytes=256 * KiB, stall_warning_s=0))


def test_a_new_backend_reuses_striping_backpressure_and_checksums(tmp_path):
    engine = StripedEngine(config(tmp_path), PlainBackend)
    try:
        blobs = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (1, 5000, 300 * KiB, 1024 * KiB)]
        handles = [engine.write(b).get() for b in blobs]
        # blocks of the 1 MiB blob alternate over both paths
        assert {e.path_index for e in handles[-1].extents} == {0, 1} and len(handles[-1].extents) == 16
        for b, h in zip(blobs, handles):
            back = engine.read(h, engine.alloc(h.nbytes, torch.device("cpu"), h)).get()
            assert torch.equal(back, b)
        stats = engine.stats()
        assert stats.extra["plain_bytes"] == sum(b.numel() for b in blobs)
        assert stats.extra["inflight_peak_bytes"] <= 1024 * KiB  # one blob over the bound runs alone
        # a flipped byte on the drive is caught by the engine's checksum bookkeeping
        first = handles[2].extents[0]
        with open(first.file, "r+b") as f:
            f.seek(first.offset)
            byte = f.read(1)
            f.seek(first.offset)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(ChecksumError, match="checksum mismatch"):
            engine.read(handles[2], engine.alloc(handles[2].nbytes, torch.device("cpu"), handles[2])).get()
        for h in handles:
            engine.free(h)
        assert engine.stats().disk_bytes == 0
    finally:
        engine.close()


def test_the_kvikio_engine_moves_host_tensors_with_its_posix_peer(tmp_path, monkeypatch):
    class FakeKvikio:
        """Stands in for the module: host tensors never reach cuFile."""

        def CuFile(self, *args):  # noqa: N802 - the kvikio name
            raise AssertionError("a host tensor went to cuFile")

    monkeypatch.setattr(kvikio_backend, "_import_kvikio", FakeKvikio)
    engine = kvikio_backend.KvikioEngine(config(tmp_path))
    try:
        assert isinstance(engine.backend, kvikio_backend.KvikioBackend)
        assert isinstance(engine.backend.host, PosixBackend) and engine.backend.host.services is engine
        blob = torch.randint(0, 256, (3 * 64 * KiB + 17,), dtype=torch.uint8)
        handle = engine.write(blob).get()
        assert torch.equal(engine.read(handle, engine.alloc(handle.nbytes, torch.device("cpu"), handle)).get(), blob)
        engine.free(handle)
    finally:
        engine.close()
