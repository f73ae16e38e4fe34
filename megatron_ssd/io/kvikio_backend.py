"""The kvikio backend: GPUDirect Storage reads and writes straight from CUDA memory.

:class:`KvikioBackend` moves the blocks; :class:`KvikioEngine` is the engine around it,
with the same layout, striping, backpressure and checksums as :class:`PosixEngine`: both
are a :class:`~megatron_ssd.io.striped.StripedEngine` with a peer backend (NOTE [Block
backends]). A CUDA block is moved by kvikio's stream-ordered cuFile calls
(``CuFile.raw_write_async`` / ``raw_read_async``) between device memory and the file,
with no host staging when GDS is active (kvikio falls back to its own bounce buffers in
compatibility mode). CPU tensors take the POSIX backend's path.

``io.engine: auto`` never picks this engine: it has not been measured on a GPU yet, so
it runs only where ``io.engine: kvikio`` names it (docs/io.md).

kvikio loads ``libcuda.so.1`` on every file operation, even for host memory, so this
engine needs a GPU. Importing this module never imports kvikio; constructing the engine
does, and raises :class:`~megatron_ssd.errors.ConfigError` when kvikio or CUDA is
missing. ::

    engine = KvikioEngine(OffloadConfig(paths=["/nvme0"], io=IOConfig(engine="kvikio")))
"""

from __future__ import annotations

import errno
import importlib
import importlib.util
import itertools
import threading
import time
from functools import partial
from typing import Any, Dict, Optional

import torch

from ..config import OffloadConfig
from ..errors import ConfigError, OffloadIOError
from .base import ALIGN
from .checksum import ALGORITHM, DEVICE_ALGORITHM, new_digest, wsum64
from .backend import BlockBackend, BlockServices
from .buffers import tensor_buffer
from .cuda import CUDA, CudaOps
from .layout import Fault, io_error
from .pinned import HostSlab
from .posix import PosixBackend
from .blocks import BlobOp, Block
from .striped import StripedEngine

__all__ = ["KvikioBackend", "KvikioEngine", "kvikio_available"]

_MASK = (1 << 64) - 1


def kvikio_available() -> bool:
    """True when the kvikio package is installed (without importing it)."""
    return importlib.util.find_spec("kvikio") is not None


def _import_kvikio() -> Any:
    if not kvikio_available():
        raise ConfigError(
            "IOConfig.engine = 'kvikio': the kvikio package is not installed "
            "(pip install -e .[gpu]); use io.engine=posix or auto"
        )
    if not CUDA.is_available():
        raise ConfigError(
            "IOConfig.engine = 'kvikio': needs a CUDA device and none is visible "
            "(kvikio loads libcuda.so.1 for every file operation); use io.engine=posix or auto"
        )
    try:
        return importlib.import_module("kvikio")
    except Exception as e:  # a broken CUDA install surfaces here as any exception type
        raise ConfigError(f"IOConfig.engine = 'kvikio': importing kvikio failed: {e!r}") from e


class KvikioEngine(StripedEngine):
    """GPUDirect Storage engine for CUDA tensors: a :class:`StripedEngine` whose blocks
    move with :class:`KvikioBackend`; see the module docstring.

    Args:
        config: Offload settings (``paths`` and ``io``).
        rank: Rank used in run directory names.
        fault: Optional fault-injection hook (see :class:`~megatron_ssd.io.posix.PosixEngine`).
        cuda: The CUDA calls to make (default: the real ones; tests pass a fake).
        kvikio: The kvikio module to use (default: imported; tests pass a fake).

    Raises:
        ConfigError: kvikio is not installed, CUDA is not available, or a path is bad.
    """

    def __init__(self, config: OffloadConfig, rank: Optional[int] = None, fault: Optional[Fault] = None,
                 cuda: Optional[CudaOps] = None, kvikio: Any = None) -> None:
        if kvikio is None:
            kvikio = _import_kvikio()
        super().__init__(config, partial(KvikioBackend, kvikio=kvikio), rank, fault, cuda)


def _digest_into(slot: torch.Tensor, part: torch.Tensor) -> None:
    """Queue ``wsum64(part)`` and its 8-byte copy into the pinned ``slot`` on the current
    stream (NOTE [Device checksums] in ``checksum.py``)."""
    slot.copy_(wsum64(part), non_blocking=True)


