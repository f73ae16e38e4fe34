"""The one place the I/O engines touch ``torch.cuda``: a seam tests replace with a fake.

Every engine takes a :class:`CudaOps` (default :data:`CUDA`, the real one) and makes
each CUDA call through it: which device a tensor lives on, device and stream contexts,
streams, events, copies, ``record_stream``, device allocations and page-locking host
memory; and the process's device-memory cap (``offload.device_memory_cap``). A
recording fake with the same methods (``tests/io/fake_cuda.py``) runs the
engines' CUDA paths on a CPU-only machine, checking the ordering rules below::

    cuda = CudaOps()
    streams = CopyStreams(cuda)
    with cuda.device(dev), cuda.use_stream(streams.d2h(dev)):
        cuda.copy(host_slice, device_block)
        done = cuda.event()
        done.record(streams.d2h(dev))
    with cuda.device(dev):
        done.synchronize()          # the worker thread sleeps; it does not spin

NOTE [CUDA threads]: the engines' worker threads never call ``torch.cuda.set_device``,
and a thread's current device starts at 0. A CUDA call made there for a tensor on GPU 1
would create a context on GPU 0 (about 500 MiB of its memory, per process, for nothing)
or issue work to the wrong device. So every CUDA call an engine makes, on any thread,
runs inside ``cuda.device(dev)`` for the device of the tensor it concerns, and streams
are created under their device. ``torch.cuda.device`` restores the previous device on
exit without creating a context there.

NOTE [Blocking events]: ``torch.cuda.Event()`` defaults to ``blocking=False``: a host
thread that calls ``synchronize()`` on it spins on a core for as long as the GPU lags
behind. The engines only ever wait on events made by :meth:`CudaOps.event`, which are
``blocking=True``: the waiting thread sleeps until the event completes.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["CUDA", "CudaOps", "CopyStreams", "FreshBuffers", "H2D_PRIORITY"]

H2D_PRIORITY = -1
"""Priority of the host-to-device streams (lower is higher in CUDA): reads that
backward waits for go ahead of the forward pass's device-to-host copies."""

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


class CudaOps:
    """The CUDA calls the engines make (NOTE [CUDA threads], NOTE [Blocking events])."""

    def is_available(self) -> bool:
        """True when a CUDA device is usable."""
        return torch.cuda.is_available()

    def device_of(self, t: torch.Tensor) -> Optional[torch.device]:
        """The CUDA device ``t`` lives on, or None for host memory."""
        return t.device if t.is_cuda else None

    def resolve(self, device: Any) -> torch.device:
        """``device`` as a ``torch.device`` with an index (``cuda`` means the current one)."""
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev

    def device(self, dev: torch.device) -> AbstractContextManager:
        """Make ``dev`` the calling thread's current device inside the block."""
        return torch.cuda.device(dev)

    def use_stream(self, stream: Any) -> AbstractContextManager:
        """Queue the block's CUDA work (copies, kernels, allocations) on ``stream``."""
        return torch.cuda.stream(stream)

    def new_stream(self, dev: torch.device, priority: int = 0) -> Any:
        """A stream on ``dev``, created under that device."""
        with torch.cuda.device(dev):
            return torch.cuda.Stream(device=dev, priority=priority)

    def current_stream(self, dev: torch.device) -> Any:
        """The calling thread's current stream on ``dev`` (the producer's, at submit)."""
        return torch.cuda.current_stream(dev)

    def event(self) -> Any:
        """A new blocking event (NOTE [Blocking events])."""
        return torch.cuda.Event(blocking=True)

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        """Tell the caching allocator that ``stream`` uses ``t``: a free of its block
        waits for the work queued on ``stream`` up to the free before reusing it."""
        t.record_stream(stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``dst.copy_(src)`` on the current stream (asynchronous for pinned memory)."""
        dst.copy_(src, non_blocking=True)

    def launch(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)``, whose torch ops queue work on the current stream (the fake
        queues the call itself, so it runs in stream order)."""
        return fn(*args)

    def empty(self, nbytes: int, dev: torch.device) -> torch.Tensor:
        """``nbytes`` uninitialised bytes on ``dev``, from the current stream's pool."""
        return torch.empty(nbytes, dtype=torch.uint8, device=dev)

    def stream_handle(self, stream: Any) -> int:
        """The raw ``cudaStream_t`` of ``stream`` (for kvikio's stream-ordered calls)."""
        return stream.cuda_stream

    def host_register(self, t: torch.Tensor) -> None:
        """Page-lock the host memory of ``t`` (exactly its bytes: ``cudaHostRegister``,
        not torch's caching host allocator, which rounds every request up to a power of
        two: NOTE [Pinned slabs] in ``io/pinned.py``)."""
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(),
                                                                    _HOST_REGISTER_PORTABLE))

    def host_unregister(self, ptr: int) -> None:
        """Undo :meth:`host_register` of the memory at address ``ptr``."""
        torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(ptr))

    def total_memory(self, dev: torch.device) -> int:
        """The memory of device ``dev`` in bytes."""
        return int(torch.cuda.get_device_properties(dev).total_memory)

    def set_memory_fraction(self, fraction: float, dev: torch.device) -> None:
        """Bound the caching allocator of this process on ``dev`` to ``fraction`` of its
        memory (``torch.cuda.set_per_process_memory_fraction``; NOTE [Device memory cap]
        in ``cache/memory_cap.py``)."""
        torch.cuda.set_per_process_memory_fraction(fraction, dev)

    def memory_allocated(self, dev: torch.device) -> int:
        """Bytes the caching allocator has handed out on ``dev`` now."""
        return int(torch.cuda.memory_allocated(dev))

    def reset_peak_memory(self, dev: torch.device) -> None:
        """Start the peaks :meth:`peak_memory` reports afresh on ``dev``."""
        torch.cuda.reset_peak_memory_stats(dev)

    def peak_memory(self, dev: torch.device) -> Tuple[int, int]:
        """The most bytes allocated and the most reserved on ``dev`` since the last
        :meth:`reset_peak_memory` (NOTE [Working set under a cap] in ``adaptive.py``)."""
        return int(torch.cuda.max_memory_allocated(dev)), int(torch.cuda.max_memory_reserved(dev))

    def working_peaks(self, dev: torch.device) -> Optional[Tuple[int, int]]:
        """The working set's peaks inside and outside the layers since the last
        :meth:`reset_peak_memory`: None, not resolved by phase on CUDA (NOTE [Working set
        by phase] in ``adaptive.py``)."""
        return None


