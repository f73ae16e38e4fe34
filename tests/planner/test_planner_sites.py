"""Site granularity in the planner (NOTE [Sites]): a layer offloads the prefix of its saved
tensors that its window carries, on constructed profiles (the cache's side:
tests/cache/test_sites.py)."""

from __future__ import annotations

import pytest

from megatron_ssd.config import Placement
from megatron_ssd.errors import ConfigError
from megatron_ssd.placement import LayerChoice
from megatron_ssd.planner import IOProfile, LayerProfile, Plan, StageProfile, make_plan, predict, PlanRequest

from layer_choices import choices_of

GB = 10**9
K, O, R = Placement.KEEP, Placement.OFFLOAD, Placement.RECOMPUTE


def split_stage(n: int = 8, sites: int = 4, io: IOProfile = IOProfile(GB / 0.035, GB / 0.035)) -> StageProfile:
    """n layers of 1 GB in ``sites`` equal tensors, 10 ms forward and 20 ms backward; a
    whole layer's write or read takes 35 ms, more than one layer's backward."""
    q = GB // sites
    return StageProfile(layers=[LayerProfile(i, 0.010, 0.020, q * sites, site_bytes=[q] * sites) for i in range(n)],
                        io=io)


def test_site_bytes_must_be_non_negative_and_sum_to_saved_bytes():
    with pytest.raises(ConfigError, match=r"LayerProfile\(layer_id=0\)\.site_bytes = \[1, 2\]: must sum to saved_bytes = 4"):
        LayerProfile(0, 0.1, 0.2, 4, site_bytes=[1, 2])
    with pytest.raises(ConfigError, match=r"site_bytes = \[-1, 5\]: must be a list of integers >= 0 or null"):
        LayerProfile(0, 0.1, 0.2, 4, site_bytes=[-1, 5])
    assert LayerProfile(0, 0.1, 0.2, 4, site_bytes=[0, 4]).moved_bytes(1) == 0  # another layer's storage (NOTE [Sites])
    assert LayerProfile(0, 0.1, 0.2, 4).sites == [4] and LayerProfile(0, 0.1, 0.2, 0).sites == []
    layer = LayerProfile(0, 0.1, 0.2, 6, site_bytes=[1, 2, 3])
    assert [layer.moved_bytes(k) for k in (0, 1, 2, 3, None)] == [0, 1, 3, 6, 6]
    stage = StageProfile(layers=[layer], io=IOProfile(1.0, 1.0))
    assert StageProfile.from_json(stage.to_json()) == stage


