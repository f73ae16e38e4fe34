"""NOTE [Capacity guard]: with a resident limit, a tensor its layer would keep is
offloaded when keeping it would exceed the limit, the forward waits for writes while the
resident bytes exceed it, and a prefetch that would exceed it waits until backward needs
the tensor. Driven by a scripted store whose writes complete when a helper thread says."""

import threading
import time

import torch

from megatron_ssd import OffloadConfig, Placement, TensorCache
from megatron_ssd.cache.policy import PlacementPolicy

from scripted import ScriptedEngine
from test_entry_events import forward, model_and_batch, reference_grads

TENSOR = 32 * 64 * 4  # bytes of each activation model_and_batch's layers save


def test_the_policy_offloads_what_keeping_would_put_over_the_limit():
    policy = PlacementPolicy(OffloadConfig(paths=["/x"]), host_available=False)
    policy.layers[:] = [0, 1]
    policy.set_plan({0: "keep", 1: "keep"})
    assert policy.tensor(0, 0, resident_after=100) is Placement.KEEP
    policy.resident_limit = 99
    assert policy.tensor(0, 0, resident_after=100) is Placement.OFFLOAD
    assert policy.tensor(0, None, resident_after=100) is Placement.KEEP  # no site: not offloadable
    assert policy.tensor(0, 0, resident_after=99) is Placement.KEEP


class Completer(threading.Thread):
    """Completes the scripted engine's writes whenever some are pending, as its workers would."""

    def __init__(self, engine):
        super().__init__(daemon=True)
        self.engine, self.stop = engine, threading.Event()

    def run(self):
        while not self.stop.is_set():
            if self.engine.pending:
                self.engine.complete_writes()
            time.sleep(0.001)


def test_a_keep_plan_over_the_limit_is_held_within_it_and_stays_bit_identical():
    engine = ScriptedEngine()
    model, batch = model_and_batch(layers=4)
    expected = reference_grads(model, batch)
    limit = 3 * TENSOR
    completer = Completer(engine)
    completer.start()
    try:
        with TensorCache(OffloadConfig(paths=["/unused"], min_tensor_bytes=1024, return_freed_pages=False),
                         engine=engine) as cache:
            cache.register_layers(model)
            cache.set_plan({i: "keep" for i in range(4)})
            cache.policy.resident_limit = limit
            loss, entries = forward(cache, model, batch)
            moved = [e for e in entries if e.placement is Placement.OFFLOAD]
            loss.backward()
            stats = cache.finish_step()
    finally:
        completer.stop.set()
        completer.join()
    assert moved, "a keep plan over the limit moved nothing"
    assert stats.peak_resident_bytes <= limit + TENSOR  # at most the tensor being saved over it
    assert stats.bytes_offloaded >= sum(e.nbytes for e in moved)  # the head's tensors may move too
    assert stats.peak_saved_bytes >= 4 * TENSOR  # what keeping everything would have held
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected))