CUDA = CudaOps()
"""The real CUDA calls; what every engine uses unless given another :class:`CudaOps`."""


class CopyStreams:
    """One device-to-host and one high-priority host-to-device stream per device.

    Writes copy on ``d2h`` and reads on ``h2d``, so backward's reads never queue behind
    the forward pass's writes (NOTE [Copy streams] in ``io/posix.py``). Each stream is
    created under its device on first use (NOTE [CUDA threads]).

    Args:
        cuda: the CUDA calls to use.
    """

    def __init__(self, cuda: CudaOps) -> None:
        self.cuda = cuda
        self._streams: Dict[Tuple[int, str], Any] = {}
        self._lock = threading.Lock()

    def _get(self, dev: torch.device, kind: str) -> Any:
        key = (dev.index, kind)
        with self._lock:
            stream = self._streams.get(key)
            if stream is None:
                priority = H2D_PRIORITY if kind == "h2d" else 0
                stream = self._streams[key] = self.cuda.new_stream(dev, priority)
            return stream

    def d2h(self, dev: torch.device) -> Any:
        """The device-to-host (write) stream of ``dev``."""
        return self._get(dev, "d2h")

    def h2d(self, dev: torch.device) -> Any:
        """The high-priority host-to-device (read) stream of ``dev``."""
        return self._get(dev, "h2d")


class FreshBuffers:
    """The CUDA read buffers an engine's ``alloc`` made that no read has filled yet.

    Such a buffer was allocated on the engine's host-to-device stream and nothing else
    has been queued on it, so its read need not wait for the caller's stream (NOTE
    [Fresh read buffers] in ``io/posix.py``). A buffer is fresh for its first read only.
    Storages are held by weak reference: a storage freed unread drops out, and its
    identity cannot be taken by a new storage while the entry exists.
    """

    PRUNE_AT = 4096
    """Entries kept before the dead ones are dropped."""

    def __init__(self) -> None:
        self._refs: Dict[int, StorageWeakRef] = {}
        self._lock = threading.Lock()

    def add(self, t: torch.Tensor) -> None:
        """``t`` was just allocated for a read."""
        ref = StorageWeakRef(t.untyped_storage())
        with self._lock:
            if len(self._refs) >= self.PRUNE_AT:
                self._refs = {k: r for k, r in self._refs.items() if not r.expired()}
            self._refs[ref.cdata] = ref

    def claim(self, t: torch.Tensor) -> bool:
        """True when ``t``'s storage is fresh; it is not any more afterwards."""
        with self._lock:
            ref = self._refs.pop(t.untyped_storage()._cdata, None)
        return ref is not None and not ref.expired()
