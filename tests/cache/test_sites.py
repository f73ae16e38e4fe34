"""Sites in the cache (NOTE [Sites] in planner/profile.py): the cache numbers each layer's
offloadable tensors in save order, reports their bytes, moves only the prefix a plan
names, reads a layer's tensors back last-saved first, and training stays bit-identical
(the planner's side: tests/planner/test_planner_sites.py)."""

import copy

import pytest
import torch

from megatron_ssd.placement import LayerChoice
from megatron_ssd import OffloadConfig, TensorCache
from megatron_ssd.planner.measured_profile import stage_from_stats
from megatron_ssd.config import Placement
from megatron_ssd.errors import ConfigError

from tiny_model import TinyGPT, make_batches


def run(cache, model, batches):
    stats = []
    for microbatches in batches:
        for batch in microbatches:
            with cache.microbatch():
                loss = model(batch)
            loss.backward()
        stats.append(cache.finish_step())
    return stats


def test_sites_are_numbered_stably_and_a_plan_moves_only_its_prefix(offload_dir):
    torch.manual_seed(0)
    model = TinyGPT(layers=4, hidden=64, seq=64)
    reference = copy.deepcopy(model)
    batches = make_batches(steps=2, microbatches=2, batch=4, seq=64, vocab=256)
    config = OffloadConfig(paths=[offload_dir], min_tensor_bytes=4096, default_read_ahead=1)
    with TensorCache(config) as cache:
        cache.register_layers(model.layers)
        cache.set_plan({i: "keep" for i in range(4)})
        keep = run(cache, model, batches[:1])[0]
        sites = {i: keep.layers[i].site_bytes for i in range(4)}
        assert all(len(s) >= 3 for s in sites.values())
        for i in range(4):
            assert sum(sites[i]) == keep.layers[i].saved_bytes
        # layer 1 moves its first two tensors, layer 2 all of them, layer 3 none (0 sites)
        cache.set_plan({0: "keep", 1: LayerChoice(Placement.OFFLOAD, sites=2), 2: "offload",
                        3: LayerChoice(Placement.OFFLOAD, sites=0)})
        assert {k: c.sites for k, c in cache.plan().choices.items()} == {0: None, 1: 2, 2: None, 3: 0}
        split = run(cache, model, batches[1:])[0]
        with pytest.raises(ConfigError, match=r"sites\[1\] = -1: must be an integer >= 0"):
            cache.set_plan({1: LayerChoice(Placement.OFFLOAD, sites=-1)})
    assert {i: split.layers[i].site_bytes for i in range(4)} == sites  # the same numbering next step
    moved = {i: split.layers[i].offloaded_bytes for i in range(4)}
    assert moved == {0: 0, 1: sum(sites[1][:2]), 2: sum(sites[2]), 3: 0}
    # each moved byte was written, or its write was cancelled because backward used it from
    # memory first (NOTE [Cancelled writes]; on a loaded machine backward can get there first)
    assert split.bytes_offloaded + split.bytes_write_cancelled == moved[1] + moved[2]
    assert split.bytes_reloaded + split.bytes_forwarded == moved[1] + moved[2]  # read back, or still in memory
    for microbatches in batches:
        for batch in microbatches:
            reference(batch).backward()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad)


def _mask_layers(cache, first_seen: bool):
    """Two layers, each saving exp(x), a mask both share, and exp(exp(x) * mask); layer 0's
    saves reach the cache or, as under RECOMPUTE (a checkpoint's own hooks), do not. The
    sites of layer 1's step (its site bytes, and the site of each of its entries)."""
    torch.manual_seed(0)
    x = torch.randn(64, 64, requires_grad=True)  # 16 KiB a tensor
    mask = torch.rand(64, 64)
    with cache.microbatch():
        out = x
        for i in range(2):
            cache.enter_layer(i, (out,))
            hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
            if i == 0 and not first_seen:
                hooks.__enter__()
            out = torch.exp(torch.exp(out) * mask)
            if i == 0 and not first_seen:
                hooks.__exit__(None, None, None)
            cache.exit_layer(i, out)
        record = cache.scopes.current_record()
        entries = sorted((e.site, e.nbytes) for e in record.layer_entries[1] if e.layer == 1)
    out.sum().backward()
    return cache.finish_step().layers[1].site_bytes, entries


def test_a_storage_another_layer_saved_first_keeps_its_site(offload_dir):
    """NOTE [Sites]: layer 1's sites are numbered alike whether the mask it shares with
    layer 0 reached the cache first from layer 0 (a site of no bytes in layer 1) or first
    from layer 1 (layer 0 recomputed): before, the last tensor was site 1 in one step and
    site 2 in the other, so a plan's site count moved other tensors than it priced."""
    config = OffloadConfig(paths=[offload_dir], min_tensor_bytes=4096)
    size = 64 * 64 * 4
    with TensorCache(config) as cache:
        cache.register_layers([torch.nn.Identity(), torch.nn.Identity()])
        cache.set_plan({0: "keep", 1: "keep"})
        shared = _mask_layers(cache, first_seen=True)
        alone = _mask_layers(cache, first_seen=False)
    assert shared == ([size, 0, size], [(0, size), (2, size)])
    assert alone == ([size, size, size], [(0, size), (1, size), (2, size)])


def test_a_layer_is_read_back_last_saved_first(offload_dir):
    torch.manual_seed(0)
    model = TinyGPT(layers=2, hidden=64, seq=64)
    batch = make_batches(steps=1, microbatches=1, batch=4, seq=64, vocab=256)[0][0]
    config = OffloadConfig(paths=[offload_dir], min_tensor_bytes=4096)
    with TensorCache(config) as cache:
        cache.register_layers(model.layers)
        cache.set_plan({0: "offload", 1: "keep"})
        order = []
        real = cache.entries.backward._submit_read

        def submit(entry):
            order.append(entry.site)
            return real(entry)

        cache.entries.backward._submit_read = submit
        with cache.microbatch():
            loss = model(batch)
        cache.drain()
        loss.backward()
        cache.finish_step()
    assert order and order == sorted(order, reverse=True)


def test_the_profile_carries_the_measured_sites(offload_dir):
    torch.manual_seed(0)
    model = TinyGPT(layers=3, hidden=64, seq=64)
    batches = make_batches(steps=2, microbatches=2, batch=4, seq=64, vocab=256)
    config = OffloadConfig(paths=[offload_dir], min_tensor_bytes=4096)
    with TensorCache(config) as cache:
        cache.register_layers(model.layers)
        cache.set_plan({}, Placement.KEEP)
        keep = run(cache, model, batches[:1])
        cache.set_plan({}, Placement.OFFLOAD)
        offload = run(cache, model, batches[1:])
    stage = stage_from_stats(keep, offload)
    # the token ids (4 x 64 int64, under min_tensor_bytes) are saved before layer 0
    embedding = stage.layers[0]
    assert (embedding.layer_id, embedding.recomputable, embedding.kept_bytes, embedding.sites) == (
        "embedding", False, 4 * 64 * 8, [])
    for layer in stage.layers[1:]:
        measured = keep[0].layers[layer.layer_id]
        assert layer.site_bytes == [b // 2 for b in measured.site_bytes]  # per micro-batch
        assert layer.saved_bytes == sum(layer.site_bytes)
        # what a recompute layer would keep: its input, 4 x 64 x 64 fp32 per micro-batch
        assert measured.input_bytes == 2 * 4 * 64 * 64 * 4 and layer.boundary_bytes == 4 * 64 * 64 * 4
