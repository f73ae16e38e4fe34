"""Recompute inside a layer as a planner choice (NOTE [Recompute inside a layer] in
``planner/module_recompute.py``): the layer a choice derives, its timeline, the search's
module moves against moving the same bytes, and the plan's JSON (the runtime's side:
tests/megatron/test_megatron_module_recompute.py)."""

from __future__ import annotations

import json

import pytest

from megatron_ssd.errors import ConfigError
from megatron_ssd.placement import LayerChoice, Placement
from megatron_ssd.planner import (IOProfile, LayerProfile, ModuleProfile, Plan, StageProfile, make_plan, predict,
                                  recomputed_layer)
from megatron_ssd.planner.search import replay
from megatron_ssd.planner.request import PlanRequest

MB = 1 << 20
K, O = Placement.KEEP, Placement.OFFLOAD


def attention_layer(i: int) -> LayerProfile:
    """A layer of three sites: its input (10 MB), the attention's softmax (20 MB, freed by
    recomputing ``core_attn`` for 0.05 s) and the MLP's (10 MB, freed by ``mlp`` for
    0.5 s); 1 s forward, 2 s backward."""
    return LayerProfile(i, 1.0, 2.0, 40 * MB, site_bytes=[10 * MB, 20 * MB, 10 * MB], site_use=[0.9, 0.5, 0.1],
                        modules=[ModuleProfile("core_attn", 0.05, [1]), ModuleProfile("mlp", 0.5, [2])])


def stage(bytes_per_s: float, n: int = 4) -> StageProfile:
    return StageProfile(layers=[attention_layer(i) for i in range(n)], io=IOProfile(bytes_per_s, bytes_per_s))


def test_a_recomputed_module_frees_its_sites_and_lengthens_the_backward():
    layer = attention_layer(0)
    derived = recomputed_layer(layer, ("core_attn",))
    assert derived.sites == [10 * MB, 10 * MB] and derived.saved_bytes == 20 * MB
    assert derived.site_use == [0.9, 0.1]
    assert derived.backward_s == pytest.approx(2.05) and derived.rebuilt_bytes == 20 * MB
    assert not derived.recomputable  # full recompute supersedes it
    assert [(m.name, m.freed_sites) for m in derived.modules] == [("mlp", [1])]  # renumbered
    both = recomputed_layer(derived, ("mlp",))
    assert both == recomputed_layer(layer, ("core_attn", "mlp"))
    assert both.sites == [10 * MB] and both.rebuilt_bytes == 30 * MB and both.backward_s == pytest.approx(2.55)
    assert recomputed_layer(layer, ()) is layer
    with pytest.raises(ConfigError, match=r"recompute\[0\] = \['core_attn'\]: the profile measured no 'core_attn' "
                                          r"in this layer \(LayerProfile.modules: \[\]\)"):
        recomputed_layer(LayerProfile(0, 1.0, 2.0, 10), ("core_attn",))


@pytest.mark.parametrize("recompute_s, factor", [(None, 1.0), (1.5, 1.5), (0.8, 1.0), (1.0, 1.0)])
def test_a_module_rerun_costs_the_layer_s_measured_rerun_factor(recompute_s, factor):
    """NOTE [Pricing a module's rerun]: where the profile measured RECOMPUTE steps, a
    module's forward run again in backward costs the layer's ``recompute_s`` over its
    forward (at least 1) per second; without them, its forward."""
    import dataclasses

    layer = dataclasses.replace(attention_layer(0), recompute_s=recompute_s)  # 1 s forward
    assert recomputed_layer(layer, ("core_attn",)).backward_s == pytest.approx(2.0 + 0.05 * factor)
    assert recomputed_layer(layer, ("core_attn", "mlp")).backward_s == pytest.approx(2.0 + 0.55 * factor)
    one = StageProfile(layers=[layer], io=IOProfile(1e9, 1e9))
    kept = replay(one, [LayerChoice(K)], read_ahead=1)
    assert replay(one, [LayerChoice(K, recompute=("core_attn",))], read_ahead=1).step_s == \
        pytest.approx(kept.step_s + 0.05 * factor)


def test_rebuilt_bytes_are_held_while_the_layer_runs_backward():
    one = StageProfile(layers=[attention_layer(0)], io=IOProfile(1e9, 1e9), other_s=1.0)
    kept = replay(one, [LayerChoice(K)], read_ahead=1)
    recomputed = replay(one, [LayerChoice(K, recompute=("core_attn",))], read_ahead=1)
    assert kept.peak_bytes == 40 * MB
    assert recomputed.microbatch_peak_bytes == 40 * MB  # 20 MB held, 20 MB rebuilt in backward
    assert recomputed.memory[1:3] == [(1.0, 20 * MB), (2.0, 40 * MB)]  # the sites left, then the rebuilt too
    assert recomputed.step_s == pytest.approx(kept.step_s + 0.05)
    two = StageProfile(layers=[attention_layer(0), attention_layer(1)], io=IOProfile(1e9, 1e9))
    both = replay(two, [LayerChoice(K, recompute=("core_attn",))] * 2, read_ahead=1)
    assert both.peak_bytes == 60 * MB  # layer 1's rebuilt bytes on top of both layers' sites left


def test_the_planner_recomputes_inside_a_layer_where_moving_would_stall():
    plan = make_plan(stage(1e6), PlanRequest(memory_budget=100 * MB))  # 1 MB/s: a write of 10 MB takes 10 s
    assert [c.recompute for c in plan.choices().values()] == [("core_attn",)] * 3 + [()]
    assert plan.placements == [K] * 4
    assert plan.peak_activation_bytes <= 100 * MB
    assert plan.step_s == pytest.approx(plan.keep_step_s + 3 * 0.05)  # core_attn, not the dearer mlp


