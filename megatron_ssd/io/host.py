"""The host-memory tier: blobs held in a bounded pool of host memory instead of the SSDs.

A layer placed ``host`` (``Placement.HOST``) has its saved tensors copied into host
memory during forward and copied back for backward, through the same
:class:`~megatron_ssd.io.base.Engine` protocol as the SSD engines::

    host = HostEngine(capacity_bytes=4 << 30)      # a pinned pool when CUDA is available
    fut = host.write(blob, block=False)           # None when the pool is full
    handle = fut.get()
    back = host.read(handle, host.alloc(handle.nbytes, blob.device)).get()
    host.free(handle)

On a GPU it frees device memory for the price of a PCIe copy each way, with no SSD
bandwidth or drive wear: the tier for when the SSDs' bandwidth is spent. On a CPU the
"device" already is host memory, so the tier saves nothing there; it runs the same code,
which is what lets CPU tests check it.

NOTE [Host pool bound]: ``capacity_bytes`` bounds the payload bytes held at once. A write
that would exceed it is refused at once (``write`` returns None, whatever ``block`` says)
and the cache keeps that tensor where it is: room in the pool is only given back by
backward, so waiting for it during forward could wait forever. The pool is one slab of
``capacity_bytes`` (NOTE [Pinned slabs]), an anonymous mapping not reported to the
allocator timeline (NOTE [Host blobs are not device memory]); with CUDA it is
page-locked once when the engine is built. Blobs are carved out of it at
``SLAB_GRANULARITY``-byte granularity by a first-fit allocator: no pinned allocation, no
``cudaHostAlloc`` and no fresh pages on the forward thread. On a CPU a mapping per blob
(as before) cost a page fault per 4 KiB on every copy into it: 288 MiB hosted cost 0.19-
0.23 s of CPU against 0.04 s into the slab, whose pages are faulted once (NOTE [Pricing
host copies] in ``planner/measured_profile.py``); its pages stay resident up to the most
the pool has held. A blob that does not fit in the slab's free space (rounding and
fragmentation can leave less than the bound) is refused like one over the bound.

NOTE [Host copy ordering]: copies are queued on the caller's thread: device-to-host on
the tier's own write stream, which first waits for an event recorded on the caller's
current stream (the producer of ``src``); host-to-device on its own high-priority read
stream, which waits for the caller's stream only when the destination did not come from
:meth:`HostEngine.alloc` (NOTE [Fresh read buffers] in ``posix.py``). A write's source is
marked used by the write stream (``record_stream``). One worker thread waits for each
copy's blocking event, under the tensor's device (NOTE [CUDA threads] in ``cuda.py``),
and only then completes the future, so a completed future means the bytes are in place
on both sides. A write is staged when it completes (NOTE [Staged writes]). Each
direction has its own worker, so reads never queue behind writes.

With ``copy_bytes_per_s`` each direction is paced as a link of that rate: a copy's future
completes no sooner than its bytes take at that rate after the link is free (NOTE [Host
copy rate] in ``pacing.py``), which holds a CPU's memory-speed copies to a GPU's PCIe
ratio for comparisons.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..config.host_pool import HostPoolChoice, size_text
from ..errors import CacheStateError, ConfigError
from .base import Engine, EngineStats, Extent, IOFuture, SwapHandle
from .buffers import copy_bytes
from .cuda import CUDA, CopyStreams, CudaOps, FreshBuffers
from .layout import ExtentAllocator
from .mapped import mapped_empty
from .pinned import HostSlab
from .blocks import check_blob, check_read_target
from .pacing import RateLimiter
from .workers import READ, WRITE, Workers

__all__ = ["HostEngine", "HOST_PATH_INDEX", "SLAB_GRANULARITY", "open_host_pool"]

logger = logging.getLogger("megatron_ssd")

HOST_PATH_INDEX = -1
"""``Extent.path_index`` of a host blob: it lives on no offload path."""

SLAB_GRANULARITY = 64
"""Bytes by which blobs are placed in the pinned slab (a cache line: copies start aligned)."""


class HostEngine(Engine):
    """Holds blobs in host memory, at most ``capacity_bytes`` at once.

    Args:
        capacity_bytes: Bound on the payload bytes held at once (NOTE [Host pool bound]).
        pin: Use a page-locked pool (when CUDA is available); None: pin when CUDA is.
        cuda: The CUDA calls to make (default: the real ones; tests pass a fake).
        copy_bytes_per_s: Pace each direction's copies to this rate (NOTE [Host copy
            rate]); None: as fast as they copy.
        clock, sleep: For the pacing (tests pass fakes).
    """

    def __init__(self, capacity_bytes: int, pin: Optional[bool] = None, cuda: Optional[CudaOps] = None,
                 copy_bytes_per_s: Optional[float] = None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ConfigError(
                f"OffloadConfig.host_pool_bytes = {capacity_bytes!r}: must be a size > 0 for the host tier"
            )
        self.cuda = cuda if cuda is not None else CUDA
        self.capacity_bytes = capacity_bytes
        available = self.cuda.is_available()
        self.pinned = available if pin is None else bool(pin) and available
        # NOTE [Host pool bound]: one slab, pinned now on CUDA, not a mapping per blob on the forward thread
        self._slab = HostSlab(capacity_bytes, pin=self.pinned, cuda=self.cuda)
        self._places = ExtentAllocator(SLAB_GRANULARITY)
        self._places.add_space(self._slab.nbytes)
        self.streams = CopyStreams(self.cuda)
        """The tier's own write and read streams (NOTE [Host copy ordering])."""
        self.fresh = FreshBuffers()
        self._lock = threading.Lock()
        self._blobs: Dict[int, Tuple[torch.Tensor, Optional[int]]] = {}  # id -> (buffer, slab offset)
        self._ids = itertools.count()
        self._used = 0
        self._peak = 0
        self._stats = EngineStats()
        self._refused = 0
        self._closed = False
        self._clock = clock
        self._links: Optional[Tuple[RateLimiter, RateLimiter]] = None
        """The write and read directions' pacing (NOTE [Host copy rate]); None: unpaced."""
        if copy_bytes_per_s is not None:
            self._links = (RateLimiter(copy_bytes_per_s, clock, sleep), RateLimiter(copy_bytes_per_s, clock, sleep))
        # one worker per direction; not an executor: NOTE [Signals and condition locks] in interruptible.py
        self._writer = Workers(1, "megatron-ssd-host-write")
        self._reader = Workers(1, "megatron-ssd-host-read")

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
            place = self._place(nbytes)
            if place is False:
                self._refused += 1
                return None
            self._used += nbytes
            self._peak = max(self._peak, self._used)
            blob_id = next(self._ids)
        fut: IOFuture[SwapHandle] = IOFuture(nbytes)
        handle = SwapHandle(nbytes, (Extent(HOST_PATH_INDEX, blob_id, nbytes, 0),))
        try:
            dst = self._buffer(nbytes, place)
            done = self._queue_copy(dst, src, write=True)
        except BaseException:
            self._give_back(nbytes, place)
            raise
        self._writer.submit(WRITE, self._finish_write, fut, handle, dst, place, done, self._clock())
        return fut

    def read(self, handle: SwapHandle, dst: torch.Tensor) -> IOFuture[torch.Tensor]:
        self._check_open()
        check_read_target(handle, dst)
        with self._lock:
            blob = self._blobs.get(self._key(handle))
        if blob is None:
            raise CacheStateError("read of a host blob this engine does not hold (freed, or from another engine)")
        fut: IOFuture[torch.Tensor] = IOFuture(handle.nbytes)
        done = self._queue_copy(dst[: handle.nbytes], blob[0], write=False, fresh=self.fresh.claim(dst))
        self._reader.submit(READ, self._finish_read, fut, dst, done, self._clock())
        return fut

    def alloc(self, nbytes: int, device: torch.device, handle: Optional[SwapHandle] = None) -> torch.Tensor:
        device = torch.device(device)
        if device.type == "cpu":
            return mapped_empty(nbytes)[:nbytes]
        dev = self.cuda.resolve(device)  # NOTE [Fresh read buffers] in posix.py
        with self.cuda.device(dev), self.cuda.use_stream(self.streams.h2d(dev)):
            buf = self.cuda.empty(max(nbytes, 1), dev)
        self.fresh.add(buf)
        return buf[:nbytes]

    def free(self, handle: SwapHandle) -> None:
        with self._lock:
            blob = self._blobs.pop(self._key(handle), None)
            if blob is None:
                raise CacheStateError("free of a host blob this engine does not hold (freed twice?)")
        self._give_back(handle.nbytes, blob[1])

    def stats(self) -> EngineStats:
        with self._lock:
            s = self._stats
            return EngineStats(
                bytes_written=s.bytes_written, bytes_read=s.bytes_read, write_busy_s=s.write_busy_s,
                read_busy_s=s.read_busy_s, write_errors=s.write_errors, read_errors=s.read_errors,
                extra={"host_bytes": self._used, "host_peak_bytes": self._peak,
                       "host_capacity_bytes": self.capacity_bytes, "host_refused_writes": self._refused,
                       "pinned": self.pinned, "pinned_bytes": self._slab.nbytes if self.pinned else 0},
            )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._writer.shutdown()  # every copy was waited for: the slab can be unpinned
        self._reader.shutdown()
        with self._lock:
            self._blobs.clear()
            self._used = 0
        self._slab.close()

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _key(handle: SwapHandle) -> int:
        if len(handle.extents) != 1 or handle.extents[0].path_index != HOST_PATH_INDEX:
            raise CacheStateError("not a host blob handle")
        return handle.extents[0].offset

    def _check_open(self) -> None:
        if self._closed:
            raise CacheStateError("the host pool is closed")

    def _place(self, nbytes: int) -> Any:
        """The slab offset for a new blob (False: it does not fit). Lock held."""
        offset = self._places.alloc(max(nbytes, 1))
        return False if offset is None else offset

    def _give_back(self, nbytes: int, place: int) -> None:
        with self._lock:
            self._used -= nbytes
            self._places.free(place, max(nbytes, 1))

    def _buffer(self, nbytes: int, place: int) -> torch.Tensor:
        return self._slab.tensor[place : place + nbytes]


    def _queue_copy(self, dst: torch.Tensor, src: torch.Tensor, write: bool, fresh: bool = False) -> Any:
        """Queue ``dst.copy_(src)``; returns what the worker waits on (NOTE [Host copy ordering])."""
        cuda = self.cuda
        dev = cuda.device_of(src) if write else cuda.device_of(dst)
        if dev is None:
            return ("host", dst, src)  # host to host: the worker copies
        with cuda.device(dev):
            stream = self.streams.d2h(dev) if write else self.streams.h2d(dev)
            if not fresh:  # the caller's stream produced src, or may still use dst
                cuda.record_stream(src if write else dst, stream)
                ready = cuda.event()
                ready.record(cuda.current_stream(dev))
            with cuda.use_stream(stream):
                if not fresh:
                    stream.wait_event(ready)
                cuda.copy(dst, src)
                done = cuda.event()
                done.record(stream)
        return ("cuda", dev, done)

    def _run_copy(self, done: Any, nbytes: int, queued_at: float, write: bool) -> float:
        """Wait for (or make) the copy, then for its link when paced; the busy seconds."""
        started = time.perf_counter()
        kind, a, b = done
        if kind == "host":
            copy_bytes(a, b)
        else:
            with self.cuda.device(a):  # NOTE [CUDA threads]
                b.synchronize()
        busy = time.perf_counter() - started
        if self._links is not None:  # NOTE [Host copy rate]
            busy = self._links[0 if write else 1].pace(nbytes, queued_at)
        return busy

    def _finish_write(self, fut: IOFuture, handle: SwapHandle, dst: torch.Tensor, place: Optional[int],
                      done: Any, queued_at: float) -> None:
        try:
            busy = self._run_copy(done, handle.nbytes, queued_at, write=True)
        except BaseException as err:  # noqa: BLE001 - handed to the future
            self._give_back(handle.nbytes, place)
            with self._lock:
                self._stats.write_errors += 1
            fut.set_error(err)
            return
        with self._lock:
            self._blobs[self._key(handle)] = (dst, place)
            self._stats.bytes_written += handle.nbytes
            self._stats.write_busy_s += busy
        fut.set_result(handle)

    def _finish_read(self, fut: IOFuture, dst: torch.Tensor, done: Any, queued_at: float) -> None:
        try:
            busy = self._run_copy(done, fut.nbytes, queued_at, write=False)
        except BaseException as err:  # noqa: BLE001 - handed to the future
            with self._lock:
                self._stats.read_errors += 1
            fut.set_error(err)
            return
        with self._lock:
            self._stats.bytes_read += fut.nbytes
            self._stats.read_busy_s += busy
        fut.set_result(dst)


