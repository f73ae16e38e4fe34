"""Reads issued site by site at each site's own read-ahead (NOTE [Write and read issue
points]) and the site use points the cache measures (NOTE [Site use times])."""

import copy

import pytest
import torch

from megatron_ssd import OffloadConfig, TensorCache
from megatron_ssd.adaptive import stage_from_stats
from megatron_ssd.errors import ConfigError

from tiny_model import TinyGPT, make_batches


def run_step(model, cache, batch, before_backward=None):
    with cache.microbatch():
        loss = model(batch)
    if before_backward is not None:
        before_backward()
    loss.backward()
    return cache.finish_step()


def test_each_site_is_read_when_its_own_read_ahead_comes(offload_dir):
    torch.manual_seed(0)
    model = TinyGPT(layers=6, hidden=64, seq=64)
    reference = copy.deepcopy(model)
    (batch,) = make_batches(steps=1, microbatches=1, batch=4, seq=64, vocab=256)[0]
    config = OffloadConfig(paths=[offload_dir], min_tensor_bytes=4096, prefetch_layers=1)
    with TensorCache(config) as cache:
        cache.register_layers(model.layers)
        cache.set_plan({i: "offload" for i in range(6)})
        sites = len(run_step(model, cache, batch).layers[1].site_bytes)
        assert sites >= 3
        model.zero_grad()
        # layer 1: its first site 3 layers ahead, its second 1 ahead, the rest when its
        # own backward starts
        cache.set_plan({i: "offload" for i in range(6)}, read_ahead={1: [3, 1] + [0] * (sites - 2)})
        assert cache.read_ahead() == {1: (3, 1) + (0,) * (sites - 2)}
        issued, running = [], []
        real_submit, real_started = cache.entries._submit_read, cache.entries.backward_started

        def submit(entry):
            issued.append((running[-1], entry.layer, entry.site))
            return real_submit(entry)

        def started(record, layer_id):
            running.append(layer_id)
            return real_started(record, layer_id)

        cache.entries._submit_read, cache.entries.backward_started = submit, started
        stats = run_step(model, cache, batch, before_backward=cache.entries.drain)
        assert stats.late_reads == 0
    reference(batch).backward()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad)
    layer1 = [(at, site) for at, layer, site in issued if layer == 1]
    assert layer1 == [(4, 0), (2, 1)] + [(1, s) for s in range(sites - 1, 1, -1)]
    # the other layers' sites all go one layer ahead, last saved first
    layer3 = [(at, site) for at, layer, site in issued if layer == 3 and site is not None]
    assert layer3 == [(4, s) for s in range(len(layer3) - 1, -1, -1)]


def test_per_site_read_ahead_is_validated(offload_dir):
    with TensorCache(OffloadConfig(paths=[offload_dir])) as cache:
        for bad in ([], [1, -1], [1.5], (True,)):
            with pytest.raises(ConfigError, match=r"read_ahead\[2\] = .*: must be an integer >= 1 or a non-empty list "
                                                  r"of integers >= 0, one per site"):
                cache.set_plan({2: "offload"}, read_ahead={2: bad})


def test_site_use_points_follow_backward_order(offload_dir):
    # Backward runs a block's ops in reverse: the MLP's input to fc2 (saved last) is
    # unpacked first, the block input saved first by its layernorm is unpacked last.
    torch.manual_seed(0)
    model = TinyGPT(layers=3, hidden=64, seq=64)
    (batch,) = make_batches(steps=1, microbatches=1, batch=4, seq=64, vocab=256)[0]
    config = OffloadConfig(paths=[offload_dir], min_tensor_bytes=4096)
    with TensorCache(config) as cache:
        cache.register_layers(model.layers)
        cache.set_plan({i: "keep" for i in range(3)})
        steps = [run_step(model, cache, batch) for _ in range(2)]
    for step in steps:
        lc = step.layers[1]
        assert lc.site_uses == [1] * len(lc.site_bytes)
    profile = stage_from_stats(steps, [])
    for layer in profile.layers:
        if layer.layer_id not in (0, 1, 2):
            continue
        use = layer.site_use
        assert use is not None and len(use) == len(layer.sites)
        assert all(0.0 <= u <= 1.0 for u in use)
        assert use[0] > use[-1]  # first saved, used after the last saved


def test_a_site_first_used_by_another_layer_counts_as_needed_at_the_start():
    from megatron_ssd.adaptive import _use_shares
    from megatron_ssd.cache.stats import LayerCounters

    lc = LayerCounters(site_bytes=[8192, 8192, 8192, 8192], site_use_s=[1.0, 0.0, 0.2], site_uses=[2, 0, 1])
    assert _use_shares(lc, 1.0) == [0.5, 0.0, 0.2, 0.0]
    assert _use_shares(LayerCounters(site_bytes=[8192]), 1.0) is None
