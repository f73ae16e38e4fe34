"""The POSIX engine: O_DIRECT ``pwrite`` / ``preadv`` from a pool of worker threads.

Works on every Linux machine; the syscalls release the GIL, so the workers keep
``io.threads`` requests in flight while Python (and the training step) runs on. ::

    cfg = OffloadConfig(paths=["/nvme0", "/nvme1"])
    with PosixEngine(cfg) as engine:
        handle = engine.write(blob).get()          # blob: 1-D uint8 tensor
        back = engine.read(handle, engine.alloc(handle.nbytes, blob.device, handle)).get()
        engine.free(handle)

Data path of one block (see NOTE [Staging buffers]):

* CPU memory is written / read in place, with no copy, except for at most one page at
  each end of a block: memory aligned as O_DIRECT needs (the device's DMA alignment from
  ``statx``; ALIGN when unknown) directly, other memory by writing the blob with a skew
  (NOTE [Skewed blocks]). The end pages go through an aligned staging buffer.
* CUDA memory goes through a pinned staging buffer, copied on a side stream that is
  ordered after the caller's stream (NOTE [CUDA ordering]).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from ..config import OffloadConfig
from ..errors import ChecksumError, OffloadIOError
from .base import ALIGN, align_up
from .buffers import BufferPool, tensor_buffer
from .checksum import ALGORITHM, Digest, format_digest
from .layout import Fault, io_error
from .backend import BlockBackend
from .striped import BlobOp, Block, StripedEngine

__all__ = ["PosixBackend", "PosixEngine"]


class PosixEngine(StripedEngine):
    """O_DIRECT thread-pool engine: a :class:`StripedEngine` whose blocks move with
    :class:`PosixBackend`; see the module docstring.

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
        super().__init__(config, PosixBackend, rank, fault)


