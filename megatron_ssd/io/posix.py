"""The POSIX engine: O_DIRECT ``pwrite`` / ``preadv`` from a pool of worker threads.

Works on every Linux machine; the syscalls release the GIL, so the workers keep
``io.threads`` requests in flight while Python (and the training step) runs on. ::

    cfg = OffloadConfig(paths=["/nvme0", "/nvme1"])
    with PosixEngine(cfg) as engine:
        handle = engine.write(blob).get()          # blob: 1-D uint8 tensor
        back = engine.read(handle, engine.alloc(handle.nbytes, blob.device)).get()
        engine.free(handle)

Data path of one block (see NOTE [Staging buffers]):

* CPU memory aligned as O_DIRECT needs (the device's DMA alignment from ``statx``;
  ALIGN when unknown) is written / read in place, with no copy; only a final partial
  page goes through a staging buffer. Other CPU memory is copied through an aligned
  staging buffer.
* CUDA memory goes through a pinned staging buffer, copied on a side stream that is
  ordered after the caller's stream (NOTE [CUDA ordering]).
"""

from __future__ import annotations

import errno
import os
import threading
import time
import zlib
from typing import Dict, Optional

import numpy as np
import torch

from ..config import OffloadConfig
from ..errors import ChecksumError, OffloadIOError
from .base import ALIGN, align_up
from .buffers import BufferPool, tensor_buffer
from .layout import Fault, io_error
from .striped import BlobOp, Block, StripedEngine

__all__ = ["PosixEngine"]


