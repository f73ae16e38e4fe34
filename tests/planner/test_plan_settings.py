"""A planner setting takes the same values and is refused with the same rule wherever a
user gives it: the config, ``simulate``'s keys and the API's ``PlanRequest``
(``megatron_ssd/config/plan_settings.py``)."""

from __future__ import annotations

import re

import pytest

from megatron_ssd.config import OffloadConfig, load_config
from megatron_ssd.errors import ConfigError
from megatron_ssd.planner import PlanRequest, make_plan
from megatron_ssd.planner.profile import IOProfile, uniform_stage
from megatron_ssd.planner.simulation_spec import spec_from_overrides

# (PlanRequest field, its config key, its simulate key or None)
SHARED = [
    ("memory_budget", "offload.planner.memory_budget", "memory_budget"),
    ("safety_margin", "offload.planner.safety_margin", "safety_margin"),
    ("default_read_ahead", "offload.default_read_ahead", "default_read_ahead"),
    ("read_ahead_mode", "offload.planner.read_ahead_mode", "read_ahead_mode"),
    ("allow_recompute", "offload.planner.allow_recompute", "allow_recompute"),
    ("max_slowdown", "offload.planner.max_slowdown", None),
    ("search", "offload.planner.search", None),
    ("capacity_bytes", "offload.planner.activation_capacity_bytes", None),
]
BAD = {
    "memory_budget": [("0", 0), ("-1", -1)],
    "safety_margin": [("1.0", 1.0), ("-0.1", -0.1)],
    "default_read_ahead": [("0", 0), ("-2", -2), ("10001", 10001)],
    "read_ahead_mode": [("later", "later")],
    "allow_recompute": [],  # the config and simulate parse true/false before the rule sees them
    "max_slowdown": [("-0.5", -0.5), ("1001", 1001.0)],
    "search": [("exact", "exact")],
    "capacity_bytes": [("0", 0)],
}
GOOD = {
    "memory_budget": [("1", 1), ("2GiB", 2 << 30)],
    "safety_margin": [("0", 0.0), ("0.5", 0.5)],
    "default_read_ahead": [("1", 1), ("3", 3)],
    "read_ahead_mode": [("auto", "auto"), ("fixed", "fixed")],
    "allow_recompute": [("false", False)],
    "max_slowdown": [("0", 0.0), ("0.05", 0.05)],
    "search": [("greedy", "greedy"), ("full", "full")],
    "capacity_bytes": [("64MiB", 64 << 20)],
}


def _rule(error: ConfigError) -> str:
    """The rule of a one-line error, without the class, the field and the value."""
    text = str(error).splitlines()[0]
    return re.sub(r"^megatron_ssd: [\w.]+ = .*?: ", "", text)


def _config_error(key: str, typed: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(OffloadConfig, None, [f"{key.removeprefix('offload.')}={typed}"])
    return info.value


def _cases(table):
    return [(field, key, sim, typed, value) for field, key, sim in SHARED for typed, value in table[field]]


@pytest.mark.parametrize("field, key, sim, typed, value", _cases(BAD))
def test_a_value_one_place_refuses_every_place_refuses_with_the_same_rule(field, key, sim, typed, value):
    with pytest.raises(ConfigError) as api:
        PlanRequest(**{field: value})
    assert f"PlanRequest.{field} = " in str(api.value)
    rule = _rule(api.value)
    assert _rule(_config_error(key, typed)) == rule
    if sim is not None:
        with pytest.raises(ConfigError) as simulated:
            spec_from_overrides([f"{sim}={typed}"])
        assert _rule(simulated.value) == rule


@pytest.mark.parametrize("field, key, sim, typed, value", _cases(GOOD))
def test_a_value_one_place_takes_every_place_takes(field, key, sim, typed, value):
    assert getattr(PlanRequest(**{field: value}), field) == value
    cfg = load_config(OffloadConfig, None, [f"{key.removeprefix('offload.')}={typed}"])
    section = cfg.planner if key.startswith("offload.planner.") else cfg
    assert getattr(section, key.rsplit(".", 1)[1]) == value
    if sim is not None:
        assert getattr(spec_from_overrides([f"{sim}={typed}"]), sim) == value


def test_make_plan_takes_a_request_and_nothing_else():
    stage = uniform_stage(3, 0.1, 0.2, 1 << 20, IOProfile(write_bytes_per_s=1e9, read_bytes_per_s=1e9))
    assert make_plan(stage).request == PlanRequest()
    with pytest.raises(TypeError):
        make_plan(stage, memory_budget=1 << 20)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match=r"request = dict: must be a PlanRequest"):
        make_plan(stage, {"memory_budget": 1 << 20})  # type: ignore[arg-type]
