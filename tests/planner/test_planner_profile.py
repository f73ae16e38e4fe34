"""Profiles: validation names field, value and rule; JSON round trip."""

from __future__ import annotations

import json

import pytest

from megatron_ssd.errors import ConfigError
from megatron_ssd.planner.profile import IOProfile, LayerProfile, StageProfile, uniform_stage


def test_defaults():
    layer = LayerProfile("decoder.layers.0", 1.0, 2.0, 100)
    assert layer.kept_bytes == 0 and layer.boundary_bytes == 0
    assert layer.recompute_time == 1.0
    assert LayerProfile(0, 1.0, 2.0, 100, recompute_s=0.5).recompute_time == 0.5
    io = IOProfile(1e9, 2e9)
    assert io.compute_slowdown == 0.0
    assert io.derated(0.25) == IOProfile(0.75e9, 1.5e9)


def test_microbatches_in_flight_defaults_to_1f1b():
    io = IOProfile(1e9, 1e9)
    assert uniform_stage(2, 1.0, 2.0, 1, io).microbatches_in_flight == 1
    assert uniform_stage(2, 1.0, 2.0, 1, io, pipeline_rank=0, pipeline_size=4).microbatches_in_flight == 4
    assert uniform_stage(2, 1.0, 2.0, 1, io, pipeline_rank=3, pipeline_size=4).microbatches_in_flight == 1
    assert uniform_stage(2, 1.0, 2.0, 1, io, pipeline_size=4, microbatches_in_flight=7).microbatches_in_flight == 7


def test_json_round_trip(tmp_path):
    layers = [
        LayerProfile(0, 1.0, 2.0, 100, kept_bytes=3, recompute_s=0.9, boundary_bytes=8),
        LayerProfile("decoder.layers.1", 1.5, 2.5, 200),
    ]
    stage = StageProfile(layers, IOProfile(1e9, 2e9, 0.3, host_bytes_per_s=25e9), pipeline_rank=1, pipeline_size=2,
                         other_s=0.25)
    assert StageProfile.from_json(stage.to_json()) == stage
    data = json.loads(stage.to_json())
    assert data["layers"][1]["layer_id"] == "decoder.layers.1"
    assert data["io"] == {"write_bytes_per_s": 1e9, "read_bytes_per_s": 2e9, "compute_slowdown": 0.3,
                          "host_bytes_per_s": 25e9, "host_compute_slowdown": 0.0, "max_inflight_bytes": None,
                          "shared_host_link": True, "tiers": {}}
    del data["io"]["tiers"]  # a profile written before the field: no tier beyond the SSDs and the host pool
    del data["io"]["host_compute_slowdown"]  # a profile written before the field: host copies priced at nothing
    del data["io"]["max_inflight_bytes"]  # a profile written before the field loads, unbounded
    del data["io"]["shared_host_link"]  # ... and before this one, on a shared link (NOTE [Shared link])
    assert StageProfile.from_dict(data) == stage
    path = tmp_path / "profile.json"
    stage.save(str(path))
    assert StageProfile.load(str(path)) == stage


def test_json_errors_are_named():
    data = uniform_stage(1, 1.0, 2.0, 1, IOProfile(1e9, 1e9)).to_dict()
    data["layers"][0]["forward_seconds"] = 1.0
    with pytest.raises(ConfigError, match="unknown key 'forward_seconds'; did you mean 'forward_s'"):
        StageProfile.from_dict(data)
    with pytest.raises(ConfigError, match="not valid JSON"):
        StageProfile.from_json("{")


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: LayerProfile(0, -1.0, 2.0, 1), r"LayerProfile\(layer_id=0\).forward_s = -1.0: must be a number >= 0"),
        (lambda: LayerProfile(0, 1.0, 2.0, -5), "saved_bytes = -5: must be an integer >= 0"),
        (lambda: LayerProfile(0, 1.0, 2.0, 1.5), "saved_bytes = 1.5"),
        (lambda: LayerProfile(None, 1.0, 2.0, 1), "layer_id = None"),
        (lambda: IOProfile(0, 1e9), "IOProfile.write_bytes_per_s = 0: must be a number > 0"),
        (lambda: IOProfile(1e9, 1e9, -0.1), "compute_slowdown = -0.1"),
        (lambda: StageProfile([], IOProfile(1, 1)), "StageProfile.layers"),
        (
            lambda: StageProfile([LayerProfile(0, 1, 1, 1), LayerProfile(0, 1, 1, 1)], IOProfile(1, 1)),
            "layer ids must be unique",
        ),
        (lambda: uniform_stage(2, 1, 1, 1, IOProfile(1, 1), pipeline_rank=2, pipeline_size=2), "pipeline_rank = 2"),
        (lambda: uniform_stage(2, 1, 1, 1, IOProfile(1, 1), microbatches_in_flight=0), "microbatches_in_flight = 0"),
        (lambda: uniform_stage(2, 1, 1, 1, IOProfile(1, 1), other_s=-1), "other_s = -1"),
    ],
)
def test_validation_names_field_value_rule(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


def test_an_unmeasured_bandwidth_is_null_and_round_trips():
    """A profile from steps that moved nothing to the drives has no bandwidth: null, not
    +inf (which priced moving bytes at no time, and which no JSON reader takes back: a
    ``megatron-ssd train`` that kept every layer planned from it, then exited 2 with
    "IOProfile.write_bytes_per_s = inf: must be a finite number" and no summary). Both
    bandwidths are known or neither is; NaN and infinities stay refused."""
    io = IOProfile(None, None, 0.2)
    assert (io.write_bytes_per_s, io.read_bytes_per_s) == (None, None)
    derated = io.derated(0.25)
    assert (derated.write_bytes_per_s, derated.read_bytes_per_s) == (None, None)
    assert derated.compute_slowdown == pytest.approx(0.2 / 0.75)
    stage = uniform_stage(2, 1.0, 2.0, 1, io)
    assert StageProfile.from_json(stage.to_json()) == stage
    assert json.loads(stage.to_json())["io"]["write_bytes_per_s"] is None
    with pytest.raises(ConfigError, match=r"IOProfile.read_bytes_per_s = 1.0: must be null exactly when "
                                          r"write_bytes_per_s is"):
        IOProfile(None, 1.0)
    for bad in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(ConfigError, match=r"IOProfile.write_bytes_per_s = -?(nan|inf): must be a finite number"):
            IOProfile(bad, 1.0)
    with pytest.raises(ConfigError, match=r"IOProfile.compute_slowdown = inf: must be a finite number"):
        IOProfile(1.0, 1.0, compute_slowdown=float("inf"))
