"""Machinery shared by the block engines: striping, completion, stats, and the parts
each engine composes.

A blob of ``n`` bytes is cut into blocks of ``io.block_bytes``; block ``i`` goes to path
``(start + i) % len(paths)`` (RAID0-like; ``start`` rotates per blob so small blobs
spread too). Each block is one task for a pool of workers (``io/workers.py``) that keeps
``io.threads`` requests in flight (NOTE [I/O slots]), so the blocks of one blob proceed in
parallel and the blob's future completes when the last is done. Reads overtake queued
writes: a prefetch must not wait behind the forward pass's offload traffic.
The engine holds three parts with one job each and delegates to them:
:class:`~megatron_ssd.io.admission.Admission` bounds the bytes of writes in flight
(NOTE [Backpressure]), :class:`~megatron_ssd.io.descriptors.Descriptors` lends each
transfer its file's descriptor (NOTE [Descriptors]), and
:class:`~megatron_ssd.io.recovery.Recovery` handles what did not go as asked: a failing
path leaves the rotation while another remains (NOTE [Failed paths]), failed and
cancelled writes, and frees that must not fail (NOTE [Freed once]).
How one block is written or read is a :class:`~megatron_ssd.io.backend.BlockBackend`'s
job (NOTE [Block backends]); the POSIX and kvikio backends are peers under this class.
Every CUDA call goes through the engine's :class:`~megatron_ssd.io.cuda.CudaOps` (``cuda``),
which tests replace with a recording fake.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import weakref
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..config import OffloadConfig
from ..errors import CacheStateError, ConfigError, OffloadIOError, WriteCancelled
from .admission import Admission
from .backend import BlockBackend, BlockServices
from .base import Engine, EngineStats, Extent, IOFuture, SwapHandle, align_up
from .blocks import BlobOp, Block, check_blob, check_read_target
from .cuda import CUDA, CopyStreams, CudaOps, FreshBuffers
from .descriptors import Descriptors
from .layout import Fault, Layout, make_layout
from .mapped import mapped_empty
from .recovery import Recovery
from .watchdog import StallWatchdog
from .workers import READ, WRITE, Workers

__all__ = ["Block", "BlobOp", "StripedEngine"]

logger = logging.getLogger(__name__)


class _AllocationFailed(Exception):
    """A write found no space for its blocks; its ``__cause__`` says why."""


def _shutdown(workers: Workers, layout: Layout, watchdog: Optional[StallWatchdog]) -> None:
    # The files go whatever stops the wait: an exception raised into it by a signal
    # handler (PyTorch's DataLoader raises "DataLoader worker ... is killed by signal" from
    # its SIGCHLD handler when a job's SIGTERM reached its workers too) left a SLURM rank's
    # run directory behind (NOTE [Exit cleanup] in cache/exit_guard.py).
    try:
        workers.shutdown()  # waits for the requests in flight; the watchdog still warns about stuck ones
    finally:
        try:
            layout.close()  # its unlinks are watched too
        finally:
            if watchdog is not None:
                watchdog.stop()


def _start(config: OffloadConfig, rank: Optional[int], fault: Optional[Fault]
           ) -> Tuple[Optional[StallWatchdog], Layout, Workers]:
    """The engine's watchdog (none when ``io.stall_warning_s`` is 0), its layout and its
    ``2 x io.threads`` workers, in that order: the watchdog first, so creating the run
    directories and files is watched too; where one fails to start, what started before
    it is stopped (no thread of ours is left running, no run directory left behind) and
    the error names the setting."""
    watchdog: Optional[StallWatchdog] = None
    if config.io.stall_warning_s > 0:
        try:
            watchdog = StallWatchdog(config.io.stall_warning_s)
        except Exception as e:
            raise OffloadIOError(f"cannot start the I/O engine's watchdog thread "
                                 f"(io.stall_warning_s = {config.io.stall_warning_s:g}): {e}") from e
    try:
        layout = make_layout(config.paths, config.io, rank, fault, watchdog)
    except BaseException:
        if watchdog is not None:
            watchdog.stop()
        raise
    try:
        workers = Workers(2 * config.io.threads, "megatron_ssd-io", config.io.priority)
    except BaseException as e:
        try:
            layout.close()
        finally:
            if watchdog is not None:
                watchdog.stop()
        if not isinstance(e, Exception):
            raise
        raise OffloadIOError(f"cannot start the I/O engine's {2 * config.io.threads} worker threads "
                             f"(io.threads = {config.io.threads}): {e}") from e
    return watchdog, layout, workers


class StripedEngine(Engine):
    """Block striping over a :class:`~megatron_ssd.io.layout.Layout` with a worker pool,
    blocks moved by a backend (NOTE [Block backends]).

    Args:
        config: Offload settings; ``config.paths`` and ``config.io`` are used.
        backend: builds the :class:`~megatron_ssd.io.backend.BlockBackend` from the
            engine's :class:`~megatron_ssd.io.backend.BlockServices` (the engine itself),
            once its layout and workers run.
        rank: Rank for run directory names (default: see ``resolve_rank``).
        fault: Optional fault-injection hook, see :data:`~megatron_ssd.io.layout.Fault`.
        cuda: The CUDA calls to make (default: the real ones; tests pass a fake).
    """

    def __init__(self, config: OffloadConfig, backend: Callable[[BlockServices], BlockBackend],
                 rank: Optional[int] = None, fault: Optional[Fault] = None, cuda: Optional[CudaOps] = None) -> None:
        if not config.paths:
            raise ConfigError("OffloadConfig.paths = []: must name at least one offload directory")
        self.config = config
        self.io = config.io
        self.fault = fault
        self.cuda = cuda if cuda is not None else CUDA
        """Every CUDA call the engine and its backend make (NOTE [CUDA threads])."""
        self.cuda_offload = self.cuda.is_available() and config.device != "cpu"
        """Whether CUDA tensors may come: pinned staging is allocated only then."""
        self.streams = CopyStreams(self.cuda)
        """The device-to-host and host-to-device copy streams (NOTE [Copy streams])."""
        self.fresh = FreshBuffers()
        """CUDA read buffers from :meth:`alloc` not read into yet (NOTE [Fresh read buffers])."""
        self._watchdog, self._layout, self._workers = _start(config, rank, fault)
        # NOTE [I/O slots]: io.threads is the number of requests kept in flight on the
        # disk. Twice as many workers run blocks, and a worker holds one of io.threads
        # slots only inside a syscall, so staging copies and checksums of the next
        # blocks overlap the transfers instead of leaving the disk idle between them.
        self.io_slots = threading.BoundedSemaphore(config.io.threads)
        """Held by a backend around each transfer: ``io.threads`` requests on the disks."""
        self._finalizer = weakref.finalize(self, _shutdown, self._workers, self._layout, self._watchdog)
        self.admission = Admission(config.io.max_inflight_bytes)
        """Bounds the bytes of writes in flight (NOTE [Backpressure])."""
        self.descriptors = Descriptors(self._layout)
        """Lends each transfer its file's descriptor (NOTE [Descriptors])."""
        self.recovery = Recovery(self._layout, self.descriptors)
        """Failed paths, failed and cancelled writes, frees that must not fail."""
        self._lock = threading.Lock()  # the stats, the live handles, the rotation's next path, the checksum switch
        self._closed = False
        self._stats = EngineStats(extra={"inflight_peak_bytes": 0, "zero_copy_bytes": 0, "staged_bytes": 0,
                                         "checksum_s": 0.0, "write_cpu_s": 0.0, "read_cpu_s": 0.0,
                                         "cancelled_write_bytes": 0, "ring_staged_bytes": 0})
        self._busy: Dict[str, List[float]] = {"write": [0, 0.0], "read": [0, 0.0]}  # [count, since]
        self._live: Dict[Any, int] = {}  # handle key -> reads in flight
        self._next_path = 0
        self._checksum = config.io.checksum != "off"
        if not self._checksum:
            logger.warning(
                "megatron_ssd: io.checksum = off: blocks read back from %s are not verified, so a corrupted "
                "byte on the drive would reach training unnoticed; remove the setting to verify them",
                ", ".join(config.paths),
            )
        try:
            self.backend = backend(self)
            """Moves the blocks (NOTE [Block backends])."""
        except BaseException:
            self.close()
            raise
        self._layout.on_unlink = self.backend.forget_file

    # ----------------------------------------------------------------------- interface

    @property
    def paths(self) -> Tuple[str, ...]:
        return self._layout.dirs

    @property
    def layout(self) -> Layout:
        """The on-disk layout (run directories, files, allocator)."""
        return self._layout

    def write(self, src: torch.Tensor, block: bool = True) -> Optional[IOFuture[SwapHandle]]:
        self._check_open()
        n = check_blob(src, "write(src)").numel()
        if n == 0:
            return IOFuture.completed(SwapHandle(0, ()))
        if not self.admission.admit(n, block):  # NOTE [Backpressure]
            return None
        try:
            op = self._write_op(src, n)
        except _AllocationFailed as e:  # reported through the future, like any failed write
            self.admission.release(n)
            with self._lock:
                self._stats.write_errors += 1
            fut: IOFuture[SwapHandle] = IOFuture(n)
            fut.set_error(self.recovery.allocation_failed(n, e.__cause__))
            return fut
        except BaseException:  # an interrupt: the admitted bytes go back (NOTE [Interrupted submissions])
            self.admission.release(n)
            raise
        self._submit(op, WRITE)
        return op.future

    def _write_op(self, src: torch.Tensor, n: int) -> BlobOp:
        """The op writing ``src`` over freshly allocated extents.

        Raises:
            _AllocationFailed: no space for it (its cause says why).
        """
        fut: IOFuture[SwapHandle] = IOFuture(n)
        bb = self.io.block_bytes
        healthy = self.recovery.healthy()  # NOTE [Failed paths]
        with self._lock:
            start, self._next_path = self._next_path, self._next_path + 1
            checksum = self._checksum
        skew = self.backend.skew(src)  # NOTE [Skewed blocks]: only the first block is skewed
        starts = [0, *range(bb - skew, n, bb)] if skew else list(range(0, n, bb))
        ends = [*starts[1:], n]
        plan = [(off, end - off, healthy[(start + i) % len(healthy)]) for i, (off, end) in enumerate(zip(starts, ends))]
        skews = [skew] + [0] * (len(plan) - 1)
        try:
            where = self._layout.allocate([(p, align_up(k + nb)) for (_, nb, p), k in zip(plan, skews)])
        except Exception as e:
            raise _AllocationFailed() from e
        blocks = [Block(off, nb, p, f, o, skew=k) for (off, nb, p), (f, o), k in zip(plan, where, skews)]
        with self._lock:
            self._stats.disk_bytes += sum(b.length for b in blocks)
        op = BlobOp("write", src, blocks, fut, device=self.cuda.device_of(src), checksum=checksum,
                    unstaged=len(blocks))
        fut.on_cancel(partial(self.recovery.cancel, op))  # NOTE [Cancelled writes] in recovery.py
        return op

    def read(self, handle: SwapHandle, dst: torch.Tensor) -> IOFuture[torch.Tensor]:
        self._check_open()
        check_read_target(handle, dst)
        fut: IOFuture[torch.Tensor] = IOFuture(handle.nbytes)
        if handle.nbytes == 0:
            fut.set_result(dst)
            return fut
        key = self._key(handle)
        with self._lock:
            if key not in self._live:
                raise CacheStateError("read of a handle this engine does not hold (freed, or from another engine)")
            self._live[key] += 1
        ends = [e.blob_offset for e in handle.extents[1:]] + [handle.nbytes]
        blocks = [
            Block(e.blob_offset, end - e.blob_offset, e.path_index, e.file or "", e.offset, expected=e.checksum,
                  skew=e.skew, algo=e.checksum_algo)
            for e, end in zip(handle.extents, ends)
        ]
        self._submit(BlobOp("read", dst, blocks, fut, device=self.cuda.device_of(dst), key=key), READ)
        return fut

    def alloc(self, nbytes: int, device: torch.device, handle: Optional[SwapHandle] = None) -> torch.Tensor:
        device = torch.device(device)
        if device.type == "cpu":  # NOTE [Mapped read buffers]: unmapped, not kept by the heap, when freed
            skew = handle.extents[0].skew if handle is not None and handle.extents else 0
            return mapped_empty(skew + nbytes)[skew : skew + nbytes]
        # NOTE [Fresh read buffers]: allocated on the read stream, filled without waiting
        # for the caller's stream; its consumer calls record_stream (the Engine contract)
        dev = self.cuda.resolve(device)
        with self.cuda.device(dev), self.cuda.use_stream(self.streams.h2d(dev)):
            buf = self.cuda.empty(align_up(max(nbytes, 1)), dev)
        self.fresh.add(buf)
        return buf[:nbytes]

    def free(self, handle: SwapHandle) -> None:
        if not handle.extents:
            return
        key = self._key(handle)
        with self._lock:
            reads = self._live.get(key)
            if reads is None:
                raise CacheStateError("free of a handle this engine does not hold (freed twice?)")
            if reads:
                raise CacheStateError(f"free of a handle with {reads} read(s) in flight")
            del self._live[key]
            self._stats.disk_bytes -= handle.disk_bytes
        self.recovery.free(handle.extents)  # NOTE [Freed once] in recovery.py: forgotten first, never fails

    def stats(self) -> EngineStats:
        with self._lock:
            snap = copy.deepcopy(self._stats)
            now = time.perf_counter()
            for kind, (count, since) in self._busy.items():
                if count:
                    setattr(snap, f"{kind}_busy_s", getattr(snap, f"{kind}_busy_s") + now - since)
            snap.cpu_s = snap.extra["write_cpu_s"] + snap.extra["read_cpu_s"]
            inflight, snap.extra["inflight_peak_bytes"], snap.backpressure_wait_s = self.admission.snapshot()
            snap.extra["inflight_bytes"] = inflight
            snap.extra["live_blobs"] = len(self._live)
            snap.extra["checksum"] = "on" if self._checksum else "off"
        snap.extra["failed_paths"] = self.recovery.failed_paths()
        return snap

    def set_checksum(self, enabled: bool) -> None:
        with self._lock:
            self._checksum = bool(enabled)

    def close(self) -> None:
        with self._lock:
            already = self._closed
            self._closed = True
        self.admission.close()  # wakes the writers held back; they raise
        self._finalizer()
        backend = getattr(self, "backend", None)
        if backend is not None and not already:
            backend.close()

    # ------------------------------------------------------------------ implementation

    def _check_open(self) -> None:
        if self._closed:
            raise OffloadIOError("the I/O engine is closed")

    @staticmethod
    def _key(handle: SwapHandle) -> Tuple[Optional[str], int]:
        first = handle.extents[0]
        return (first.file, first.offset)

    def _busy_change(self, kind: str, delta: int) -> None:
        # Busy time is the union of intervals with >= 1 op of this kind in flight.
        now = time.perf_counter()
        entry = self._busy[kind]
        if delta > 0 and entry[0] == 0:
            entry[1] = now
        entry[0] += delta
        if delta < 0 and entry[0] == 0:
            setattr(self._stats, f"{kind}_busy_s", getattr(self._stats, f"{kind}_busy_s") + now - entry[1])

    # NOTE [Interrupted submissions]: writes and reads are submitted on the training
    # thread, where Ctrl-C raises KeyboardInterrupt wherever Python code runs. What
    # fails in a submission (a backend's preparation) fails the op through its future,
    # like a failed transfer, and the cache copes (a failed write keeps its tensor in
    # memory). An interrupt must not be handled so: turned into a failed write, it was
    # one more warning and training went on, Ctrl-C lost (found by interrupting a step
    # at each point in turn: tests/reliability/test_reliability_interruptible.py). So an
    # interrupt in a write before its op exists gives the admitted bytes back, one in a
    # backend's preparation ends the op (a write as cancelled, a read as failed: its
    # extents and in-flight bytes are freed) and both are raised again. The caller gets
    # no future. One between two blocks' submissions leaves the queued blocks to run and
    # the op unfinished, which nothing waits for: the engine's close runs what is queued.

    def _submit(self, op: BlobOp, priority: int) -> None:
        op.remaining = len(op.blocks)
        with self._lock:
            self._busy_change(op.kind, +1)
        try:
            self.backend.prepare(op)
        except BaseException as e:
            interrupted = not isinstance(e, Exception)
            if interrupted and op.kind == "write":  # NOTE [Interrupted submissions]
                op.skipped_bytes = op.future.nbytes
                for b in op.blocks:  # staging the preparation had given them goes back
                    self._discard_block(op, b)
            else:
                op.error = e
            op.remaining = 1
            self._block_done(op)
            if interrupted:
                raise
            return
        for b in op.blocks:
            self._workers.submit(priority, self._run_block, op, b)

    def _run_block(self, op: BlobOp, block: Block) -> None:
        started = time.thread_time()
        if op.error is None and op.cancelled:  # NOTE [Cancelled writes] in recovery.py
            with op.lock:
                op.skipped_bytes += block.nbytes
            self._discard_block(op, block)
        elif op.error is not None:  # blocks after a failed one are skipped
            self._discard_block(op, block)
        else:
            try:
                with self.descriptors.held(block):  # NOTE [Descriptors]
                    if op.kind == "write":
                        self.backend.write_block(op, block)
                        block.written = True
                    else:
                        self.backend.read_block(op, block)
            except BaseException as e:
                with op.lock:
                    if op.error is None:
                        op.error = e
                        op.failed_path = block.path_index
        self._block_done(op)
        # every worker task is a block: its CPU time, completion callbacks included,
        # is the engine's cpu_s (EngineStats), split by direction
        self.count(f"{op.kind}_cpu_s", time.thread_time() - started)

    def _discard_block(self, op: BlobOp, block: Block) -> None:
        try:
            self.backend.discard_block(op, block)
        except BaseException as e:
            with op.lock:
                if op.error is None:
                    op.error = e
                    op.failed_path = block.path_index

    def _block_done(self, op: BlobOp) -> None:
        with op.lock:
            op.remaining -= 1
            if op.remaining:
                return
        try:
            self._finish(op)
        except BaseException as e:  # completing must never leave a future hanging
            op.future.set_error(e)

    def _finish(self, op: BlobOp) -> None:
        # NOTE [Blob completion]: runs once, on the worker that finished the blob's last
        # block, so no block of it can still touch its file space or its tensor.
        # Order: on a failed write free the extents (only now: an earlier
        # free could hand them to another blob while a block of this one still writes);
        # release in-flight bytes so blocked writers proceed; drop the tensor; complete
        # the future. Done-callbacks run on this worker thread: they must not block on
        # this engine (a blocking write there can wait for workers that never come).
        error = self.recovery.outcome(op, self.backend.read_block)  # failed, cancelled, its host copy
        result: Any = None
        if op.kind == "write":
            if error is not None:
                self._layout.free([self._extent(b) for b in op.blocks])
            else:
                result = SwapHandle(op.future.nbytes, tuple(self._extent(b) for b in op.blocks))
            self.admission.release(op.future.nbytes)  # NOTE [Backpressure]
        with self._lock:
            self._busy_change(op.kind, -1)
            if op.kind == "write" and error is None:
                self._stats.bytes_written += op.future.nbytes
                self._live[self._key(result)] = 0
            elif op.kind == "write":
                if isinstance(error, WriteCancelled):  # the blocks that started did reach the disk
                    self._stats.extra["cancelled_write_bytes"] += op.skipped_bytes
                    self._stats.bytes_written += op.future.nbytes - op.skipped_bytes
                else:
                    self._stats.write_errors += 1
                self._stats.disk_bytes -= sum(b.length for b in op.blocks)
            else:
                self._live[op.key] -= 1
                if error is None:
                    self._stats.bytes_read += op.future.nbytes
                    result = op.tensor
                else:
                    self._stats.read_errors += 1
        op.tensor = None
        if error is not None:
            op.future.set_error(error)
        else:
            op.future.set_result(result)

    @staticmethod
    def _extent(b: Block) -> Extent:
        return Extent(b.path_index, b.offset, b.length, b.blob_offset, b.file, b.checksum, b.skew, b.algo)

    # ------------------------------------------------------------------ for backends

    def watch(self, op: str, file: str, offset: int, nbytes: int) -> Optional[int]:
        """Register a disk request with the stall watchdog (``io.stall_warning_s``); the
        token for :meth:`watch_progress` and :meth:`watch_end`."""
        return None if self._watchdog is None else self._watchdog.begin(op, file, offset, nbytes)

    def watch_progress(self, token: Optional[int], offset: int, nbytes: int) -> None:
        """The request ``token`` moved on: ``nbytes`` left from ``offset``."""
        if token is not None:
            self._watchdog.progress(token, offset, nbytes)  # type: ignore[union-attr]

    def watch_end(self, token: Optional[int]) -> None:
        """The request ``token`` ended."""
        if token is not None:
            self._watchdog.end(token)  # type: ignore[union-attr]

    def keep_bytes(self, op: BlobOp, block: Block, data: torch.Tensor) -> None:
        """For backends: ``data`` holds ``block``'s bytes in host memory and is about to
        be given back; keep them if ``op`` was staged early (NOTE [Failed staged writes]
        in ``recovery.py``)."""
        self.recovery.keep_bytes(op, block, data)

    def blocks_staged(self, op: BlobOp, n: int) -> None:
        """``n`` more blocks of the write ``op`` no longer read its source; with the last,
        the engine drops the source and stages the future (NOTE [Staged writes])."""
        with op.lock:
            before = op.unstaged
            op.unstaged -= n
            # an error or a cancel first: staged at completion, the source kept (NOTE [Failed
            # staged writes] in recovery.py)
            last = before > 0 and op.unstaged <= 0 and op.error is None and not op.cancelled
            if last:
                op.staged_early = True
                op.tensor = None
        if last:
            op.future.set_staged()

    def count(self, name: str, nbytes: int) -> None:
        """Add ``nbytes`` (or seconds) to the extra stat ``name``."""
        with self._lock:
            self._stats.extra[name] = self._stats.extra.get(name, 0) + nbytes
