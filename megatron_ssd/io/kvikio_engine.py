"""The kvikio engine: GPUDirect Storage reads and writes straight from CUDA memory.

Same layout, striping, backpressure and checksums as :class:`PosixEngine`: both are a
:class:`~megatron_ssd.io.striped.StripedEngine` with a peer backend (NOTE [Block
backends]). A CUDA block is moved by ``kvikio.CuFile.pwrite`` / ``pread`` between device
memory and the file, with no host staging when GDS is active (kvikio falls back to its
own bounce buffers in compatibility mode). CPU tensors take the POSIX backend's path.

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
import threading
import time
from functools import partial
from typing import Any, Dict, Optional

import torch

from ..config import OffloadConfig
from ..errors import ConfigError, OffloadIOError
from .checksum import digest
from .backend import BlockBackend
from .layout import ExtentLayout, Fault, io_error
from .posix import PosixBackend
from .striped import BlobOp, Block, StripedEngine

__all__ = ["KvikioBackend", "KvikioEngine", "kvikio_available"]


def kvikio_available() -> bool:
    """True when the kvikio package is installed (without importing it)."""
    return importlib.util.find_spec("kvikio") is not None


def _import_kvikio() -> Any:
    if not kvikio_available():
        raise ConfigError(
            "IOConfig.engine = 'kvikio': the kvikio package is not installed "
            "(pip install -e .[gpu]); use io.engine=posix or auto"
        )
    if not torch.cuda.is_available():
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

    Raises:
        ConfigError: kvikio is not installed, CUDA is not available, or a path is bad.
    """

    def __init__(self, config: OffloadConfig, rank: Optional[int] = None, fault: Optional[Fault] = None) -> None:
        kvikio = _import_kvikio()
        super().__init__(config, partial(KvikioBackend, kvikio=kvikio), rank, fault)


class KvikioBackend(BlockBackend):
    """Moves CUDA blocks with ``kvikio.CuFile`` and host blocks with a
    :class:`~megatron_ssd.io.posix.PosixBackend` of its own, whose staging pool and side
    streams also serve the device checksums (NOTE [Block backends]).

    Args:
        engine: the engine it serves.
        kvikio: the imported kvikio module.
    """

    def __init__(self, engine: StripedEngine, kvikio: Any) -> None:
        super().__init__(engine)
        self.kvikio = kvikio
        self.host = PosixBackend(engine)
        """The POSIX path: host tensors, staging buffers, CUDA ordering events."""
        self._cufiles: Dict[str, Any] = {}
        self._cufiles_lock = threading.Lock()

    # NOTE [CuFile lifetime]: in the extent layout each path has one file for the whole
    # run, so its CuFile is opened on first use and closed by close() after the workers
    # stopped. In the file layout a blob's files are unlinked on free (or on a failed
    # write) by code that does not know about CuFiles, so there a CuFile lives for one
    # block only.

    def _with_cufile(self, file: str, fn: Any) -> Any:
        if not isinstance(self.engine.layout, ExtentLayout):
            f = self.kvikio.CuFile(file, "r+")
            try:
                return fn(f)
            finally:
                f.close()
        with self._cufiles_lock:
            f = self._cufiles.get(file)
            if f is None:
                f = self._cufiles[file] = self.kvikio.CuFile(file, "r+")
        return fn(f)

    def _gds(self, op_name: str, block: Block, part: torch.Tensor) -> None:
        """One cuFile pwrite / pread of the block's payload; errors become OffloadIOError."""
        engine = self.engine
        token = engine.watch(op_name, block.file, block.offset, block.nbytes)
        try:
            if engine.fault is not None:
                err = engine.fault(op_name, block.file, block.offset, block.nbytes)
                if err is not None:
                    raise err
            call = (lambda f: f.pwrite(part, block.nbytes, block.offset)) if op_name == "write" else (
                lambda f: f.pread(part, block.nbytes, block.offset))
            with engine.io_slots:  # NOTE [I/O slots]
                moved = self._with_cufile(block.file, lambda f: call(f).get())
        except OffloadIOError:
            raise
        except OSError as e:
            raise io_error(op_name, block.file, block.offset, block.nbytes, e) from e
        except Exception as e:  # kvikio reports failures as RuntimeError
            raise io_error(op_name, block.file, block.offset, block.nbytes, OSError(errno.EIO, repr(e))) from e
        finally:
            engine.watch_end(token)
        if moved != block.nbytes:
            short = OSError(errno.EIO, f"short {op_name} ({moved} of {block.nbytes} bytes)")
            raise io_error(op_name, block.file, block.offset, block.nbytes, short)

    def _device_digest(self, part: torch.Tensor) -> int:
        """Checksum of CUDA bytes, through a pinned staging buffer (checksums cost a D2H copy)."""
        buf = self.host.pool.acquire()
        try:
            started = time.perf_counter()
            self.host.cuda_copy(buf[: part.numel()], part, part.device, None)
            value = digest(buf[: part.numel()].numpy())
            self.engine.count("checksum_s", time.perf_counter() - started)
            return value
        finally:
            self.host.pool.release(buf)

    def prepare(self, op: BlobOp) -> None:
        self.host.prepare(op)  # the CUDA event both paths order on (NOTE [CUDA ordering])

    def skew(self, src: torch.Tensor) -> int:
        return self.host.skew(src)

    def write_block(self, op: BlobOp, block: Block) -> None:
        src = op.tensor
        if not src.is_cuda:
            return self.host.write_block(op, block)
        # cuFile reads device memory outside stream order: wait on the host until the
        # kernels queued before write() produced the bytes (NOTE [CUDA ordering]).
        op.ready.synchronize()
        part = src[block.blob_offset : block.blob_offset + block.nbytes]
        self._gds("write", block, part)
        if op.checksum:
            block.checksum = self._device_digest(part)

    def read_block(self, op: BlobOp, block: Block) -> None:
        dst = op.tensor
        if not dst.is_cuda:
            return self.host.read_block(op, block)
        op.ready.synchronize()
        part = dst[block.blob_offset : block.blob_offset + block.nbytes]
        self._gds("read", block, part)
        if block.expected is not None:
            PosixBackend.verify(block, self._device_digest(part))

    def close(self) -> None:
        self.host.close()
        with self._cufiles_lock:
            files, self._cufiles = self._cufiles, {}
        for f in files.values():
            f.close()
