"""The host-memory tier: blobs held in a bounded pool of host memory instead of the SSDs.

A layer placed ``host`` (``Placement.HOST``) has its saved tensors copied into host
memory during forward and copied back for backward, through the same
:class:`~megatron_ssd.io.base.Engine` protocol as the SSD engines::

    host = HostEngine(capacity_bytes=4 << 30)      # pinned buffers when CUDA is available
    fut = host.write(blob, block=False)           # None when the pool is full
    handle = fut.get()
    back = host.read(handle, host.alloc(handle.nbytes, blob.device)).get()
    host.free(handle)

On a GPU it frees device memory for the price of a PCIe copy each way, with no SSD
bandwidth or drive wear: the tier for when the SSDs' bandwidth is spent. On a CPU the
"device" already is host memory, so the tier saves nothing there; it runs the same code,
which is what lets CPU tests check it.

NOTE [Host pool bound]: ``capacity_bytes`` bounds the bytes held at once. A write that
would exceed it is refused at once (``write`` returns None, whatever ``block`` says) and
the cache keeps that tensor where it is: room in the pool is only given back by
backward, so waiting for it during forward could wait forever. Each blob has a buffer of
its own: an anonymous mapping on CPU (returned to the kernel when freed, NOTE [Mapped
read buffers]), a pinned buffer from torch's caching host allocator on CUDA (so pinned
pages are reused from step to step, not registered again).

NOTE [Host copy ordering]: copies run on one worker thread (``concurrent.futures``). A
CUDA copy is queued on a side stream that first waits for the work already queued on
the caller's current stream (the producer of ``src``), and the worker completes the
future only after the copy's event has finished, so a completed future means the bytes
are in place on both sides. The cache keeps ``src`` alive until the write's future
completes (the Engine contract), so the caching allocator cannot reuse its memory while
the copy reads it.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Optional, Tuple

import torch

from ..errors import CacheStateError, ConfigError
from .base import Engine, EngineStats, Extent, IOFuture, SwapHandle
from .mapped import mapped_empty
from .striped import check_blob, check_read_target

__all__ = ["HostEngine", "HOST_PATH_INDEX"]

HOST_PATH_INDEX = -1
"""``Extent.path_index`` of a host blob: it lives on no offload path."""


class HostEngine(Engine):
    """Holds blobs in host memory, at most ``capacity_bytes`` at once.

    Args:
        capacity_bytes: Bound on the payload bytes held at once (NOTE [Host pool bound]).
        pin: Use page-locked buffers (when CUDA is available); None: pin when CUDA is.
    """

    def __init__(self, capacity_bytes: int, pin: Optional[bool] = None) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ConfigError(
                f"OffloadConfig.host_pool_bytes = {capacity_bytes!r}: must be a size > 0 for the host tier"
            )
        self.capacity_bytes = capacity_bytes
        self.pinned = torch.cuda.is_available() if pin is None else bool(pin) and torch.cuda.is_available()
        self._lock = threading.Lock()
        self._blobs: Dict[int, torch.Tensor] = {}
        self._ids = itertools.count()
        self._used = 0
        self._peak = 0
        self._stats = EngineStats()
        self._refused = 0
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatron-ssd-host")
        self._stream = None

    # ------------------------------------------------------------------ Engine

    @property
    def paths(self) -> Tuple[str, ...]:
        return ()

    def write(self, src: torch.Tensor, block: bool = True) -> Optional[IOFuture[SwapHandle]]:
        self._check_open()
        check_blob(src, "write(src)")
        nbytes = src.numel()
        with self._lock:
            if self._used + nbytes > self.capacity_bytes:  # NOTE [Host pool bound]
                self._refused += 1
                return None
            self._used += nbytes
            self._peak = max(self._peak, self._used)
            blob_id = next(self._ids)
        fut: IOFuture[SwapHandle] = IOFuture(nbytes)
        handle = SwapHandle(nbytes, (Extent(HOST_PATH_INDEX, blob_id, nbytes, 0),))
        try:
            dst = self._buffer(nbytes)
        except BaseException:
            with self._lock:
                self._used -= nbytes
            raise
        done = self._queue_copy(dst, src)
        self._pool.submit(self._finish_write, fut, handle, dst, done)
        return fut

    def read(self, handle: SwapHandle, dst: torch.Tensor) -> IOFuture[torch.Tensor]:
        self._check_open()
        check_read_target(handle, dst)
        with self._lock:
            src = self._blobs.get(self._key(handle))
        if src is None:
            raise CacheStateError("read of a host blob this engine does not hold (freed, or from another engine)")
        fut: IOFuture[torch.Tensor] = IOFuture(handle.nbytes)
        done = self._queue_copy(dst[: handle.nbytes], src)
        self._pool.submit(self._finish_read, fut, dst, done)
        return fut

    def alloc(self, nbytes: int, device: torch.device, handle: Optional[SwapHandle] = None) -> torch.Tensor:
        device = torch.device(device)
        if device.type == "cpu":
            return mapped_empty(nbytes)[:nbytes]
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)[:nbytes]

    def free(self, handle: SwapHandle) -> None:
        with self._lock:
            blob = self._blobs.pop(self._key(handle), None)
            if blob is None:
                raise CacheStateError("free of a host blob this engine does not hold (freed twice?)")
            self._used -= handle.nbytes

    def stats(self) -> EngineStats:
        with self._lock:
            s = self._stats
            return EngineStats(
                bytes_written=s.bytes_written, bytes_read=s.bytes_read, write_busy_s=s.write_busy_s,
                read_busy_s=s.read_busy_s, write_errors=s.write_errors, read_errors=s.read_errors,
                extra={"host_bytes": self._used, "host_peak_bytes": self._peak,
                       "host_capacity_bytes": self.capacity_bytes, "host_refused_writes": self._refused,
                       "pinned": self.pinned},
            )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        with self._lock:
            self._blobs.clear()
            self._used = 0

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _key(handle: SwapHandle) -> int:
        if len(handle.extents) != 1 or handle.extents[0].path_index != HOST_PATH_INDEX:
            raise CacheStateError("not a host blob handle")
        return handle.extents[0].offset

    def _check_open(self) -> None:
        if self._closed:
            raise CacheStateError("the host pool is closed")

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if self.pinned:
            return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)[:nbytes]
        return mapped_empty(nbytes)[:nbytes]

    def _queue_copy(self, dst: torch.Tensor, src: torch.Tensor):
        """Queue ``dst.copy_(src)``; returns what the worker waits on (NOTE [Host copy ordering])."""
        if dst.device.type == "cuda" or src.device.type == "cuda":
            device = dst.device if dst.device.type == "cuda" else src.device
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=device)
            self._stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._stream):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            return event
        return (dst, src)  # CPU: the worker copies

    def _run_copy(self, done) -> float:
        started = time.perf_counter()
        if isinstance(done, tuple):
            dst, src = done
            dst.copy_(src)
        else:
            done.synchronize()
        return time.perf_counter() - started

    def _finish_write(self, fut: IOFuture, handle: SwapHandle, dst: torch.Tensor, done) -> None:
        try:
            busy = self._run_copy(done)
        except BaseException as err:  # noqa: BLE001 - handed to the future
            with self._lock:
                self._used -= handle.nbytes
                self._stats.write_errors += 1
            fut.set_error(err)
            return
        with self._lock:
            self._blobs[self._key(handle)] = dst
            self._stats.bytes_written += handle.nbytes
            self._stats.write_busy_s += busy
        fut.set_result(handle)

    def _finish_read(self, fut: IOFuture, dst: torch.Tensor, done) -> None:
        try:
            busy = self._run_copy(done)
        except BaseException as err:  # noqa: BLE001 - handed to the future
            with self._lock:
                self._stats.read_errors += 1
            fut.set_error(err)
            return
        with self._lock:
            self._stats.bytes_read += fut.nbytes
            self._stats.read_busy_s += busy
        fut.set_result(dst)