def test_the_planner_moves_where_moving_hides():
    plan = make_plan(stage(1e9), PlanRequest(memory_budget=100 * MB))
    assert all(not c.recompute for c in plan.choices().values())
    assert O in plan.placements and plan.step_s == pytest.approx(plan.keep_step_s)


def test_recompute_inside_a_layer_combines_with_offloading_its_other_sites():
    plan = make_plan(stage(3e7), PlanRequest(memory_budget=70 * MB))  # neither alone fits 70 MB at the least step time
    first = plan.layers[0]
    assert first.placement is O and first.choice.recompute == ("core_attn",)
    assert first.site_count == 2 and first.moved == 20 * MB  # the sites left, moved
    assert first.placement_text == "offload +core_attn"
    assert plan.peak_activation_bytes <= 70 * MB and plan.exposed_s == 0.0
    again = replay(stage(3e7), list(plan.choices().values()), read_ahead=1)
    assert again.peak_bytes == plan.peak_activation_bytes and again.step_s == pytest.approx(plan.step_s)


def test_read_ahead_auto_plans_the_sites_left():
    plan = make_plan(stage(6e7), PlanRequest(memory_budget=70 * MB, read_ahead_mode="auto"))
    for lp in plan.layers:
        if lp.site_read_ahead is not None:
            assert len(lp.site_read_ahead) == lp.site_count
    assert any(lp.choice.recompute for lp in plan.layers)


def test_plan_json_round_trip_keeps_the_modules_and_reads_plans_without_them():
    plan = make_plan(stage(3e7), PlanRequest(memory_budget=70 * MB))
    data = json.loads(plan.to_json())
    assert data["schema"] == "megatron_ssd.plan/3"
    assert data["layers"][0]["choice"]["recompute"] == ["core_attn"]
    assert "recompute" not in data["layers"][3]["choice"]  # written only where a module is named
    back = Plan.from_json(plan.to_json())
    assert back.choices() == plan.choices()
    assert back.layers[0].choice.recompute == ("core_attn",)
    old = json.loads(make_plan(stage(1e9), PlanRequest(memory_budget=100 * MB)).to_json())  # a plan of before: no key
    assert all(set(layer["choice"]) == {"placement", "sites", "read_ahead"} for layer in old["layers"])
    assert all(c.recompute == () for c in Plan.from_dict(old).choices().values())


def test_an_unknown_module_is_one_clear_error():
    with pytest.raises(ConfigError) as err:
        LayerChoice.of(3, LayerChoice(K, recompute=("attention",)))
    assert str(err.value) == ("megatron_ssd: plan[3].recompute = ['attention']: 'attention' is not a module a plan "
                              "can recompute inside a layer; must be names of ['core_attn', 'mlp']")
    bad = json.loads(make_plan(stage(3e7), PlanRequest(memory_budget=70 * MB)).to_json())
    bad["layers"][0]["choice"]["recompute"] = ["core_attn", "layernorm"]
    with pytest.raises(ConfigError, match=r"^megatron_ssd: plan\[0\]\.recompute = \['core_attn', 'layernorm'\]: "
                                          r"'layernorm' is not a module"):
        Plan.from_dict(bad)
    with pytest.raises(ConfigError, match=r"plan\[1\]\.recompute = \['mlp'\]: the placement 'recompute' recomputes "
                                          r"the whole layer already"):
        LayerChoice.of(1, LayerChoice(Placement.RECOMPUTE, recompute=("mlp",)))
    with pytest.raises(ConfigError, match=r"plan\['head'\]\.recompute = \['mlp'\]: the tensors saved outside"):
        LayerChoice.of("head", LayerChoice(K, recompute=("mlp",)))


def test_profile_modules_round_trip_and_are_checked():
    profile = stage(1e9, n=2)
    assert StageProfile.from_json(profile.to_json()) == profile
    data = json.loads(profile.to_json())
    assert data["layers"][0]["modules"][0] == {"name": "core_attn", "forward_s": 0.05, "freed_sites": [1],
                                               "held_bytes": 0}
    del data["layers"][0]["modules"]  # a profile written before the field
    assert StageProfile.from_dict(data).layers[0].modules is None
    with pytest.raises(ConfigError, match=r"ModuleProfile.name = 'softmax': must be one of \['core_attn', 'mlp'\]"):
        ModuleProfile("softmax", 0.1, [0])
    with pytest.raises(ConfigError, match=r"modules = .*: freed_sites must be sites of the layer \(< 3\)"):
        LayerProfile(0, 1.0, 2.0, 40 * MB, site_bytes=[10 * MB, 20 * MB, 10 * MB],
                     modules=[ModuleProfile("core_attn", 0.05, [3])])


def test_predict_refuses_nothing_new_for_layers_without_modules():
    """A stage without measured modules plans as before: no module move is offered."""
    plain = StageProfile(layers=[LayerProfile(i, 1.0, 2.0, 40 * MB) for i in range(4)], io=IOProfile(1e6, 1e6))
    plan = make_plan(plain, PlanRequest(memory_budget=100 * MB))
    assert all(not c.recompute for c in plan.choices().values())
    assert predict(plain, [K] * 4).peak_bytes == 160 * MB


def test_a_drifted_forward_scales_the_modules_recompute_price():
    from megatron_ssd.planner import DriftDetector

    profile = stage(1e9, n=1)
    detector = DriftDetector(window=1)
    detector.rebase(profile)
    decision = detector.observe(forward_s=[2.0], backward_s=[2.0])  # forward twice as slow
    assert decision.replan
    modules = decision.profile.layers[0].modules
    assert [m.forward_s for m in modules] == pytest.approx([0.1, 1.0])
