"""IOFuture: ``get()`` returns once the result is set, ``wait_settled()`` once the
callbacks have run too (the cache's ``drain()`` relies on it: a blob's callback frees it,
so disk bytes counted before the callback ran would count a blob already dropped)."""

from __future__ import annotations

import threading

import pytest

from megatron_ssd.errors import WriteCancelled
from megatron_ssd.io.base import IOFuture
from waits import HANG_S  # tests/waits.py


def test_wait_settled_waits_for_the_callbacks_get_does_not():
    fut: IOFuture = IOFuture(4)
    entered, gate, ran = threading.Event(), threading.Event(), []

    def callback(f):
        entered.set()
        assert gate.wait(HANG_S)
        ran.append(f.get())

    fut.add_done_callback(callback)
    worker = threading.Thread(target=fut.set_result, args=("handle",))
    worker.start()
    assert entered.wait(HANG_S)
    assert fut.get(timeout=HANG_S) == "handle"  # the result is there, the callback still runs
    assert not fut.wait_settled(timeout=0.01) and ran == []
    gate.set()
    assert fut.wait_settled(timeout=HANG_S) and ran == ["handle"]
    worker.join()


def test_cancel_calls_the_engine_hook_until_the_future_is_done():
    fut: IOFuture = IOFuture(4)
    assert not fut.cancel()  # no engine hook: nothing to ask
    asked = []
    fut.on_cancel(lambda: asked.append(True))
    assert fut.cancel() and asked == [True] and not fut.done()  # cancel never completes it
    fut.set_result("handle")
    assert not fut.cancel() and asked == [True]


def test_staged_fires_once_and_late_callbacks_run_at_once_on_the_caller():
    fut: IOFuture = IOFuture(4)
    seen = []
    fut.add_staged_callback(lambda f: seen.append(("staged", threading.current_thread().name)))
    assert not fut.staged()
    worker = threading.Thread(target=fut.set_staged, name="engine-worker")
    worker.start()
    worker.join()
    fut.set_staged()  # a second call does nothing
    assert fut.staged() and seen == [("staged", "engine-worker")]
    fut.add_staged_callback(lambda f: seen.append(("late", threading.current_thread().name)))
    assert seen[-1] == ("late", threading.current_thread().name)
    fut.set_result("handle")
    assert len(seen) == 2


@pytest.mark.parametrize("outcome", ["result", "error", "cancelled"])
def test_completing_an_unstaged_future_stages_it_first(outcome):
    fut: IOFuture = IOFuture(4)
    order = []
    fut.add_done_callback(lambda f: order.append(("done", f.staged())))
    fut.add_staged_callback(lambda f: order.append(("staged", f.done())))
    if outcome == "result":
        fut.set_result("handle")
    else:
        fut.set_error(WriteCancelled("cancelled") if outcome == "cancelled" else OSError(5, "EIO"))
    # staged at completion: done() is already True there, so the caller knows nothing was
    # released early (a failed write's source is still its own)
    assert order == [("staged", True), ("done", True)]


def test_done_callbacks_wait_for_staged_callbacks_running_on_another_thread():
    fut: IOFuture = IOFuture(4)
    entered, gate, order = threading.Event(), threading.Event(), []

    def staged(f):
        entered.set()
        assert gate.wait(HANG_S)
        order.append("staged")

    fut.add_staged_callback(staged)
    fut.add_done_callback(lambda f: order.append("done"))
    stager = threading.Thread(target=fut.set_staged)
    stager.start()
    assert entered.wait(HANG_S)
    completer = threading.Thread(target=fut.set_result, args=("handle",))
    completer.start()
    completer.join(0.2)
    assert completer.is_alive() and order == []  # the done callbacks wait for the staged one
    gate.set()
    stager.join(HANG_S)
    completer.join(HANG_S)
    assert order == ["staged", "done"]


def test_a_staged_callback_may_complete_the_future_on_its_own_thread():
    fut: IOFuture = IOFuture(4)
    fut.add_staged_callback(lambda f: f.set_result("handle"))
    fut.set_staged()
    assert fut.get(timeout=HANG_S) == "handle"
