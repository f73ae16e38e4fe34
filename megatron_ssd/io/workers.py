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
import queue
import threading
from typing import Any, Callable, Optional, Tuple

__all__ = ["READ", "WRITE", "Workers", "set_thread_priority"]

logger = logging.getLogger(__name__)

READ, WRITE, _STOP = 0, 1, 2  # queue priorities: reads overtake queued writes


class Workers:
    """``n`` threads draining one priority queue (reads before writes, FIFO within)."""

    def __init__(self, n: int, name: str, priority: str = "normal") -> None:
        self._q: "queue.PriorityQueue[Tuple[int, int, Optional[Callable[..., None]], tuple]]" = queue.PriorityQueue()
        self._seq = itertools.count()
        self._priority = priority
        self._started = threading.Barrier(n + 1)
        self._threads = [
            threading.Thread(target=self._loop, args=(i,), name=f"{name}-{i}", daemon=True) for i in range(n)
        ]
        started = []
        try:
            for t in self._threads:
                t.start()
                started.append(t)
        except BaseException:
            # the threads already running wait on the barrier: break it so they return
            self._started.abort()
            for t in started:
                t.join()
            raise
        self._started.wait()  # every worker runs at its priority before the first task

    def submit(self, priority: int, fn: Callable[..., None], *args: Any) -> None:
        self._q.put((priority, next(self._seq), fn, args))

    def _loop(self, index: int) -> None:
        if not set_thread_priority(self._priority) and index == 0:
            logger.warning("megatron_ssd: io.priority = %r could not be applied on this system (Linux "
                           "only); the I/O threads run at normal priority", self._priority)
        try:
            self._started.wait()
        except threading.BrokenBarrierError:  # a later worker failed to start
            return
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
        for _ in self._threads:
            self._q.put((_STOP, next(self._seq), None, ()))
        for t in self._threads:
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
