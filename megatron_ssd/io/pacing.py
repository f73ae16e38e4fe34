"""Pace a copy engine to a link's rate (the host tier's copies on a machine whose copies are
memory-speed: NOTE [Host copy rate])."""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional, Tuple

from ..config import _parse_size
from ..errors import ConfigError

__all__ = ["RateLimiter", "parse_rate"]


# NOTE [Host copy rate]
# blkio throttles a block device; the host tier copies memory to memory, which no cgroup
# limits, and on a CPU it copies at memory speed (several GB/s) against a compute that is
# a thousand times slower per byte than a GPU's. So the host engine paces its own copies
# (``OffloadConfig.host_copy_bytes_per_s``): each direction is a link of its own, modelled
# as one transfer at a time at the given rate, a transfer starting when it was queued or
# when the one before it on that link ended, whichever is later, and ending its bytes /
# rate later. The copy itself runs at once; the engine completes the transfer's future
# (and so frees its source, NOTE [Staged writes]) only at that end. The tensor therefore
# stays in memory as long as it would behind a link of that speed, and a read is late by
# as much, which is what a GPU's PCIe link does to Megatron's and Transformer Engine's
# host offloading. The engine's busy time is the link's (bytes / rate per transfer), so
# the measured bandwidth is the rate.


class RateLimiter:
    """One direction of a link that carries ``bytes_per_s`` (NOTE [Host copy rate]).

    Args:
        bytes_per_s: the link's rate.
        clock: seconds, monotonic (tests pass a fake).
        sleep: waits that many seconds (tests pass a fake).

    Raises:
        ConfigError: a rate that is not > 0.
    """

    def __init__(self, bytes_per_s: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if isinstance(bytes_per_s, bool) or not isinstance(bytes_per_s, (int, float)) or not bytes_per_s > 0:
            raise ConfigError(f"OffloadConfig.host_copy_bytes_per_s = {bytes_per_s!r}: must be a rate > 0 bytes per "
                              "second")
        self.bytes_per_s = float(bytes_per_s)
        self.clock = clock
        self.sleep = sleep
        self._free_at = float("-inf")
        self._lock = threading.Lock()

    def schedule(self, nbytes: int, queued_at: float) -> Tuple[float, float]:
        """Book a transfer of ``nbytes`` queued at ``queued_at``: its (start, end) times."""
        with self._lock:
            start = max(queued_at, self._free_at)
            end = start + nbytes / self.bytes_per_s
            self._free_at = end
        return start, end

    def pace(self, nbytes: int, queued_at: float) -> float:
        """Book the transfer and wait until it ends; returns the link's busy seconds
        (``nbytes / bytes_per_s``)."""
        start, end = self.schedule(nbytes, queued_at)
        wait = end - self.clock()
        if wait > 0:
            self.sleep(wait)
        return end - start


def parse_rate(owner: str, flag: str, text: Optional[str]) -> Optional[int]:
    """Bytes per second from ``50MiB`` or ``1.5e8``; None for no text. A ConfigError
    names ``owner.flag`` and the text when it is not a size."""
    return None if text is None else _parse_size(owner, flag, text)
