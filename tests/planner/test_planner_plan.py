"""make_plan: both goals, infeasible budgets, pipeline stages, JSON form."""

from __future__ import annotations

import json
import os

import pytest

from megatron_ssd.config import Placement
from megatron_ssd.errors import ConfigError, MegatronSSDError
from megatron_ssd.planner.plan import (
    GOAL_MAX_OFFLOAD,
    GOAL_MEMORY_BUDGET,
    PLAN_SCHEMA,
    Plan,
    PlanInfeasibleError,
    make_plan,
)
from megatron_ssd.placement import LayerChoice
from megatron_ssd.planner.profile import IOProfile, StageProfile, uniform_stage
from megatron_ssd.planner.search import replay
from megatron_ssd.planner.step_timeline import predict
from megatron_ssd.planner.request import PlanRequest

GB = 10**9
K, O, R = Placement.KEEP, Placement.OFFLOAD, Placement.RECOMPUTE


def fast_stage(**kw) -> StageProfile:
    """8 layers of 1 s forward, 2 s backward, 1 GB; writes and reads take 0.1 s."""
    return uniform_stage(8, 1.0, 2.0, GB, IOProfile(10 * GB, 10 * GB), **kw)


def slow_stage(**kw) -> StageProfile:
    """The same layers on an array where a write or a read takes 1.5 s."""
    return uniform_stage(8, 1.0, 2.0, GB, IOProfile(GB / 1.5, GB / 1.5), **kw)


def test_window_fits_offloads_every_layer_that_lowers_the_peak():
    """Every write and read hides, but offloading layer 6 would buy nothing: its read
    buffer is allocated when the first backward starts, which is when the peak is (layer 7
    and layer 6's bytes), so it stays: no zero-benefit writes."""
    plan = make_plan(fast_stage())
    assert plan.goal == GOAL_MAX_OFFLOAD
    assert plan.placements == [O] * 6 + [K] * 2
    assert plan.exposed_s == 0.0
    assert plan.step_s == plan.keep_step_s == 24.0
    assert plan.keep_peak_activation_bytes == 8 * GB
    assert plan.peak_activation_bytes == 2 * GB  # the last two layers
    assert plan.offloaded_bytes == 6 * GB
    assert all(lp.write_s == pytest.approx(0.1) and lp.read_s == pytest.approx(0.1) for lp in plan.layers[:6])
    seven = predict(fast_stage(), [O] * 7 + [K])
    assert not seven.forwarded and seven.exposed_s == 0.0 and seven.peak_bytes == plan.peak_activation_bytes


def test_window_does_not_fit_offloads_a_prefix_without_stall():
    stage = slow_stage()
    plan = make_plan(stage, PlanRequest(safety_margin=0.1))
    offloaded = plan.layers_with(O)
    assert 0 < len(offloaded) < 7
    assert offloaded == list(range(len(offloaded)))  # the first layers
    assert plan.exposed_s <= 0.1 * plan.step_s
    assert plan.exposed_s == 0.0 and not any(lp.forwarded for lp in plan.layers)
    # the planner stopped where it had to: one more layer stalls, is forwarded or buys no memory
    more = plan.placements
    more[len(offloaded)] = O
    tl = predict(stage, more, io=stage.io.derated(0.1))
    assert tl.exposed_s > 0 or tl.forwarded or tl.peak_bytes >= predict(stage, plan.placements, io=stage.io.derated(0.1)).peak_bytes


def test_compute_slowdown_is_reported_not_hidden():
    stage = uniform_stage(8, 1.0, 2.0, GB, IOProfile(10 * GB, 10 * GB, compute_slowdown=0.5))
    plan = make_plan(stage)
    assert plan.exposed_s == 0.0
    assert plan.slowdown_s > 0
    assert plan.step_s == pytest.approx(plan.keep_step_s + plan.slowdown_s)


