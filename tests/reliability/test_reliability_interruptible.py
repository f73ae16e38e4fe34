"""NOTE [Signals and condition locks]: a KeyboardInterrupt raised wherever Python can raise
one in what the main thread calls into the I/O engines' synchronisation leaves no lock
taken and no worker stuck. Each test raises it at the 1st, 2nd, ... point of the call where
Python 3.12 would run a signal handler, in turn (every frame the call runs, the standard
library's included: :func:`_signal_points`), until the call runs to its end, and checks the
locks after each. The
standard library's ``threading.Event`` and ``queue.PriorityQueue`` are the controls: the
same interrupts leave their locks taken, which is how ``megatron-ssd train`` hung on
Ctrl-C."""

from __future__ import annotations

import os
import queue
import sys
import threading
from typing import Callable, Iterator, Optional, Tuple

import pytest

from megatron_ssd.interruptible import Latch, TaskQueue
from megatron_ssd.io.base import IOFuture
from megatron_ssd.io.workers import WRITE, Workers
from waits import HANG_S  # tests/waits.py

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

needs_monitoring = pytest.mark.skipif(not hasattr(sys, "monitoring"),
                                reason="models where Python 3.12's interpreter runs signal handlers "
                                       "(sys.monitoring, Python 3.12 and later)")


def interrupted_at(k: int, call: Callable[[], object]) -> Tuple[bool, Optional[BaseException]]:
    """Run ``call()`` with KeyboardInterrupt raised at the ``k``-th point where Python 3.12
    would run a pending signal's handler on this thread (:func:`_signal_points`); whether it
    was raised (False: the call passed fewer such points) and the exception the call ended with."""
    _, fired, error = _signal_points(k, call)
    return fired, error


def _points(call: Callable[[], object]) -> int:
    """How many signal-check points ``call()`` passes on this thread (:func:`_signal_points`)."""
    passed, _, error = _signal_points(None, call)
    if error is not None:
        raise error
    return passed


def _signal_points(k: Optional[int], call: Callable[[], object]) -> Tuple[int, bool, Optional[BaseException]]:
    """Run ``call()``, counting the points where Python 3.12 would run a pending signal's
    handler on this thread and raising KeyboardInterrupt at the ``k``-th (None: none); the
    points passed, whether it was raised, and the exception the call ended with.

    Those points are CPython's eval-breaker checks: a function's start or a generator's
    resumption (``RESUME``: ``sys.monitoring``'s PY_START and PY_RESUME), the end of a
    call to a C function (after the call, in its ``CALL`` instruction: C_RETURN), and a
    backward jump. The first two raise from the event's callback, which propagates from
    there. A signal at a backward jump is raised with the jump already taken and looked
    up in the exception table just before its target, while an exception from the JUMP
    callback is looked up at the jump itself, which the compiler leaves outside a with
    statement's range when a loop ends the block (the lock's exit then seemed to be
    skipped; a real SIGINT there releases it): so the JUMP callback only marks the point,
    and the INSTRUCTION event of the target raises. ``with lock:`` takes the lock in
    ``BEFORE_WITH``, which checks for none."""
    mon = sys.monitoring
    events = mon.events
    tool, me = mon.DEBUGGER_ID, threading.get_ident()
    here = (_signal_points.__code__, _calling.__code__)
    state = {"count": 0, "armed": False, "at_target": False, "fired": False}

    def counted(code) -> bool:
        if not state["armed"] or code in here or threading.get_ident() != me:
            return False
        state["count"] += 1
        return state["count"] == k

    def point(code, *_):
        if counted(code):
            state["fired"] = True
            raise KeyboardInterrupt

    def jump(code, src, dest):
        if dest <= src and counted(code):
            state["at_target"] = True

    def instruction(code, offset):
        if state["at_target"] and threading.get_ident() == me:
            state["at_target"] = False
            state["fired"] = True
            raise KeyboardInterrupt

    callbacks = {events.PY_START: point, events.PY_RESUME: point, events.C_RETURN: point, events.JUMP: jump,
                 events.INSTRUCTION: instruction}
    mon.use_tool_id(tool, "interrupt at each signal check")
    try:
        for event, fn in callbacks.items():
            mon.register_callback(tool, event, fn)
        mon.set_events(tool, events.PY_START | events.PY_RESUME | events.JUMP | events.INSTRUCTION | events.CALL
                       | events.C_RETURN | events.C_RAISE)  # C_RETURN only comes with CALL and C_RAISE
        try:
            state["armed"] = True
            _calling(call)
        except BaseException as e:  # noqa: BLE001 - what the interrupt turned into is the point
            return state["count"], state["fired"], e
        finally:
            state["armed"] = False
        return state["count"], state["fired"], None
    finally:
        mon.set_events(tool, 0)
        for event in callbacks:
            mon.register_callback(tool, event, None)
        mon.free_tool_id(tool)


