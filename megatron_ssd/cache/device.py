"""The tensor cache's compute device: which one it serves, how it times work there, and
the one place the cache itself calls ``torch.cuda`` (so tests can record those calls).

* :class:`DeviceBinding`: the device whose saved tensors the cache manages, bound to the
  first one it sees when the configuration names none (NOTE [Binding the device]).
* :class:`HostClock` / :class:`CudaClock`: layer forward, backward, stall and site-use
  times, from the host clock on a CPU and from CUDA events on the compute stream on a GPU
  (NOTE [Device time]).
* :class:`CudaCalls`: ``record_stream`` for the consumers of read buffers (NOTE [Read
  buffers and their consumers]).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, List, Optional, Tuple

import torch

from ..errors import ConfigError

__all__ = ["CudaCalls", "CudaClock", "DeviceBinding", "HostClock", "check_device", "make_clock", "parse_device"]

logger = logging.getLogger("megatron_ssd")


def parse_device(name: str) -> torch.device:
    """The device ``OffloadConfig.device`` names, without asking CUDA which one is current:
    ``auto`` is ``cuda`` (no index) when CUDA is available, else ``cpu``."""
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(name)


def check_device(name: str, field: str = "OffloadConfig.device", need_cuda: bool = False) -> None:
    """Refuse a device that does not exist on this machine (NOTE [A device that exists]).

    Args:
        name: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        field: The setting named in the error.
        need_cuda: Also refuse ``cuda`` without an index when no CUDA device is visible.

    Raises:
        ConfigError: ``cuda:N`` where the machine has N or fewer CUDA devices; ``cuda``
            without any when ``need_cuda``.
    """
    device = torch.device(name) if name not in ("auto", "cpu") else torch.device("cpu")
    if device.type != "cuda" or (device.index is None and not need_cuda):
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.index is None and count == 0:
        raise ConfigError(f"{field} = {name!r}: no CUDA device is visible on this machine; must be auto or cpu here")
    if device.index is not None and device.index >= count:
        have = f"CUDA devices cuda:0 .. cuda:{count - 1}" if count > 1 else "CUDA device cuda:0" if count else \
            "no CUDA device"
        raise ConfigError(f"{field} = {name!r}: this machine has {have}; must name a device that exists "
                          "(or auto, which serves the GPU the process trains on)")


# NOTE [A device that exists]: ``device = cuda:99`` on a machine without that GPU used to
# train with nothing offloaded: no tensor is ever saved on a device that does not exist,
# so every one was left to autograd, and the run exited 0. A named index that the
# machine does not have is a ConfigError when a cache is built (and before the train job
# builds its model); ``cuda`` without an index stays lazy (NOTE [Binding the device]) and
# is refused by the train job where no CUDA device is visible. What remains (a cache
# serving another device than the one the model trains on, every tensor under
# ``min_tensor_bytes``, layers placed offload that never run) is named once by the first
# step that saved tensors and moved none although layers are placed to move
# (``StepAccountant``).


# NOTE [Binding the device]
# A cache configured for ``auto`` or ``cuda`` (no index) must serve the GPU its process
# trains on, which is known only once the process has chosen it: Megatron calls
# ``torch.cuda.set_device(local_rank)`` in its initialization, often after the model and
# the cache are built. Resolving ``torch.cuda.current_device()`` at construction gave
# ``cuda:0`` on every rank built that early, and ranks training on ``cuda:1`` .. ``cuda:7``
# skipped every saved tensor, silently. So the index stays open until the first saved
# tensor on that device type, whose device the cache then serves for the rest of its life;
# a saved tensor on another device of the same type afterwards is skipped with one
# warning. A configured index (``cuda:3``) is bound from the start.


class DeviceBinding:
    """Which device's saved tensors the cache manages (NOTE [Binding the device]).

    Args:
        configured: the device parsed from ``OffloadConfig.device``.
    """

    def __init__(self, configured: torch.device) -> None:
        self.device = configured
        """The device served: no index until bound, for ``cuda`` without one."""
        self._warned = False

    @property
    def bound(self) -> bool:
        """Whether the device is known (always on a CPU)."""
        return self.device.type == "cpu" or self.device.index is not None

    def accepts(self, device: torch.device) -> bool:
        """Whether a tensor saved on ``device`` is the cache's to manage; binds the device
        on the first one of its type."""
        if device.type != self.device.type:
            return False
        if self.device.type == "cpu":
            return True
        if self.device.index is None:
            self.device = torch.device(device.type, device.index if device.index is not None else 0)
            return True
        if device.index == self.device.index:
            return True
        if not self._warned:
            self._warned = True
            logger.warning("megatron_ssd: a tensor saved on %s is left in memory: this tensor cache serves %s "
                           "(set OffloadConfig.device to choose)", device, self.device)
        return False

    def resolved(self) -> torch.device:
        """The device, its index taken from CUDA's current device if not bound yet."""
        if self.bound:
            return self.device
        return torch.device(self.device.type, torch.cuda.current_device())


