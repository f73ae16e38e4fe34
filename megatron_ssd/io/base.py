"""The I/O engine protocol: futures, swap handles and the engine interface.

Async first (as kvikio's ``pread``/``pwrite``): every call returns an :class:`IOFuture`;
waiting is explicit with ``get()``. The cache never touches files itself.

An engine moves *blobs*: the bytes of one untyped storage, given as a 1-D ``uint8``
tensor. It decides where they go (striping blocks over the configured paths) and returns
a :class:`SwapHandle` saying where they went.
"""

from __future__ import annotations

import abc
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Generic, List, Optional, Tuple, TypeVar

import torch

from ..interruptible import Latch

__all__ = [
    "ALIGN",
    "align_up",
    "Extent",
    "SwapHandle",
    "IOFuture",
    "EngineStats",
    "Engine",
]

ALIGN = 4096
"""O_DIRECT alignment of buffer addresses, file offsets and request sizes (bytes)."""

R = TypeVar("R")


def align_up(n: int, align: int = ALIGN) -> int:
    """Round ``n`` up to a multiple of ``align``."""
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class Extent:
    """One contiguous, aligned piece of a blob on one path."""

    path_index: int
    """Index into the engine's configured paths."""
    offset: int
    """Byte offset in that path's file (multiple of ALIGN)."""
    length: int
    """Bytes on disk (multiple of ALIGN; the last extent of a blob includes padding)."""
    blob_offset: int
    """Where this extent's bytes start within the blob."""
    file: Optional[str] = None
    """The file holding this extent (the per-tensor file in the ``file`` layout)."""
    checksum: Optional[int] = None
    """Checksum of the extent's payload bytes (without padding), when checksums are on;
    its algorithm is ``checksum_algo`` (:mod:`megatron_ssd.io.checksum`)."""
    skew: int = 0
    """Zero bytes before the payload in the extent's first page: the source memory's
    offset from a page boundary, so the payload's whole pages move straight from and to
    memory with the same offset (NOTE [Skewed blocks])."""
    checksum_algo: str = "xxh3_64"
    """Algorithm of ``checksum``: ``xxh3_64`` (computed on host bytes) or ``wsum64``
    (computed on the device, NOTE [Device checksums])."""


@dataclass(frozen=True)
class SwapHandle:
    """Where one blob lives on the SSD array."""

    nbytes: int
    """Payload bytes of the blob."""
    extents: Tuple[Extent, ...]
    """Pieces of the blob, in blob order."""

    @property
    def disk_bytes(self) -> int:
        """Bytes the blob occupies on disk, padding included."""
        return sum(e.length for e in self.extents)


