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
* CUDA memory is copied device-to-host into pinned host memory on the write stream,
  ordered after the caller's stream (NOTE [CUDA ordering]): at submit into the staging
  ring as far as it has room (NOTE [Staging ring]), the other blocks into a worker's
  staging buffer just before their write. Reads land in a staging buffer and are copied
  host-to-device on the high-priority read stream (NOTE [Copy streams]).
"""

from __future__ import annotations

import errno
import os
import time
from typing import List, Optional, Tuple

import torch

from ..config import OffloadConfig
from ..errors import ChecksumError, OffloadIOError
from .base import ALIGN, align_up
from .buffers import BufferPool, copy_bytes, tensor_buffer
from .checksum import ALGORITHM, format_digest, new_digest
from .cuda import CudaOps
from .layout import Fault, io_error
from .backend import BlockBackend, BlockServices
from .blocks import BlobOp, Block
from .striped import StripedEngine

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
        cuda: The CUDA calls to make (default: the real ones; tests pass a fake).

    Raises:
        ConfigError: no paths, or a path is missing, a symlink, not writable, or
            refuses O_DIRECT while ``io.direct`` is on.
    """

    def __init__(self, config: OffloadConfig, rank: Optional[int] = None, fault: Optional[Fault] = None,
                 cuda: Optional[CudaOps] = None) -> None:
        super().__init__(config, PosixBackend, rank, fault, cuda)


