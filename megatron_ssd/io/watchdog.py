"""Warnings for requests that make no progress: a stalled drive must not hang training silently.

A read or write that waits on a drive that stopped answering blocks its worker, and
sooner or later the training thread waiting for it, with no message at all. The engine
registers each request with a :class:`StallWatchdog` (``begin`` / ``progress`` /
``end``); the watchdog's thread logs a WARNING naming the operation, the file, the
offset, the bytes and the seconds waited once a request has made no progress for
``io.stall_warning_s``, and again every ``io.stall_warning_s`` while it stays stuck.
It changes nothing else: a request that finishes late completes as usual.

The calls around the data path are watched alike (:func:`watched`): creating the run
directory, its marker and the data files, growing a file (``posix_fallocate`` /
``ftruncate``), flushing, unlinking and removing; a stalled drive or a frozen
filesystem blocks those as surely as a read. ``megatron-ssd clean`` watches its
listings, unlinks and removals with a watchdog of its own (``--stall-warning-s``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from typing import Dict, Iterator, List, Optional

from ..interruptible import Latch

__all__ = ["StallWatchdog", "watched"]

logger = logging.getLogger("megatron_ssd")


class StallWatchdog:
    """Watches the requests in flight; see the module docstring.

    Args:
        threshold_s: Seconds without progress before the first warning, and between
            warnings of one request (``io.stall_warning_s``; > 0).
        setting: What the warning names as the source of ``threshold_s``.
        waiter: What the warning says waits for the stuck request.
    """

    def __init__(self, threshold_s: float, setting: str = "io.stall_warning_s", waiter: str = "training") -> None:
        self.threshold_s = threshold_s
        self.setting = setting
        self.waiter = waiter
        self._lock = threading.Lock()
        self._stop = Latch()  # NOTE [Signals and condition locks] in interruptible.py
        self._ids = itertools.count()
        self._requests: Dict[int, List] = {}  # id -> [op, file, offset, nbytes, since, last warning]
        self._thread = threading.Thread(target=self._loop, name="megatron_ssd-stall-watchdog", daemon=True)
        self._thread.start()

    def begin(self, op: str, file: str, offset: int, nbytes: int) -> int:
        """Register a request that starts now; returns its token."""
        token = next(self._ids)
        with self._lock:
            self._requests[token] = [op, file, offset, nbytes, time.monotonic(), 0.0]
        return token

    def progress(self, token: int, offset: int, nbytes: int) -> None:
        """The request moved bytes: it now waits for ``nbytes`` at ``offset``, since now."""
        with self._lock:
            req = self._requests.get(token)
            if req is not None:
                req[2:6] = [offset, nbytes, time.monotonic(), 0.0]

    def end(self, token: int) -> None:
        """The request finished (or failed)."""
        with self._lock:
            self._requests.pop(token, None)

    def stop(self) -> None:
        """Stop the watchdog's thread; idempotent."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _loop(self) -> None:
        period = min(max(self.threshold_s / 4, 0.01), 5.0)
        while not self._stop.wait(period):
            now = time.monotonic()
            stuck = []
            with self._lock:
                for req in self._requests.values():
                    op, file, offset, nbytes, since, warned = req
                    if now - since >= self.threshold_s and now - max(warned, since) >= self.threshold_s:
                        req[5] = now
                        stuck.append((op, file, offset, nbytes, now - since))
            for op, file, offset, nbytes, waited in stuck:
                what = f"{op} of {nbytes} bytes at offset {offset} of {file}" if nbytes else f"{op} of {file}"
                logger.warning(
                    "megatron_ssd: %s has made no progress for %.1f s (%s = %g): the drive may be stalled; %s "
                    "waits for it", what, waited, self.setting, self.threshold_s, self.waiter,
                )


@contextlib.contextmanager
def watched(watchdog: Optional[StallWatchdog], op: str, file: str, offset: int = 0, nbytes: int = 0) -> Iterator[None]:
    """Run the body as one request of ``watchdog`` (nothing when it is None): a disk call
    outside the data path (``create``, ``allocate``, ``fsync``, ``unlink``, ...) of
    ``file``, ``nbytes`` at ``offset`` where it has a size."""
    if watchdog is None:
        yield
        return
    token = watchdog.begin(op, file, offset, nbytes)
    try:
        yield
    finally:
        watchdog.end(token)
