"""Just-in-time reads (NOTE [Just-in-time reads]) and no zero-benefit writes, on
constructed profiles (the cache's side: tests/cache/test_read_ahead.py)."""

from __future__ import annotations

import pytest

from megatron_ssd.config import Placement
from megatron_ssd.errors import ConfigError
from megatron_ssd.planner import IOProfile, LayerProfile, StageProfile, make_plan, predict, uniform_stage, PlanRequest

from layer_choices import choices_of

GB = 10**9
K, O, R = Placement.KEEP, Placement.OFFLOAD, Placement.RECOMPUTE


def gpu_like_stage() -> StageProfile:
    """16 layers of 1 GB, 10 ms forward and 20 ms backward, on an array where a layer's
    write or read takes 35 ms: a read needs about two layers' backward, so with one layer
    of read-ahead nothing hides."""
    return uniform_stage(16, 0.010, 0.020, GB, IOProfile(GB / 0.035, GB / 0.035))


def test_per_layer_depths_replay_like_one_depth():
    stage = gpu_like_stage()
    placements = [O] * 4 + [K] * 12
    for depth in (1, 2, 5):
        assert predict(stage, choices_of(placements, depth)) == predict(stage, choices_of(placements, [[depth]] * 16))
    with pytest.raises(ConfigError, match=r"choices: 15 given for 16 layers"):
        predict(stage, choices_of(placements[:15]))
    with pytest.raises(ConfigError, match=r"must be an integer >= 1, or one per layer \(16\), each an integer >= 1 or a list of integers >= 0"):
        predict(stage, choices_of(placements, 0))


@pytest.mark.slow
def test_fixed_depth_one_offloads_nothing_and_auto_hides_reads_further_ahead():
    stage = gpu_like_stage()
    fixed = make_plan(stage, PlanRequest(read_ahead_mode="fixed"))
    assert fixed.layers_with(O) == []
    auto = make_plan(stage, PlanRequest(read_ahead_mode="auto"))
    offloaded = auto.layers_with(O)
    assert len(offloaded) >= 2
    assert auto.exposed_s == 0.0 and auto.step_s == pytest.approx(auto.keep_step_s)
    assert auto.peak_activation_bytes < fixed.peak_activation_bytes
    assert all(auto.layers[i].read_ahead >= 2 for i in offloaded)
    assert auto.request.read_ahead_mode == "auto"
    assert {i: c.read_ahead for i, c in auto.choices().items() if c.moved} == {i: auto.layers[i].read_ahead for i in offloaded}
    assert "read ahead" in auto.table()


@pytest.mark.slow
def test_auto_reads_are_issued_as_late_as_they_still_arrive_in_time():
    stage = gpu_like_stage()
    plan = make_plan(stage, PlanRequest(read_ahead_mode="auto"))
    depths = [lp.read_ahead for lp in plan.layers]
    base = predict(stage, choices_of(plan.placements, depths))
    assert base.exposed_s == 0.0
    for i in plan.layers_with(O):
        if depths[i] == 1:
            continue
        earlier_issue = depths[:i] + [depths[i] - 1] + depths[i + 1:]
        tl = predict(stage, choices_of(plan.placements, earlier_issue))
        derated = predict(stage, choices_of(plan.placements, earlier_issue), io=stage.io.derated(plan.request.safety_margin))
        assert (tl.exposed_s > 0 or tl.forwarded or tl.step_s > base.step_s or tl.peak_bytes > base.peak_bytes
                or derated.exposed_s > 0 or derated.forwarded), i


@pytest.mark.slow
@pytest.mark.parametrize("read_ahead", ["fixed", "auto"])
def test_every_offloaded_layer_lowers_the_peak(read_ahead):
    """No zero-benefit writes: putting any offloaded layer back to KEEP raises the peak."""
    for stage in (gpu_like_stage(), uniform_stage(8, 1.0, 2.0, GB, IOProfile(10 * GB, 10 * GB))):
        plan = make_plan(stage, PlanRequest(read_ahead_mode=read_ahead))
        depths = [lp.read_ahead for lp in plan.layers]
        for i in plan.layers_with(O):
            kept = plan.placements[:i] + [K] + plan.placements[i + 1:]
            assert predict(stage, choices_of(kept, depths)).peak_bytes > plan.peak_activation_bytes, (read_ahead, i)


def test_under_a_budget_equal_step_times_go_to_the_fewest_bytes_written():
    """Two layers of equal cost, one offloadable in the window and one recomputable:
    the budget is met at the same predicted step time by OFFLOAD or by a cheap RECOMPUTE;
    among equal times the plan writes the least (drive wear)."""
    layers = [LayerProfile(i, 0.010, 0.020, GB, recompute_s=0.0) for i in range(4)]
    stage = StageProfile(layers=layers, io=IOProfile(GB / 0.035, GB / 0.035))
    plan = make_plan(stage, PlanRequest(memory_budget=3 * GB, read_ahead_mode="auto"))
    assert plan.peak_activation_bytes <= 3 * GB
    assert plan.offloaded_bytes == 0 and plan.layers_with(R)


def test_pipeline_wait_lends_time_to_the_io_but_not_to_the_step():
    """NOTE [Pipeline micro-batches]: with two micro-batches in flight the replayed one's
    backward comes one slot (12 s) after its forward, while another micro-batch's write
    and read use the array; a 5 s write + 5 s read that no read-ahead hides in a lone
    micro-batch hides there, and the step time is still the micro-batch's own 12 s."""
    layers = dict(num_layers=4, forward_s=1.0, backward_s=2.0, saved_bytes=GB, io=IOProfile(GB / 5, GB / 5))
    alone = uniform_stage(**layers)
    piped = uniform_stage(**layers, microbatches_in_flight=2)
    offload_first = [O, K, K, K]
    assert all(predict(alone, choices_of(offload_first, d)).exposed_s > 0 or predict(alone, choices_of(offload_first, d)).forwarded
               for d in (1, 2, 3, 4))
    tl = predict(piped, choices_of(offload_first, 3))
    assert tl.exposed_s == 0.0 and not tl.forwarded
    assert tl.step_s == predict(piped, [K] * 4).step_s == 12.0