def test_slowdown_bound_holds_the_hidden_offload_to_a_step_time():
    """NOTE [Slowdown bound]: every write and read hides, but compute runs 50% slower
    while I/O is in flight. Unbounded, six layers are offloaded (as with no slowdown);
    bounded at 1%, the first layers up to the bound; at 0, none. A memory budget is
    met whatever the bound."""
    stage = uniform_stage(8, 1.0, 2.0, GB, IOProfile(10 * GB, 10 * GB, compute_slowdown=0.5))
    assert make_plan(stage).placements == [O] * 6 + [K] * 2
    bounded = make_plan(stage, PlanRequest(max_slowdown=0.01))
    assert bounded.placements == [O] * 3 + [K] * 5
    assert bounded.step_s <= 1.01 * bounded.keep_step_s < predict(stage, [O] * 4 + [K] * 4).step_s
    assert bounded.request.max_slowdown == 0.01 and "step at most 1.010x keep-everything" in bounded.table()
    assert Plan.from_dict(bounded.to_dict()).request.max_slowdown == 0.01
    assert make_plan(stage, PlanRequest(max_slowdown=0.0)).placements == [K] * 8
    budget = make_plan(stage, PlanRequest(memory_budget=3 * GB, max_slowdown=0.0))
    assert budget.goal == GOAL_MEMORY_BUDGET and budget.peak_activation_bytes <= 3 * GB
    with pytest.raises(ConfigError, match=r"PlanRequest.max_slowdown = -0.1: must be a number >= 0 or null"):
        make_plan(stage, PlanRequest(max_slowdown=-0.1))


def test_budget_met_with_offload_and_recompute():
    stage = slow_stage()
    budget = 3 * GB
    plan = make_plan(stage, PlanRequest(memory_budget=budget))
    assert plan.goal == GOAL_MEMORY_BUDGET and plan.request.memory_budget == budget
    assert plan.peak_activation_bytes <= budget
    assert plan.layers_with(O) and plan.layers_with(R)
    assert plan.exposed_s == 0.0
    # cheaper than reaching the same budget by recompute alone (5 layers recomputed)
    recompute_only = predict(stage, [R] * 5 + [K] * 3)
    assert recompute_only.peak_bytes <= budget
    assert plan.step_s < recompute_only.step_s


def test_budget_already_met_keeps_everything():
    plan = make_plan(fast_stage(), PlanRequest(memory_budget=8 * GB))
    assert plan.placements == [K] * 8
    assert plan.step_s == plan.keep_step_s


def test_budget_without_recompute_uses_offload_only():
    plan = make_plan(fast_stage(), PlanRequest(memory_budget=4 * GB, allow_recompute=False))
    assert plan.peak_activation_bytes <= 4 * GB
    assert not plan.layers_with(R)
    assert plan.step_s == plan.keep_step_s