class PosixBackend(BlockBackend):
    """Moves blocks with ``pwrite`` / ``preadv`` (NOTE [Block backends]): host memory in
    place where it is aligned as the device needs, the rest and CUDA memory through
    pinned staging.

    Args:
        services: what it uses of the engine it serves (its ``io`` settings, layout,
            slots, watchdog, CUDA calls and copy streams).
        staging: Allocate the pinned staging for CUDA tensors (ring and page-locked
            worker buffers) where CUDA tensors may come; False for a backend that only
            ever moves host memory.
    """

    SKEW_MIN_BYTES = 1 << 20
    """Blobs smaller than this are staged whole rather than skewed: below it one copy
    costs less than the two extra page-sized requests for the head and the tail (256 KiB
    blobs ran at 55% of ``dd`` staged and 27-29% skewed on the reference machine's
    virtual disk)."""

    def __init__(self, services: BlockServices, staging: bool = True) -> None:
        super().__init__(services)
        io = services.io
        self.cuda = services.cuda
        gpu = staging and services.cuda_offload
        self.pool = BufferPool.from_config(io, pin=gpu, cuda=self.cuda)
        """Block-sized staging buffers, one per worker (NOTE [Staging buffers])."""
        slices = io.staging_ring_slices() if gpu else 0
        self.ring: Optional[BufferPool] = BufferPool(slices, io.block_bytes, pin=True, cuda=self.cuda) if slices \
            else None
        """The staging ring: pinned block slices CUDA writes are copied into at submit
        (NOTE [Staging ring]); None without CUDA or with ``io.staging_ring_bytes`` 0."""
        self.mem_align = max(d.dio_mem_align for d in services.layout.run_dirs)
        """The memory alignment O_DIRECT needs on these paths (``statx``)."""

    # NOTE [Staging buffers]: the pool has one block-sized buffer per worker. A worker
    # acquires one for the part of a block it cannot move in place and releases it
    # before the block counts as done, on every path (try/finally). Any CUDA copy into
    # or out of it is synchronized before the release, so the next owner never races
    # a pending DMA. The skew before the payload (NOTE [Skewed blocks]) and the padding
    # after it, up to ALIGN, are zeroed so no stale memory reaches the disk.

    # NOTE [CUDA ordering]: at submit time ``prepare`` records a blocking event on the
    # caller's current stream (``op.ready``), on the caller's thread. Copy-stream copies
    # wait on it: a write reads the tensor only after the kernels that produced it, a
    # read fills a destination that is not fresh (NOTE [Fresh read buffers]) only after
    # the work queued on it before the read was asked for. A write's source is marked
    # used by the write stream (``record_stream``), so if its owner frees the storage
    # (Megatron's ``resize_(0)``) while a copy is queued, the caching allocator reuses the
    # memory only after the copy. Every copy is waited for on the worker (a blocking
    # event: the thread sleeps) before its staging memory is written to disk or reused,
    # and a read's future completes only after its last copy, so the destination's
    # bytes are in place on every stream once ``get()`` returns.

    # NOTE [Copy streams]: writes copy device-to-host on one stream per device, reads
    # host-to-device on another of high priority (``CopyStreams``): a read that backward
    # waits for never queues behind the forward pass's writes, and the copy engines run
    # both directions at once. Both are created under their device, and every CUDA call
    # a worker makes runs under the tensor's device (NOTE [CUDA threads] in ``cuda.py``).

    # NOTE [Staging ring]: a pinned region allocated once (``io.staging_ring_bytes``, at
    # most ``io.max_inflight_bytes``), cut into ``block_bytes`` slices. At submit, on the
    # caller's thread, a CUDA write takes as many free slices as it has blocks, without
    # waiting, and queues its first blocks' device-to-host copies into them on the write
    # stream (after ``op.ready``), followed by one event. The first worker to wait for that
    # event counts those blocks staged. Blocks that found no slice (the ring is full, or
    # the blob is larger) are copied by their worker into its own staging buffer just
    # before their write, as each comes up. When every block is in host memory, before any
    # error or cancel, the engine drops the source and stages the future early (NOTE
    # [Staged writes] in ``base.py``, NOTE [Failed staged writes] in ``recovery.py``): the
    # caller may free the device memory then, at PCIe speed, while
    # the workers still write the slices, each slice going back to the ring after its
    # block's write. The caller never waits for the ring, and a worker never waits for a
    # slice (it has its own buffer), so the ring cannot deadlock; the in-flight bound
    # (NOTE [Backpressure]) still bounds what is queued.

    # NOTE [Fresh read buffers]: ``alloc`` allocates a CUDA read buffer on the read
    # stream and records it as fresh; its read (the first only) does not wait for the
    # caller's stream, since nothing there touches it: backward's prefetch does not wait
    # for the kernels already queued. Any other CUDA destination waits for ``op.ready``
    # and is marked used by the read stream (``record_stream``).

    def prepare(self, op: BlobOp) -> None:
        dev = op.device
        if dev is None:
            return
        cuda = self.cuda
        with cuda.device(dev):
            if op.kind == "read":
                if self.services.fresh.claim(op.tensor):  # NOTE [Fresh read buffers]
                    return
                op.ready = cuda.event()
                op.ready.record(cuda.current_stream(dev))
                cuda.record_stream(op.tensor, self.services.streams.h2d(dev))
                return
            op.ready = cuda.event()  # NOTE [CUDA ordering]
            op.ready.record(cuda.current_stream(dev))
            d2h = self.services.streams.d2h(dev)
            cuda.record_stream(op.tensor, d2h)
            self._stage_into_ring(op, d2h)

    def _stage_into_ring(self, op: BlobOp, d2h: object) -> None:
        """Queue the copies of ``op``'s first blocks into free ring slices (NOTE [Staging ring])."""
        if self.ring is None:
            return
        slices = self.ring.try_acquire(len(op.blocks))
        if not slices:
            return
        cuda, src = self.cuda, op.tensor
        try:
            with cuda.use_stream(d2h):
                d2h.wait_event(op.ready)  # type: ignore[attr-defined]
                for block, buf in zip(op.blocks, slices):
                    block.staging = buf
                    cuda.copy(buf[: block.nbytes], src[block.blob_offset : block.blob_offset + block.nbytes])
                op.copied = cuda.event()
                op.copied.record(d2h)
        except BaseException:
            try:  # the copies queued before the failure must end before the slices go back
                with cuda.use_stream(d2h):
                    drained = cuda.event()
                    drained.record(d2h)
                drained.synchronize()
            except BaseException:  # noqa: BLE001 - CUDA itself failed: the first error is the one to raise
                pass
            for block in op.blocks:
                block.staging = None
            for buf in slices:
                self.ring.release(buf)
            raise
        op.ring_blocks = len(slices)
        self.services.count("ring_staged_bytes", sum(b.nbytes for b in op.blocks[: len(slices)]))

    def _ring_copied(self, op: BlobOp) -> None:
        """Wait for ``op``'s submit-time ring copies; the first to see them done counts
        those blocks staged."""
        if op.ring_synced:
            return
        with self.cuda.device(op.device):
            op.copied.synchronize()
        with op.lock:
            first, op.ring_synced = not op.ring_synced, True
        if first:
            self.services.blocks_staged(op, op.ring_blocks)

    def _copy_out(self, op: BlobOp, block: Block, buf: torch.Tensor) -> None:
        """Copy ``block`` of ``op``'s CUDA source into ``buf`` on the write stream and wait
        for it (NOTE [CUDA ordering]); the source is referenced only in here."""
        dev = op.device
        cuda = self.cuda
        with cuda.device(dev):
            d2h = self.services.streams.d2h(dev)
            with cuda.use_stream(d2h):
                d2h.wait_event(op.ready)
                cuda.copy(buf[: block.nbytes], op.tensor[block.blob_offset : block.blob_offset + block.nbytes])
                done = cuda.event()
                done.record(d2h)
            done.synchronize()

    def _copy_in(self, op: BlobOp, lo: int, hi: int, buf: torch.Tensor) -> None:
        """Copy ``buf`` into bytes ``[lo, hi)`` of ``op``'s CUDA destination on the read
        stream and wait for it (NOTE [CUDA ordering])."""
        dev = op.device
        cuda = self.cuda
        with cuda.device(dev):
            h2d = self.services.streams.h2d(dev)
            with cuda.use_stream(h2d):
                if op.ready is not None:
                    h2d.wait_event(op.ready)
                cuda.copy(op.tensor[lo:hi], buf)
                done = cuda.event()
                done.record(h2d)
            done.synchronize()

    def discard_block(self, op: BlobOp, block: Block) -> None:
        # a skipped block never copied is not staged: the write is staged as it completes
        if op.device is None or op.kind != "write" or block.staging is None:
            return
        buf, block.staging = block.staging, None  # its copy may still run: wait before it goes back
        try:
            self._ring_copied(op)
            self.services.keep_bytes(op, block, buf[: block.nbytes])  # NOTE [Failed staged writes]
        finally:
            self.ring.release(buf)  # type: ignore[union-attr]

    # ------------------------------------------------------------------------ syscalls

    def transfer(self, op_name: str, fd: int, view: memoryview, file: str, offset: int) -> None:
        """Move all of ``view`` with pwrite / preadv, retrying short transfers."""
        done, total = 0, len(view)
        services = self.services
        token = services.watch(op_name, file, offset, total)
        try:
            while done < total:
                if services.fault is not None:
                    err = services.fault(op_name, file, offset + done, total - done)
                    if err is not None:
                        raise err
                with services.io_slots:  # NOTE [I/O slots]
                    if op_name == "write":
                        n = os.pwrite(fd, view[done:], offset + done)
                    else:
                        n = os.preadv(fd, [view[done:]], offset + done)
                if n <= 0:
                    raise OSError(errno.EIO, f"short {op_name} ({done} of {total} bytes)")
                done += n
                services.watch_progress(token, offset + done, total - done)
        except OffloadIOError:
            raise
        except OSError as e:
            raise io_error(op_name, file, offset + done, total - done, e) from e
        finally:
            services.watch_end(token)

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
        if (src.numel() < self.SKEW_MIN_BYTES or self.cuda.device_of(src) is not None
                or src.data_ptr() % self.mem_align == 0):
            return 0
        return src.data_ptr() % ALIGN

    def _segments(self, op: BlobOp, block: Block) -> List[Tuple[int, int, int, int, bool]]:
        """The pieces one block moves in: ``(lo, hi, disk_offset, lead, in_place)``.

        Payload bytes ``[lo, hi)`` of the block go to / come from ``disk_offset``, behind
        ``lead`` zero bytes; ``in_place`` pieces move straight from / into ``op.tensor``
        (whole pages of host memory at an address the device accepts), the others
        through a staging buffer, which each fits. See NOTE [Skewed blocks].
        """
        nb, skew = block.nbytes, block.skew
        head = min(nb, ALIGN - skew) if skew else 0
        pieces = [(0, head, block.offset, skew, False)] if head else []
        disk = block.offset + (ALIGN if head else 0)
        body = (nb - head) - (nb - head) % ALIGN
        if (body and op.device is None
                and (op.tensor.data_ptr() + block.blob_offset + head) % self.mem_align == 0):  # type: ignore[union-attr]
            pieces.append((head, head + body, disk, 0, True))
            if head + body < nb:
                pieces.append((head + body, nb, disk + body, 0, False))
        elif head < nb:
            pieces.append((head, nb, disk, 0, False))
        return pieces

    # -------------------------------------------------------------------------- blocks

    def _digest(self, d: object, view: memoryview, offset: int) -> None:
        """``d.update(view, offset)``, its time added to the ``checksum_s`` counter."""
        started = time.perf_counter()
        d.update(view, offset)  # type: ignore[attr-defined]
        self.services.count("checksum_s", time.perf_counter() - started)

    def write_block(self, op: BlobOp, block: Block) -> None:
        if op.device is not None:
            return self._write_cuda_block(op, block)
        src = op.tensor
        fd = block.fd
        d = new_digest(ALGORITHM) if op.checksum else None
        for lo, hi, disk, lead, in_place in self._segments(op, block):
            n = hi - lo
            if in_place:
                view = tensor_buffer(src, block.blob_offset + lo, n)
                if d is not None:
                    self._digest(d, view, lo)
                self.transfer("write", fd, view, block.file, disk)
                self.services.count("zero_copy_bytes", n)
                continue
            buf = self.pool.acquire()  # NOTE [Staging buffers]
            try:
                copy_bytes(buf[lead : lead + n], src[block.blob_offset + lo : block.blob_offset + hi])
                padded = align_up(lead + n)
                buf[:lead].zero_()
                buf[lead + n : padded].zero_()
                view = tensor_buffer(buf, 0, padded)
                if d is not None:
                    self._digest(d, view[lead : lead + n], lo)
                self.transfer("write", fd, view, block.file, disk)
            finally:
                self.pool.release(buf)
            self.services.count("staged_bytes", n)
        if d is not None:
            block.checksum, block.algo = d.value(), d.algorithm

    def _write_cuda_block(self, op: BlobOp, block: Block) -> None:
        """A block of a CUDA source: from its ring slice, or copied into a worker buffer
        now (NOTE [Staging ring]); then written from host memory."""
        if block.staging is not None:
            buf, pool = block.staging, self.ring
            block.staging = None
            try:
                self._ring_copied(op)
            except BaseException:
                pool.release(buf)  # type: ignore[union-attr]
                raise
        else:
            buf, pool = self.pool.acquire(), self.pool  # NOTE [Staging buffers]
            try:
                self._copy_out(op, block, buf)
            except BaseException:
                pool.release(buf)
                raise
            self.services.blocks_staged(op, 1)
        try:
            n = block.nbytes
            padded = align_up(n)
            buf[n:padded].zero_()
            view = tensor_buffer(buf, 0, padded)
            if op.checksum:
                d = new_digest(ALGORITHM)
                self._digest(d, view[:n], 0)
                block.checksum, block.algo = d.value(), d.algorithm
            try:
                self.transfer("write", block.fd, view, block.file, block.offset)
            except BaseException:
                self.services.keep_bytes(op, block, buf[:n])  # NOTE [Failed staged writes]
                raise
        finally:
            pool.release(buf)  # type: ignore[union-attr]
        self.services.count("staged_bytes", n)

    def read_block(self, op: BlobOp, block: Block) -> None:
        dst = op.tensor
        fd = block.fd
        d = new_digest(block.algo) if block.expected is not None else None
        pieces = self._segments(op, block)
        for i, (lo, hi, disk, lead, in_place) in enumerate(pieces):
            n = hi - lo
            if in_place:
                view = tensor_buffer(dst, block.blob_offset + lo, n)
                self.transfer("read", fd, view, block.file, disk)
                if d is not None:
                    self._digest(d, view, lo)
                self.services.count("zero_copy_bytes", n)
                continue
            buf = self.pool.acquire()  # NOTE [Staging buffers]
            try:
                view = tensor_buffer(buf, 0, align_up(lead + n))
                self.transfer("read", fd, view, block.file, disk)
                if d is not None:
                    self._digest(d, view[lead : lead + n], lo)
                if op.device is not None:
                    if d is not None and i == len(pieces) - 1:
                        self.verify(block, d.value())  # a CUDA block's bytes go to the device checked
                        d = None
                    self._copy_in(op, block.blob_offset + lo, block.blob_offset + hi, buf[lead : lead + n])
                else:
                    copy_bytes(dst[block.blob_offset + lo : block.blob_offset + hi], buf[lead : lead + n])
            finally:
                self.pool.release(buf)
            self.services.count("staged_bytes", n)
        if d is not None:
            self.verify(block, d.value())

    @staticmethod
    def verify(block: Block, value: int) -> None:
        if value != block.expected:
            raise ChecksumError(
                f"checksum mismatch reading {block.file} at offset {block.offset} "
                f"({block.nbytes} bytes): expected {block.algo} {format_digest(block.expected)}, "
                f"got {format_digest(value)}"
            )

    def close(self) -> None:
        # the workers stopped and waited for every copy they queued: unpin
        self.pool.close()
        if self.ring is not None:
            self.ring.close()
