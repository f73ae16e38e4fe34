"""A planned rok point's prediction error split in two (NOTE [Two parts of a prediction's
error] in ``megatron_ssd/commands/rok.py``): the plan's step against its prediction, and
the profile's KEEP step against the keep steps paired with the plan's."""

from __future__ import annotations

import pytest

from megatron_ssd.commands.rok import prediction_parts


def test_a_ratio_error_from_the_profiles_keep_step_is_told_apart_from_the_plans_price():
    # configs/gpt-ref-cpu.yaml at budget 0.7 (rok-gpt-ref-cpu-s60.json): predicted 1.088x,
    # measured 1.240x paired; its plan's step predicted 4.7% fast, its KEEP step 8.7% slow
    plan = {"step_s": 2.494808486198048, "keep_step_s": 2.29268704700371}
    point = {"paired_step_s": 2.617571020993637, "paired_keep_step_s": 2.1098329960004776}
    parts = prediction_parts(plan, 1, point)
    assert parts["predicted_paired_step_s"] == plan["step_s"]
    assert parts["plan_step_error"] == pytest.approx(-0.0469, abs=5e-4)
    assert parts["profile_keep_drift"] == pytest.approx(0.0867, abs=5e-4)
    # the two parts make the ratio's error: 1.088 predicted against 1.240 measured
    ratio_error = (1 + parts["plan_step_error"]) / (1 + parts["profile_keep_drift"]) - 1
    assert ratio_error == pytest.approx(-0.123, abs=5e-4)


def test_a_step_is_its_microbatches_replays_and_missing_medians_give_nothing():
    plan = {"step_s": 1.189, "keep_step_s": 1.140}  # per micro-batch; two per step (gpt-deep-cpu)
    parts = prediction_parts(plan, 2, {"paired_step_s": 2.304, "paired_keep_step_s": 2.280})
    assert parts["predicted_paired_step_s"] == pytest.approx(2.378)
    assert parts["profile_keep_drift"] == pytest.approx(2.280 / 2.280 - 1, abs=1e-12)
    assert prediction_parts(plan, 2, {"paired_step_s": 0.0, "paired_keep_step_s": 2.28}) == {}
    assert prediction_parts(plan, 2, {}) == {}