def test_budget_impossible_names_smallest_peak():
    # everything recomputed still materializes one layer (1 GB) during its backward
    with pytest.raises(PlanInfeasibleError) as info:
        make_plan(slow_stage(), PlanRequest(memory_budget=GB // 2))
    err = info.value
    assert isinstance(err, MegatronSSDError)
    assert err.memory_budget == GB // 2
    assert err.smallest_peak == GB
    text = str(err)
    assert text.startswith("megatron_ssd:")
    assert "memory_budget = 500000000 bytes" in text
    assert "smallest reachable predicted peak is 1000000000 bytes" in text


def test_budget_impossible_without_recompute():
    with pytest.raises(PlanInfeasibleError) as info:
        make_plan(slow_stage(), PlanRequest(memory_budget=2 * GB, allow_recompute=False))
    assert info.value.smallest_peak > 2 * GB
    assert str(info.value.smallest_peak) in str(info.value)


def test_first_pipeline_stage_offloads_more_for_the_same_budget():
    budget = 6 * GB
    first = make_plan(fast_stage(pipeline_rank=0, pipeline_size=4), PlanRequest(memory_budget=budget))
    last = make_plan(fast_stage(pipeline_rank=3, pipeline_size=4), PlanRequest(memory_budget=budget))
    assert first.microbatches_in_flight == 4 and last.microbatches_in_flight == 1
    assert first.keep_peak_activation_bytes == 32 * GB and last.keep_peak_activation_bytes == 8 * GB
    assert first.peak_activation_bytes <= budget and last.peak_activation_bytes <= budget
    moved = lambda plan: sum(lp.bytes for lp in plan.layers if lp.placement is not K)  # noqa: E731
    assert moved(first) > moved(last)
    assert len(first.layers_with(O)) > len(last.layers_with(O))


def test_plan_json_round_trip_and_schema():
    plan = make_plan(slow_stage(), PlanRequest(memory_budget=3 * GB))
    data = json.loads(plan.to_json())
    assert data["schema"] == PLAN_SCHEMA
    assert data["goal"] == "memory_budget"
    assert {entry["choice"]["placement"] for entry in data["layers"]} <= {"keep", "offload", "recompute"}
    assert all(set(entry["choice"]) == {"placement", "sites", "read_ahead"} for entry in data["layers"])
    for key in ("layer_id", "choice", "bytes", "write_s", "read_s", "exposed_s"):
        assert all(key in entry for entry in data["layers"])
    for key in ("peak_activation_bytes", "step_s", "keep_peak_activation_bytes", "keep_step_s", "io"):
        assert key in data
    assert data["io"]["write_bytes_per_s"] == GB / 1.5
    assert Plan.from_json(plan.to_json()) == plan


def test_a_plan_written_in_the_first_schema_loads_as_the_same_plan():
    """plan/1 held a layer's decision as four side-by-side fields; plan/2 as one choice."""
    for plan in (make_plan(slow_stage(), PlanRequest(memory_budget=3 * GB)), make_plan(fast_stage(), PlanRequest(read_ahead_mode="auto"))):
        old = plan.to_dict()
        old["schema"] = "megatron_ssd.plan/1"
        for entry in old["layers"]:
            choice = entry.pop("choice")
            depth = choice["read_ahead"]
            entry.update(placement=choice["placement"], offload_sites=choice["sites"],
                         read_ahead=depth if isinstance(depth, int) else max(1, max(depth)),
                         site_read_ahead=None if isinstance(depth, int) else depth)
        assert Plan.from_json(json.dumps(old)) == plan


def test_plan_json_rejects_wrong_schema_and_unknown_keys():
    data = make_plan(fast_stage()).to_dict()
    with pytest.raises(ConfigError, match=r"^megatron_ssd: Plan.schema = 'other/9': must be 'megatron_ssd.plan/3' "
                                          r"\(or 'megatron_ssd.plan/2' or 'megatron_ssd.plan/1', read too\)$"):
        Plan.from_dict({**data, "schema": "other/9"})
    bad = {**data, "layers": [{**data["layers"][0], "choice": {"placement": "offload", "sites": -2, "read_ahead": 1}}]}
    with pytest.raises(ConfigError, match=r"sites\[0\] = -2: must be an integer >= 0"):
        Plan.from_dict(bad)
    with pytest.raises(ConfigError, match="unknown key 'peak'"):
        Plan.from_dict({**data, "peak": 1})


@pytest.mark.parametrize("change, match", [
    (lambda d: d["layers"][0].update(bytes=-5), r"Plan.layers\[0\].bytes = -5: must be a finite number >= 0"),
    (lambda d: d["layers"][1].update(write_s=float("inf")), r"write_s = inf: must be a finite number"),
    (lambda d: d.update(peak_activation_bytes=-1), r"Plan.peak_activation_bytes = -1: must be a finite number"),
    (lambda d: d["layers"][2].update(layer_id=-3), r"Plan.layers\[-3\].layer_id = -3: must be >= 0"),
    (lambda d: d["layers"][2].update(layer_id=d["layers"][1]["layer_id"]), r"layer_id = 1: must name each layer once"),
    (lambda d: d["layers"][0].update(site_count=2, choice={"placement": "offload", "sites": 5, "read_ahead": 1}),
     r"Plan.layers\[0\].choice.sites = 5: must be at most site_count = 2"),
    (lambda d: d.update(pipeline_rank=4, pipeline_size=2), r"Plan.pipeline_rank = 4: must be in \[0, pipeline_size"),
])
def test_a_plan_read_back_is_checked_like_a_config(change, match):
    """``Plan.from_json`` is a library call with no command behind it: what it reads is
    checked all the same (docs/reliability.md, Known limits)."""
    data = json.loads(make_plan(fast_stage()).to_json())
    change(data)
    with pytest.raises(ConfigError, match=match):
        Plan.from_json(json.dumps(data))


def test_table_lists_every_layer():
    plan = make_plan(fast_stage(), PlanRequest(memory_budget=3 * GB))
    text = plan.table()
    lines = text.splitlines()
    assert len(lines) == 1 + 8 + 2
    assert "offload" in text and "keep-everything" in text
    assert plan.placement(7) is K
    with pytest.raises(KeyError):
        plan.placement(99)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"safety_margin": 1.0}, "safety_margin = 1.0"),
        ({"safety_margin": -0.1}, "safety_margin"),
        ({"default_read_ahead": 0}, "default_read_ahead = 0"),
        ({"memory_budget": -1}, "memory_budget = -1"),
        ({"memory_budget": 1.5}, "memory_budget = 1.5"),
    ],
)
def test_bad_arguments_name_field_and_rule(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        make_plan(fast_stage(), PlanRequest(**kwargs))


def test_unequal_layers_skip_the_one_that_does_not_fit():
    stage = fast_stage()
    stage.layers[1].saved_bytes = 40 * GB  # 4 s each way: cannot hide behind one backward
    plan = make_plan(stage)
    assert plan.placement(1) is K
    assert plan.placement(0) is O and plan.placement(2) is O
    assert plan.exposed_s == 0.0


def test_drives_not_measured_get_nothing_and_the_plan_says_so():
    """An IOProfile without bandwidths (no profiling step moved a byte to the drives:
    ``offload.keep_last_layers`` kept every layer) cannot price OFFLOAD, so no plan places a
    layer there: without a budget every layer is kept, a budget is met by recomputing, and
    one it cannot meet says why. Before, the bandwidths were +inf and every layer was
    offloaded as if writing cost no time."""
    unmeasured = uniform_stage(8, 1.0, 2.0, GB, IOProfile(None, None))
    plan = make_plan(unmeasured)
    assert plan.placements == [K] * 8 and plan.offloaded_bytes == 0
    assert Plan.from_json(plan.to_json()) == plan
    assert "drives: not measured (no profiling step moved a byte to them), so nothing is placed on them" in plan.table()
    assert O not in make_plan(unmeasured, PlanRequest(memory_budget=4 * GB)).placements
    with pytest.raises(PlanInfeasibleError, match=r"cannot be met without the drives \(their bandwidth was not "
                                                    r"measured"):
        make_plan(unmeasured, PlanRequest(memory_budget=4 * GB, allow_recompute=False))
    with pytest.raises(ConfigError, match=r"placements: 'offload' needs the drives' measured bandwidths"):
        predict(unmeasured, [O] + [K] * 7)
    assert "not measured" not in make_plan(fast_stage()).table()



# A 2-layer GPT's profile measured on a loaded 2-core machine (rok's budget point), on which
# the greedy search met no single move that lowered the peak (NOTE [Uniform fallback]).
PLATEAU_STAGE = {'layers': [{'layer_id': 'embedding',
                             'forward_s': 0.0,
                             'backward_s': 0.0,
                             'saved_bytes': 0,
                             'kept_bytes': 2048,
                             'recompute_s': None,
                             'boundary_bytes': 0,
                             'site_bytes': None,
                             'site_use': None,
                             'recomputable': False,
                             'modules': None,
                             'rebuilt_bytes': 0},
                            {'layer_id': 1,
                             'forward_s': 0.032869,
                             'backward_s': 0.013121,
                             'saved_bytes': 659456,
                             'kept_bytes': 2048,
                             'recompute_s': 0.01272,
                             'boundary_bytes': 32768,
                             'site_bytes': [32768, 32768, 98304, 4096, 131072, 32768, 32768, 32768, 131072, 131072],
                             'site_use': [0.97424, 0.954439, 0.898032, 0.0, 0.900512, 0.872147, 0.071072, 0.050051, 0.025208,
                                          0.006586],
                             'recomputable': True,
                             'modules': [{'name': 'core_attn', 'forward_s': 0.000662, 'freed_sites': [4], 'held_bytes': 0}],
                             'rebuilt_bytes': 0},
                            {'layer_id': 2,
                             'forward_s': 0.015545,
                             'backward_s': 0.006537,
                             'saved_bytes': 655360,
                             'kept_bytes': 2048,
                             'recompute_s': 0.006015,
                             'boundary_bytes': 32768,
                             'site_bytes': [32768, 32768, 98304, 131072, 32768, 32768, 32768, 131072, 131072],
                             'site_use': [0.978548, 0.940394, 0.83734, 0.842087, 0.806412, 0.774695, 0.736012, 0.685155,
                                          0.015449],
                             'recomputable': True,
                             'modules': [{'name': 'core_attn', 'forward_s': 0.000585, 'freed_sites': [3], 'held_bytes': 0}],
                             'rebuilt_bytes': 0}],
                 'io': {'write_bytes_per_s': 27186938.32,
                        'read_bytes_per_s': 123846688.85,
                        'compute_slowdown': 2.983,
                        'host_bytes_per_s': None,
                        'max_inflight_bytes': 268435456,
                        'shared_host_link': True},
                 'pipeline_rank': 0,
                 'pipeline_size': 1,
                 'microbatches_in_flight': 1,
                 'other_s': 0.013905,
                 'head_bytes': 198784}


def test_a_budget_that_recomputing_every_layer_meets_is_met_where_no_single_move_helps():
    """NOTE [Uniform fallback] in ``greedy.py``: before it, the greedy search raised
    PlanInfeasibleError for 759872 bytes while naming 724992 bytes as its smallest reachable
    peak (rok's budget point then had no plan and no paired steps, under load only, since
    the profile's times decide the plateau). The greedy then met it by recomputing both
    layers; the search now meets it faster, recomputing one layer and offloading one site
    of the other with its core attention recomputed, and reaches the smallest peak any plan
    has (696320 bytes: the exhaustive oracle's), where the greedy stopped at 724992."""
    stage = StageProfile.from_dict(PLATEAU_STAGE)
    both = [LayerChoice(Placement.KEEP), LayerChoice(Placement.RECOMPUTE), LayerChoice(Placement.RECOMPUTE)]
    for read_ahead in ("fixed", "auto"):
        plan = make_plan(stage, PlanRequest(memory_budget=759872, default_read_ahead=2, read_ahead_mode=read_ahead))
        assert plan.peak_activation_bytes <= 759872
        assert plan.step_s < replay(stage, both, 2).step_s
        assert [lp.placement for lp in plan.layers] == [Placement.KEEP, Placement.RECOMPUTE, Placement.OFFLOAD]
        assert plan.layers[2].choice.recompute == ("core_attn",)
    assert make_plan(stage, PlanRequest(memory_budget=696320, default_read_ahead=2)).peak_activation_bytes <= 696320
    with pytest.raises(PlanInfeasibleError, match="smallest reachable predicted peak is 696320 bytes"):
        make_plan(stage, PlanRequest(memory_budget=696319, default_read_ahead=2))


@pytest.mark.parametrize("name, made", [
    ("plan2_memory_budget.json", lambda: make_plan(slow_stage(), PlanRequest(memory_budget=3 * GB, default_read_ahead=2))),
    ("plan2_read_ahead_auto.json", lambda: make_plan(fast_stage(), PlanRequest(read_ahead_mode="auto"))),
])
def test_a_plan_written_before_the_read_ahead_names_loads_as_the_same_plan(name, made):
    """Plans written with ``prefetch_depth`` and ``read_ahead`` (the mode) at the top
    level read those as ``default_read_ahead`` and ``read_ahead_mode``, and a ``plan/2``
    layer's ``offloaded`` as its ``moved``."""
    path = os.path.join(os.path.dirname(__file__), "fixtures", name)
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    assert '"prefetch_depth"' in text and '"read_ahead_mode"' not in text and '"offloaded"' in text
    assert Plan.from_json(text) == made()
