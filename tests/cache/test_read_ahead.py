"""The cache issues each offloaded layer's read at the read-ahead its plan gives
(NOTE [Write and read issue points]), and training stays bit-identical."""

import copy

import pytest
import torch

from megatron_ssd.placement import LayerChoice, Placement
from megatron_ssd import OffloadConfig, TensorCache
from megatron_ssd.errors import ConfigError

from tiny_model import TinyGPT, make_batches


def six_layers():
    """A 6-layer model, a copy to check gradients against, one batch and a config
    reading one layer ahead by default."""
    torch.manual_seed(0)
    model = TinyGPT(layers=6, hidden=64, seq=64)
    (batch,) = make_batches(steps=1, microbatches=1, batch=4, seq=64, vocab=256)[0]
    return model, copy.deepcopy(model), batch


def spy(cache, method, log):
    """Log ``(running layer, *what(args))`` on each call of ``cache.entries.backward.<method>``,
    the running layer being the last whose backward started."""
    running = []
    real, real_started = getattr(cache.entries.backward, method), cache.entries.backward_started

    def call(*args):
        log.append((running[-1], *args))
        return real(*args)

    def started(record, layer_id):
        running.append(layer_id)
        return real_started(record, layer_id)

    setattr(cache.entries.backward, method, call)
    cache.entries.backward_started = started


def run_step(model, cache, batch, before_backward=None):
    with cache.microbatch():
        loss = model(batch)
    if before_backward is not None:
        before_backward()
    loss.backward()
    return cache.finish_step()


def same_gradients(model, reference, batch):
    reference(batch).backward()
    return all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters()))


def test_the_cache_issues_each_read_at_its_read_ahead(offload_dir):
    model, reference, batch = six_layers()
    config = OffloadConfig(paths=[offload_dir], min_tensor_bytes=4096, default_read_ahead=1)
    with TensorCache(config) as cache:
        cache.register_layers(model.layers)
        cache.set_plan({**{i: "offload" for i in range(6)}, 0: LayerChoice(Placement.OFFLOAD, read_ahead=4),
                        2: LayerChoice(Placement.OFFLOAD, read_ahead=3)})
        assert [cache.plan().choices[i].read_ahead for i in range(6)] == [4, None, 3, None, None, None]
        calls = []
        spy(cache, "_prefetch", calls)
        run_step(model, cache, batch)
        with pytest.raises(ConfigError, match=r"read_ahead\[1\] = 0: must be an integer >= 1 or a non-empty list of "
                                              r"integers >= 0, one per site"):
            cache.set_plan({1: LayerChoice(Placement.OFFLOAD, read_ahead=0)})
    assert same_gradients(model, reference, batch)
    # layer k is read when the backward of layer k + read_ahead starts (1 by default), needed first:
    # layer 2 (3 ahead) with layer 5, layer 0 (4 ahead) with layer 4; the tensors saved before
    # layer 0 (pseudo-layer "embedding", NOTE [Sites outside the layers]) 1 ahead of layer 0
    assert [(at, layer) for at, _, layer, _ in calls] == [
        (5, 5), (5, 4), (5, 2), (4, 3), (4, 0), (2, 1), (0, "embedding")]


def test_each_site_is_read_when_its_own_read_ahead_comes(offload_dir):
    model, reference, batch = six_layers()
    config = OffloadConfig(paths=[offload_dir], min_tensor_bytes=4096, default_read_ahead=1)
    with TensorCache(config) as cache:
        cache.register_layers(model.layers)
        cache.set_plan({i: "offload" for i in range(6)})
        sites = len(run_step(model, cache, batch).layers[1].site_bytes)
        assert sites >= 3
        model.zero_grad()
        # layer 1: its first site 3 layers ahead, its second 1 ahead, the rest when its
        # own backward starts
        cache.set_plan({**{i: "offload" for i in range(6)},
                        1: LayerChoice(Placement.OFFLOAD, read_ahead=[3, 1] + [0] * (sites - 2))})  # type: ignore[arg-type]
        assert cache.plan().choices[1].read_ahead == (3, 1) + (0,) * (sites - 2)
        reads = []
        spy(cache, "_submit_read", reads)
        stats = run_step(model, cache, batch, before_backward=cache.entries.drain)  # every write done
        assert stats.late_reads == 0
    assert same_gradients(model, reference, batch)
    layer1 = [(at, entry.site) for at, entry in reads if entry.layer == 1]
    assert layer1 == [(4, 0), (2, 1)] + [(1, s) for s in range(sites - 1, 1, -1)]
    # the other layers' sites all go one layer ahead, last saved first
    layer3 = [(at, entry.site) for at, entry in reads if entry.layer == 3 and entry.site is not None]
    assert layer3 == [(4, s) for s in range(len(layer3) - 1, -1, -1)]


def test_per_site_read_ahead_is_validated(offload_dir):
    with TensorCache(OffloadConfig(paths=[offload_dir])) as cache:
        for bad in ([], [1, -1], [1.5], (True,)):
            with pytest.raises(ConfigError, match=r"read_ahead\[2\] = .*: must be an integer >= 1 or a non-empty list "
                                                  r"of integers >= 0, one per site"):
                cache.set_plan({2: LayerChoice(Placement.OFFLOAD, read_ahead=bad)})
