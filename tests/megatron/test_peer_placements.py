"""The peers' rules on a megatron-core GPT, through Megatron's own schedule: under a rule
that reads them the layers label what each submodule saves, and carry no group hooks
otherwise (NOTE [Module groups] in ``megatron/groups.py``), the fine-grained and
first-N-layers rules move those tensors to the host tier with losses and gradients
bit-identical to keeping them, Megatron's own recompute runs on the same
path, and the ``HybridModel`` megatron-core 0.19 recommends computes the GPT's losses."""

from __future__ import annotations

import collections

import pytest
import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

from megatron_ssd import OffloadConfig, TensorCache
from megatron_ssd.adaptive import AdaptivePlanner
from megatron_ssd.config import PeerConfig, PlannerConfig
from megatron_ssd.megatron import get_forward_backward_func, offload_layer_spec
from megatron_ssd.megatron.groups import MODULE_GROUPS, GroupLabel
from megatron_ssd.megatron.layer import find_offload_layers
from megatron_ssd.workloads.harness import SyntheticData, gpt_forward_step, run_steps
from megatron_ssd.workloads.models import build_gpt, build_hybrid_gpt, hybrid_available, tiny_transformer_config
from megatron_ssd.workloads.parallel import destroy_parallel, init_parallel

VOCAB, SEQ, MBS, LAYERS = 256, 64, 2, 4


@pytest.fixture(scope="module")
def world(cpu_only):
    init_parallel(seed=1)
    yield
    destroy_parallel()


def _run(path, peer=None, recompute=None, builder=build_gpt, steps=3, nmb=1):
    """Train ``steps`` steps; returns the run's result, its step stats, the (layer, group)
    of each saved tensor and the cache's rule."""
    torch.manual_seed(3)
    model = builder(tiny_transformer_config(LAYERS, 64, 4, **(recompute or {})), VOCAB, SEQ,
                    **({"layer_spec": offload_layer_spec(get_gpt_layer_local_spec())} if builder is build_gpt else {}))
    config = OffloadConfig(paths=[str(path)], device="cpu", min_tensor_bytes=4096, host_pool_bytes=64 << 20,
                           planner=PlannerConfig(mode="keep"), peer=peer or PeerConfig())
    saved = collections.Counter()
    with TensorCache(config) as cache:
        pack = cache.entries.saved

        def counted(record, key, t, layer_id, unmovable=False, group=None, started=None):
            saved[(layer_id, group)] += 1
            return pack(record, key, t, layer_id, unmovable, group, started)

        cache.entries.saved = counted
        planner = AdaptivePlanner(cache, PlannerConfig(mode="keep"))
        stats = []
        fb = get_forward_backward_func(cache=cache, on_step=lambda s: (stats.append(s), planner.on_step(s)))
        data = SyntheticData("gpt", MBS, SEQ, VOCAB, seed=3)
        result = run_steps([model], gpt_forward_step, data, nmb, SEQ, MBS, steps=steps, forward_backward_func=fb)
        rule = cache.policy.rule
    return result, stats, saved, rule


def _identical(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a.losses, b.losses, strict=True))
    assert [n for n in a.grads if not torch.equal(a.grads[n], b.grads[n])] == []


GROUPED = PeerConfig(rule="megatron-offload")
"""A rule that reads the module groups (it moves nothing of these small layers)."""


def test_every_submodule_labels_what_it_saves(world, tmp_path):
    _, _, saved, _ = _run(tmp_path, GROUPED, steps=1)
    names = {name for _, name in MODULE_GROUPS}
    for layer in range(1, LAYERS + 1):
        labelled = {group for (lid, group) in saved if lid == layer and group is not None}
        assert labelled == names, layer
    assert saved[(1, "core_attn")] > saved[(1, "qkv_linear")] == 1  # Q, K, V, scores...; one input


def _group_hooks(model):
    """Per (layer id, group name), the group-label hooks on ``model``'s layers."""
    found = collections.Counter()
    for _, layer in find_offload_layers(model):
        for module in layer.modules():
            for hook in (*module._forward_pre_hooks.values(), *module._forward_hooks.values()):
                label = getattr(hook, "__self__", None)
                if isinstance(label, GroupLabel):
                    found[(layer.layer_id, label.name)] += 1
    return found


