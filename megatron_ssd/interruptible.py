"""Synchronisation the main thread can be interrupted in: a one-way event and a priority
queue that no Ctrl-C leaves locked (NOTE [Signals and condition locks]).

The I/O engines' futures wait on :class:`Latch` and their worker pools drain a
:class:`TaskQueue`; the main thread waits on the first and fills the second thousands of
times a step, so a KeyboardInterrupt lands there sooner or later::

    done = Latch()
    done.wait(timeout=1.0)   # False: not set yet
    done.set()               # from any thread; every waiter returns True

    tasks = TaskQueue()
    tasks.put((0, 1, "read"))
    tasks.get()              # the smallest item first, waiting while there is none
"""

from __future__ import annotations

import heapq
import threading
import time
from typing import Any, List, Optional

__all__ = ["Latch", "TaskQueue"]

# NOTE [Signals and condition locks]
# Python runs a signal's handler on the main thread between bytecodes, and Ctrl-C's
# raises KeyboardInterrupt there, in whatever Python frame that is: the standard
# library's synchronisation included. ``threading.Condition.__enter__`` is a Python frame
# around the lock's acquire: the interrupt can land in it after the lock was taken and
# before the with-block was entered, so the block's exit never runs and the lock stays
# taken. ``threading.Event.wait`` and ``set``, ``queue.Queue.put`` and ``get``,
# ``threading.Semaphore`` and ``concurrent.futures`` all enter Conditions so. The
# engine's workers then wait for that lock for ever, and so does the main thread
# joining them while it closes the cache: ``megatron-ssd train`` given SIGINT on a
# loaded machine hung (seen in CI twice: first inside the write admission's Condition,
# then, with that fixed, with every thread in a futex wait behind an ``Event`` or the
# workers' ``PriorityQueue``). So:
#   * every lock a Condition shares with worker threads is a plain lock entered with
#     ``with lock:``, which takes it in C with no Python frame between the acquire and
#     the block; the Condition is built on it only to wait and notify, on the workers'
#     side (``Admission``, ``BufferPool``, the cache's write room);
#   * what the main thread waits on or fills is built here from plain locks only:
#     :class:`Latch` for the futures' events and the background threads' stop flags,
#     :class:`TaskQueue` for the worker pools. No stdlib Event, Queue, Semaphore,
#     Barrier or executor is used where the main thread meets a worker thread.
# ``tests/reliability/test_reliability_interruptible.py`` raises KeyboardInterrupt at each
# point of these calls where Python runs a signal handler, in turn, and checks that
# nothing is left locked, against ``threading.Event`` and ``queue.PriorityQueue`` as controls.

POLL_S = 0.05
"""How often a waiter looks at the flag itself: a wake-up lost to an interrupt in
:meth:`Latch.set` (after the flag, before the waiter's release) costs at most this."""


IDLE_POLL_S = 1.0
"""How often an idle :meth:`TaskQueue.get` looks at the queue itself: a wake-up lost to
an interrupt in :meth:`TaskQueue.put` (after the item, before the notify) costs at most
this, where no later put wakes it first."""


class Latch:
    """A flag set once and never cleared, with ``threading.Event``'s ``is_set``, ``set``
    and ``wait``, that an interrupt wherever Python can raise one in them leaves usable
    (NOTE [Signals and condition locks]).

    Each waiter blocks on a lock of its own, taken before it is listed; :meth:`set` sets
    the flag and takes the list under the latch's lock, then releases the waiters. A
    waiter also looks at the flag every :data:`POLL_S`, so one whose release an
    interrupt skipped still returns.
    """

    __slots__ = ("_lock", "_waiters", "_flag")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: List[Any] = []
        self._flag = False

    def is_set(self) -> bool:
        """Whether :meth:`set` was called."""
        return self._flag

    def set(self) -> None:
        """Set the flag and wake every waiter."""
        with self._lock:
            self._flag = True
            waiters, self._waiters = self._waiters, []
        for waiter in waiters:  # each held since it was listed, listed once: released once
            waiter.release()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait until the flag is set, or ``timeout`` seconds; return the flag."""
        if self._flag:
            return True
        if timeout is not None and timeout <= 0:
            return False
        deadline = None if timeout is None else time.monotonic() + timeout
        waiter = threading.Lock()
        waiter.acquire()
        with self._lock:
            if self._flag:
                return True
            self._waiters.append(waiter)
        while not self._flag:
            left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if left <= 0 or waiter.acquire(True, left):
                break
        if not self._flag:  # timed out: stop being listed
            with self._lock:
                if waiter in self._waiters:  # locks compare by identity
                    self._waiters.remove(waiter)
        return self._flag


class TaskQueue:
    """An unbounded priority queue (smallest item first) whose :meth:`put` an interrupt
    wherever Python can raise one leaves usable (NOTE [Signals and condition locks]): the
    main thread puts, worker threads get."""

    def __init__(self) -> None:
        self._items: List[Any] = []
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)  # entered as self._lock

    def put(self, item: Any) -> None:
        """Add ``item``; wake one waiting :meth:`get`."""
        with self._lock:
            heapq.heappush(self._items, item)
            self._ready.notify()

    def get(self) -> Any:
        """Remove and return the smallest item, waiting while there is none."""
        with self._lock:
            while not self._items:
                self._ready.wait(IDLE_POLL_S)  # a notify an interrupted put skipped is not waited for
            return heapq.heappop(self._items)

    def __len__(self) -> int:
        return len(self._items)
