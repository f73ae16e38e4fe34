"""Removal of offload files at process exit and on SIGTERM / SIGINT (NOTE [Exit cleanup])."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import weakref
from typing import Any, Dict, List

__all__ = ["EXIT_GUARD"]

logger = logging.getLogger("megatron_ssd")


# NOTE [Exit cleanup]
# Offload files must not outlive their process. Normal exits close the caches: ``with``
# blocks, close(), else the atexit hook below, which also runs after an uncaught
# KeyboardInterrupt (Python's SIGINT handler). A signal left at its default action
# (SIGTERM; SIGINT where SIG_DFL was restored) kills the process without unwinding, so
# while a cache is open the main thread installs one handler for SIGTERM and SIGINT:
#   * the previous handler is a Python callable (Python's SIGINT handler, a launcher's
#     graceful-exit handler): it is called and nothing else happens here; the process
#     unwinds or carries on, and closes its caches as usual;
#   * the previous action is SIG_DFL: every open cache's run directories are deleted
#     now, without waiting for I/O or taking a lock (the handler may have interrupted
#     the main thread while it held one), then SIG_DFL is restored and the signal
#     raised again, so the process dies of it as it would have;
#   * SIG_IGN (or a handler installed outside Python): left as it is.
# The handler goes in when the first cache opens and the previous ones come back when
# the last closes (only if ours is still installed; from the main thread). A forked
# child inherits the handler but deletes nothing: files belong to the pid that made
# them. SIGKILL cannot be caught; the next start removes what it leaves
# (:func:`megatron_ssd.io.rundir.remove_stale_runs`).


class _ExitGuard:
    """Process-wide signal and atexit cleanup of open caches; see NOTE [Exit cleanup]."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._caches: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._previous: Dict[int, Any] = {}
        self._atexit = False

    def add(self, cache: Any) -> None:
        with self._lock:
            if not self._atexit:
                atexit.register(self._at_exit)
                self._atexit = True
            self._caches.add(cache)
            if self._previous or threading.current_thread() is not threading.main_thread():
                return
            for sig in self.SIGNALS:
                previous = signal.getsignal(sig)
                if previous is None or previous == signal.SIG_IGN:
                    continue
                signal.signal(sig, self._on_signal)
                self._previous[sig] = previous

    def discard(self, cache: Any) -> None:
        with self._lock:
            self._caches.discard(cache)
            if len(self._caches) or not self._previous:
                return
            if threading.current_thread() is not threading.main_thread():
                return
            for sig, previous in self._previous.items():
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, previous)
            self._previous.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        previous = self._previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
            return
        caches: List[Any] = []
        for _ in range(3):  # another thread may open or close a cache meanwhile
            try:
                caches = list(self._caches)
                break
            except RuntimeError:
                continue
        for cache in caches:
            cache._remove_files_now()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def _at_exit(self) -> None:
        for cache in list(self._caches):
            if cache._pid == os.getpid():
                try:
                    cache.close()
                except Exception:  # noqa: BLE001 - exiting anyway; the next start cleans up
                    logger.exception("megatron_ssd: closing a tensor cache at exit failed")


EXIT_GUARD = _ExitGuard()
"""The process-wide guard every TensorCache registers with."""
