"""IOFuture: ``get()`` returns once the result is set, ``wait_settled()`` once the
callbacks have run too (the cache's ``drain()`` relies on it: a blob's callback frees it,
so disk bytes counted before the callback ran would count a blob already dropped)."""

from __future__ import annotations

import threading

from megatron_ssd.io.base import IOFuture


def test_wait_settled_waits_for_the_callbacks_get_does_not():
    fut: IOFuture = IOFuture(4)
    entered, gate, ran = threading.Event(), threading.Event(), []

    def callback(f):
        entered.set()
        assert gate.wait(30)
        ran.append(f.get())

    fut.add_done_callback(callback)
    worker = threading.Thread(target=fut.set_result, args=("handle",))
    worker.start()
    assert entered.wait(30)
    assert fut.get(timeout=30) == "handle"  # the result is there, the callback still runs
    assert not fut.wait_settled(timeout=0.01) and ran == []
    gate.set()
    assert fut.wait_settled(timeout=30) and ran == ["handle"]
    worker.join()


def test_cancel_calls_the_engine_hook_until_the_future_is_done():
    fut: IOFuture = IOFuture(4)
    assert not fut.cancel()  # no engine hook: nothing to ask
    asked = []
    fut.on_cancel(lambda: asked.append(True))
    assert fut.cancel() and asked == [True] and not fut.done()  # cancel never completes it
    fut.set_result("handle")
    assert not fut.cancel() and asked == [True]