class PosixBackend(BlockBackend):
    """Moves blocks with ``pwrite`` / ``preadv`` (NOTE [Block backends]): host memory in
    place where it is aligned as the device needs, the rest and CUDA memory through
    pinned staging buffers.

    Args:
        engine: the engine it serves (its ``io`` settings, layout, slots and watchdog).
    """

    SKEW_MIN_BYTES = 1 << 20
    """Blobs smaller than this are staged whole rather than skewed: below it one copy
    costs less than the two extra page-sized requests for the head and the tail (256 KiB
    blobs ran at 55% of ``dd`` staged and 27-29% skewed on the reference machine's
    virtual disk)."""

    def __init__(self, engine: StripedEngine) -> None:
        super().__init__(engine)
        self.pool = BufferPool.from_config(engine.io, pin=torch.cuda.is_available())
        """Block-sized staging buffers, one per worker (NOTE [Staging buffers])."""
        self.mem_align = max(d.dio_mem_align for d in engine.layout.run_dirs)
        """The memory alignment O_DIRECT needs on these paths (``statx``)."""
        self._streams: Dict[int, "torch.cuda.Stream"] = {}
        self._streams_lock = threading.Lock()

    # NOTE [Staging buffers]: the pool has one block-sized buffer per worker. A worker
    # acquires one for the part of a block it cannot move in place and releases it
    # before the block counts as done, on every path (try/finally). Any CUDA copy into
    # or out of it is synchronized before the release, so the next owner never races
    # a pending DMA. The skew before the payload (NOTE [Skewed blocks]) and the padding
    # after it, up to ALIGN, are zeroed so no stale memory reaches the disk.

    # NOTE [CUDA ordering]: at submit time ``prepare`` records an event on the caller's
    # current stream. Side-stream copies wait on it: a write reads the tensor only
    # after the kernels that produced it, a read fills the destination only after the
    # work queued on its memory before the read was asked for. Every copy is
    # synchronized on the worker before the block is done, so a completed future means
    # the bytes are in place and no side-stream work still touches the tensor.

    def prepare(self, op: BlobOp) -> None:
        t = op.tensor
        if t is not None and t.is_cuda:
            op.ready = torch.cuda.Event()
            op.ready.record(torch.cuda.current_stream(t.device))

    def side_stream(self, device: torch.device) -> "torch.cuda.Stream":
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._streams_lock:
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = torch.cuda.Stream(device=index)
            return stream

    def cuda_copy(self, dst: torch.Tensor, src: torch.Tensor, device: torch.device, ready: object) -> None:
        """``dst.copy_(src)`` on the side stream after event ``ready`` (if any); waits for it."""
        stream = self.side_stream(device)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()

    # ------------------------------------------------------------------------ syscalls

    def transfer(self, op_name: str, fd: int, view: memoryview, file: str, offset: int) -> None:
        """Move all of ``view`` with pwrite / preadv, retrying short transfers."""
        done, total = 0, len(view)
        engine = self.engine
        token = engine.watch(op_name, file, offset, total)
        try:
            while done < total:
                if engine.fault is not None:
                    err = engine.fault(op_name, file, offset + done, total - done)
                    if err is not None:
                        raise err
                with engine.io_slots:  # NOTE [I/O slots]
                    if op_name == "write":
                        n = os.pwrite(fd, view[done:], offset + done)
                    else:
                        n = os.preadv(fd, [view[done:]], offset + done)
                if n <= 0:
                    raise OSError(errno.EIO, f"short {op_name} ({done} of {total} bytes)")
                done += n
                engine.watch_progress(token, offset + done, total - done)
        except OffloadIOError:
            raise
        except OSError as e:
            raise io_error(op_name, file, offset + done, total - done, e) from e
        finally:
            engine.watch_end(token)

    # NOTE [Skewed blocks]: PyTorch's CPU allocator aligns tensors to 64 bytes, and
    # O_DIRECT needs the memory aligned as the device asks (``statx`` STATX_DIOALIGN:
    # often 4 bytes on NVMe, 512 on virtio; ALIGN when unknown). A blob whose memory is
    # not aligned so is written with a skew ``s`` = its address modulo ALIGN: its first
    # block's payload starts ``s`` bytes into that block's first disk page and is
    # ``block_bytes - s`` long, so every later block starts at an ALIGN-aligned address.
    # Memory and disk offsets then agree modulo ALIGN, and only two pieces per blob go
    # through a staging buffer: the head (the first ALIGN - s payload bytes, behind s
    # zero bytes) and the partial last page. Every whole page in between moves straight
    # from the tensor. ``alloc(nbytes, device, handle)`` gives reads a destination with
    # the same skew, so they move in place too (the head page is staged there as well:
    # its s zero bytes would land in front of the payload). The zero bytes before the
    # payload, like the padding after it, are written from the staging buffer: no byte
    # of memory outside the tensor ever reaches the disk.

    def skew(self, src: torch.Tensor) -> int:
        if src.numel() < self.SKEW_MIN_BYTES or src.is_cuda or src.data_ptr() % self.mem_align == 0:
            return 0
        return src.data_ptr() % ALIGN

    def _segments(self, t: torch.Tensor, block: Block) -> List[Tuple[int, int, int, int, bool]]:
        """The pieces one block moves in: ``(lo, hi, disk_offset, lead, in_place)``.

        Payload bytes ``[lo, hi)`` of the block go to / come from ``disk_offset``, behind
        ``lead`` zero bytes; ``in_place`` pieces move straight from / into ``t`` (whole
        pages at an address the device accepts), the others through a staging buffer,
        which each fits. See NOTE [Skewed blocks].
        """
        nb, skew = block.nbytes, block.skew
        head = min(nb, ALIGN - skew) if skew else 0
        pieces = [(0, head, block.offset, skew, False)] if head else []
        disk = block.offset + (ALIGN if head else 0)
        body = (nb - head) - (nb - head) % ALIGN
        if body and not t.is_cuda and (t.data_ptr() + block.blob_offset + head) % self.mem_align == 0:
            pieces.append((head, head + body, disk, 0, True))
            if head + body < nb:
                pieces.append((head + body, nb, disk + body, 0, False))
        elif head < nb:
            pieces.append((head, nb, disk, 0, False))
        return pieces

    # -------------------------------------------------------------------------- blocks

    def _digest(self, d: Digest, view: memoryview) -> None:
        """``d.update(view)``, its time added to the ``checksum_s`` counter."""
        started = time.perf_counter()
        d.update(view)
        self.engine.count("checksum_s", time.perf_counter() - started)

    def write_block(self, op: BlobOp, block: Block) -> None:
        src = op.tensor
        fd = block.fd
        d = Digest() if op.checksum else None
        for lo, hi, disk, lead, in_place in self._segments(src, block):
            n = hi - lo
            if in_place:
                view = tensor_buffer(src, block.blob_offset + lo, n)
                if d is not None:
                    self._digest(d, view)
                self.transfer("write", fd, view, block.file, disk)
                self.engine.count("zero_copy_bytes", n)
                continue
            buf = self.pool.acquire()  # NOTE [Staging buffers]
            try:
                part = src[block.blob_offset + lo : block.blob_offset + hi]
                if src.is_cuda:
                    self.cuda_copy(buf[lead : lead + n], part, src.device, op.ready)
                else:
                    np.copyto(buf[lead : lead + n].numpy(), part.numpy())  # faster than copy_ for bytes
                padded = align_up(lead + n)
                buf[:lead].zero_()
                buf[lead + n : padded].zero_()
                view = tensor_buffer(buf, 0, padded)
                if d is not None:
                    self._digest(d, view[lead : lead + n])
                self.transfer("write", fd, view, block.file, disk)
            finally:
                self.pool.release(buf)
            self.engine.count("staged_bytes", n)
        if d is not None:
            block.checksum = d.value()

    def read_block(self, op: BlobOp, block: Block) -> None:
        dst = op.tensor
        fd = block.fd
        d = Digest() if block.expected is not None else None
        for lo, hi, disk, lead, in_place in self._segments(dst, block):
            n = hi - lo
            part = dst[block.blob_offset + lo : block.blob_offset + hi]
            if in_place:
                view = tensor_buffer(dst, block.blob_offset + lo, n)
                self.transfer("read", fd, view, block.file, disk)
                if d is not None:
                    self._digest(d, view)
                self.engine.count("zero_copy_bytes", n)
                continue
            buf = self.pool.acquire()  # NOTE [Staging buffers]
            try:
                view = tensor_buffer(buf, 0, align_up(lead + n))
                self.transfer("read", fd, view, block.file, disk)
                if d is not None:
                    self._digest(d, view[lead : lead + n])
                if dst.is_cuda:
                    self.cuda_copy(part, buf[lead : lead + n], dst.device, op.ready)
                else:
                    np.copyto(part.numpy(), buf[lead : lead + n].numpy())
            finally:
                self.pool.release(buf)
            self.engine.count("staged_bytes", n)
        if d is not None:
            self.verify(block, d.value())

    @staticmethod
    def verify(block: Block, value: int) -> None:
        if value != block.expected:
            raise ChecksumError(
                f"checksum mismatch reading {block.file} at offset {block.offset} "
                f"({block.nbytes} bytes): expected {ALGORITHM} {format_digest(block.expected)}, "
                f"got {format_digest(value)}"
            )
