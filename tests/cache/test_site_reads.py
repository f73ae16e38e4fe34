"""The site use and save points the cache measures (NOTE [Site use times], NOTE [Site
save times]); the reads issued at each site's own read-ahead are tested in
test_read_ahead.py."""

import torch

from megatron_ssd import OffloadConfig, TensorCache
from megatron_ssd.planner.measured_profile import stage_from_stats

from tiny_model import TinyGPT, make_batches


def run_step(model, cache, batch):
    with cache.microbatch():
        loss = model(batch)
    loss.backward()
    return cache.finish_step()


def two_kept_steps(offload_dir):
    """Two steps of a 3-layer TinyGPT with every layer kept."""
    torch.manual_seed(0)
    model = TinyGPT(layers=3, hidden=64, seq=64)
    (batch,) = make_batches(steps=1, microbatches=1, batch=4, seq=64, vocab=256)[0]
    config = OffloadConfig(paths=[offload_dir], min_tensor_bytes=4096)
    with TensorCache(config) as cache:
        cache.register_layers(model.layers)
        cache.set_plan({i: "keep" for i in range(3)})
        return [run_step(model, cache, batch) for _ in range(2)]


def test_site_use_points_follow_backward_order(offload_dir):
    # Backward runs a block's ops in reverse: the MLP's input to fc2 (saved last) is
    # unpacked first, the block input saved first by its layernorm is unpacked last.
    steps = two_kept_steps(offload_dir)
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


def test_site_save_points_follow_forward_order(offload_dir):
    # Each site is timed once per micro-batch from its layer's forward start, in save
    # order, so the shares rise from the first site to the last.
    steps = two_kept_steps(offload_dir)
    for step in steps:
        lc = step.layers[1]
        assert lc.site_saves == [1] * len(lc.site_bytes)
        assert lc.site_save_s == sorted(lc.site_save_s) and lc.site_save_s[-1] <= lc.forward_s
    for layer in stage_from_stats(steps, []).layers:
        if layer.layer_id in (0, 1, 2):
            save = layer.site_save
            assert save is not None and len(save) == len(layer.sites)
            assert save == sorted(save) and all(0.0 <= s <= 1.0 for s in save)


def test_a_site_first_used_by_another_layer_counts_as_needed_at_the_start():
    from megatron_ssd.planner.measured_profile import _shares

    assert _shares([1.0, 0.0, 0.2], [2, 0, 1], 4, 1.0) == [0.5, 0.0, 0.2, 0.0]
    assert _shares([], [], 1, 1.0) is None