class KvikioBackend(BlockBackend):
    """Moves CUDA blocks with ``kvikio.CuFile`` and host blocks with a
    :class:`~megatron_ssd.io.posix.PosixBackend` of its own (NOTE [Block backends]).

    Args:
        services: what it uses of the engine it serves.
        kvikio: the imported kvikio module.
    """

    def __init__(self, services: BlockServices, kvikio: Any) -> None:
        super().__init__(services)
        self.kvikio = kvikio
        self.cuda = services.cuda
        self.host = PosixBackend(services, staging=False)
        """The POSIX path for host tensors (no pinned staging: CUDA blocks never use it)."""
        self._files: Dict[str, Any] = {}
        self._files_lock = threading.Lock()
        self._tls = threading.local()
        self._slot_ids = itertools.count()
        self._scratch = HostSlab(ALIGN, pin=True, cuda=self.cuda) if self.cuda.is_available() else None
        """Pinned 8-byte slots, one per worker, that device checksums are copied into."""

    # NOTE [kvikio data path]: kvikio's ``CuFile.pread`` / ``pwrite`` synchronize the
    # null stream before every call (``sync_default_stream``, which the Python API cannot
    # turn off), which waits for all the compute queued there, and run on kvikio's own
    # thread pool (one thread by default). This backend uses the stream-ordered
    # ``raw_write_async`` / ``raw_read_async`` instead, on a stream of each worker's own
    # per device, so the engine's workers (``io.threads`` requests in flight) overlap the
    # blocks and nothing synchronizes the null stream. A worker first makes its stream
    # wait for ``op.ready`` (the caller's stream at submit: NOTE [CUDA ordering] in
    # ``posix.py``) and queues the block's device checksum there, waits for that with a
    # blocking event (so kvikio's compatibility mode, which synchronizes the stream
    # itself, finds it idle and does not spin), then issues the transfer and waits for
    # it with another blocking event. The source is read by the drive until its block's
    # transfer ends, so a GDS write is staged only when it completes (NOTE [Staged
    # writes]): device memory is freed at drive speed, not at PCIe speed as with the
    # POSIX engine's staging ring.

    # NOTE [CuFile lifetime]: each data file is opened once, on its first block, and its
    # CuFile kept: the extent layout's per-path file for the whole run (closed by
    # ``close`` after the workers stopped), a ``file``-layout blob's file until the
    # layout unlinks it (``forget_file``, called by the layout just before the unlink, on
    # free and on a failed write, when no block of it is in flight).

    def _cufile(self, file: str) -> Any:
        with self._files_lock:
            f = self._files.get(file)
            if f is None:
                f = self._files[file] = self.kvikio.CuFile(file, "r+")
            return f

    def forget_file(self, file: str) -> None:
        with self._files_lock:
            f = self._files.pop(file, None)
        if f is not None:
            f.close()

    def _stream(self, dev: torch.device) -> Any:
        """This worker's stream on ``dev`` (created under ``dev``; NOTE [CUDA threads])."""
        streams = getattr(self._tls, "streams", None)
        if streams is None:
            streams = self._tls.streams = {}
        stream = streams.get(dev.index)
        if stream is None:
            stream = streams[dev.index] = self.cuda.new_stream(dev)
        return stream

    def _slot(self) -> torch.Tensor:
        """This worker's pinned 8-byte digest slot."""
        slot = getattr(self._tls, "slot", None)
        if slot is None:
            i = next(self._slot_ids)
            slot = self._tls.slot = self._scratch.tensor[8 * i : 8 * i + 8].view(torch.int64)[0]  # type: ignore[union-attr]
        return slot

    def prepare(self, op: BlobOp) -> None:
        dev = op.device
        if dev is None:
            return
        cuda = self.cuda
        with cuda.device(dev):
            op.ready = cuda.event()
            if op.kind == "read" and self.services.fresh.claim(op.tensor):
                # allocated on the read stream: wait only for what that stream did before
                op.ready.record(self.services.streams.h2d(dev))
            else:
                op.ready.record(cuda.current_stream(dev))

    def skew(self, src: torch.Tensor) -> int:
        return self.host.skew(src)

    def _wait_ready(self, op: BlobOp, block: Block, stream: Any, digest: bool) -> None:
        """Order ``stream`` after ``op.ready``, queue the block's device checksum when
        ``digest``, and wait for both on the host (NOTE [kvikio data path])."""
        cuda = self.cuda
        part = op.tensor[block.blob_offset : block.blob_offset + block.nbytes]  # type: ignore[index]
        cuda.record_stream(op.tensor, stream)
        with cuda.use_stream(stream):
            stream.wait_event(op.ready)
            if digest:
                cuda.launch(_digest_into, self._slot(), part)
            ready = cuda.event()
            ready.record(stream)
        ready.synchronize()

    def _gds(self, op_name: str, op: BlobOp, block: Block, stream: Any) -> None:
        """One stream-ordered cuFile transfer of the block's payload, waited for with a
        blocking event; errors become OffloadIOError."""
        services, cuda = self.services, self.cuda
        part = op.tensor[block.blob_offset : block.blob_offset + block.nbytes]  # type: ignore[index]
        token = services.watch(op_name, block.file, block.offset, block.nbytes)
        try:
            if services.fault is not None:
                err = services.fault(op_name, block.file, block.offset, block.nbytes)
                if err is not None:
                    raise err
            f = self._cufile(block.file)
            call = f.raw_write_async if op_name == "write" else f.raw_read_async
            with services.io_slots:  # NOTE [I/O slots]
                fut = call(part, cuda.stream_handle(stream), block.nbytes, block.offset, 0)
                done = cuda.event()
                done.record(stream)
                done.synchronize()
                moved = fut.check_bytes_done()
        except OffloadIOError:
            raise
        except OSError as e:
            raise io_error(op_name, block.file, block.offset, block.nbytes, e) from e
        except Exception as e:  # kvikio reports failures as RuntimeError
            raise io_error(op_name, block.file, block.offset, block.nbytes, OSError(errno.EIO, repr(e))) from e
        finally:
            services.watch_end(token)
        if moved != block.nbytes:
            short = OSError(errno.EIO, f"short {op_name} ({moved} of {block.nbytes} bytes)")
            raise io_error(op_name, block.file, block.offset, block.nbytes, short)

    def _slot_value(self) -> int:
        return int(self._slot().item()) & _MASK

    def write_block(self, op: BlobOp, block: Block) -> None:
        if op.device is None:
            return self.host.write_block(op, block)
        with self.cuda.device(op.device):
            stream = self._stream(op.device)
            started = time.perf_counter()
            self._wait_ready(op, block, stream, op.checksum)
            if op.checksum:
                self.services.count("checksum_s", time.perf_counter() - started)
            self._gds("write", op, block, stream)
        if op.checksum:
            block.checksum, block.algo = self._slot_value(), DEVICE_ALGORITHM

    def read_block(self, op: BlobOp, block: Block) -> None:
        if op.device is None:
            return self.host.read_block(op, block)
        cuda = self.cuda
        with cuda.device(op.device):
            stream = self._stream(op.device)
            self._wait_ready(op, block, stream, False)
            self._gds("read", op, block, stream)
            if block.expected is None:
                return
            started = time.perf_counter()
            if block.algo == DEVICE_ALGORITHM:
                value = self._device_digest(op, block, stream)
            else:
                value = self._host_digest(op, block, stream)
            self.services.count("checksum_s", time.perf_counter() - started)
        PosixBackend.verify(block, value)

    def _device_digest(self, op: BlobOp, block: Block, stream: Any) -> int:
        """``wsum64`` of the block as read, computed on the device (NOTE [Device checksums])."""
        cuda = self.cuda
        part = op.tensor[block.blob_offset : block.blob_offset + block.nbytes]  # type: ignore[index]
        with cuda.use_stream(stream):
            cuda.launch(_digest_into, self._slot(), part)
            done = cuda.event()
            done.record(stream)
        done.synchronize()
        return self._slot_value()

    def _host_digest(self, op: BlobOp, block: Block, stream: Any) -> int:
        """xxh3 of a block that was written from host memory: its bytes are copied to the
        host to be digested (only blobs written from CPU tensors and read to a GPU)."""
        cuda = self.cuda
        buf = self.host.pool.acquire()
        try:
            part = op.tensor[block.blob_offset : block.blob_offset + block.nbytes]  # type: ignore[index]
            with cuda.use_stream(stream):
                cuda.copy(buf[: block.nbytes], part)
                done = cuda.event()
                done.record(stream)
            done.synchronize()
            d = new_digest(ALGORITHM)
            d.update(tensor_buffer(buf, 0, block.nbytes))
            self.services.count("checksum_copied_bytes", block.nbytes)
            return d.value()
        finally:
            self.host.pool.release(buf)

    def discard_block(self, op: BlobOp, block: Block) -> None:
        self.host.discard_block(op, block)

    def close(self) -> None:
        self.host.close()
        with self._files_lock:
            files, self._files = self._files, {}
        for f in files.values():
            f.close()
        if self._scratch is not None:
            self._scratch.close()