@pytest.mark.parametrize("rule", ["none", "te-offload", "megatron-offload"])
def test_the_layers_carry_group_hooks_only_under_a_rule_that_reads_groups(world, tmp_path, rule):
    model = build_gpt(tiny_transformer_config(LAYERS, 64, 4), VOCAB, SEQ,
                      layer_spec=offload_layer_spec(get_gpt_layer_local_spec()))
    assert _group_hooks(model) == {}  # building the layers hooks nothing
    config = OffloadConfig(paths=[str(tmp_path)], device="cpu", host_pool_bytes=64 << 20,
                           planner=PlannerConfig(mode="keep"), peer=PeerConfig(rule=rule))
    with TensorCache(config) as cache:
        get_forward_backward_func(cache=cache).register_model([model])
        get_forward_backward_func(cache=cache).register_model([model])  # a second schedule labels nothing again
    names = [name for _, name in MODULE_GROUPS]
    layers = [layer for _, layer in find_offload_layers(model)]
    if rule == "megatron-offload":
        assert _group_hooks(model) == {(layer, name): 2 for layer in range(1, LAYERS + 1) for name in names}
        assert [layer.ssd_module_groups for layer in layers] == [names] * LAYERS
    else:
        assert _group_hooks(model) == {}
        assert [layer.ssd_module_groups for layer in layers] == [[]] * LAYERS


def test_a_group_closes_when_its_module_raises(world):
    from megatron_ssd.megatron.groups import label_module_groups

    layer = torch.nn.Module()
    layer.input_layernorm = torch.nn.Linear(2, 2)
    assert label_module_groups(layer) == ["attn_norm"]

    class Scope:  # stands in for an active cache
        def __init__(self):
            self.stack = []

        def enter_group(self, name):
            self.stack.append(name)

        def exit_group(self, name):
            assert self.stack.pop() == name

        def current_group(self):
            return self.stack[-1] if self.stack else None

    scope = Scope()
    import megatron_ssd.megatron.groups as groups

    original = groups.active_cache
    groups.active_cache = lambda: scope
    try:
        with pytest.raises(RuntimeError):
            layer.input_layernorm(torch.ones(3))  # wrong shape: the forward raises
    finally:
        groups.active_cache = original
    assert scope.stack == []


def test_fine_grained_moves_the_groups_to_the_host_tier_bit_identically(world, tmp_path):
    keep, keep_stats, _, _ = _run(tmp_path)
    peer = PeerConfig(rule="megatron-offload", min_tensor_elements=4096, offload_fraction=0.5)
    moved, stats, _, rule = _run(tmp_path, peer)
    _identical(keep, moved)
    assert rule.offloaded is not None and len(rule.groups) == 5 * LAYERS
    assert len(rule.offloaded) == 15 - int(15 * 0.5)  # the last layer's 5 groups are the margin
    assert all(s.bytes_to_host > 0 for s in stats)
    assert stats[0].bytes_to_host > stats[-1].bytes_to_host  # the warm-up moved every group
    assert stats[-1].peak_resident_bytes < keep_stats[-1].peak_resident_bytes


def test_first_layers_moves_whole_layers_bit_identically(world, tmp_path):
    keep, keep_stats, _, _ = _run(tmp_path)
    one, stats_one, _, _ = _run(tmp_path, PeerConfig(rule="te-offload", num_layers=1, min_tensor_elements=4096))
    three, stats_three, _, _ = _run(tmp_path, PeerConfig(rule="te-offload", num_layers=3,
                                                         min_tensor_elements=4096))
    _identical(keep, one)
    _identical(keep, three)
    assert 0 < stats_one[-1].bytes_to_host < stats_three[-1].bytes_to_host
    assert stats_three[-1].peak_resident_bytes < stats_one[-1].peak_resident_bytes < keep_stats[-1].peak_resident_bytes


@pytest.mark.parametrize("recompute", [
    {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
    {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
])
def test_megatrons_own_recompute_runs_on_the_same_path(world, tmp_path, recompute):
    keep, keep_stats, _, _ = _run(tmp_path)
    ran, stats, saved, _ = _run(tmp_path, recompute=recompute)
    _identical(keep, ran)
    assert stats[-1].peak_resident_bytes < keep_stats[-1].peak_resident_bytes
    if recompute["recompute_granularity"] == "full":
        assert all(group is None for (_, group) in saved)  # forward runs without grad: nothing saved inside
        assert stats[-1].peak_resident_bytes < keep_stats[-1].peak_resident_bytes / 4


@pytest.mark.skipif(not hybrid_available(), reason="HybridModel arrived in megatron-core 0.19; this one has none")
def test_the_hybrid_model_computes_the_gpts_losses(world, tmp_path):
    gpt, _, _, _ = _run(tmp_path)
    hybrid, stats, saved, _ = _run(tmp_path, GROUPED, builder=build_hybrid_gpt)
    assert [l.tolist() for l in gpt.losses] == [l.tolist() for l in hybrid.losses]
    layers = sorted({lid for (lid, _) in saved if isinstance(lid, int)})
    assert layers == list(range(1, 2 * LAYERS + 1))  # attention and MLP layers
    assert {g for (lid, g) in saved if lid == 1} >= {"attn_norm", "core_attn"}
    assert {g for (lid, g) in saved if lid == 2} >= {"mlp_norm", "mlp_fc1"}