def _calling(call: Callable[[], object]) -> None:
    call()


def every_interrupt(make: Callable[[], object], call: Callable[[object], object]) -> Iterator[tuple]:
    """``(k, subject, exception)`` for k = 1, 2, ...: ``call(make())`` interrupted before its
    k-th signal-check point, until a k past its end (at least one interrupt is asserted)."""
    k = 0
    while True:
        k += 1
        subject = make()
        fired, error = interrupted_at(k, lambda: call(subject))
        if not fired:
            assert error is None and k > 2, (k, error)  # past the call's end (after at least 2 interrupts)
            return
        yield k, subject, error


def _returns(fn: Callable[[], object]) -> object:
    """``fn()`` on a thread of its own; its result, failing if it has not returned after HANG_S."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(HANG_S)
    assert not t.is_alive(), f"{fn} did not return in {HANG_S:g} s: a lock was left taken"
    return out[0]


def _waiting(latch: Latch, n: int) -> list:
    """``n`` threads waiting on ``latch``, each listed (its wait has begun)."""
    threads = [threading.Thread(target=latch.wait, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    while len(latch._waiters) < n:
        threading.Event().wait(0.001)
    return threads


@needs_monitoring
def test_an_interrupt_anywhere_in_latch_wait_leaves_it_usable():
    for timeout in (None, 0.0, 0.001):
        def make():
            latch = Latch()
            if timeout is None:  # a wait with no timeout returns once set: set it from another thread
                threading.Timer(0.001, latch.set).start()
            return latch
        for k, latch, error in every_interrupt(make, lambda latch: latch.wait(timeout)):
            assert type(error) is KeyboardInterrupt, (timeout, k, error)
            assert not latch._lock.locked(), (timeout, k)
            _returns(latch.set)
            assert latch.is_set() and _returns(latch.wait) is True


@needs_monitoring
def test_an_interrupt_anywhere_in_latch_set_still_wakes_the_waiters():
    waiters = []

    def make():
        latch = Latch()
        waiters[:] = _waiting(latch, 2)
        return latch

    for k, latch, error in every_interrupt(make, lambda latch: latch.set()):
        assert type(error) is KeyboardInterrupt, (k, error)
        assert not latch._lock.locked(), k
        _returns(latch.set)  # set again: a waiter the interrupted set took off the list finds the flag itself
        for t in waiters:
            t.join(HANG_S)
            assert not t.is_alive(), k
        assert _returns(latch.wait) is True


@needs_monitoring
def test_an_interrupt_anywhere_in_task_queue_put_leaves_it_usable():
    got = []

    def make():
        q = TaskQueue()
        t = threading.Thread(target=lambda: got.append(q.get()), daemon=True)
        t.start()
        return q, t

    for k, (q, t), error in every_interrupt(make, lambda qt: qt[0].put((1, "interrupted"))):
        assert type(error) is KeyboardInterrupt, (k, error)
        assert not q._lock.locked(), k
        q.put((2, "after"))
        t.join(HANG_S)  # the waiting get takes one of the two
        assert not t.is_alive(), k
        items = [got[-1]] + [_returns(q.get) for _ in range(len(q))]
        assert sorted(items) in ([(2, "after")], [(1, "interrupted"), (2, "after")]), (k, items)


@needs_monitoring
def test_an_interrupt_anywhere_in_a_submit_lets_the_workers_shut_down():
    ran, made = [], []

    def make():
        made.append(Workers(2, "interrupted"))
        return made[-1]

    for k, workers, error in every_interrupt(make, lambda w: w.submit(WRITE, ran.append, 1)):
        assert type(error) is KeyboardInterrupt, (k, error)
        _returns(workers.shutdown)
    for k, workers, error in every_interrupt(make, lambda w: w.shutdown()):
        assert type(error) is KeyboardInterrupt, (k, error)
        _returns(workers.shutdown)
    for workers in made:  # the last of each loop ran uninterrupted; shutting down twice is harmless
        _returns(workers.shutdown)
    assert ran  # the submit that was not interrupted ran


@needs_monitoring
@pytest.mark.parametrize("wait", ["get", "wait_settled"])
def test_an_interrupt_anywhere_in_a_wait_for_an_io_future_lets_its_worker_complete_it(wait):
    def call(fut):
        if wait == "wait_settled":
            return fut.wait_settled(0.001)
        try:
            fut.get(timeout=0.001)
        except TimeoutError:
            return None
        raise AssertionError("get() of a pending future returned")

    for k, fut, error in every_interrupt(IOFuture, call):
        assert type(error) is KeyboardInterrupt, (k, error)
        _returns(lambda: fut.set_result(7))  # the engine's worker completes it
        assert fut.get() == 7 and fut.wait_settled() is True


@needs_monitoring
def test_the_standard_library_controls_are_left_locked_by_some_interrupt():
    """Why the package does not use them where the main thread meets a worker: the same
    interrupts leave ``Event``'s and ``PriorityQueue``'s locks taken, and the worker that
    sets the event or takes from the queue then waits for ever."""
    left = [k for k, event, _ in every_interrupt(threading.Event, lambda e: e.wait(0.0)) if event._cond._lock.locked()]
    assert left, "threading.Event.wait: no interrupt left its lock taken"
    left = [k for k, q, _ in every_interrupt(queue.PriorityQueue, lambda q: q.put((1, "x"))) if q.mutex.locked()]
    assert left, "queue.PriorityQueue.put: no interrupt left its lock taken"


def _conditions_entered_by_with(source: str):
    """``(line, name)`` of each ``with self.NAME:`` whose NAME the same source assigns a
    ``threading.Condition(...)`` to."""
    import ast

    tree = ast.parse(source)
    conditions = {t.attr for node in ast.walk(tree) if isinstance(node, ast.Assign)
                  and isinstance(node.value, ast.Call) and getattr(node.value.func, "attr", None) == "Condition"
                  for t in node.targets if isinstance(t, ast.Attribute)}
    return [(node.lineno, item.context_expr.attr) for node in ast.walk(tree) if isinstance(node, ast.With)
            for item in node.items if isinstance(item.context_expr, ast.Attribute)
            and item.context_expr.attr in conditions]


def test_no_condition_shared_with_workers_is_entered_through_its_python_enter():
    """NOTE [Signals and condition locks]: Ctrl-C landing in Condition.__enter__ after it
    took the lock left the lock taken, and ``megatron-ssd train`` hung joining the I/O
    workers that waited for it (in CI, and in 1 of 5 runs beside a CPU burner). Every Condition is
    entered through its plain lock instead."""
    import pathlib

    package = pathlib.Path(REPO) / "megatron_ssd"
    found = {str(p.relative_to(package)): hits for p in sorted(package.rglob("*.py"))
             if (hits := _conditions_entered_by_with(p.read_text(encoding="utf-8")))}
    assert found == {}
    planted = "import threading\nclass A:\n    def __init__(self):\n        self._cv = threading.Condition()\n" \
              "    def f(self):\n        with self._cv:\n            pass\n"
    assert _conditions_entered_by_with(planted) == [(6, "_cv")]


STDLIB_SYNC = {"Event", "Semaphore", "BoundedSemaphore", "Barrier", "Queue", "PriorityQueue", "LifoQueue",
               "ThreadPoolExecutor"}
"""The standard library's synchronisation that enters Conditions through their Python
``__enter__`` (the executor through its futures and idle semaphore)."""

WORKERS_ONLY = {("io/striped.py", "BoundedSemaphore"):
                "io_slots: taken and given back by the engine's workers only, around each transfer"}
"""Where one is used all the same, and why no main thread meets it."""


def _stdlib_sync_built(source: str):
    """``(line, name)`` of each ``threading.X(...)``, ``queue.X(...)`` or
    ``ThreadPoolExecutor(...)`` built in ``source`` with X in STDLIB_SYNC."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in ("threading", "queue") \
                and f.attr in STDLIB_SYNC:
            found.append((node.lineno, f.attr))
        elif isinstance(f, ast.Name) and f.id in STDLIB_SYNC:
            found.append((node.lineno, f.id))
    return found


