"""A recording fake of the engines' CUDA calls (:class:`megatron_ssd.io.cuda.CudaOps`),
so their CUDA paths run and are checked on a CPU-only machine.

"Device" tensors are CPU tensors the fake registers as living on ``cuda:0`` or
``cuda:1``. Work queued on a fake stream (copies, ``launch``-ed kernels, stream waits)
does not run when it is queued: it runs in stream order when an event recorded after it
is synchronized (or a stream that waits on such an event runs). So a copy whose bytes
are used before its event was waited for, a copy not ordered after the producer's
stream, or a staging buffer given back before its copy ran all give wrong bytes, as on a
GPU. Every call is recorded with the thread's current device (``device()`` contexts), so
tests can check that no call is made under another device than the tensor's (NOTE [CUDA
threads]). Streams have no ``synchronize``: only blocking events are waited for.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef


@dataclass
class Call:
    """One recorded CUDA call: its name, the thread's current device and the device it
    concerns (None: no device)."""

    name: str
    current: int
    target: Optional[int]
    detail: Dict[str, Any] = field(default_factory=dict)


class FakeStream:
    """A stream: a queue of thunks run in order, on demand."""

    def __init__(self, fake: "FakeCuda", device: int, priority: int, name: str) -> None:
        self.fake = fake
        self.device = torch.device("cuda", device)
        self.priority = priority
        self.name = name
        self.handle = next(fake._handles)
        self._ops: List[Optional[Callable[[], None]]] = []
        self._ran = 0

    @property
    def cuda_stream(self) -> int:
        return self.handle

    def _enqueue(self, fn: Callable[[], None]) -> None:
        with self.fake.lock:
            self._ops.append(fn)

    def run_until(self, mark: int) -> None:
        with self.fake.lock:  # reentrant: a wait_event thunk runs another stream
            while self._ran < mark:
                fn, self._ops[self._ran] = self._ops[self._ran], None  # drop the thunk's references
                self._ran += 1
                fn()

    @property
    def queued(self) -> int:
        with self.fake.lock:
            return len(self._ops)

    def wait_event(self, event: "FakeEvent") -> None:
        self.fake._call("wait_event", self.device.index, stream=self.name)
        if event.stream is None:
            raise AssertionError("wait_event on an event never recorded")
        stream, mark = event.stream, event.mark
        self._enqueue(lambda: stream.run_until(mark))

    def __repr__(self) -> str:
        return f"FakeStream({self.name}, cuda:{self.device.index}, priority={self.priority})"


class FakeEvent:
    """A blocking event: ``synchronize`` runs its stream up to where it was recorded."""

    blocking = True

    def __init__(self, fake: "FakeCuda") -> None:
        self.fake = fake
        self.stream: Optional[FakeStream] = None
        self.mark = 0

    def record(self, stream: FakeStream) -> None:
        self.fake._call("event.record", stream.device.index, stream=stream.name)
        with self.fake.lock:
            self.stream, self.mark = stream, len(stream._ops)

    def synchronize(self) -> None:
        if self.stream is None:
            raise AssertionError("synchronize of an event never recorded")
        self.fake._call("event.synchronize", self.stream.device.index, stream=self.stream.name)
        self.stream.run_until(self.mark)

    def query(self) -> bool:
        return self.stream is None or self.stream._ran >= self.mark


@dataclass
class Copy:
    kind: str  # "d2h", "h2d", "d2d" or "h2h"
    nbytes: int
    stream: FakeStream


class FakeCuda:
    """Stands in for :class:`megatron_ssd.io.cuda.CudaOps` with ``devices`` fake GPUs."""

    def __init__(self, devices: int = 2) -> None:
        self.devices = devices
        self.lock = threading.RLock()
        self._handles = itertools.count(0x1000)
        self._tls = threading.local()
        self._registry: Dict[int, Tuple[torch.device, StorageWeakRef]] = {}
        self._compute: Dict[int, FakeStream] = {}
        self.calls: List[Call] = []
        self.copies: List[Copy] = []
        self.streams: List[FakeStream] = []
        self.record_streams: List[Tuple[int, FakeStream]] = []  # (storage cdata, stream)
        self.allocations: List[Tuple[int, int, Optional[FakeStream]]] = []  # (device, nbytes, current stream)
        self.registered: Dict[int, int] = {}  # pinned: data_ptr -> nbytes
        self.registered_sizes: List[int] = []  # every page-locked size, in order
        self.unregistered: List[int] = []
        self.memory = 80 << 30  # each fake device's memory (total_memory)
        self.fractions: List[Tuple[float, int]] = []  # set_memory_fraction calls: (fraction, device index)
        self.allocated = 0  # memory_allocated
        self.peak = (0, 0)  # peak_memory: (max allocated, max reserved) since the last reset
        self.peak_resets: List[int] = []  # reset_peak_memory calls: device index

    # ------------------------------------------------------------------ test helpers

    def to_device(self, t: torch.Tensor, index: int = 0) -> torch.Tensor:
        """A fake device copy of the CPU tensor ``t`` on ``cuda:index``."""
        out = t.clone()
        self._register(out, index)
        return out

    def compute(self, index: int = 0) -> FakeStream:
        """The default (compute) stream of ``cuda:index``."""
        with self.lock:
            s = self._compute.get(index)
            if s is None:
                s = self._compute[index] = FakeStream(self, index, 0, f"compute{index}")
            return s

    def kernel(self, index: int, fn: Callable[[], None]) -> None:
        """Queue ``fn`` (a producer kernel) on ``cuda:index``'s compute stream."""
        self.compute(index)._enqueue(fn)

    def finish(self) -> None:
        """Run everything queued on every stream (the device idles)."""
        with self.lock:
            streams = list(self.streams) + list(self._compute.values())
        for s in streams:
            s.run_until(s.queued)

    def mismatches(self) -> List[Call]:
        """Calls made under another device than the one they concern."""
        return [c for c in self.calls if c.target is not None and c.current != c.target]

    def calls_named(self, name: str) -> List[Call]:
        return [c for c in self.calls if c.name == name]

    # ------------------------------------------------------------------ internals

    def _register(self, t: torch.Tensor, index: int) -> None:
        ref = StorageWeakRef(t.untyped_storage())
        with self.lock:
            self._registry[ref.cdata] = (torch.device("cuda", index), ref)

    def _current_device(self) -> int:
        return getattr(self._tls, "device", 0)

    def _call(self, name: str, target: Optional[int], **detail: Any) -> None:
        with self.lock:
            self.calls.append(Call(name, self._current_device(), target, detail))

    def _current_stream_of(self, index: int) -> FakeStream:
        streams = getattr(self._tls, "streams", {})
        return streams.get(index) or self.compute(index)

    # ------------------------------------------------------------------ CudaOps

    def is_available(self) -> bool:
        return True

    def device_of(self, t: torch.Tensor) -> Optional[torch.device]:
        with self.lock:
            entry = self._registry.get(t.untyped_storage()._cdata)
        if entry is None or entry[1].expired():
            return None
        return entry[0]

    def resolve(self, device: Any) -> torch.device:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", self._current_device())
        return dev

    @contextlib.contextmanager
    def device(self, dev: torch.device):
        index = torch.device(dev).index
        if index is None or not 0 <= index < self.devices:
            raise AssertionError(f"device({dev!r}): not a fake device")
        prev = self._current_device()
        self._tls.device = index
        try:
            yield
        finally:
            self._tls.device = prev

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream):
        self._call("use_stream", stream.device.index, stream=stream.name)
        streams = getattr(self._tls, "streams", None)
        if streams is None:
            streams = self._tls.streams = {}
        index = stream.device.index
        prev = streams.get(index)
        streams[index] = stream
        try:
            yield
        finally:
            if prev is None:
                del streams[index]
            else:
                streams[index] = prev

    def new_stream(self, dev: torch.device, priority: int = 0) -> FakeStream:
        self._call("new_stream", dev.index, priority=priority)
        with self.lock:
            s = FakeStream(self, dev.index, priority, f"s{len(self.streams)}")
            self.streams.append(s)
        return s

    def current_stream(self, dev: torch.device) -> FakeStream:
        self._call("current_stream", dev.index)
        return self._current_stream_of(dev.index)

    def event(self) -> FakeEvent:
        return FakeEvent(self)

    def record_stream(self, t: torch.Tensor, stream: FakeStream) -> None:
        dev = self.device_of(t)
        if dev is None:
            raise AssertionError("record_stream of a host tensor")
        self._call("record_stream", dev.index, stream=stream.name)
        if dev != stream.device:
            raise AssertionError(f"record_stream of a cuda:{dev.index} tensor for a stream of {stream.device}")
        with self.lock:
            self.record_streams.append((t.untyped_storage()._cdata, stream))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        ddev, sdev = self.device_of(dst), self.device_of(src)
        kind = {(False, True): "d2h", (True, False): "h2d", (True, True): "d2d"}.get(
            (ddev is not None, sdev is not None), "h2h")
        target = (ddev or sdev).index if (ddev or sdev) is not None else None
        self._call("copy", target, kind=kind)
        if dst.numel() != src.numel():
            raise AssertionError(f"copy of {src.numel()} bytes into {dst.numel()}")
        stream = self._current_stream_of(target if target is not None else self._current_device())
        with self.lock:
            self.copies.append(Copy(kind, src.numel(), stream))
        stream._enqueue(lambda: dst.copy_(src))

    def launch(self, fn: Callable[..., Any], *args: Any) -> None:
        index = self._current_device()
        self._call("launch", index)
        self._current_stream_of(index)._enqueue(lambda: fn(*args))

    def empty(self, nbytes: int, dev: torch.device) -> torch.Tensor:
        self._call("empty", dev.index)
        t = torch.empty(nbytes, dtype=torch.uint8)
        self._register(t, dev.index)
        with self.lock:
            self.allocations.append((dev.index, nbytes, getattr(self._tls, "streams", {}).get(dev.index)))
        return t

    def stream_handle(self, stream: FakeStream) -> int:
        return stream.handle

    def stream_by_handle(self, handle: int) -> FakeStream:
        with self.lock:
            return next(s for s in self.streams if s.handle == handle)

    def host_register(self, t: torch.Tensor) -> None:
        with self.lock:
            self.registered[t.data_ptr()] = t.numel()
            self.registered_sizes.append(t.numel())

    def host_unregister(self, ptr: int) -> None:
        with self.lock:
            if ptr not in self.registered:
                raise AssertionError(f"unregister of {ptr:#x}: not registered")
            del self.registered[ptr]
            self.unregistered.append(ptr)

    def total_memory(self, dev: torch.device) -> int:
        self._call("total_memory", torch.device(dev).index)
        return self.memory

    def set_memory_fraction(self, fraction: float, dev: torch.device) -> None:
        self._call("set_memory_fraction", torch.device(dev).index, fraction=fraction)
        with self.lock:
            self.fractions.append((fraction, torch.device(dev).index))

    def memory_allocated(self, dev: torch.device) -> int:
        self._call("memory_allocated", torch.device(dev).index)
        return self.allocated

    def reset_peak_memory(self, dev: torch.device) -> None:
        self._call("reset_peak_memory", torch.device(dev).index)
        with self.lock:
            self.peak_resets.append(torch.device(dev).index)

    def peak_memory(self, dev: torch.device) -> Tuple[int, int]:
        self._call("peak_memory", torch.device(dev).index)
        return self.peak

    def working_peaks(self, dev: torch.device) -> None:
        return None  # as CudaOps: not resolved by phase on CUDA