# NOTE [Device time]
# The planner plans from each layer's forward and backward time, the time backward waits
# for reads, and when backward first uses each site. On a CPU those are host times. On a
# GPU the host only queues kernels: a layer's forward "ends" on the host long before its
# kernels have run, and a host wait for a read may overlap kernels still running. So on
# CUDA every time is the distance between two CUDA events recorded on the current
# (compute) stream at the same points of the code: the GPU's time between them, a wait
# counting only the time the stream sat idle behind it. Events are resolved at the end of
# the step (``finish_step``, after the step's last kernel), each measured span added to
# its counter there; until then spans are kept in order with the function that adds them.
# On a CPU a span is added at once.


class HostClock:
    """Spans measured with the host's ``perf_counter`` and added at once (a CPU device)."""

    def mark(self) -> float:
        """A point in time."""
        return time.perf_counter()

    def add(self, start: Any, end: Any, apply: Callable[[float], None]) -> None:
        """Add the seconds between two marks with ``apply``."""
        apply(max(end - start, 0.0))

    def since(self, start: Any, apply: Callable[[float], None]) -> None:
        """Add the seconds from ``start`` to now with ``apply``."""
        self.add(start, self.mark(), apply)

    def wait(self) -> None:
        """Nothing is pending on the host clock."""

    def resolve(self) -> None:
        """Nothing is pending on the host clock."""


class CudaClock(HostClock):
    """Spans between CUDA events recorded on the current stream, resolved at the step's end
    (NOTE [Device time]).

    Args:
        device: the CUDA device whose current stream is marked.
        event: the event factory (``torch.cuda.Event``; a recording fake in tests).
        current_stream: the current stream of a device (``torch.cuda.current_stream``).
    """

    def __init__(self, device: Callable[[], torch.device], event: Optional[Callable[..., Any]] = None,
                 current_stream: Optional[Callable[[torch.device], Any]] = None) -> None:
        self._device = device
        self._event = event or torch.cuda.Event
        self._current_stream = current_stream or torch.cuda.current_stream
        self._pending: List[Tuple[Any, Any, Callable[[float], None]]] = []
        self._lock = threading.Lock()

    def mark(self) -> Any:
        event = self._event(enable_timing=True, blocking=True)
        event.record(self._current_stream(self._device()))
        return event

    def add(self, start: Any, end: Any, apply: Callable[[float], None]) -> None:
        with self._lock:
            self._pending.append((start, end, apply))

    def wait(self) -> None:
        """Wait, without spinning (blocking events), until every pending span's end event
        has run: after this the step's kernels are done."""
        with self._lock:
            ends = [end for _, end, _ in self._pending]
        for end in ends:
            end.synchronize()

    def resolve(self) -> None:
        """Add every pending span, its events' distance in seconds; call :meth:`wait` first
        (spans added after it are waited for here)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for start, end, apply in pending:
            end.synchronize()
            apply(max(start.elapsed_time(end) / 1e3, 0.0))


def make_clock(binding: DeviceBinding) -> HostClock:
    """The clock for the cache's device: CUDA events on its current stream on a CUDA device,
    the host clock elsewhere."""
    return CudaClock(binding.resolved) if binding.device.type == "cuda" else HostClock()


# NOTE [Read buffers and their consumers]
# A read buffer is allocated by the I/O engine on its host-to-device copy stream, so the
# read does not wait for the compute stream; the engine completes the read's future only
# once the copy is done. The tensor restored from it is then used by kernels on whatever
# stream backward runs on (the compute stream, or a side stream for communication
# overlap). The caching allocator ties a block to the stream that allocated it: when the
# cache drops the buffer after its last use, the block could be handed to the copy
# stream's next read while those kernels still read it. So each unpack of a read-back
# tensor records the consumer's current stream on the buffer (``record_stream``); the
# block is reused only after the work queued there at unpack time has run.


class CudaCalls:
    """The cache's own ``torch.cuda`` calls (NOTE [Read buffers and their consumers])."""

    def is_cuda(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives on a CUDA device."""
        return t.is_cuda

    def record_consumer(self, t: torch.Tensor) -> None:
        """Mark ``t``'s memory in use by its device's current stream."""
        t.record_stream(torch.cuda.current_stream(t.device))
