"""DriftDetector: re-plan on sustained change, not on noise; fell-behind streaks."""

from __future__ import annotations

import pytest

from megatron_ssd.errors import ConfigError
from megatron_ssd.planner.drift import DriftDetector
from megatron_ssd.planner.measurement import LayerMeasurement, StepMeasurement
from megatron_ssd.planner.plan import make_plan
from megatron_ssd.planner.profile import IOProfile, uniform_stage

GB = 10**9
NOISE = [1.0, 1.05, 0.95, 1.03, 0.97, 1.04, 0.96, 1.02, 0.98, 1.0]


def stage(slowdown=0.0):
    return uniform_stage(4, 1.0, 2.0, GB, IOProfile(2 * GB, 4 * GB, slowdown))


def detector(**kw):
    d = DriftDetector(**kw)
    d.rebase(stage())
    return d


def test_small_noise_never_replans():
    d = detector()
    for f in NOISE:
        decision = d.observe(2 * GB * f, 4 * GB / f, [1.0 * f] * 4, [2.0 / f] * 4)
        assert not decision.replan, decision.reasons


def test_sustained_write_bandwidth_drop_replans_after_window():
    d = detector(threshold=0.15, window=3)
    decisions = [d.observe(1.2 * GB, 4 * GB, [1.0] * 4, [2.0] * 4) for _ in range(3)]
    assert [x.replan for x in decisions] == [False, False, True]
    last = decisions[-1]
    assert any(r.startswith("write_bw") for r in last.reasons)
    assert last.profile.io.write_bytes_per_s == pytest.approx(1.2 * GB)
    assert last.profile.io.read_bytes_per_s == pytest.approx(4 * GB)
    assert last.profile.layers[0].forward_s == pytest.approx(1.0)


def test_one_outlier_step_is_ignored():
    d = detector()
    for f in [1.0, 0.5, 1.0, 1.0, 1.0]:  # one step at half bandwidth (e.g. a checkpoint write)
        assert not d.observe(2 * GB * f, 4 * GB).replan


def test_layer_compute_change_replans_with_scaled_profile():
    d = detector()
    for _ in range(3):
        decision = d.observe(2 * GB, 4 * GB, {0: 1.0, 1: 1.0, 2: 1.5, 3: 1.0}, {2: 2.0})
    assert decision.replan
    assert decision.reasons == ["forward:2: median 1500.00 ms vs expected 1000.00 ms (+50.0%)"]
    assert decision.profile.layers[2].forward_s == pytest.approx(1.5)
    assert decision.profile.layers[1].forward_s == pytest.approx(1.0)


def test_layers_that_scatter_around_the_plan_do_not_replan():
    """NOTE [Compute drift by stage]: +20% on two layers and -20% on the other two leave
    the stage's time where the plan put it."""
    d = detector()
    for _ in range(5):
        decision = d.observe(2 * GB, 4 * GB, [1.2, 1.2, 0.8, 0.8], [2.4, 1.6, 2.4, 1.6])
        assert not decision.replan, decision.reasons


def test_the_whole_stage_slowing_down_replans_with_every_layer_scaled():
    d = detector()
    for _ in range(3):
        decision = d.observe(2 * GB, 4 * GB, [1.2] * 4, [2.0] * 4)
    assert decision.replan
    assert decision.reasons == ["forward of the stage: median 4800.00 ms vs expected 4000.00 ms (+20.0%)"]
    assert [layer.forward_s for layer in decision.profile.layers] == pytest.approx([1.2] * 4)
    assert [layer.backward_s for layer in decision.profile.layers] == pytest.approx([2.0] * 4)


def test_expected_times_come_from_the_plan():
    # with a compute slowdown the plan predicts layers slower than the profile's pure
    # compute; measuring exactly the plan's prediction is no drift
    s = stage(slowdown=0.5)
    plan = make_plan(s)
    assert any(lp.forward_s > 1.0 for lp in plan.layers)
    d = DriftDetector()
    d.rebase(s, plan)
    for _ in range(5):
        decision = d.observe(2 * GB, 4 * GB, [lp.forward_s for lp in plan.layers], [lp.backward_s for lp in plan.layers])
        assert not decision.replan


