"""Peak of live tensor bytes over a window, counted from the storages torch allocates.

The second independent measure (beside the process's RSS, :mod:`.rss`): it counts what
torch allocated, not what the tensor cache thinks it holds, so tensors that recompute
rebuilds during backward, gradients, temporaries and read-back buffers all count::

    with AllocatorTimeline() as timeline:
        run_one_step()
    timeline.peak_bytes        # host bytes, above the window's start

NOTE [Allocator timeline]: a ``TorchDispatchMode`` sees the outputs of every operator
run while it is open, forward and backward (autograd runs CPU backward on the calling
thread, with the mode). An output whose storage is new (shared with no input: not a
view, not in place) is an allocation of ``storage.nbytes()`` bytes at that time. Not
``set_``: its output aliases the storage passed to it, which is no tensor input, so it
looked new, and the tensor cache's pack (``storage_bytes``: a byte view made with
``set_``) counted every saved tensor it took a second time, for the tensor's whole life. Its
death is observed through a storage weak reference, which expires when the storage is
freed, on whichever thread drops the last reference; expiries are checked before and
after every operator, so a free is timed to within one operator. Read-back buffers come
from their own mappings, not from an operator (NOTE [Mapped read buffers]);
:mod:`megatron_ssd.io.mapped` reports their maps and unmaps. The running sum of both is
the live bytes allocated inside the window; its peak is measured above the level at the
window's start. Not seen: scratch memory an operator allocates and frees inside itself.
The PyTorch profiler's ``profile_memory`` events were tried first: they record only
the profiled thread's frees, and the I/O threads drop offloaded tensors, so offloaded
bytes looked alive until the end of the step (``profile_all_threads`` records none).
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["AllocatorTimeline", "TimelinePeaks", "peak_of_events", "working_peaks"]


def peak_of_events(events: List[Tuple[int, int]]) -> int:
    """Peak of the running sum of ``(time_ns, delta_bytes)`` events taken in time order.

    At equal times frees go first, so a free and an allocation at the same instant do
    not count twice.
    """
    live = peak = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):
        live += delta
        peak = max(peak, live)
    return peak


def working_peaks(events: List[Tuple[int, int]], held: List[Tuple[int, int]],
                  phases: List[Tuple[int, bool]]) -> Tuple[int, int]:
    """Peaks of the working set, live bytes less the activations among them, inside and
    outside the layers (NOTE [Working set by phase] in ``adaptive.py``).

    Args:
        events: ``(time_ns, delta)`` of live tensor bytes (:func:`peak_of_events`'s).
        held: ``(time_ns, delta)`` of the live bytes that are activations: saved tensors'
            storages and read-back buffers.
        phases: ``(time_ns, outside)``: from then on the step runs outside the layers
            (the embedding, the head and loss) or inside one (a layer's forward or
            backward). The window opens outside.

    Returns:
        ``(inside, outside)``: the largest working set seen in each phase (0 where a phase
        never ran).
    """
    merged = sorted([(t, 0, 0, outside) for t, outside in phases]  # a phase starts before what happens then
                    + [(t, 1, d, True) for t, d in held if d > 0]  # counted as an activation before it shows
                    + [(t, 2 if d < 0 else 3, d, False) for t, d in events]  # frees before allocations
                    + [(t, 4, d, True) for t, d in held if d < 0],
                    key=lambda e: (e[0], e[1]))
    live = cached = 0
    outside = True
    peaks = [0, 0]
    for _, kind, delta, flag in merged:
        if kind == 0:
            outside = flag
            continue
        if kind in (1, 4):
            cached += delta
        else:
            live += delta
        peaks[outside] = max(peaks[outside], live - cached)
    return peaks[0], peaks[1]


def _storages(obj: Any, out: List[Any]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _storages(o, out)


class _Tracker(TorchDispatchMode):
    """Records fresh output storages and when they die (NOTE [Allocator timeline])."""

    def __init__(self, timeline: "AllocatorTimeline") -> None:
        super().__init__()
        self.timeline = timeline

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        tl = self.timeline
        tl.poll()
        inputs: List[Any] = []
        _storages(args, inputs)
        _storages(list((kwargs or {}).values()), inputs)
        seen = {_key(t) for t in inputs if _has_storage(t)}
        result = func(*args, **(kwargs or {}))
        if func.overloadpacket is _SET:  # NOTE [Allocator timeline]: aliases a storage it is given
            tl.poll()
            return result
        outputs: List[Any] = []
        _storages(result, outputs)
        for t in outputs:
            if _has_storage(t) and t.device.type == "cpu":
                key = _key(t)
                if key not in seen:
                    seen.add(key)
                    tl.allocated(t)
        tl.poll()
        return result


_SET = torch.ops.aten.set_
"""``Tensor.set_(storage)``: its output's storage is the one it is given (no tensor among
its inputs holds it), never a new allocation."""


def _has_storage(t: torch.Tensor) -> bool:
    try:
        t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() or id(t.untyped_storage())


class AllocatorTimeline:
    """Context manager: the peak of live tensor bytes while it is open (NOTE [Allocator timeline])."""

    def __init__(self) -> None:
        self.peak_bytes: Optional[int] = None
        """Host (CPU) peak above the window's start, read-back mappings included."""
        self.device_peak_bytes: Optional[int] = None
        """Reserved for CUDA; on a GPU use ``torch.cuda.max_memory_allocated`` instead."""
        self.allocations = 0
        """Number of storages and mappings allocated inside the window."""
        self._events: List[Tuple[int, int]] = []
        self._held: List[Tuple[int, int]] = []
        self._phases: List[Tuple[int, bool]] = []
        self._live: Dict[int, Tuple[Any, int, int]] = {}  # id: (weak reference, bytes, storage key)
        self._by_storage: Dict[int, int] = {}  # storage key: id, of the live ones
        self._saved: Set[int] = set()
        self._ids = itertools.count()
        self._tokens: Set[int] = set()
        self._lock = threading.Lock()
        self._mode: Optional[_Tracker] = None

    def allocated(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage as allocated now (called by the dispatch mode)."""
        from torch.multiprocessing.reductions import StorageWeakRef

        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        with self._lock:
            i, key = next(self._ids), _key(t)
            self._live[i] = (StorageWeakRef(storage), nbytes, key)
            self._by_storage[key] = i
            self._events.append((time.time_ns(), nbytes))
            self.allocations += 1

    def poll(self) -> None:
        """Record the frees of tracked storages that have died since the last poll."""
        now = time.time_ns()
        with self._lock:
            dead = [k for k, (ref, _, _) in self._live.items() if ref.expired()]
            for k in dead:
                _, nbytes, key = self._live.pop(k)
                self._events.append((now, -nbytes))
                if self._by_storage.get(key) == k:  # not yet taken by a storage at the same address
                    del self._by_storage[key]
                if k in self._saved:
                    self._saved.discard(k)
                    self._held.append((now, -nbytes))

    def saved(self, t: torch.Tensor) -> None:
        """``t`` was saved for backward (the tensor cache packed it): its storage, when
        allocated inside the window, counts as an activation, not as working set, until it
        dies (NOTE [Working set by phase] in ``adaptive.py``)."""
        if not _has_storage(t) or t.device.type != "cpu":
            return
        key = _key(t)
        now = time.time_ns()
        with self._lock:
            i = self._by_storage.get(key)
            if i is not None and i not in self._saved and i in self._live:
                self._saved.add(i)
                self._held.append((now, self._live[i][1]))

    def phase(self, outside: bool) -> None:
        """The step runs outside the layers (True) or inside one (False) from now on."""
        now = time.time_ns()
        with self._lock:
            self._phases.append((now, outside))

    def working_peaks(self) -> Tuple[int, int]:
        """``(inside, outside)`` peaks of live bytes less the saved tensors' storages and
        the read-back buffers alive (:func:`working_peaks`); read after the window
        closed."""
        with self._lock:
            return working_peaks(self._events, self._held, self._phases)

    def _on_mapped(self, time_ns: int, delta: int, token: int) -> None:
        with self._lock:
            if delta > 0:
                self._tokens.add(token)
                self.allocations += 1
            elif token not in self._tokens:
                return  # mapped before the window: part of its base
            self._events.append((time_ns, delta))
            self._held.append((time_ns, delta))  # a read-back buffer is an activation

    def __enter__(self) -> "AllocatorTimeline":
        from ..io.mapped import add_listener

        add_listener(self._on_mapped)
        self._mode = _Tracker(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        from ..io.mapped import remove_listener

        try:
            if self._mode is not None:
                self._mode.__exit__(*exc)
        finally:
            remove_listener(self._on_mapped)
            self._mode = None
        self.poll()
        with self._lock:
            self.peak_bytes = peak_of_events(self._events)


class TimelinePeaks:
    """The CPU counterpart of the CUDA calls that measure a step's working set under a cap
    (``memory_allocated``, ``reset_peak_memory``, ``peak_memory`` of
    :class:`~megatron_ssd.io.cuda.CudaOps`; NOTE [Working set under a cap] in
    ``adaptive.py``), read from an :class:`AllocatorTimeline`, the measure a cap is checked
    by on a CPU (NOTE [Fits within a cap] in ``commands/rok_largest.py``).

    ``reset_peak_memory`` opens a timeline on the calling thread and ``peak_memory``
    closes it, on the same thread, with no other dispatch mode opened in between and left
    open: the two bracket one training step. ``memory_allocated`` is 0: on a CPU the cap
    bounds what a step adds above its start (weights and gradients are not in the count).
    """

    def __init__(self) -> None:
        self._timeline: Optional[AllocatorTimeline] = None
        self._working: Optional[Tuple[int, int]] = None

    def memory_allocated(self, dev: Any) -> int:
        return 0

    def reset_peak_memory(self, dev: Any) -> None:
        if self._timeline is not None:
            self._timeline.__exit__(None, None, None)
        self._timeline = AllocatorTimeline().__enter__()

    def peak_memory(self, dev: Any) -> Tuple[int, int]:
        """The peak of live tensor bytes since :meth:`reset_peak_memory`, twice (allocated
        and "reserved": no caching allocator between the tensors and the count); closes
        the timeline."""
        timeline, self._timeline = self._timeline, None
        if timeline is None:
            return 0, 0
        timeline.__exit__(None, None, None)
        self._working = timeline.working_peaks()
        peak = int(timeline.peak_bytes or 0)
        return peak, peak

    def saved(self, t: torch.Tensor) -> None:
        """The cache packed ``t`` (its memory observer, NOTE [Working set by phase] in
        ``adaptive.py``); nothing while no timeline is open."""
        if self._timeline is not None:
            self._timeline.saved(t)

    def phase(self, outside: bool) -> None:
        """The step left the layers (True) or entered one (False)."""
        if self._timeline is not None:
            self._timeline.phase(outside)

    def working_peaks(self, dev: Any) -> Optional[Tuple[int, int]]:
        """The last closed timeline's ``(inside, outside)`` working-set peaks; None before
        one closed."""
        return self._working

    def close(self) -> None:
        """Close a timeline left open (a run that ended before its first step did)."""
        if self._timeline is not None:
            self._timeline.__exit__(None, None, None)
            self._timeline = None
