"""Admission: the bound on the bytes of writes in flight, and the backpressure it makes.

:class:`Admission` counts the payload bytes of the writes a
:class:`~megatron_ssd.io.striped.StripedEngine` has accepted and not yet finished, and
holds a new write back while it would take them over ``io.max_inflight_bytes``: the
caller waits (``io.on_backpressure: wait``) or is told no (``keep``: the cache then
keeps the tensor in memory). It times those waits and keeps the peak. It knows nothing of blocks,
paths or files.
"""

from __future__ import annotations

import threading
import time
from typing import Tuple

from ..errors import OffloadIOError

__all__ = ["Admission"]


class Admission:
    """The in-flight bound on writes (NOTE [Backpressure]).

    Args:
        bound: ``io.max_inflight_bytes``.
    """

    # The lock the Condition shares with the workers is entered as ``with self._lock:``,
    # never through the Condition: NOTE [Signals and condition locks] in interruptible.py.

    # NOTE [Backpressure]: a write is admitted while in-flight payload + n stays
    # within io.max_inflight_bytes, or when nothing is in flight at all (a blob
    # bigger than the bound must not wait forever). The bytes are released by the
    # worker finishing the blob, before its future completes (NOTE [Blob completion]
    # in ``striped.py``).

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)  # entered as self._lock (see above)
        self._inflight = 0
        self._closed = False
        self._peak = 0
        self._wait_s = 0.0

    def admit(self, n: int, block: bool) -> bool:
        """Reserve ``n`` in-flight bytes; see NOTE [Backpressure].

        Args:
            n: the write's payload bytes.
            block: wait for room; otherwise return False at once when there is none.

        Returns:
            Whether the bytes were reserved (always, when ``block``).

        Raises:
            OffloadIOError: the engine closed while the write waited.
        """
        with self._lock:
            fits = lambda: self._closed or self._inflight == 0 or self._inflight + n <= self.bound  # noqa: E731
            if not fits():
                if not block:
                    return False
                start = time.perf_counter()
                self._cv.wait_for(fits)
                self._wait_s += time.perf_counter() - start
                if self._closed:
                    raise OffloadIOError("the I/O engine is closed")
            self._inflight += n
            self._peak = max(self._peak, self._inflight)
        return True

    def release(self, n: int) -> None:
        """The write of ``n`` bytes finished (or never started): wake the writers waiting."""
        with self._lock:
            self._inflight -= n
            self._cv.notify_all()

    def close(self) -> None:
        """Wake every waiting writer; each then raises (the engine is closed)."""
        with self._lock:
            self._closed = True
            self._cv.notify_all()

    def snapshot(self) -> Tuple[int, int, float]:
        """Bytes in flight now, their peak, and the seconds writers waited in all."""
        with self._lock:
            return self._inflight, self._peak, self._wait_s