def test_fell_behind_streak_replans_with_lower_write_bandwidth():
    d = detector(window=3)
    for step in range(3):
        d.report_fell_behind(layer_id=1, nbytes=GB)
        decision = d.observe(2 * GB, 4 * GB)
        assert decision.fell_behind == 1
    assert decision.replan
    assert any("fell behind" in r for r in decision.reasons)
    assert decision.profile.io.write_bytes_per_s == pytest.approx(2 * GB * 0.85)
    assert d.fell_behind_total == 3


def test_fell_behind_now_and_then_is_not_a_streak():
    d = detector(window=3)
    for step in range(6):
        if step % 2 == 0:
            d.report_fell_behind()
        assert not d.observe(2 * GB, 4 * GB).replan
    assert d.fell_behind_total == 3


def test_rebase_clears_history():
    d = detector()
    for _ in range(2):
        d.observe(1.0 * GB, 4 * GB)
    d.rebase(stage())
    assert d.steps_observed == 0
    assert not d.observe(1.0 * GB, 4 * GB).replan


def step(write_bytes_per_s, read_bytes_per_s, busy_s, backpressure_keeps, layers):
    """A measured step of 10 s whose writes and reads were each busy for ``busy_s``."""
    return StepMeasurement(wall_s=10.0, microbatches=2, write_bytes_per_s=write_bytes_per_s,
                           read_bytes_per_s=read_bytes_per_s, write_busy_s=busy_s, read_busy_s=busy_s,
                           backpressure_keeps=backpressure_keeps, peak_saved_bytes=0, peak_open_microbatches=1,
                           layers=layers)


def test_observe_step_stats_reads_cache_counters():
    d = detector()
    layers = {i: LayerMeasurement(forward_s=2.0, backward_s=4.0, microbatches=2) for i in range(4)}
    stats = step(2 * GB, 4 * GB, 5.0, 1, layers)
    for _ in range(3):
        decision = d.observe_step_stats(stats)
    assert decision.fell_behind == 1
    assert decision.replan and all("fell behind" in r for r in decision.reasons)


def test_bad_use_is_named():
    with pytest.raises(ConfigError, match="threshold = 0"):
        DriftDetector(threshold=0)
    with pytest.raises(ConfigError, match="window = 0"):
        DriftDetector(window=0)
    with pytest.raises(ConfigError, match="rebase"):
        DriftDetector().observe(GB, GB)
    with pytest.raises(ConfigError, match="unknown layer ids"):
        detector().observe(GB, GB, {"x": 1.0})
    with pytest.raises(ConfigError, match="one per layer"):
        detector().observe(GB, GB, [1.0])


def test_bandwidth_from_a_short_burst_is_no_sample():
    """NOTE [Short I/O samples]: writes busy for 1% of a step measure a burst; they do not
    move the expected bandwidth, while the same rate over 50% of the step does."""
    layers = {i: LayerMeasurement(forward_s=2.0, backward_s=4.0, microbatches=2) for i in range(4)}

    def stats(busy_s):
        return step(4 * GB, 4 * GB, busy_s, 0, layers)

    burst, sustained = detector(), detector()
    for _ in range(3):
        short, long = burst.observe_step_stats(stats(0.1)), sustained.observe_step_stats(stats(5.0))
    assert not short.replan
    assert long.replan and any("write_bw" in r for r in long.reasons)


def test_drives_not_measured_are_not_watched():
    """A profile without bandwidths (nothing moved to the drives) has no bandwidth to drift
    from: the steps' bandwidths are not compared, the layers' times still are."""
    d = DriftDetector(threshold=0.15, window=3)
    d.rebase(uniform_stage(4, 1.0, 2.0, GB, IOProfile(None, None)))
    decisions = [d.observe(1.2 * GB, 4 * GB, [1.0] * 4, [2.0] * 4) for _ in range(3)]
    assert not any(x.replan for x in decisions)
    for _ in range(3):
        d.report_fell_behind()
        decision = d.observe(1.2 * GB, 4 * GB, [2.0] * 4, [2.0] * 4)
    assert decision.replan and decision.profile.io == IOProfile(None, None)
    assert decision.profile.layers[0].forward_s == pytest.approx(2.0)

