"""A fake ``kvikio`` module backed by CPU files and the fake CUDA's streams: records which
files were opened and closed and which calls were made, and moves bytes for real.

Only the stream-ordered calls work (``raw_write_async`` / ``raw_read_async``: their
transfer is queued on the fake stream and runs in stream order, as cuFile's does); the
calls that synchronize the null stream or run on kvikio's thread pool (``pread``,
``pwrite``, ``read``, ``write``, ``raw_read``, ``raw_write``) fail the test.
"""

from __future__ import annotations

import os
import threading
from typing import List, Tuple

import torch

from megatron_ssd.io.buffers import tensor_buffer

from fake_cuda import FakeCuda


class FakeStreamFuture:
    """``IOFutureStream``: ``check_bytes_done`` runs the stream up to the transfer."""

    def __init__(self, kvikio: "FakeKvikio", stream, mark: int) -> None:
        self.kvikio, self.stream, self.mark = kvikio, stream, mark
        self.value = None

    def check_bytes_done(self) -> int:
        self.kvikio.record("check_bytes_done")
        self.stream.run_until(self.mark)
        return self.value


class FakeCuFile:
    def __init__(self, kvikio: "FakeKvikio", file: str, flags: str) -> None:
        self.kvikio, self.file = kvikio, file
        self.fd = os.open(file, os.O_RDWR)
        self.closed = False
        kvikio.record("open", file)

    def close(self) -> None:
        assert not self.closed, f"{self.file} closed twice"
        self.closed = True
        self.kvikio.record("close", self.file, os.path.exists(self.file))
        os.close(self.fd)

    def _queue(self, name: str, buf: torch.Tensor, stream: int, size: int, file_offset: int, dev_offset: int):
        assert not self.closed, f"{name} on a closed CuFile"
        cuda = self.kvikio.cuda
        assert cuda.device_of(buf) is not None, f"{name} of host memory"
        s = cuda.stream_by_handle(stream)
        self.kvikio.record(name, self.file, s.handle, size)
        view = tensor_buffer(buf, dev_offset, size)
        fut = FakeStreamFuture(self.kvikio, s, 0)

        def run() -> None:
            if name == "raw_write_async":
                fut.value = os.pwrite(self.fd, view, file_offset)
            else:
                fut.value = os.preadv(self.fd, [view], file_offset)

        s._enqueue(run)
        fut.mark = s.queued
        return fut

    def raw_write_async(self, buf, raw_stream, size=None, file_offset=0, dev_offset=0):
        return self._queue("raw_write_async", buf, raw_stream, size, file_offset, dev_offset)

    def raw_read_async(self, buf, raw_stream, size=None, file_offset=0, dev_offset=0):
        return self._queue("raw_read_async", buf, raw_stream, size, file_offset, dev_offset)

    def _refused(self, name: str):
        def call(*args, **kwargs):
            self.kvikio.record(name, self.file)
            raise AssertionError(f"CuFile.{name} synchronizes the null stream or uses kvikio's thread pool")
        return call

    def __getattr__(self, name: str):
        if name in ("pread", "pwrite", "read", "write", "raw_read", "raw_write"):
            return self._refused(name)
        raise AttributeError(name)


class FakeKvikio:
    """Stands in for the ``kvikio`` module (``CuFile``)."""

    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.events: List[Tuple] = []
        self.lock = threading.Lock()

    def record(self, *event) -> None:
        with self.lock:
            self.events.append(event)

    def CuFile(self, file, flags="r"):  # noqa: N802 - the kvikio name
        return FakeCuFile(self, str(file), flags)

    def named(self, name: str) -> List[Tuple]:
        with self.lock:
            return [e for e in self.events if e[0] == name]