# NOTE [Host blobs are not device memory]: on a GPU the host tier's blobs live in pinned
# host memory, which is not the device memory a placement saves; on a CPU they live in
# the same RAM as the "device". The allocator timeline (``memory/allocator_timeline.py``) is the
# independent measure of the device's memory that ``rok`` compares placements by, and it
# counts every mapping ``mapped_empty`` reports; so the host tier's blobs live in a slab
# of its own (``HostSlab``), not reported to it, and the timeline counts on a CPU what it
# would count on a GPU. The process's RSS still counts them: on a CPU the host tier saves no RSS.
# Read-back buffers (``alloc``) are device memory and stay ``mapped_empty``'s.


# NOTE [Pinning fails]: the pool is pinned once, when the engine is built (``HostSlab``:
# an anonymous mapping, then ``cudaHostRegister``). Either can fail on a machine that
# looked big enough: a memlock limit the driver honours, a container's cap on pinned
# memory (Docker on WSL2 stops near 0.5-1 GiB), an mmap refused under strict overcommit,
# or fragmentation. A host tier is an optimisation, so a failure never ends the job: one
# warning line names the pool, the error's first line and what happens instead. A size
# the user gave becomes an unpinned pool of that size (its
# copies are pageable, so they block the forward thread while they run, and the planner
# gives the tier no budget: ``AdaptivePlanner.host_budget``), since the user asked for
# that tier; an ``auto`` pool becomes no host tier, since ``auto`` asks for the tier only
# where it pays, which pageable copies do not. The choice records the error, so the train
# summary and its JSON say what happened.

