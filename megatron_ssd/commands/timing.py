"""Step times on a GPU: CUDA events around each step, and a schedule that ends on the device.

Used by :mod:`megatron_ssd.commands.train` on CUDA; on a CPU both do nothing and the
cache's ``StepStats.wall_s`` is the step time::

    timer = StepTimer("cuda")
    timer.start()
    train_step(...)
    timer.stop()          # seconds between the two events, after waiting for the second

NOTE [Device step time]: on a GPU the host returns from a step's forward and backward
long before the kernels it queued have run, so a host clock read there times the
queueing, not the step. Two consequences, and what is done about each:

- ``StepStats.wall_s`` is the time between two ``finish_step`` calls, which the schedule
  wrapper makes right after Megatron's schedule returns. Without a synchronize there,
  the step's last kernels run after its ``finish_step`` and are counted in the next
  step. :func:`synchronized` wraps the schedule so that it returns only once the device
  is idle: ``wall_s`` is then the step as the GPU ran it (the optimizer update of the
  step before included, which also ends on a synchronize).
- :class:`StepTimer` records a CUDA event on the current stream before the step's first
  kernel and one after its last (the optimizer update included), waits for the second,
  and reads the time between them. A host stall that leaves the GPU idle (an unpack
  waiting for a read) delays every kernel queued after it, so it is counted too. The
  paired steps' ratios (NOTE [Paired steps]) come from these on a GPU.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

from ..errors import MegatronSSDError

__all__ = ["StepTimer", "synchronized"]


def synchronized(inner: Callable[..., Any], synchronize: Optional[Callable[[], None]] = None) -> Callable[..., Any]:
    """``inner`` followed by a device synchronize (NOTE [Device step time]).

    Args:
        inner: a megatron-core ``forward_backward_func`` (called with keywords).
        synchronize: what waits for the device (default ``torch.cuda.synchronize``).
    """
    if synchronize is None:
        import torch

        synchronize = torch.cuda.synchronize

    def forward_backward(**kwargs: Any) -> Any:
        result = inner(**kwargs)
        synchronize()
        return result

    return forward_backward


class StepTimer:
    """CUDA-event time of each step on ``device`` ``"cuda"``; times nothing elsewhere.

    Args:
        device: ``"cuda"`` or ``"cpu"``.
        event: the event class (default ``torch.cuda.Event``; tests pass a recording fake).

    Attributes:
        last_s: seconds of the last :meth:`stop`, or None (CPU, or nothing timed yet).
        times_s: every :meth:`stop`'s seconds, in order.
    """

    def __init__(self, device: str, event: Optional[Callable[..., Any]] = None) -> None:
        self.enabled = device == "cuda"
        if self.enabled and event is None:
            import torch

            event = torch.cuda.Event
        self._event = event
        self._start: Any = None
        self.last_s: Optional[float] = None
        self.times_s: List[float] = []

    def start(self) -> None:
        """Record the start event on the current stream (before the step's first kernel)."""
        if self.enabled:
            self._start = self._event(enable_timing=True)
            self._start.record()

    def stop(self) -> Optional[float]:
        """Record the end event, wait for it, and return the seconds since :meth:`start`."""
        if not self.enabled:
            return None
        if self._start is None:
            raise MegatronSSDError("megatron_ssd: StepTimer.stop() called without start()")
        end = self._event(enable_timing=True)
        end.record()
        end.synchronize()
        self.last_s = self._start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds
        self.times_s.append(self.last_s)
        self._start = None
        return self.last_s
