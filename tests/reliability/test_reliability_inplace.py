"""In-place changes of a saved tensor raise autograd's own error under the cache, whether
the tensor still exists, whether its write ran before or after the change, and whatever
its placement (NOTE [In-place changes] in ``cache/identity.py``)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from megatron_ssd import OffloadConfig, TensorCache
from megatron_ssd.cache.identity import version_probe
from megatron_ssd.config import Placement
from megatron_ssd.io import create_engine

AUTOGRAD = "one of the variables needed for gradient computation has been modified by an inplace operation"


def _forward(x, change, gate=None, cache=None):
    """``sin`` saves ``a``; ``change(a)`` then changes it in place and ``a`` itself is
    dropped when this returns: only the graph refers to it."""
    a = x * 2
    b = a.sin()
    if cache is not None and gate is None:
        cache.drain()  # the write ran before the change
    with torch.no_grad():
        change(a)
    if gate is not None:
        gate.set()  # the write runs after the change
    return (b * 3).sum()


def _plain_error(change):
    x = torch.randn(128, 128, requires_grad=True)
    with pytest.raises(RuntimeError) as info:
        _forward(x, change).backward()
    return str(info.value)


CHANGES = {
    "add_": lambda a: a.add_(1),
    "a view's mul_": lambda a: a[3:7].mul_(2),
    "copy_": lambda a: a.copy_(torch.zeros_like(a)),
}


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
@pytest.mark.parametrize("placement, order", [("offload", "write first"), ("offload", "change first"),
                                              ("keep", "")], ids=["offload-write-first", "offload-change-first",
                                                                  "keep"])
def test_in_place_change_of_a_dropped_saved_tensor_is_autograds_error(offload_dir, change, placement, order):
    """Item: with the saved tensor gone after forward, the change went unseen: training
    went on silently, on the old bytes when the write came first and on the new ones (or a
    ChecksumError blaming the drive) when it came after."""
    expected = _plain_error(CHANGES[change])
    assert AUTOGRAD in expected and "is at version 1; expected version 0 instead" in expected
    gate = threading.Event() if order == "change first" else None

    def hold_writes(op, path, offset, nbytes):
        if op == "write" and gate is not None:
            gate.wait()

    cfg = OffloadConfig(paths=[offload_dir], min_free_bytes=0, min_tensor_bytes=0)
    with TensorCache(cfg, engine=create_engine(cfg, fault=hold_writes)) as cache:
        cache.register_layers([torch.nn.Identity()], ids=["L"], install_hooks=False)
        cache.set_plan({"L": Placement(placement)})
        x = torch.randn(128, 128, requires_grad=True)
        with cache.microbatch():
            with cache.layer("L"):
                loss = _forward(x, CHANGES[change], gate, cache if placement == "offload" else None)
        with pytest.raises(RuntimeError) as info:
            loss.backward()
    msg = str(info.value)
    assert msg.startswith("megatron_ssd: a tensor saved for backward in layer 'L' was modified by an in-place "
                          "operation after it was saved: ") and "\n" not in msg, msg
    assert f"{AUTOGRAD}: [torch.FloatTensor [128, 128]], is at version 1; expected version 0 instead." in msg
    assert x.grad is None


def test_a_version_probe_holds_no_bytes_and_sees_changes_after_the_tensor_is_gone():
    t = torch.randn(1 << 16)
    view = t[10:20]
    probe = version_probe(t)
    storage = StorageWeakRef(t.untyped_storage())
    assert probe.untyped_storage().nbytes() == 0 and probe._version == 0
    del t
    view.mul_(2)
    assert probe._version == 1
    del view
    assert storage.expired(), "the probe keeps no bytes alive"


def test_changes_no_version_counter_sees_are_not_detected_with_or_without_the_cache(offload_dir):
    """What cannot be detected, as without the cache: a write through ``.data``."""
    x = torch.randn(64, 64, requires_grad=True)
    a = x * 2
    b = a.sin()
    a.data.add_(1)
    (b * 3).sum().backward()  # plain autograd: no error
    with TensorCache(OffloadConfig(paths=[offload_dir], min_free_bytes=0, min_tensor_bytes=0)) as cache:
        cache.register_layers([torch.nn.Identity()], ids=["L"], install_hooks=False)
        cache.set_plan({"L": "keep"})
        with cache.microbatch():
            with cache.layer("L"):
                a = x * 2
                b = a.sin()
                a.data.add_(1)
                loss = (b * 3).sum()
        loss.backward()  # no error either: nothing tracks writes through .data