def test_a_partly_offloaded_layer_holds_the_sites_it_keeps():
    stage = split_stage(n=1)
    with pytest.raises(ConfigError, match=r"sites\[0\] = 5: must be None or an integer in \[0, 4\]"):
        predict(stage, choices_of([O], sites=[5]))
    whole, half, none = (predict(stage, choices_of([O], sites=[k])) for k in (None, 2, 0))
    assert [lt.moved_bytes for lt in (whole.layers[0], half.layers[0], none.layers[0])] == [GB, GB // 2, 0]
    assert half.write_busy_s == pytest.approx(whole.write_busy_s / 2)
    # the half it keeps stays resident from the forward's end to the backward's end
    assert (half.parked_bytes, none.parked_bytes, whole.parked_bytes) == (GB // 2, GB, 0)
    assert none.peak_bytes == predict(stage, [K]).peak_bytes and none.write_busy_s == 0.0


@pytest.mark.slow
def test_max_offload_moves_the_longest_prefix_each_window_carries():
    """Whole layers take 35 ms to read back against 20 ms of backward: with one layer of
    read-ahead none hides, so whole-layer planning offloads nothing; with sites, each of
    the first layers offloads the two tensors (17.5 ms) that fit."""
    stage = split_stage()
    whole = StageProfile(layers=[LayerProfile(i, 0.010, 0.020, GB) for i in range(8)], io=stage.io)
    assert make_plan(whole, PlanRequest(read_ahead_mode="fixed")).layers_with(O) == []
    plan = make_plan(stage, PlanRequest(read_ahead_mode="fixed"))
    # the fifth layer's first site lowers the measured peak only (see the next test)
    assert [lp.placement_text for lp in plan.layers] == ["offload 2/4"] * 4 + ["offload 1/4"] + ["keep"] * 3
    sites = [c.sites for c in plan.layer_choices]
    assert sites == [2, 2, 2, 2, 1, None, None, None]
    assert {i: c.sites for i, c in plan.choices().items()} == {i: [2, 2, 2, 2, 1][i] if i < 5 else None
                                                              for i in range(8)}
    assert plan.offloaded_bytes == 4 * GB // 2 + GB // 4 and plan.exposed_s == 0.0
    assert plan.step_s == pytest.approx(plan.keep_step_s)
    assert plan.peak_activation_bytes == plan.keep_peak_activation_bytes - 2 * GB - GB // 4
    # one more site in any of the first four would stall or buy nothing
    derated = stage.io.derated(plan.request.safety_margin)
    for i in plan.layers_with(O)[:4]:
        more = sites[:i] + [3] + sites[i + 1:]
        tl = predict(stage, choices_of(plan.placements, 1, more), io=derated)
        assert tl.exposed_s > 0 or tl.peak_bytes >= plan.peak_activation_bytes
    assert "offload 2/4" in plan.table()


def test_a_site_whose_write_ends_after_the_peak_is_not_offloaded():
    """NOTE [Every offloaded byte buys memory], per site: a site is moved only where it
    lowers a predicted peak, at the derated or at the measured bandwidths. The fifth
    layer's first site, written after the forward ends at the derated bandwidths, still
    lowers the measured peak (by its 0.25 GB), so it moves; the sixth layer's lowers
    neither, so nothing of it moves. (The greedy search, judging by the derated
    bandwidths alone, kept the fifth layer whole: a 6.0 GB measured peak for 5.75.)"""
    stage = split_stage()
    plan = make_plan(stage, PlanRequest(read_ahead_mode="fixed"))
    assert plan.placement(4) is O and plan.layers[4].offload_sites == 1 and plan.placement(5) is K
    sites = [c.sites for c in plan.layer_choices]
    derated = stage.io.derated(plan.request.safety_margin)
    chosen = [predict(stage, choices_of(plan.placements, 1, sites), io=io) for io in (derated, None)]
    without = choices_of(plan.placements[:4] + [K] * 4, 1, sites[:4] + [None] * 4)
    tl = predict(stage, without, io=derated)
    assert tl.peak_bytes == chosen[0].peak_bytes  # nothing at the derated bandwidths...
    assert predict(stage, without).peak_bytes == chosen[1].peak_bytes + GB // 4  # ...0.25 GB at the measured ones
    one_more = choices_of(plan.placements[:5] + [O] + [K] * 2, 1, sites[:5] + [1] + [None] * 2)
    for io, tl in zip((derated, None), chosen):
        more = predict(stage, one_more, io=io)
        assert more.layers[5].write_end > more.layers[5].forward_end
        assert more.peak_bytes >= tl.peak_bytes


@pytest.mark.slow
def test_under_a_wear_bound_a_budget_is_met_with_the_share_the_drives_can_take():
    """The drives allow 0.6 GB per step: no whole layer fits, so whole-layer planning
    recomputes two layers to reach 6.5 GB; with sites the first layer offloads two of its
    four tensors (0.5 GB) and one layer fewer is recomputed. At 7.5 GB sites avoid
    recompute altogether."""
    stage = split_stage(io=IOProfile(GB / 0.010, GB / 0.010))
    limit = 0.6 * GB / 0.240  # bytes per second over keep-everything's 240 ms step
    budget = int(6.5 * GB)
    whole = StageProfile(layers=[LayerProfile(i, 0.010, 0.020, GB) for i in range(8)], io=stage.io)
    by_layer = make_plan(whole, PlanRequest(memory_budget=budget, max_write_bytes_per_s=limit, read_ahead_mode="fixed"))
    by_site = make_plan(stage, PlanRequest(memory_budget=budget, max_write_bytes_per_s=limit, read_ahead_mode="fixed"))
    assert by_layer.offloaded_bytes == 0 and len(by_layer.layers_with(R)) == 2
    assert [c.sites for c in by_site.layer_choices] == [2] + [None] * (len(by_site.layers) - 1) and by_site.offloaded_bytes == GB // 2
    assert len(by_site.layers_with(R)) == 1
    assert by_site.step_s < by_layer.step_s and by_site.peak_activation_bytes <= budget
    loose = make_plan(stage, PlanRequest(memory_budget=int(7.5 * GB), max_write_bytes_per_s=limit, read_ahead_mode="fixed"))
    assert [lp.placement_text for lp in loose.layers] == ["offload 2/4"] + ["keep"] * 7
    assert loose.step_s == pytest.approx(loose.keep_step_s)


def test_a_budget_plan_writes_no_site_it_does_not_need():
    """With fast drives the greedy offloads whole layers; a 6.5 GB budget needs only half
    of the second one, so the plan writes 1.5 GB, not 2 GB."""
    stage = split_stage(io=IOProfile(GB / 0.005, GB / 0.005))
    plan = make_plan(stage, PlanRequest(memory_budget=int(6.5 * GB), read_ahead_mode="fixed", allow_recompute=False))
    assert plan.peak_activation_bytes <= 6.5 * GB
    assert plan.offloaded_bytes == int(1.5 * GB)
    assert plan.step_s == pytest.approx(plan.keep_step_s)


@pytest.mark.slow
def test_plans_with_sites_round_trip_and_report_site_changes():
    plan = make_plan(split_stage(), PlanRequest(read_ahead_mode="fixed"))
    again = Plan.from_json(plan.to_json())
    assert again.choices() == plan.choices() and again.layers[0].offload_sites == 2
    assert again.layers[0].site_count == 4 and again.layers[0].moved == GB // 2
    whole = Plan.from_json(plan.to_json())
    whole.layers[0].choice = LayerChoice(Placement.OFFLOAD)
    assert plan.changes_from(whole) == ["layer 0: offload -> offload 2/4"]


def test_a_measured_profile_with_sites_of_no_bytes_plans_under_its_capacity():
    """configs/gpt-ref-cpu.yaml at micro-batch 8 under a 500 MiB cap, as the first step
    measured it (tests/planner/fixtures/profile_gpt_ref_cpu_mb8_cap500.json): layers 2-8 hold
    the attention mask layer 1 saved first as a site of no bytes (NOTE [Sites]). Two
    prefixes that differ by that site score alike, and the greedy start's heap then
    compared their targets: "TypeError: '<' not supported between instances of
    'LayerChoice' and 'LayerChoice'", which ``rok --largest-within`` recorded as "cannot
    be met" at micro-batches 7 and 8. Its plan there measured 471.4 MiB; predicted 471.5."""
    import json
    import os

    path = os.path.join(os.path.dirname(__file__), "fixtures", "profile_gpt_ref_cpu_mb8_cap500.json")
    with open(path) as f:
        stage = StageProfile.from_dict(json.load(f))
    assert [layer.sites[3] for layer in stage.layers[2:]] == [0] * 7
    plan = make_plan(stage, PlanRequest(capacity_bytes=500 << 20, allow_recompute=True, read_ahead_mode="auto",
                                        max_slowdown=0.05, safety_margin=0.1, default_read_ahead=1))
    assert plan.peak_activation_bytes <= 500 << 20
