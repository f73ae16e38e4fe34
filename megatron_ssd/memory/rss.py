"""The process's resident memory, as the kernel counts it: now, and its peak since a reset.

This is the independent measure of what offloading saves on a CPU: it counts every page
the process holds, whoever allocated it (the tensor cache, autograd, Megatron, glibc's
heap), so memory the cache believes freed but the allocator keeps shows up here.

Two ways to get a peak that can be restarted (``getrusage``'s ``ru_maxrss`` cannot)::

    peak = RSSPeak()
    peak.mark_base()       # RSS right before the first forward
    peak.reset()           # the peak restarts from the current RSS
    ...                    # train
    peak.peak_above_base() # bytes

NOTE [Resettable RSS peak]: on Linux, writing ``5`` to ``/proc/self/clear_refs``
resets ``VmHWM`` (the kernel's high-water mark of RSS) to the current RSS, so the peak
between two points is read exactly from ``/proc/self/status``, at no cost between them.
Where that write is refused (old kernels, some sandboxes), a daemon thread reads
``/proc/self/statm`` every ``interval_s`` seconds and keeps the maximum; it can miss a
peak shorter than the interval, so ``method`` says which one produced the number.
Both were checked on the reference machine (a container): ``clear_refs`` works there and
is the default. Either is exact only to the kernel's batching of per-thread RSS counters
(up to 64 pages per thread), a few hundred KiB.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

from ..interruptible import Latch

__all__ = ["RSSPeak", "current_rss_bytes", "hwm_bytes", "reset_hwm"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def current_rss_bytes() -> int:
    """Resident set size of this process now (bytes); 0 where ``/proc`` is missing."""
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def hwm_bytes() -> int:
    """``VmHWM`` of this process (peak RSS since start or the last reset), bytes; 0 if unknown."""
    try:
        with open("/proc/self/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0


def reset_hwm() -> bool:
    """Reset ``VmHWM`` to the current RSS (NOTE [Resettable RSS peak]); True if it worked."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
    except OSError:
        return False
    return hwm_bytes() > 0


class RSSPeak:
    """Peak RSS of this process since :meth:`reset`, and relative to a base level.

    Args:
        interval_s: Sampling interval of the fallback thread (NOTE [Resettable RSS peak]).
        method: ``"auto"`` (``vmhwm`` where the kernel allows, else ``sampled``),
            ``"vmhwm"`` or ``"sampled"``.
    """

    def __init__(self, interval_s: float = 0.002, method: str = "auto") -> None:
        if method not in ("auto", "vmhwm", "sampled"):
            raise ValueError(f"megatron_ssd: RSSPeak(method={method!r}): must be 'auto', 'vmhwm' or 'sampled'")
        if interval_s <= 0:
            raise ValueError(f"megatron_ssd: RSSPeak(interval_s={interval_s}): must be > 0")
        if method == "auto":
            method = "vmhwm" if reset_hwm() else "sampled"
        elif method == "vmhwm" and not reset_hwm():
            raise OSError("megatron_ssd: RSSPeak(method='vmhwm'): /proc/self/clear_refs cannot reset VmHWM here")
        self.method = method
        """How the peak is measured: ``vmhwm`` (exact) or ``sampled`` (every ``interval_s``)."""
        self.interval_s = interval_s
        self.base_bytes = current_rss_bytes()
        self._peak = self.base_bytes
        self._lock = threading.Lock()
        self._stop = Latch()  # NOTE [Signals and condition locks] in interruptible.py
        self.samples = 0
        """How many times the sampling thread has read the RSS (``sampled`` only)."""
        self._thread: Optional[threading.Thread] = None
        if method == "sampled":
            self._thread = threading.Thread(target=self._sample, name="megatron_ssd-rss", daemon=True)
            self._thread.start()

    def mark_base(self) -> int:
        """Take the current RSS as the base level (e.g. right before the first forward)."""
        self.base_bytes = current_rss_bytes()
        return self.base_bytes

    def reset(self) -> None:
        """Restart the peak from the current RSS."""
        if self.method == "vmhwm":
            reset_hwm()
        else:
            with self._lock:
                self._peak = current_rss_bytes()

    def peak_bytes(self) -> int:
        """Peak RSS since the last :meth:`reset` (bytes)."""
        if self.method == "vmhwm":
            return max(hwm_bytes(), current_rss_bytes())
        with self._lock:
            self._peak = max(self._peak, current_rss_bytes())
            return self._peak

    def peak_above_base(self) -> int:
        """Peak since the last :meth:`reset` minus the base level (bytes, >= 0)."""
        return max(0, self.peak_bytes() - self.base_bytes)

    def close(self) -> None:
        """Stop the sampling thread, if any."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            rss = current_rss_bytes()
            with self._lock:
                if rss > self._peak:
                    self._peak = rss
                self.samples += 1

    def __enter__(self) -> "RSSPeak":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
