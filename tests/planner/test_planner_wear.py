"""Drive wear as a planning constraint (NOTE [Wear model]): the arithmetic, the write
limit honoured under both goals on constructed profiles, config and report."""

from __future__ import annotations

import math

import pytest

from megatron_ssd.config import Placement, PlannerConfig
from megatron_ssd.errors import ConfigError
from megatron_ssd.planner.plan import Plan, PlanInfeasibleError, make_plan
from megatron_ssd.planner.profile import IOProfile, uniform_stage
from megatron_ssd.planner.drives import lifetime_for, write_limit_for
from megatron_ssd.planner.wear import drive_lifetime_years, write_limit_bytes_per_s
from megatron_ssd.planner.request import PlanRequest

GB = 10**9
K, O, R = Placement.KEEP, Placement.OFFLOAD, Placement.RECOMPUTE


def fast_stage():
    """8 layers of 1 s forward, 2 s backward, 1 GB each; I/O hides easily (24 s a step)."""
    return uniform_stage(8, 1.0, 2.0, GB, IOProfile(10 * GB, 10 * GB))


def test_limit_and_lifetime_are_inverse():
    limit = write_limit_bytes_per_s(7.0e15, target_years=3, ssd_count=4, gpus_per_array=8, duty_cycle=0.5)
    assert drive_lifetime_years(limit, 7.0e15, ssd_count=4, gpus_per_array=8, duty_cycle=0.5) == pytest.approx(3.0)
    # 8 GPUs on four 1-DWPD 3.84 TB drives for 3 years: 38.6 MB/s each, not GB/s.
    assert write_limit_bytes_per_s(7.3e15, 3, 4, 8) == pytest.approx(38.58e6, rel=1e-3)
    assert drive_lifetime_years(0.0, 7e15) == math.inf


def test_no_limit_offloads_what_hides():
    plan = make_plan(fast_stage())
    assert plan.placements == [O] * 6 + [K] * 2  # layer 6 would not lower the peak
    assert plan.request.max_write_bytes_per_s is None


@pytest.mark.parametrize("limit, offloaded", [(0.15 * GB / 1, 3), (1 * GB / 24 + 1, 1), (0.0, 0)])
def test_write_limit_caps_max_offload(limit, offloaded):
    plan = make_plan(fast_stage(), PlanRequest(max_write_bytes_per_s=limit))
    assert plan.placements == [O] * offloaded + [K] * (8 - offloaded)
    assert plan.write_bytes_per_s <= limit
    assert "the drives' endurance allows this process" in plan.table()
    assert Plan.from_json(plan.to_json()).request.max_write_bytes_per_s == limit


@pytest.mark.slow
def test_write_limit_turns_a_budget_to_recompute():
    keep_peak = make_plan(fast_stage()).keep_peak_activation_bytes
    budget = keep_peak // 2
    free = make_plan(fast_stage(), PlanRequest(memory_budget=budget))
    assert O in free.placements
    worn = make_plan(fast_stage(), PlanRequest(memory_budget=budget, max_write_bytes_per_s=0.0))
    assert O not in worn.placements and R in worn.placements
    assert worn.peak_activation_bytes <= budget


def test_budget_that_needs_writes_beyond_the_limit_is_one_clear_error():
    keep_peak = make_plan(fast_stage()).keep_peak_activation_bytes
    with pytest.raises(PlanInfeasibleError, match=r"cannot be met within the drive-wear write limit of 0\.0 MB/s"):
        make_plan(fast_stage(), PlanRequest(memory_budget=keep_peak // 2, allow_recompute=False, max_write_bytes_per_s=0.0))


@pytest.mark.parametrize("bad", [-1.0, True, "fast"])
def test_bad_write_limit_is_named(bad):
    with pytest.raises(ConfigError, match=r"PlanRequest.max_write_bytes_per_s = .*: must be a number >= 0 or null"):
        make_plan(fast_stage(), PlanRequest(max_write_bytes_per_s=bad))


def test_config_fields_give_the_limit_per_process():
    assert write_limit_for(PlannerConfig(), paths=4) is None
    cfg = PlannerConfig(drive_tbw_bytes=int(7e15), drive_lifetime_years=3, drive_sharing=8)
    assert write_limit_for(cfg, paths=4) == pytest.approx(write_limit_bytes_per_s(7e15, 3, 4, 8))
    raid = PlannerConfig(drive_tbw_bytes=int(7e15), drive_count=4, drive_sharing=8)
    assert write_limit_for(raid, paths=1) == write_limit_for(cfg, paths=4)  # one RAID0 mount of 4 drives
    assert lifetime_for(cfg, 4, write_limit_for(cfg, 4)) == pytest.approx(3.0)


@pytest.mark.parametrize(
    "field, value, rule",
    [
        ("drive_tbw_bytes", 0, "must be > 0 bytes or null"),
        ("drive_lifetime_years", 0.0, "must be > 0"),
        ("drive_sharing", 0, "must be >= 1"),
        ("drive_duty_cycle", 1.5, r"must be in \(0, 1\]"),
        ("drive_count", -1, "must be >= 0"),
    ],
)
def test_drive_fields_are_checked(field, value, rule):
    with pytest.raises(ConfigError, match=rf"PlannerConfig\.{field} = .*: {rule}"):
        PlannerConfig(**{field: value})


@pytest.mark.slow
@pytest.mark.parametrize("limit_gb_s", [0.02, 0.05, 0.1, 0.3])
def test_plans_write_within_the_limit_at_their_own_predicted_step_time(limit_gb_s):
    """Slow drives: offloads stall and lengthen the step, and the bound still holds at
    the plan's own (measured-bandwidth) step time, under both goals."""
    slow = uniform_stage(8, 1.0, 2.0, GB, IOProfile(GB / 1.5, GB / 1.5))
    limit = limit_gb_s * GB
    keep_peak = make_plan(slow).keep_peak_activation_bytes
    for plan in (make_plan(slow, PlanRequest(max_write_bytes_per_s=limit)),
                 make_plan(slow, PlanRequest(memory_budget=keep_peak // 2, max_write_bytes_per_s=limit))):
        assert plan.write_bytes_per_s <= limit
