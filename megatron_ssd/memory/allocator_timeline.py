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

NOTE [Frees of what came before]: a storage allocated before the window is not seen when
it dies, so a step that frees the previous step's gradients at its start
(``zero_grad(set_to_none=True)``) and allocates new ones in backward counted the new ones
above its start and never the freed ones: on configs/gpt-ref-cpu.yaml at micro-batch 16
the step's peak came in the head's backward with 57 MiB of new gradients counted, over a
700 MiB cap the step kept. The tensors the caller names (``existing``: the train command
names the parameters' gradients before its measured step) are watched from the window's
start, and their deaths count as frees, so the peak is what the step adds above its start.

NOTE [Survivors]: a storage allocated inside the window and still alive when it closes,
other than a saved tensor, is state the window made for what runs after it: the first
training step's gradients and optimizer state (113.2 MiB on configs/gpt-ref-cpu.yaml,
its 29.7M parameters' gradients). A later step finds it allocated at its start, so a
cap measured above that start does not count it, and the working set (:func:`working_peaks`,
:func:`layer_peaks`) leaves it out from its allocation on, as it does the activations.
Those a backward made and a later step freed (``AllocatorTimeline.remade``: gradients a
loop sets to None between steps) are remade each step: NOTE [Gradients remade each step]
in ``planner/holds.py``.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from typing import Any, Dict, Hashable, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["AllocatorTimeline", "TimelinePeaks", "layer_peaks", "peak_of_events", "working_peaks"]


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


def _in_order(markers: Sequence[Tuple[int, Any]], activations: Sequence[Tuple[int, int, Any]],
              events: Sequence[Tuple[int, int]]) -> List[Tuple[int, int, int, Any]]:
    """The one sweep :func:`working_peaks` and :func:`layer_peaks` take: ``(time_ns, kind,
    delta, tag)`` in time order, at one instant a marker (kind 0: a phase or a layer's span
    starts before what happens then), an activation's allocation (1: counted as one before
    the allocator shows it), the allocator's frees (2), its allocations (3), an
    activation's free (4). ``activations`` are ``(time_ns, delta, tag)``; the allocator's
    events carry the tag None."""
    return sorted([(t, 0, 0, tag) for t, tag in markers]
                  + [(t, 1, d, tag) for t, d, tag in activations if d > 0]
                  + [(t, 2 if d < 0 else 3, d, None) for t, d in events]
                  + [(t, 4, d, tag) for t, d, tag in activations if d < 0],
                  key=lambda e: (e[0], e[1]))


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
    live = cached = 0
    outside = True
    peaks = [0, 0]
    for _, kind, delta, flag in _in_order(phases, [(t, d, True) for t, d in held], events):
        if kind == 0:
            outside = flag
            continue
        if kind in (1, 4):
            cached += delta
        else:
            live += delta
        peaks[outside] = max(peaks[outside], live - cached)
    return peaks[0], peaks[1]


def layer_peaks(events: List[Tuple[int, int]], saved: List[Tuple[int, int, Hashable]],
                spans: List[Tuple[int, Optional[Tuple[Hashable, bool]]]],
                mapped: Sequence[Tuple[int, int]] = ()) -> Dict[Hashable, Tuple[int, int]]:
    """Per layer, the most its forward held at once beyond the other layers' saved
    tensors, and the largest working set of its backward (NOTE [Working set by layer] in
    ``adaptive.py``).

    Args:
        events: ``(time_ns, delta)`` of live tensor bytes (:func:`peak_of_events`'s).
        saved: ``(time_ns, delta, layer)`` of the live bytes that are activations: a layer's
            saved tensors, or with ``layer`` None read-back buffers and what survives the
            window.
        spans: ``(time_ns, (layer, backward))``: from then on the step runs that layer's
            forward or backward (the head's backward too: NOTE [Working set of the head's
            backward] in ``cache/memory_cap.py``); ``(time_ns, None)``: outside any layer.
        mapped: ``(time_ns, delta)`` of the read-back buffers, activations too.

    Returns:
        ``{layer: (forward, backward)}`` (0 where it never ran): in its forward the largest
        live bytes less the other layers' saved tensors (what it has saved so far and its
        temporaries); in its backward the largest of its temporaries (live bytes less every
        saved tensor and read-back buffer) less the read-back buffers freed since it began:
        what it needs beyond its saved tensors where each dies when its use is done.
    """
    activations = list(saved) + [(t, d, _MAPPED) for t, d in mapped]
    live = held = freed = 0
    by_layer: Dict[Hashable, int] = {}
    span: Optional[Tuple[Hashable, bool]] = None
    peaks: Dict[Hashable, List[int]] = {}
    for _, kind, delta, tag in _in_order(spans, activations, events):
        if kind == 0:
            span, freed = tag, 0
            if span is not None:
                peaks.setdefault(span[0], [0, 0])
            continue
        if kind in (1, 4):
            held += delta
            if tag is _MAPPED:
                freed -= min(delta, 0)
            elif tag is not None:
                by_layer[tag] = by_layer.get(tag, 0) + delta
        else:
            live += delta
        if span is not None:
            layer, backward = span
            peak = peaks[layer]
            peak[backward] = max(peak[backward], live - held - freed if backward else live - held + by_layer.get(layer, 0))
    return {layer: (p[0], p[1]) for layer, p in peaks.items()}


_MAPPED = object()
"""The tag of a read-back buffer's event in :func:`layer_peaks`."""


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

    def __init__(self, existing: Iterable[torch.Tensor] = ()) -> None:
        """``existing``: tensors allocated before the window whose storages' deaths inside
        it count as frees (NOTE [Frees of what came before]), such as the previous step's
        gradients."""
        self.peak_bytes: Optional[int] = None
        """Host (CPU) peak above the window's start, read-back mappings included."""
        self.device_peak_bytes: Optional[int] = None
        """Reserved for CUDA; on a GPU use ``torch.cuda.max_memory_allocated`` instead."""
        self.allocations = 0
        """Number of storages and mappings allocated inside the window."""
        self.surviving_bytes = 0
        """Bytes allocated inside the window and still alive when it closed, other than saved
        tensors: state the step made for the steps after it (NOTE [Survivors])."""
        self._survivors: List[Tuple[int, int]] = []
        self._made_in_backward: List[Tuple[Any, int, Hashable]] = []  # (weak reference, bytes, layer) of survivors
        self._events: List[Tuple[int, int]] = []
        self._phases: List[Tuple[int, bool]] = []
        self._live: Dict[int, Tuple[Any, int, int, int]] = {}  # id: (weak reference, bytes, storage key, time)
        self._by_storage: Dict[int, int] = {}  # storage key: id, of the live ones
        self._saved: Dict[int, Hashable] = {}  # id: the layer that saved it
        self._saved_events: List[Tuple[int, int, Hashable]] = []
        self._spans: List[Tuple[int, Optional[Tuple[Hashable, bool]]]] = []
        self._mapped: List[Tuple[int, int]] = []
        self._ids = itertools.count()
        self._tokens: Set[int] = set()
        self._lock = threading.Lock()
        self._mode: Optional[_Tracker] = None
        self._before: Dict[int, Tuple[Any, int]] = {}  # storage key: (weak reference, bytes)
        from torch.multiprocessing.reductions import StorageWeakRef

        for t in existing:  # weak references only: a strong one would keep it alive
            if _has_storage(t) and t.device.type == "cpu" and _key(t) not in self._before:
                self._before[_key(t)] = (StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes())
        t = None  # noqa: F841 (the last one)

    def allocated(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage as allocated now (called by the dispatch mode)."""
        from torch.multiprocessing.reductions import StorageWeakRef

        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        with self._lock:
            i, key, now = next(self._ids), _key(t), time.time_ns()
            self._live[i] = (StorageWeakRef(storage), nbytes, key, now)
            self._by_storage[key] = i
            self._events.append((now, nbytes))
            self.allocations += 1

    def poll(self) -> None:
        """Record the frees of tracked storages that have died since the last poll."""
        now = time.time_ns()
        with self._lock:
            for key in [k for k, (ref, _) in self._before.items() if ref.expired()]:  # NOTE [Frees of what came before]
                self._events.append((now, -self._before.pop(key)[1]))
            dead = [k for k, (ref, _, _, _) in self._live.items() if ref.expired()]
            for k in dead:
                _, nbytes, key, _ = self._live.pop(k)
                self._events.append((now, -nbytes))
                if self._by_storage.get(key) == k:  # not yet taken by a storage at the same address
                    del self._by_storage[key]
                if k in self._saved:
                    layer = self._saved.pop(k)
                    self._saved_events.append((now, -nbytes, layer))

    def saved(self, t: torch.Tensor, layer: Hashable = None) -> None:
        """``t`` was saved for backward by ``layer`` (the tensor cache packed it): its
        storage, when allocated inside the window, counts as an activation, not as working
        set, until it dies (NOTE [Working set by phase], NOTE [Working set by layer] in
        ``adaptive.py``)."""
        if not _has_storage(t) or t.device.type != "cpu":
            return
        key = _key(t)
        now = time.time_ns()
        with self._lock:
            i = self._by_storage.get(key)
            if i is not None and i not in self._saved and i in self._live:
                self._saved[i] = layer
                self._saved_events.append((now, self._live[i][1], layer))

    def phase(self, outside: bool, layer: Hashable = None, backward: bool = False) -> None:
        """The step runs outside the layers (True) or inside one (False) from now on:
        ``layer``'s backward or forward where it is named; outside, only a backward is
        named (the head's, NOTE [Working set of the head's backward] in
        ``cache/memory_cap.py``). The span running already, told again, changes nothing."""
        now = time.time_ns()
        span = None if layer is None or (outside and not backward) else (layer, backward)
        with self._lock:
            if span is not None and self._spans and self._spans[-1][1] == span:
                return
            self._phases.append((now, outside))
            self._spans.append((now, span))

    def layer_peaks(self) -> Dict[Hashable, Tuple[int, int]]:
        """Per layer, its forward's and its backward's peaks beyond the other layers' saved
        tensors and what survived the window (:func:`layer_peaks`); read after the window
        closed."""
        with self._lock:
            return layer_peaks(self._events, self._saved_events + [(t, n, None) for t, n in self._survivors],
                               self._spans, self._mapped)

    def working_peaks(self) -> Tuple[int, int]:
        """``(inside, outside)`` peaks of live bytes less the saved tensors' storages, the
        read-back buffers alive and what survived the window (:func:`working_peaks`, NOTE
        [Survivors]); read after the window closed."""
        with self._lock:
            held = [(t, d) for t, d, _ in self._saved_events] + self._mapped + self._survivors
            return working_peaks(self._events, held, self._phases)

    def _on_mapped(self, time_ns: int, delta: int, token: int) -> None:
        with self._lock:
            if delta > 0:
                self._tokens.add(token)
                self.allocations += 1
            elif token not in self._tokens:
                return  # mapped before the window: part of its base
            self._events.append((time_ns, delta))
            self._mapped.append((time_ns, delta))  # a read-back buffer is an activation

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
            # NOTE [Survivors]: held from their allocation, as the activations are
            self._survivors = [(t, n) for i, (_, n, _, t) in self._live.items() if i not in self._saved]
            self.surviving_bytes = sum(n for _, n in self._survivors)
            starts = [t for t, _ in self._spans]
            made = [(ref, n, self._backward_at(starts, t)) for i, (ref, n, _, t) in self._live.items()
                    if i not in self._saved]
            self._made_in_backward = [m for m in made if m[2] is not None]

    def _backward_at(self, starts: List[int], time_ns: int) -> Hashable:
        """The layer (or the head) whose backward the step ran at ``time_ns``, else None;
        ``starts``: the spans' start times."""
        k = bisect.bisect_right(starts, time_ns) - 1
        span = self._spans[k][1] if k >= 0 else None
        return span[0] if span is not None and span[1] else None

    def remade(self) -> Dict[Hashable, int]:
        """Per layer (and the head), the bytes its backward made in this window that
        outlived it and have died since: what a later step freed to make again (NOTE
        [Survivors], NOTE [Gradients remade each step] in ``planner/holds.py``); read after
        the window closed, once a later step ran."""
        out: Dict[Hashable, int] = {}
        for ref, nbytes, layer in self._made_in_backward:
            if ref.expired():
                out[layer] = out.get(layer, 0) + nbytes
        return out


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
        self._layers: Optional[Dict[Hashable, Tuple[int, int]]] = None
        self._closed: Optional[AllocatorTimeline] = None
        self.surviving_bytes = 0
        """The last closed timeline's :attr:`AllocatorTimeline.surviving_bytes`."""

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
        self._layers = timeline.layer_peaks()
        self._closed = timeline
        self.surviving_bytes = timeline.surviving_bytes
        peak = int(timeline.peak_bytes or 0)
        return peak, peak

    def saved(self, t: torch.Tensor, layer: Hashable = None) -> None:
        """``layer`` packed ``t`` (the cache's memory observer, NOTE [Working set by phase]
        in ``adaptive.py``); nothing while no timeline is open."""
        if self._timeline is not None:
            self._timeline.saved(t, layer)

    def phase(self, outside: bool, layer: Hashable = None, backward: bool = False) -> None:
        """The step left the layers (True) or entered one (False): ``layer``'s forward, or
        its backward."""
        if self._timeline is not None:
            self._timeline.phase(outside, layer, backward)

    def layer_peaks(self, dev: Any) -> Optional[Dict[Hashable, Tuple[int, int]]]:
        """The last closed timeline's per-layer peaks (NOTE [Working set by layer] in
        ``adaptive.py``); None before one closed."""
        return self._layers

    def remade(self, dev: Any) -> Optional[Dict[Hashable, int]]:
        """Per layer, what the last closed timeline's backward made that a later step freed
        (:meth:`AllocatorTimeline.remade`); None before one closed."""
        return self._closed.remade() if self._closed is not None else None

    def working_peaks(self, dev: Any) -> Optional[Tuple[int, int]]:
        """The last closed timeline's ``(inside, outside)`` working-set peaks; None before
        one closed."""
        return self._working

    def close(self) -> None:
        """Close a timeline left open (a run that ended before its first step did)."""
        if self._timeline is not None:
            self._timeline.__exit__(None, None, None)
            self._timeline = None
