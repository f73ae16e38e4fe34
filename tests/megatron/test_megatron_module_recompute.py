"""Recompute inside a layer on a megatron-core GPT, through Megatron's own schedule: a plan
that recomputes core attention (and the MLP) in some layers, offloading the rest of their
sites, gives losses and gradients bit-identical to keeping everything; the profile measures
what each module frees, and the layer the planner derives from it is the one the cache
sees (NOTE [Recompute inside a layer] in ``planner/module_recompute.py``, NOTE [Selective
recompute per layer] in ``megatron/module_recompute.py``). The planner's side:
tests/planner/test_planner_module_recompute.py."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

from megatron_ssd import OffloadConfig, TensorCache
from megatron_ssd.planner.measured_profile import stage_from_stats
from megatron_ssd.config import PlannerConfig
from megatron_ssd.errors import ConfigError
from megatron_ssd.megatron import get_forward_backward_func, offload_layer_spec
from megatron_ssd.megatron.layer import find_offload_layers
from megatron_ssd.placement import LayerChoice, Placement
from megatron_ssd.planner import recomputed_layer
from megatron_ssd.workloads.harness import SyntheticData, gpt_forward_step, run_steps
from megatron_ssd.workloads.models import build_gpt, tiny_transformer_config
from megatron_ssd.workloads.parallel import destroy_parallel, init_parallel

VOCAB, SEQ, MBS, LAYERS = 256, 64, 2, 3


@pytest.fixture(scope="module")
def world(cpu_only):
    init_parallel(seed=1)
    yield
    destroy_parallel()


def _model(bias: bool = False):
    torch.manual_seed(3)
    config = tiny_transformer_config(LAYERS, 64, 4, attention_dropout=0.1, hidden_dropout=0.1, add_bias_linear=bias)
    return build_gpt(config, VOCAB, SEQ, layer_spec=offload_layer_spec(get_gpt_layer_local_spec()))


def _run(path, plan=None, model=None, steps=2, nmb=2):
    """Train ``steps`` steps of ``nmb`` micro-batches under ``plan`` (every other layer
    kept); returns the run's result and its step stats."""
    model = model if model is not None else _model()
    config = OffloadConfig(paths=[str(path)], device="cpu", min_tensor_bytes=4096, planner=PlannerConfig(mode="static"))
    stats = []
    with TensorCache(config) as cache:
        cache.set_plan(plan or {}, default="keep")
        fb = get_forward_backward_func(cache=cache, on_step=stats.append)
        data = SyntheticData("gpt", MBS, SEQ, VOCAB, seed=3)
        result = run_steps([model], gpt_forward_step, data, nmb, SEQ, MBS, steps=steps, forward_backward_func=fb)
    return result, stats


def _identical(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a.losses, b.losses, strict=True))
    assert [n for n in a.grads if not torch.equal(a.grads[n], b.grads[n])] == []


def test_recompute_inside_layers_with_their_other_sites_offloaded_is_bit_identical(world, tmp_path):
    keep, keep_stats = _run(tmp_path)
    plan = {1: LayerChoice(Placement.OFFLOAD, recompute=("core_attn",)),
            2: LayerChoice(Placement.OFFLOAD, sites=3, recompute=("core_attn", "mlp"))}
    moved, stats = _run(tmp_path, plan)
    _identical(keep, moved)
    profile = stage_from_stats(keep_stats, [])
    layers = {layer.layer_id: layer for layer in profile.layers}
    for layer_id, choice in plan.items():
        derived = recomputed_layer(layers[layer_id], choice.recompute)
        measured = stats[-1].layers[layer_id]
        assert [b // 2 for b in measured.site_bytes] == derived.sites  # 2 micro-batches; the cache's sites
        assert measured.offloaded_bytes // 2 == derived.moved_bytes(choice.sites)
        assert measured.offloaded_bytes > 0
    assert stats[-1].peak_resident_bytes < keep_stats[-1].peak_resident_bytes


def test_the_profile_measures_what_each_module_frees(world, tmp_path):
    _, stats = _run(tmp_path)
    profile = stage_from_stats(stats, [])
    layer = next(layer for layer in profile.layers if layer.layer_id == 1)
    modules = {m.name: m for m in layer.modules}
    assert sorted(modules) == ["core_attn", "mlp"]
    sites = layer.sites
    # core attention: its scores and probabilities go; Q, K, V and the mask, its inputs, stay
    attention = modules["core_attn"]
    assert [sites[s] for s in attention.freed_sites] == [2 * 4 * SEQ * SEQ * 4] * 3
    assert attention.forward_s > 0 and attention.held_bytes == 0
    mlp = modules["mlp"]  # the activation's input and fc2's input go; fc1's input, the MLP's, stays
    assert [sites[s] for s in mlp.freed_sites] == [SEQ * MBS * 256 * 4] * 2
    assert set(attention.freed_sites).isdisjoint(mlp.freed_sites)
    _, measured = _run(tmp_path, {1: LayerChoice(Placement.KEEP, recompute=("core_attn",))}, steps=1)
    assert 1 not in {k for k, lc in measured[-1].layers.items() if "core_attn" in lc.modules}  # not measured then


def test_a_module_the_layer_cannot_recompute_is_one_clear_error(world, tmp_path):
    model = _model(bias=True)
    layer = dict(find_offload_layers(model))["decoder.layers.0"]
    assert layer.ssd_module_recompute.offered == ("core_attn",)
    with pytest.raises(ConfigError) as err:
        _run(tmp_path, {1: LayerChoice(Placement.KEEP, recompute=("mlp",))}, model=model, steps=1)
    message = str(err.value)
    assert message.startswith("megatron_ssd: plan[1].recompute = ['mlp']: 'mlp' cannot be recomputed in this layer: "
                              "its linear_fc2 returns its bias (add_bias_linear=True)")
    assert "\n" not in message
    with pytest.raises(ConfigError, match=r"^megatron_ssd: plan\[2\]\.recompute = \['attn'\]: 'attn' is not a module"):
        _run(tmp_path, {2: LayerChoice(Placement.KEEP, recompute=("attn",))}, steps=1)


def test_the_switch_adds_to_what_megatron_was_configured_with(world):
    torch.manual_seed(3)
    config = tiny_transformer_config(1, 64, 4, add_bias_linear=False, recompute_granularity="selective",
                                     recompute_modules=["core_attn"])
    model = build_gpt(config, VOCAB, SEQ, layer_spec=offload_layer_spec(get_gpt_layer_local_spec()))
    (_, layer), = find_offload_layers(model)
    switch = layer.ssd_module_recompute
    assert switch.configured == {"core_attn": True, "mlp": False}
    switch.apply(("mlp",))
    assert layer.self_attention.checkpoint_core_attention and layer.recompute_mlp
    switch.apply(())
    assert layer.self_attention.checkpoint_core_attention and not layer.recompute_mlp