_PIN_ERRORS = (RuntimeError, OSError, MemoryError, ValueError)
"""What building a pinned pool raises when it fails: ``torch.cuda.CudaError`` (a
RuntimeError) from ``cudaHostRegister``, OSError / MemoryError from the mapping."""


def open_host_pool(choice: HostPoolChoice, copy_bytes_per_s: Optional[float] = None,
                   cuda: Optional[CudaOps] = None) -> Tuple[Optional[HostEngine], HostPoolChoice]:
    """Build the host tier ``choice`` sized (:func:`~megatron_ssd.config.host_pool.size_host_pool`),
    falling back when pinning fails (NOTE [Pinning fails]).

    Args:
        choice: The pool's size and why (0: no host tier).
        copy_bytes_per_s: Passed to :class:`HostEngine`.
        cuda: The CUDA calls (tests pass a fake whose ``host_register`` fails).

    Returns:
        The engine (None: no host tier) and the choice as built: its bytes, whether it is
        pinned, and the pinning error if there was one.
    """
    if not choice.bytes:
        return None, choice
    try:
        engine = HostEngine(choice.bytes, cuda=cuda, copy_bytes_per_s=copy_bytes_per_s)
    except _PIN_ERRORS as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        size = size_text(choice.bytes)
        if choice.setting == "auto":
            logger.warning("megatron_ssd: the host pool (%s, offload.host_pool_bytes auto) could not be pinned: %s; "
                           "training goes on without a host tier (docs/troubleshooting.md)", size, first)
            return None, choice.built(0, False, first, f"{choice.reason}; pinning {size} failed, no host tier")
        logger.warning("megatron_ssd: the host pool (%s, offload.host_pool_bytes) could not be pinned: %s; it is "
                       "unpinned instead, its copies block the forward pass (docs/troubleshooting.md)", size, first)
        try:
            engine = HostEngine(choice.bytes, pin=False, cuda=cuda, copy_bytes_per_s=copy_bytes_per_s)
        except _PIN_ERRORS as again:  # the mapping itself was refused (strict overcommit)
            logger.warning("megatron_ssd: the unpinned host pool (%s) could not be mapped either: %s; training goes "
                           "on without a host tier", size, (str(again).strip().splitlines() or ["?"])[0])
            return None, choice.built(0, False, first, f"{choice.reason}; pinning and mapping {size} failed")
        return engine, choice.built(choice.bytes, False, first, f"{choice.reason}; pinning failed")
    return engine, choice.built(choice.bytes, engine.pinned)
