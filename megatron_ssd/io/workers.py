"""The engines' worker pool: threads draining one priority queue, reads before writes.

A plain ``ThreadPoolExecutor`` has one FIFO queue: a prefetch for backward would wait
behind the forward pass's offload traffic. :class:`Workers` keeps one priority queue
(``READ`` before ``WRITE``, FIFO within each) and runs every thread at ``io.priority``
(:func:`set_thread_priority`) before the first task::

    workers = Workers(4, "megatron_ssd-io", "normal")
    workers.submit(READ, fn, arg)
    workers.shutdown()   # runs what is queued, then stops the threads
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from typing import Any, Callable, List

from ..interruptible import Latch, TaskQueue

__all__ = ["READ", "WRITE", "Workers", "set_thread_priority"]

logger = logging.getLogger(__name__)

READ, WRITE, _STOP = 0, 1, 2  # queue priorities: reads overtake queued writes


class Workers:
    """``n`` threads draining one priority queue (reads before writes, FIFO within).

    The main thread submits and shuts down, so the queue and the start-up handshake are
    built from :mod:`megatron_ssd.interruptible`, not ``queue`` and ``threading.Barrier``
    (NOTE [Signals and condition locks] in ``interruptible.py``).
    """

    def __init__(self, n: int, name: str, priority: str = "normal") -> None:
        self._q = TaskQueue()  # items: (priority, sequence, fn or None, args)
        self._seq = itertools.count()
        self._priority = priority
        self._ready: List[Latch] = [Latch() for _ in range(n)]
        """Per worker: it runs at its priority (set by the worker)."""
        self._threads = [
            threading.Thread(target=self._loop, args=(i,), name=f"{name}-{i}", daemon=True) for i in range(n)
        ]
        started = []
        try:
            for t in self._threads:
                t.start()
                started.append(t)
        except BaseException:  # the threads already running wait for a task: stop them
            self._stop(started)
            raise
        for ready in self._ready:  # every worker runs at its priority before the first task
            ready.wait()

    def submit(self, priority: int, fn: Callable[..., None], *args: Any) -> None:
        self._q.put((priority, next(self._seq), fn, args))

    def _loop(self, index: int) -> None:
        if not set_thread_priority(self._priority) and index == 0:
            logger.warning("megatron_ssd: io.priority = %r could not be applied on this system (Linux "
                           "only); the I/O threads run at normal priority", self._priority)
        self._ready[index].set()
        while True:
            _, _, fn, args = self._q.get()
            if fn is None:
                return
            try:
                fn(*args)
            except BaseException:  # a task must never kill its worker
                logger.exception("megatron_ssd: I/O task raised")
            # An idle worker must not keep its last task: a failed read's error, raised
            # in backward, carries the frames that hold the whole autograd graph, which
            # stayed alive (every saved tensor with it) until this worker's next task.
            fn = args = None

    def shutdown(self) -> None:
        """Run what is queued, then stop the threads and wait for them."""
        self._stop(self._threads)

    def _stop(self, threads: List[threading.Thread]) -> None:
        for _ in threads:
            self._q.put((_STOP, next(self._seq), None, ()))
        for t in threads:
            if t is not threading.current_thread():
                t.join()


def set_thread_priority(priority: str) -> bool:
    """Lower the calling thread's scheduling priority (``io.priority``); True if applied.

    ``low``: nice 19 for this thread only (Linux threads have their own nice value);
    ``idle``: ``SCHED_IDLE``. Lowering needs no privilege. ``normal`` changes nothing.
    """
    if priority == "normal":
        return True
    try:
        tid = threading.get_native_id()
        if priority == "idle":
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        else:
            os.setpriority(os.PRIO_PROCESS, tid, 19)
        return True
    except (AttributeError, OSError):
        return False
