"""The device's activation capacity is a hard limit on every plan, on constructed profiles."""

from __future__ import annotations

import pytest

from megatron_ssd.config import Placement, PlannerConfig
from megatron_ssd.errors import ConfigError
from megatron_ssd.planner.plan import GOAL_CAPACITY, GOAL_MAX_OFFLOAD, GOAL_MEMORY_BUDGET, PlanInfeasibleError, make_plan
from megatron_ssd.planner.profile import IOProfile, uniform_stage
from megatron_ssd.planner.request import PlanRequest

GB = 10**9
K, O, R = Placement.KEEP, Placement.OFFLOAD, Placement.RECOMPUTE


def slow_stage():
    """8 layers of 1 s forward, 2 s backward, 1 GB; a write or a read takes 1.5 s, so
    only some layers' I/O hides."""
    return uniform_stage(8, 1.0, 2.0, GB, IOProfile(GB / 1.5, GB / 1.5))


def test_hidden_offload_that_fits_is_kept():
    free = make_plan(slow_stage())
    plan = make_plan(slow_stage(), PlanRequest(capacity_bytes=free.peak_activation_bytes))
    assert plan.goal == GOAL_MAX_OFFLOAD and plan.placements == free.placements
    assert plan.request.capacity_bytes == free.peak_activation_bytes


def test_hidden_offload_that_does_not_fit_is_replaced_by_one_that_does():
    free = make_plan(slow_stage())
    capacity = free.peak_activation_bytes // 2
    plan = make_plan(slow_stage(), PlanRequest(capacity_bytes=capacity))
    assert plan.goal == GOAL_CAPACITY
    assert plan.peak_activation_bytes <= capacity < free.peak_activation_bytes
    assert plan.step_s >= free.step_s
    assert "device capacity" in plan.table()


def test_a_budget_above_the_capacity_is_lowered_to_it():
    keep_peak = make_plan(slow_stage()).keep_peak_activation_bytes
    plan = make_plan(slow_stage(), PlanRequest(memory_budget=keep_peak, capacity_bytes=keep_peak // 3))
    assert plan.goal == GOAL_CAPACITY and plan.peak_activation_bytes <= keep_peak // 3
    within = make_plan(slow_stage(), PlanRequest(memory_budget=keep_peak // 3, capacity_bytes=keep_peak))
    assert within.goal == GOAL_MEMORY_BUDGET


def test_a_capacity_nothing_reaches_names_the_smallest_peak():
    with pytest.raises(PlanInfeasibleError, match=r"capacity_bytes = 1 bytes .* cannot be met .* smallest reachable"):
        make_plan(slow_stage(), PlanRequest(capacity_bytes=1))


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_capacity_is_named(bad):
    with pytest.raises(ConfigError, match=r"PlanRequest.capacity_bytes = .*: must be an integer > 0 bytes or null"):
        make_plan(slow_stage(), PlanRequest(capacity_bytes=bad))


@pytest.mark.parametrize(
    "field, value, rule",
    [("activation_capacity_bytes", 0, "must be an integer > 0 bytes or null"), ("capacity_reserve", 1.0, r"must be in \[0, 1\)")],
)
def test_capacity_fields_are_checked(field, value, rule):
    with pytest.raises(ConfigError, match=rf"PlannerConfig\.{field} = .*: {rule}"):
        PlannerConfig(**{field: value})