class PosixEngine(StripedEngine):
    """O_DIRECT thread-pool engine; see the module docstring.

    Args:
        config: Offload settings (``paths`` and ``io``).
        rank: Rank used in run directory names (default: torch.distributed, ``RANK``, 0).
        fault: Optional hook ``fault(op, path, offset, nbytes) -> Optional[OSError]``
            consulted before every disk operation; a returned error fails that request.
            For tests.

    Raises:
        ConfigError: no paths, or a path is missing, a symlink, not writable, or
            refuses O_DIRECT while ``io.direct`` is on.
    """

    def __init__(self, config: OffloadConfig, rank: Optional[int] = None, fault: Optional[Fault] = None) -> None:
        super().__init__(config, rank, fault)
        try:
            self._pool = BufferPool.from_config(config.io, pin=torch.cuda.is_available())
        except BaseException:
            self.close()
            raise
        self._mem_align = max(d.dio_mem_align for d in self._layout.run_dirs)
        self._streams: Dict[int, "torch.cuda.Stream"] = {}
        self._streams_lock = threading.Lock()

    # NOTE [Staging buffers]: the pool has one block-sized buffer per worker. A worker
    # acquires one for the part of a block it cannot move in place and releases it
    # before the block counts as done, on every path (try/finally). Any CUDA copy into
    # or out of it is synchronized before the release, so the next owner never races
    # a pending DMA. Padding up to ALIGN is zeroed so no stale memory reaches the disk.

    # NOTE [CUDA ordering]: at submit time ``_prepare`` records an event on the caller's
    # current stream. Side-stream copies wait on it: a write reads the tensor only
    # after the kernels that produced it, a read fills the destination only after the
    # work queued on its memory before the read was asked for. Every copy is
    # synchronized on the worker before the block is done, so a completed future means
    # the bytes are in place and no side-stream work still touches the tensor.

    def _prepare(self, op: BlobOp) -> None:
        t = op.tensor
        if t is not None and t.is_cuda:
            op.ready = torch.cuda.Event()
            op.ready.record(torch.cuda.current_stream(t.device))

    def _side_stream(self, device: torch.device) -> "torch.cuda.Stream":
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._streams_lock:
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = torch.cuda.Stream(device=index)
            return stream

    def _cuda_copy(self, dst: torch.Tensor, src: torch.Tensor, device: torch.device, ready: object) -> None:
        """``dst.copy_(src)`` on the side stream after event ``ready`` (if any); waits for it."""
        stream = self._side_stream(device)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()

    # ------------------------------------------------------------------------ syscalls

    def _transfer(self, op_name: str, fd: int, view: memoryview, file: str, offset: int) -> None:
        """Move all of ``view`` with pwrite / preadv, retrying short transfers."""
        done, total = 0, len(view)
        try:
            while done < total:
                if self.fault is not None:
                    err = self.fault(op_name, file, offset + done, total - done)
                    if err is not None:
                        raise err
                with self._io_slots:  # NOTE [I/O slots]
                    if op_name == "write":
                        n = os.pwrite(fd, view[done:], offset + done)
                    else:
                        n = os.preadv(fd, [view[done:]], offset + done)
                if n <= 0:
                    raise OSError(errno.EIO, f"short {op_name} ({done} of {total} bytes)")
                done += n
        except OffloadIOError:
            raise
        except OSError as e:
            raise io_error(op_name, file, offset + done, total - done, e) from e

    def _in_place(self, t: torch.Tensor, block: Block) -> int:
        """Bytes of ``block`` that can move straight from / into ``t`` (whole pages).

        O_DIRECT needs the memory aligned to what the device asks (``statx``
        STATX_DIOALIGN: often 4 bytes on NVMe, 512 on virtio; ALIGN when unknown), so
        ordinary PyTorch tensors, 64-byte aligned, move in place on most NVMe drives.
        """
        if t.is_cuda or (t.data_ptr() + block.blob_offset) % self._mem_align:
            return 0
        return block.nbytes - block.nbytes % ALIGN

    # -------------------------------------------------------------------------- blocks

    def _crc(self, view: memoryview, crc: int = 0) -> int:
        """``zlib.crc32(view, crc)``, its time added to the ``crc_s`` counter."""
        started = time.perf_counter()
        crc = zlib.crc32(view, crc)
        self._count("crc_s", time.perf_counter() - started)
        return crc

    def _write_block(self, op: BlobOp, block: Block) -> None:
        src = op.tensor
        fd = op.fds[block.file]
        crc = 0
        head = self._in_place(src, block)
        if head:
            view = tensor_buffer(src, block.blob_offset, head)
            if op.checksum:
                crc = self._crc(view)
            self._transfer("write", fd, view, block.file, block.offset)
            self._count("zero_copy_bytes", head)
        rest = block.nbytes - head
        if rest:
            buf = self._pool.acquire()  # NOTE [Staging buffers]
            try:
                part = src[block.blob_offset + head : block.blob_offset + block.nbytes]
                if src.is_cuda:
                    self._cuda_copy(buf[:rest], part, src.device, op.ready)
                else:
                    np.copyto(buf[:rest].numpy(), part.numpy())  # faster than copy_ for bytes
                padded = align_up(rest)
                buf[rest:padded].zero_()
                view = tensor_buffer(buf, 0, padded)
                if op.checksum:
                    crc = self._crc(view[:rest], crc)
                self._transfer("write", fd, view, block.file, block.offset + head)
            finally:
                self._pool.release(buf)
            self._count("staged_bytes", rest)
        if op.checksum:
            block.checksum = crc

    def _read_block(self, op: BlobOp, block: Block) -> None:
        dst = op.tensor
        fd = op.fds[block.file]
        crc = 0
        head = self._in_place(dst, block)
        if head:
            view = tensor_buffer(dst, block.blob_offset, head)
            self._transfer("read", fd, view, block.file, block.offset)
            if block.expected is not None:
                crc = self._crc(view)
            self._count("zero_copy_bytes", head)
        rest = block.nbytes - head
        if rest:
            buf = self._pool.acquire()  # NOTE [Staging buffers]
            try:
                view = tensor_buffer(buf, 0, align_up(rest))
                self._transfer("read", fd, view, block.file, block.offset + head)
                if block.expected is not None:
                    crc = self._crc(view[:rest], crc)
                    self._verify(block, crc)  # before the bytes reach dst
                part = dst[block.blob_offset + head : block.blob_offset + block.nbytes]
                if dst.is_cuda:
                    self._cuda_copy(part, buf[:rest], dst.device, op.ready)
                else:
                    np.copyto(part.numpy(), buf[:rest].numpy())
            finally:
                self._pool.release(buf)
            self._count("staged_bytes", rest)
        if block.expected is not None and not rest:
            self._verify(block, crc)

    @staticmethod
    def _verify(block: Block, crc: int) -> None:
        if crc != block.expected:
            raise ChecksumError(
                f"checksum mismatch reading {block.file} at offset {block.offset} "
                f"({block.nbytes} bytes): expected CRC32 {block.expected:#010x}, got {crc:#010x}"
            )
