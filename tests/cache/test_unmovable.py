"""Saved tensors the cache holds but never moves (NOTE [Unmovable saved tensors]):
tensor subclasses and tensors marked ``_TE_do_not_offload`` count in the layer's bytes
and in the resident bytes, reach no store, and come back as the same tensor."""

import copy

import torch
from torch.testing._internal.two_tensor import TwoTensor

from megatron_ssd import OffloadConfig, TensorCache
from megatron_ssd.planner.measured_profile import stage_from_stats
from megatron_ssd.cache.identity import do_not_offload, held_bytes

from scripted import ScriptedEngine


class Marked(torch.nn.Module):
    """Saves a weight cast marked as Transformer Engine's ``mark_not_offload`` marks it."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(64, 64))

    def forward(self, x):
        x = x * 1.0  # a non-leaf that needs a gradient, so the matmul saves the cast too
        cast = self.weight * 1.0  # a new tensor: a cast the forward makes every micro-batch
        cast._TE_do_not_offload = True
        return x @ cast  # saves x (offloadable) and the marked cast


def _cache(engine):
    cache = TensorCache(OffloadConfig(paths=["/unused"], min_tensor_bytes=1024, return_freed_pages=False),
                        engine=engine)
    return cache


def test_marked_tensor_is_held_counted_and_never_written():
    torch.manual_seed(0)
    model = Marked()
    x = torch.randn(32, 64, requires_grad=True)
    ref = copy.deepcopy(model)
    ref(x).square().sum().backward()
    engine = ScriptedEngine()
    with _cache(engine) as cache:
        cache.register_layers([model])
        cache.set_plan({0: "offload"})
        with cache.microbatch():
            loss = model(x).square().sum()
        engine.complete_writes()
        written = {b.numel() for b in engine.blobs.values()}
        loss.backward()
        stats = cache.finish_step()
    assert torch.equal(model.weight.grad, ref.weight.grad)
    lc = stats.layers[0]
    assert lc.unmovable_bytes == 64 * 64 * 4  # the cast, held
    assert lc.saved_bytes == 32 * 64 * 4 and lc.site_bytes == [32 * 64 * 4]  # x only: the cast has no site
    assert written == {32 * 64 * 4}
    assert stats.peak_resident_bytes >= 64 * 64 * 4


def test_a_tensor_subclass_counts_its_inner_bytes_and_is_returned_whole():
    t = TwoTensor(torch.randn(16, 16), torch.randn(16, 16))
    assert held_bytes(t) == 2 * 16 * 16 * 4
    assert not do_not_offload(t)
    engine = ScriptedEngine()
    with _cache(engine) as cache:
        cache.register_layers([torch.nn.Identity()], ids=["L"], install_hooks=False)
        with cache.microbatch() as record:
            with cache.layer("L"):
                w = torch.randn(16, 16, requires_grad=True)
                sub = TwoTensor(torch.randn(16, 16), torch.randn(16, 16))
                packed = cache.pack(record, sub)
            assert cache.resident_bytes == held_bytes(sub)
            assert cache.unpack(packed) is sub
            del packed
        assert cache.resident_bytes == 0
        stats = cache.finish_step()
    assert stats.layers["L"].unmovable_bytes == 2 * 16 * 16 * 4
    assert stats.tensors_skipped == 0
    del w


def test_the_profile_keeps_unmovable_bytes_in_the_layers_kept_bytes():
    torch.manual_seed(0)
    model = Marked()
    engine = ScriptedEngine()
    with _cache(engine) as cache:
        cache.register_layers([model])
        cache.set_plan({0: "keep"})
        with cache.microbatch():
            loss = model(torch.randn(32, 64, requires_grad=True)).square().sum()
        loss.backward()
        stats = cache.finish_step()
    layer = stage_from_stats([stats], []).layers[0]
    assert layer.kept_bytes == 64 * 64 * 4
    assert layer.saved_bytes == 32 * 64 * 4
