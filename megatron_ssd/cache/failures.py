"""Warnings about failed writes: once per offload path, then periodically with counts.

NOTE [Failed write warnings]: a write that fails keeps its tensor in memory (or in host
memory, or loses it after its device memory went: NOTE [Released at staging] in
``writes.py``), and each such failure used to log one line: a full disk gave about 24
a step, for as long as the run lasted. Now the first failure on each offload path is
told in full (bytes, layer, file, offset, errno), and the ones after it on the same
path are counted: at most one line per path every ``period_s`` (60 s) gives how many
writes and bytes failed there since the last line and the latest error, and one more
at close gives what was still uncounted. The step's ``write_fallbacks`` and
``bytes_fallen_back`` count every failure as before.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Dict, Hashable, List, Optional

from .exit_guard import EXIT_GUARD

__all__ = ["WriteFailures"]

logger = logging.getLogger("megatron_ssd")


class _Path:
    """What failed on one path since its last warning."""

    def __init__(self, name: str, now: float) -> None:
        self.name = name
        self.warned_at = now
        self.count = 0
        self.nbytes = 0
        self.outcomes: Dict[str, int] = {}
        self.last: Optional[BaseException] = None


class WriteFailures:
    """Rate-limited warnings for failed writes (NOTE [Failed write warnings]).

    Args:
        period_s: Seconds between two warnings about the same path.
        clock: Monotonic seconds (tests pass a fake).
    """

    def __init__(self, period_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.period_s = period_s
        self.clock = clock
        self._lock = threading.Lock()
        self._paths: Dict[Hashable, _Path] = {}

    @staticmethod
    def path_of(store: Any, error: Optional[BaseException]) -> Hashable:
        """The offload path a failed write of ``store`` went to, as far as ``error`` says
        (its ``path_index``); the store itself where it does not."""
        index = getattr(error, "path_index", None)
        paths = getattr(getattr(store, "engine", None), "paths", ())
        if isinstance(index, int) and 0 <= index < len(paths):
            return os.path.dirname(paths[index])
        kind = getattr(store, "kind", "ssd")
        return "the host pool" if kind == "host" else "the offload paths"

    def failed(self, store: Any, nbytes: int, layer: Hashable, outcome: str, error: BaseException) -> None:
        """A write of ``nbytes`` (layer ``layer``) failed with ``error``; ``outcome`` says
        where its tensor is now (``kept in memory instead``, ...). Nothing is said while
        the process is dying of a signal (NOTE [Cleanup before the handler runs])."""
        if EXIT_GUARD.dying:
            return
        key = self.path_of(store, error)
        now = self.clock()
        with self._lock:
            path = self._paths.get(key)
            if path is None:
                self._paths[key] = _Path(str(key), now)
                first = True
            else:
                first = False
                path.count += 1
                path.nbytes += nbytes
                path.outcomes[outcome] = path.outcomes.get(outcome, 0) + 1
                path.last = error
                due = now - path.warned_at >= self.period_s
                if due:
                    lines = self._take(path, now)
        if first:
            logger.warning("megatron_ssd: write of %d bytes (layer %r) failed, %s: %s; later failed writes to %s "
                           "are counted and reported every %g s", nbytes, layer, outcome, error, key, self.period_s)
        elif due:
            self._say(lines)

    def flush(self) -> None:
        """Report what is counted and not yet reported (at close)."""
        with self._lock:
            lines = [line for path in self._paths.values() if path.count for line in self._take(path, self.clock())]
        self._say(lines)

    def _take(self, path: _Path, now: float) -> List[Any]:
        """The summary of ``path`` since its last warning; its counts start again. Caller
        holds the lock."""
        outcomes = ", ".join(f"{n} {outcome}" for outcome, n in path.outcomes.items())
        lines = [(path.count, path.nbytes, path.name, now - path.warned_at, outcomes, path.last)]
        path.count = path.nbytes = 0
        path.outcomes = {}
        path.last = None
        path.warned_at = now
        return lines

    @staticmethod
    def _say(lines: List[Any]) -> None:
        for count, nbytes, name, seconds, outcomes, last in lines:
            logger.warning("megatron_ssd: %d more write(s), %d bytes, to %s failed in the last %.0f s (%s); the last: "
                           "%s", count, nbytes, name, seconds, outcomes, last)