class IOFuture(Generic[R]):
    """Result of an asynchronous read or write.

    ``get()`` waits and returns the result or raises the error the I/O raised.
    Callbacks added with :meth:`add_done_callback` run exactly once, on the thread that
    completes the future (or immediately, if it is already done).

    NOTE [Staged writes]: a write is *staged* once the engine no longer reads its source
    tensor: its bytes are in pinned host staging (a CUDA source copied device-to-host),
    or on disk. From then on the engine neither touches the source nor needs it alive, so
    the caller may drop it and the device memory is freed at PCIe speed rather than at
    the drives'. Staging fires at most once, no later than completion: completing a
    future that was not staged stages it as it completes (with a result, an error or a
    cancel), and the done callbacks run only after the staged callbacks have. Staged
    callbacks run by completion see ``done()`` already True: a caller tells early staging
    (its source may go while the write goes on) from staging at completion (nothing left
    to release early; a failed write's caller still has its source). For a CPU source
    written in place staged is completion. Engines stage only writes early; a read is
    staged when it completes, like any future.
    """

    __slots__ = ("_event", "_settled", "_result", "_error", "_callbacks", "_lock", "_cancel", "nbytes", "started",
                 "finished", "_staged", "_staged_settled", "_staged_callbacks", "_staging_thread")

    def __init__(self, nbytes: int = 0) -> None:
        self._event = Latch()  # NOTE [Signals and condition locks] in interruptible.py
        self._settled = Latch()
        self._result: Optional[R] = None
        self._error: Optional[BaseException] = None
        self._callbacks: List[Callable[["IOFuture[R]"], None]] = []
        self._staged = False
        self._staged_settled = Latch()
        self._staged_callbacks: List[Callable[["IOFuture[R]"], None]] = []
        self._staging_thread: Optional[int] = None
        self._lock = threading.Lock()
        self._cancel: Optional[Callable[[], None]] = None
        self.nbytes = nbytes
        self.started = time.perf_counter()
        self.finished: Optional[float] = None

    def done(self) -> bool:
        """True once the I/O finished, successfully or not."""
        return self._event.is_set()

    def get(self, timeout: Optional[float] = None) -> R:
        """Wait for the I/O and return its result; re-raise its error."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"megatron_ssd: I/O of {self.nbytes} bytes not done after {timeout}s")
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]

    def error(self) -> Optional[BaseException]:
        """The error of a finished future, or None."""
        return self._error

    def cancel(self) -> bool:
        """Ask the engine to drop the parts of this I/O not started yet (NOTE [Cancelled
        writes] in ``io/recovery.py``). The future still completes through the engine: with
        :class:`~megatron_ssd.errors.WriteCancelled` when a part was dropped, as usual when
        every part had started. Never blocks and never runs callbacks itself. Returns
        False when the future is done or its engine cannot cancel."""
        hook = self._cancel
        if hook is None or self.done():
            return False
        hook()
        return True

    def on_cancel(self, hook: Callable[[], None]) -> None:
        """Engine side: what :meth:`cancel` calls (it must not block or complete the future)."""
        self._cancel = hook

    def staged(self) -> bool:
        """True once the engine no longer reads the write's source (NOTE [Staged writes])."""
        return self._staged

    def add_staged_callback(self, fn: Callable[["IOFuture[R]"], None]) -> None:
        """Run ``fn(self)`` once the future is staged (NOTE [Staged writes]): on the thread
        that stages it, or at once on the calling thread if it is staged already. Like a
        done callback it must not wait for this future (completion waits for it)."""
        with self._lock:
            if not self._staged:
                self._staged_callbacks.append(fn)
                return
        fn(self)

    def set_staged(self) -> None:
        """Engine side: the source is no longer read (NOTE [Staged writes]); runs the staged
        callbacks on this thread. Later calls do nothing."""
        with self._lock:
            if self._staged:
                return
            self._staged = True
            self._staging_thread = threading.get_ident()
            callbacks, self._staged_callbacks = self._staged_callbacks, []
        try:
            for fn in callbacks:
                fn(self)
        finally:
            self._staged_settled.set()

    def add_done_callback(self, fn: Callable[["IOFuture[R]"], None]) -> None:
        """Run ``fn(self)`` when the future completes."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def set_result(self, result: R) -> None:
        """Complete with a result (engine side)."""
        self._finish(result, None)

    def set_error(self, error: BaseException) -> None:
        """Complete with an error (engine side)."""
        self._finish(None, error)

    def _finish(self, result: Optional[R], error: Optional[BaseException]) -> None:
        me = threading.get_ident()
        with self._lock:
            if self._event.is_set():
                return
            staged_now = not self._staged  # staged no later than done (NOTE [Staged writes])
            if staged_now:
                self._staged, self._staging_thread = True, me
                staged_callbacks, self._staged_callbacks = self._staged_callbacks, []
            self._result, self._error = result, error
            self.finished = time.perf_counter()
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
            self._cancel = None  # the engine's op is done: nothing left to cancel, no reference kept
        if staged_now:
            try:
                for fn in staged_callbacks:
                    fn(self)
            finally:
                self._staged_settled.set()
        elif self._staging_thread != me:
            self._staged_settled.wait()  # early staged callbacks may still run on another thread
        try:
            for fn in callbacks:
                fn(self)
        finally:
            self._settled.set()

    def wait_settled(self, timeout: Optional[float] = None) -> bool:
        """Wait until the future is done and the callbacks it had then have run (``get()``
        may return before them: they run after the result is set, on the completing
        thread). True unless ``timeout`` passed first."""
        return self._settled.wait(timeout)

    @classmethod
    def completed(cls, result: R, nbytes: int = 0) -> "IOFuture[R]":
        """A future that is already done."""
        fut: IOFuture[R] = cls(nbytes)
        fut.set_result(result)
        return fut


@dataclass
class EngineStats:
    """Counters an engine keeps since its creation (monotonic; diff two snapshots)."""

    bytes_written: int = 0
    """Payload bytes written successfully (a cancelled write's blocks that ran included,
    NOTE [Cancelled writes])."""
    bytes_read: int = 0
    """Payload bytes read successfully."""
    write_busy_s: float = 0.0
    """Wall time during which at least one write was in flight."""
    read_busy_s: float = 0.0
    """Wall time during which at least one read was in flight."""
    write_errors: int = 0
    """Writes that failed (their blobs were not stored)."""
    read_errors: int = 0
    """Reads that failed or failed their checksum."""
    backpressure_wait_s: float = 0.0
    """Time ``write(block=True)`` callers spent waiting for in-flight room."""
    disk_bytes: int = 0
    """Bytes currently allocated on disk (padding included)."""
    cpu_s: float = 0.0
    """CPU time the engine's worker threads used (staging copies, checksums, syscalls):
    what the I/O path takes from compute on a CPU-bound machine."""
    extra: dict = field(default_factory=dict)
    """Engine-specific counters."""


class Engine(abc.ABC):
    """Moves blobs between memory and the offload paths.

    Contract:
      * ``write(src)`` reads ``src`` until its future is *staged* (NOTE [Staged writes]):
        the caller must not modify ``src`` until then, and may drop it afterwards. For a
        CUDA ``src`` the engine orders its copies after the work queued on the caller's
        current stream at submit, and calls ``src.record_stream`` for its copy stream, so
        a storage its owner frees (``resize_(0)``) while a copy is queued is not reused
        before the copy is done. A CPU ``src`` is staged when the write completes.
      * ``read(handle, dst)`` fills ``dst[:handle.nbytes]`` with exactly the bytes that
        were written; ``dst`` should come from :meth:`alloc` (aligned, padded) so reads
        need no staging copy. The future completes once the bytes are in ``dst``: for a
        CUDA ``dst``, once the engine's copy finished (the worker waited for it), so the
        bytes may be used on any stream after ``get()``. A CUDA ``dst`` not from
        :meth:`alloc` is filled after the work queued on the caller's current stream at
        submit.
      * ``alloc(nbytes, device, handle)`` for a CUDA device allocates on the engine's
        host-to-device copy stream, so the read fills it without waiting for the compute
        stream. The consumer that uses it on another stream must call
        ``buffer.record_stream(torch.cuda.current_stream())`` before dropping it, so
        the caching allocator does not reuse its memory while that stream's kernels
        still read it.
      * ``free(handle)`` returns the handle's disk space; it must not be called while a
        read or write of that handle is in flight.
      * The future of a failed write carries an :class:`~megatron_ssd.errors.OffloadIOError`
        and nothing stays allocated for it; a failed checksum raises
        :class:`~megatron_ssd.errors.ChecksumError` from ``get()``.
    """

    @property
    @abc.abstractmethod
    def paths(self) -> Tuple[str, ...]:
        """The private run directories this engine writes into, one per offload path."""

    @abc.abstractmethod
    def write(self, src: torch.Tensor, block: bool = True) -> Optional[IOFuture[SwapHandle]]:
        """Queue ``src`` (1-D uint8, contiguous) for writing.

        With ``block=False``, return None instead of waiting when the in-flight bound
        would be exceeded.
        """

    @abc.abstractmethod
    def read(self, handle: SwapHandle, dst: torch.Tensor) -> IOFuture[torch.Tensor]:
        """Queue a read of ``handle`` into ``dst`` (1-D uint8, >= handle.nbytes)."""

    @abc.abstractmethod
    def alloc(self, nbytes: int, device: torch.device, handle: Optional[SwapHandle] = None) -> torch.Tensor:
        """A 1-D uint8 tensor of ``nbytes`` on ``device`` suitable as a read target; given
        the ``handle`` to be read, placed so that the read needs no staging copy."""

    @abc.abstractmethod
    def free(self, handle: SwapHandle) -> None:
        """Release the disk space of ``handle``."""

    @abc.abstractmethod
    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters."""

    @abc.abstractmethod
    def close(self) -> None:
        """Wait for in-flight I/O, delete every file and run directory; idempotent."""

    def set_checksum(self, enabled: bool) -> None:
        """Compute checksums for blobs written from now on, or stop computing them.

        Blobs already written with a checksum are still verified when read. Engines without
        checksums ignore the call.
        """

    def write_blocking(self, src: torch.Tensor) -> SwapHandle:
        """``write(src).get()``."""
        return self.write(src).get()  # type: ignore[union-attr]

    def read_blocking(self, handle: SwapHandle, dst: torch.Tensor) -> torch.Tensor:
        """``read(handle, dst).get()``."""
        return self.read(handle, dst).get()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
