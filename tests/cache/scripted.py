"""A scripted I/O engine for the entry state machine's tests: I/O completes when the
test says, in the order it chooses, never by timing. And stand-ins for the entry table
that its two sides (``cache/backward.py``, ``cache/writes.py``) are tested over."""

import errno
import threading
from typing import List, Optional, Tuple

import torch

from megatron_ssd.cache.device import HostClock
from megatron_ssd.cache.stats import Counters, LayerCounters
from megatron_ssd.errors import OffloadIOError, WriteCancelled
from megatron_ssd.io.base import Engine, EngineStats, Extent, IOFuture, SwapHandle

__all__ = ["ScriptedEngine", "ScriptedTable", "ScriptedWriteTable", "io_error"]


def io_error(message: str, code: int) -> OffloadIOError:
    err = OffloadIOError(message)
    err.errno = code
    return err


class WatchedFuture(IOFuture):
    """An IOFuture that records that somebody waited for it to settle."""

    __slots__ = ("waited",)

    def __init__(self, nbytes: int = 0) -> None:
        super().__init__(nbytes)
        self.waited = threading.Event()

    def wait_settled(self, timeout=None) -> bool:
        self.waited.set()
        return super().wait_settled(timeout)


class ScriptedEngine(Engine):
    """Holds blobs in memory. Writes complete only when :meth:`complete_writes` (or
    :meth:`fail_writes`) runs; reads complete at once unless ``fail_reads`` is set, in
    which case they fail with EIO, or ``hold_reads``, in which case they complete when
    :meth:`complete_reads` runs. ``refuse`` makes every write return None
    (backpressure). With ``cancellable`` a write can be cancelled until it completes, as
    a blob none of whose blocks started (NOTE [Cancelled writes]): :meth:`complete_writes`
    then completes it with :class:`WriteCancelled` and stores nothing; with
    ``out_of_memory`` set to n, the next n read buffer allocations raise
    ``torch.OutOfMemoryError``. With
    ``complete_on_cancel`` a cancel also runs :meth:`complete_writes` on a new thread, as
    an engine's worker finishes a cancelled blob."""

    def __init__(self) -> None:
        self.blobs = {}
        self.pending: List[Tuple[IOFuture, SwapHandle, torch.Tensor]] = []
        self.fail_reads = False
        self.hold_reads = False
        self.held: List[Tuple[IOFuture, SwapHandle, torch.Tensor]] = []
        self.refuse = False
        self.cancellable = False
        self.complete_on_cancel = False
        self.cancelled = set()  # ids of the pending writes' futures cancelled
        self.freed = 0
        self.reads = 0
        self.out_of_memory = 0  # this many allocs raise torch.OutOfMemoryError
        self.refused_allocs = 0
        self._lock = threading.Lock()
        self._next = 0

    @property
    def paths(self):
        return ()

    def write(self, src: torch.Tensor, block: bool = True) -> Optional[IOFuture]:
        if self.refuse:
            return None
        self._next += 1
        handle = SwapHandle(src.numel(), (Extent(0, self._next, src.numel(), 0),))
        fut: IOFuture = WatchedFuture(src.numel())
        if self.cancellable:
            fut.on_cancel(lambda: self._cancelled(fut))
        self.pending.append((fut, handle, src.clone()))
        return fut

    def _cancelled(self, fut: IOFuture) -> None:
        self.cancelled.add(id(fut))
        if self.complete_on_cancel:  # as an engine's worker would: on another thread, never in cancel()
            threading.Thread(target=self.complete_writes).start()

    def stage_writes(self) -> int:
        """Stage the pending writes (their bytes in host staging, NOTE [Staged writes])
        without completing them."""
        pending = list(self.pending)
        for fut, _, _ in pending:
            fut.set_staged()
        return len(pending)

    def fail_writes_with(self, error: BaseException) -> None:
        """Complete the pending writes with ``error``."""
        with self._lock:
            done, self.pending = self.pending, []
        for fut, _, data in done:
            fut.set_error(error)

    def complete_writes(self) -> int:
        with self._lock:
            done, self.pending = self.pending, []
        for fut, handle, data in done:
            if id(fut) in self.cancelled:
                self.cancelled.discard(id(fut))
                fut.set_error(WriteCancelled("scripted write cancelled"))
                continue
            self.blobs[handle.extents[0].offset] = data
            fut.set_result(handle)
        return len(done)

    def fail_writes(self) -> None:
        done, self.pending = self.pending, []
        for fut, _, _ in done:
            fut.set_error(io_error("scripted write failure", errno.ENOSPC))

    def read(self, handle: SwapHandle, dst: torch.Tensor) -> IOFuture:
        self.reads += 1
        fut: IOFuture = IOFuture(handle.nbytes)
        if self.hold_reads:
            self.held.append((fut, handle, dst))
        else:
            self._finish_read(fut, handle, dst)
        return fut

    def complete_reads(self) -> int:
        done, self.held = self.held, []
        for fut, handle, dst in done:
            self._finish_read(fut, handle, dst)
        return len(done)

    def _finish_read(self, fut: IOFuture, handle: SwapHandle, dst: torch.Tensor) -> None:
        if self.fail_reads:
            fut.set_error(io_error("scripted read failure", errno.EIO))
        else:
            dst[: handle.nbytes].copy_(self.blobs[handle.extents[0].offset])
            fut.set_result(dst)

    def alloc(self, nbytes: int, device: torch.device, handle: Optional[SwapHandle] = None) -> torch.Tensor:
        if self.out_of_memory > 0:
            self.out_of_memory -= 1
            self.refused_allocs += 1
            raise torch.OutOfMemoryError("scripted: CUDA out of memory. Tried to allocate")
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def free(self, handle: SwapHandle) -> None:
        self.blobs.pop(handle.extents[0].offset, None)
        self.freed += 1

    def stats(self) -> EngineStats:
        return EngineStats()

    def close(self) -> None:
        pass


class ScriptedTable:
    """Exactly the members of ``TableState`` (``cache/backward.py``), plus the table's
    transitions that its sides are given, which log each call."""

    __slots__ = ("lock", "clock", "counters", "resident", "closed", "calls")

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.clock = HostClock()
        self.counters = Counters()
        self.resident = 0
        self.closed = False
        self.calls = []

    def layer(self, layer_id):
        return self.counters.layers.setdefault(layer_id, LayerCounters())

    def set_data(self, entry, data):
        self.calls.append(("set_data", data is not None))
        self.resident += (entry.nbytes if data is not None else 0) - (entry.nbytes if entry.data is not None else 0)
        entry.data = data

    def free_disk(self, entry):
        self.calls.append(("free_disk", entry.handle is not None))
        if entry.handle is not None:
            entry.store.discard(entry.handle)
            entry.handle = None

    def cancel_write(self, entry):
        self.calls.append(("cancel_write", entry.write_future is not None))


class ScriptedWriteTable(ScriptedTable):
    """Exactly the members of ``WriteTable`` (``cache/writes.py``): those of
    ``TableState`` and ``release_at_staging``."""

    __slots__ = ("release_at_staging",)

    def __init__(self) -> None:
        super().__init__()
        self.release_at_staging = False