def test_the_package_builds_no_stdlib_synchronisation_a_main_thread_could_be_interrupted_in():
    """NOTE [Signals and condition locks]: the futures' events, the workers' queues and the
    background threads' stop flags are :mod:`megatron_ssd.interruptible`'s."""
    import pathlib

    package = pathlib.Path(REPO) / "megatron_ssd"
    found = {(str(p.relative_to(package)), name) for p in sorted(package.rglob("*.py"))
             for _, name in _stdlib_sync_built(p.read_text(encoding="utf-8"))}
    assert found == set(WORKERS_ONLY)
    planted = "import threading, queue\nfrom concurrent.futures import ThreadPoolExecutor\n" \
              "e = threading.Event()\nq = queue.PriorityQueue()\nx = ThreadPoolExecutor(1)\n"
    assert _stdlib_sync_built(planted) == [(3, "Event"), (4, "PriorityQueue"), (5, "ThreadPoolExecutor")]


def _offloaded_step(cache, model, batch) -> None:
    with cache.microbatch():
        loss = model(batch).square().mean()
    loss.backward()
    cache.finish_step()


@pytest.mark.slow
@needs_monitoring
def test_an_interrupt_anywhere_in_an_offloaded_step_lets_the_cache_close_and_remove_its_files(tmp_path):
    """The whole of one training step with every layer offloaded through the real engine
    (its worker threads, files that bypass the page cache), interrupted at one point in
    turn, 64 points spread over it: the cache then closes, its files are gone, and no
    lock it or its engine holds is left taken. The KeyboardInterrupt ends the step, or,
    when it landed in a finaliser that swallowed it, the close (NOTE [Interrupts in
    finalisers] in ``cache/exit_guard.py``)."""
    import faulthandler

    import torch

    from megatron_ssd import OffloadConfig, TensorCache
    from megatron_ssd.cache import exit_guard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(3)])
    batch = torch.randn(32, 64)
    root = tmp_path / "act"
    root.mkdir()

    def cache():
        c = TensorCache(OffloadConfig(paths=[str(root)], min_tensor_bytes=1024, min_free_bytes=0,
                                      return_freed_pages=False))
        c.register_layers(model)
        c.set_plan({i: "offload" for i in range(len(model))})
        return c

    for _ in range(2):  # the first step in a process runs one-time set-up: count on the second
        with cache() as c:
            total = _points(lambda: _offloaded_step(c, model, batch))
    assert total > 1000, total  # the step's Python: torch's modules, the hooks, the engine's submits and waits
    interrupted = 0
    for k in sorted({1 + i * (total - 1) // 63 for i in range(64)}):
        model.zero_grad(set_to_none=True)
        c = cache()
        fired, error = interrupted_at(k, lambda: _offloaded_step(c, model, batch))
        faulthandler.dump_traceback_later(HANG_S, exit=True)  # a hang prints every thread's stack and ends the run
        try:
            c.close()
        except KeyboardInterrupt as e:  # swallowed by a finaliser, raised again by the close
            error = error or e
        finally:
            faulthandler.cancel_dump_traceback_later()
        exit_guard.EXIT_GUARD.interrupted = False
        assert os.listdir(root) == [], (k, os.listdir(root))
        if not fired:  # this step passed fewer points (its waits, its threads' timing)
            assert error is None, (k, total, error)
            continue
        interrupted += 1
        assert isinstance(error, KeyboardInterrupt) or isinstance(error.__context__, KeyboardInterrupt), (k, error)
    assert interrupted >= 32, (interrupted, total)


@pytest.mark.slow
@needs_monitoring
def test_an_interrupt_in_a_micro_batch_scopes_entry_or_exit_leaves_no_hooks_and_no_active_cache(tmp_path):
    """NOTE [Scopes an interrupt cannot leak] in ``cache/scopes.py``: a micro-batch forward
    with one layer scope, its tensors offloaded, interrupted at each of the first and last
    150 points in turn (the scopes' entries and exits; the tensor traffic between is the
    whole-step test's), then closed, leaves no saved-tensor hooks on the thread and no
    active cache, and a new cache's step after it gives the same gradient. The scopes
    were generators: an interrupt after they yielded left them suspended with their hooks
    pushed, and their ``finally`` ran when collected, in the next cache's forward, popping
    its hooks; that backward then failed with "unpack after close()" (4 of the first 120
    points of an offloaded step)."""
    import torch

    from megatron_ssd import OffloadConfig, TensorCache
    from megatron_ssd.cache import exit_guard
    from megatron_ssd.cache.tensor_cache import active_cache

    root = tmp_path / "act"
    root.mkdir()
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)

    def cache():
        c = TensorCache(OffloadConfig(paths=[str(root)], min_tensor_bytes=1024, min_free_bytes=0,
                                      return_freed_pages=False))
        c.set_plan({0: "offload"})
        return c

    def forward(c):
        with c.microbatch():
            with c.layer(0):
                y = torch.tanh(x @ w)
            return (y * y).sum()

    def step(c):
        w.grad = None
        forward(c).backward()
        c.finish_step()
        return w.grad.clone()

    with cache() as c:
        expected = step(c)
        total = _points(lambda: forward(c))
    assert total > 300, total
    fired_at = []
    for k in list(range(1, 151)) + list(range(total - 150, total + 1)):
        c = cache()
        fired, error = interrupted_at(k, lambda: forward(c))
        try:
            c.close()
        except KeyboardInterrupt as e:  # swallowed by a finaliser, raised again by the close
            error = error or e
        exit_guard.EXIT_GUARD.interrupted = False
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        assert top is None and active_cache() is None, (k, top, active_cache(), error)
        assert os.listdir(root) == [], (k, os.listdir(root))
        if fired:
            fired_at.append(k)
            assert isinstance(error, KeyboardInterrupt) or isinstance(error.__context__, KeyboardInterrupt), (k, error)
        if k % 10 == 0 or k == total:  # what the leak broke: the next cache's step
            with cache() as fresh:
                assert torch.equal(step(fresh), expected), k
    assert len(fired_at) > 250, len(fired_at)
