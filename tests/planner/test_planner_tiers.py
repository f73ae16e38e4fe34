"""A storage tier added in this file alone (NOTE [Tiers] in ``megatron_ssd/tier.py``).

A second drive group is registered here as a ``Tier``, its store a POSIX engine on a
directory of its own: no other file names it. On constructed profiles (its rates in the
stage's ``IOProfile.tiers``) the search places bytes on it by cost (only where it hides
what the SSDs cannot, or costs less step time than they do), reaches the exhaustive
oracle's optimum with three tiers on seeded random stages, and a plan using it
round-trips through JSON and prints it. A real megatron-core GPT then trains with it:
its rates probed, the plan's bytes on it, its bytes in the step's stats and their JSON,
and the losses and gradients bit-identical.
"""

from __future__ import annotations

import dataclasses
import os
import random
from typing import Optional

import pytest

import torch

from megatron_ssd import IOConfig, OffloadConfig, TensorCache
from megatron_ssd.config import PlannerConfig
from megatron_ssd.io import create_engine
from megatron_ssd.io.store import BlobStore
from megatron_ssd.placement import MOVED, LayerChoice, Placement
from megatron_ssd.planner.plan import Plan, PlanRequest, make_plan
from megatron_ssd.planner.profile import IOProfile, LayerProfile, StageProfile, TierRates
from megatron_ssd.planner.step_timeline import predict
from megatron_ssd.tier import TIERS, Tier, register, unregister
from megatron_ssd.workloads.parallel import destroy_parallel, init_parallel
from megatron_ssd_lab.planner_oracle import random_case

from planned_gpt import planned_run
from test_planner_oracle import check_against_oracle

MiB = 1 << 20


def _second_drive_group(config: OffloadConfig, device_type: str) -> Optional[BlobStore]:
    """The tier's store: the cache's engine kind on each offload path's ``-slow`` sibling;
    none where those directories are not there."""
    paths = [p + "-slow" for p in config.paths]
    if not paths or not all(os.path.isdir(p) for p in paths):
        return None
    return BlobStore(create_engine(dataclasses.replace(config, paths=paths)), "ssd")


SLOW = Tier("slow-ssd", "a second drive group", link="slow-ssd", drives=True, open_store=_second_drive_group)


@pytest.fixture(autouse=True)
def slow_tier():
    """The tier, registered for each test and removed after it (the registry is global)."""
    register(SLOW)
    yield SLOW.placement
    unregister(SLOW)


def _stage(layers: int = 6, ssd: float = 400e6, slow: float = 300e6, slow_slowdown: float = 0.0,
           ssd_slowdown: float = 0.0) -> StageProfile:
    """Layers of 32 MiB saved in 4 sites, 40 ms forward, 80 ms backward; the SSDs and the
    slower group each writing at the given rate (reads 1.5x)."""
    sites = [8 * MiB] * 4
    out = [LayerProfile(i, 0.04, 0.08, sum(sites), boundary_bytes=MiB, site_bytes=sites,
                        site_use=[0.9, 0.6, 0.3, 0.1]) for i in range(layers)]
    io = IOProfile(ssd, ssd * 1.5, compute_slowdown=ssd_slowdown,
                   tiers={SLOW.name: TierRates(slow, slow * 1.5, compute_slowdown=slow_slowdown)})
    return StageProfile(layers=out, io=io, other_s=0.01, head_bytes=4 * MiB)


def test_the_tier_is_a_placement_while_registered():
    assert Placement("slow-ssd") is SLOW.placement and SLOW.placement in MOVED
    assert TIERS[SLOW.placement] is SLOW
    assert LayerChoice.from_dict(0, {"placement": "slow-ssd", "sites": 2, "read_ahead": 1}).placement is SLOW.placement


def test_a_second_drive_group_hides_what_the_ssds_alone_cannot():
    """Two queues carry twice the bytes: the lowest hidden peak uses both tiers, and is
    lower than the SSDs' alone."""
    stage = _stage()
    both = make_plan(stage)
    alone = make_plan(dataclasses.replace(stage, io=dataclasses.replace(stage.io, tiers={})))
    assert SLOW.placement in both.placements and Placement.OFFLOAD in both.placements
    assert SLOW.placement not in alone.placements
    assert both.peak_activation_bytes < alone.peak_activation_bytes
    assert both.exposed_s == 0.0
    assert both.moved_to(SLOW.placement) > 0
    assert f"slow-ssd (a second drive group) {both.moved_to(SLOW.placement) / MiB:.1f} MiB per micro-batch" \
        in both.table()


@pytest.mark.parametrize("ssd_slowdown, slow_slowdown, chosen", [(0.5, 0.0, "slow-ssd"), (0.0, 0.5, "offload")])
def test_under_a_budget_the_tier_that_costs_less_step_time_carries_the_bytes(ssd_slowdown, slow_slowdown, chosen):
    """Where each tier alone could carry what the budget needs, the one whose transfers
    slow compute less carries it: the placement is chosen by cost, not by name."""
    stage = _stage(layers=4, ssd=2e9, slow=2e9, ssd_slowdown=ssd_slowdown, slow_slowdown=slow_slowdown)
    keep = predict(stage, [Placement.KEEP] * 4).peak_bytes
    plan = make_plan(stage, PlanRequest(memory_budget=int(0.8 * keep), allow_recompute=False))
    moved = {p.value for p in plan.placements if p in MOVED}
    assert moved == {chosen}, plan.table()


def test_a_profile_naming_a_tier_no_one_registered_is_one_error():
    from megatron_ssd.errors import ConfigError

    stage = _stage()
    stage = dataclasses.replace(stage, io=dataclasses.replace(stage.io, tiers={"cxl": stage.io.tiers["slow-ssd"]}))
    with pytest.raises(ConfigError, match=r"IOProfile.tiers\['cxl'\]: no tier of that name is registered"):
        make_plan(stage)


def test_a_plan_on_the_tier_round_trips_through_json():
    plan = make_plan(_stage())
    again = Plan.from_json(plan.to_json())
    assert again.placements == plan.placements and SLOW.placement in again.placements
    assert StageProfile.from_json(_stage().to_json()).io.tiers == {SLOW.name: _stage().io.tiers[SLOW.name]}


@pytest.mark.parametrize("seed", range(24))
def test_the_search_finds_the_oracles_plan_with_three_tiers(seed):
    """The exhaustive oracle over every choice on three tiers (the host pool, the SSDs and
    the slower group) agrees with the search on seeded random stages of 2 and 3 layers."""
    rng = random.Random(5000 + seed)
    case = random_case(rng, layers=2 + seed % 2)
    io = case.stage.io
    rates = TierRates(io.write_bytes_per_s * rng.uniform(0.2, 1.0), io.read_bytes_per_s * rng.uniform(0.2, 1.0),
                      compute_slowdown=rng.choice([0.0, io.compute_slowdown, 0.5]),
                      max_inflight_bytes=rng.choice([None, 8 * MiB]))
    stage = dataclasses.replace(case.stage, io=dataclasses.replace(io, tiers={SLOW.name: rates}))
    check_against_oracle(dataclasses.replace(case, stage=stage))


@pytest.fixture
def world():
    init_parallel(seed=1234)
    yield
    destroy_parallel()


@pytest.mark.slow
def test_a_real_gpt_trains_with_the_tier_bit_identical(world, tmp_path):
    """The cache opens the tier's store beside its others, the planner probes its rates
    (NOTE [Probed tiers] in ``profiling.py``) and, with the SSDs unmeasured (every layer
    kept by ``keep_last_layers``, NOTE [Unmeasured drives]) and recompute off, meets the
    budget by moving bytes to it; the step's stats count them, and training is the stock
    model's to the bit."""
    run = dict(layers=4, hidden=64, vocab=128, seq=64, mbs=4, nmb=2)
    stock, _, _ = planned_run(None, None, steps=7, **run)
    (tmp_path / "ssd").mkdir()
    (tmp_path / "ssd-slow").mkdir()
    cfg = OffloadConfig(paths=[str(tmp_path / "ssd")], min_tensor_bytes=4096, keep_last_layers=4,
                        io=IOConfig(max_inflight_bytes=1 << 20))
    with TensorCache(cfg) as cache:
        _, kept, _ = planned_run(cache, PlannerConfig(mode="keep"), steps=2, **run)
    with TensorCache(cfg) as cache:
        assert set(cache.stores) == {Placement.OFFLOAD, SLOW.placement}
        budget = PlannerConfig(mode="auto", warmup_steps=1, allow_recompute=False,
                               memory_budget=int(kept[-1].peak_resident_bytes * 0.7))
        planned, stats, planner = planned_run(cache, budget, steps=7, **run)
    assert all(torch.equal(a, b) for a, b in zip(stock.losses, planned.losses, strict=True))
    assert [n for n in stock.grads if not torch.equal(stock.grads[n], planned.grads[n])] == []
    rates = planner.profile.io.tiers["slow-ssd"]
    assert rates.write_bytes_per_s > 0 and rates.read_bytes_per_s > 0 and not planner.profile.io.drives_measured
    # the plan the last step ran under: a drift re-plan after it is not (NOTE [Search time] in adaptive.py)
    in_force = [e.plan for e in planner.events if e.plan is not None and e.step < len(stats) - 1][-1]
    assert SLOW.placement in in_force.placements
    last = stats[-1]
    assert last.tier_bytes["slow-ssd"]["moved"] == in_force.moved_to(SLOW.placement) * 2  # two micro-batches
    assert last.tier_bytes["slow-ssd"]["returned"] == last.tier_bytes["slow-ssd"]["moved"]
    assert last.bytes_offloaded == 0
    assert last.to_dict()["tier_bytes"]["slow-ssd"]["moved"] > 0 and "slow-ssd" in last.summary()


def test_tier_modules_are_imported_when_the_cache_starts(tmp_path, monkeypatch):
    """``offload.tier_modules`` names modules that register tiers; one that cannot be
    imported is one error naming it, before anything is made on disk."""
    from megatron_ssd.errors import ConfigError

    (tmp_path / "my_tiers.py").write_text(
        "from megatron_ssd.tier import Tier, register\n"
        "register(Tier('cxl', 'CXL memory', link='cxl'))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "ssd").mkdir()
    cfg = OffloadConfig(paths=[str(tmp_path / "ssd")], tier_modules=["my_tiers"])
    try:
        with TensorCache(cfg):
            assert Placement("cxl") in TIERS
    finally:
        if "cxl" in [p.value for p in TIERS]:
            unregister(TIERS[Placement("cxl")])
    with pytest.raises(ConfigError, match=r"^megatron_ssd: offload.tier_modules: 'no_such_tiers' could not be "
                                          r"imported \(ModuleNotFoundError: "):
        TensorCache(dataclasses.replace(cfg, tier_modules=["no_such_tiers"]))
    assert not list((tmp_path / "ssd").iterdir())


def test_the_train_summary_has_a_row_per_tier_that_moved_bytes():
    from megatron_ssd.commands.train import format_summary

    phase = {"name": "offload (auto)", "peak_activation_bytes": 100 << 20, "median_step_s": 1.0, "step_s": [1.0],
             "measured_steps": 1, "measured_kind": "measured", "tier_bytes_per_step": {"slow-ssd": 3.5 * MiB}}
    line = next(l for l in format_summary([phase]).splitlines() if l.startswith("moved to slow-ssd"))
    assert line.split() == ["moved", "to", "slow-ssd", "per", "step", "(MiB)", "3.5"]


def test_rok_reports_the_tiers_plan_and_bytes():
    """rok's point of a planned run names the tier in its plan, the plan's bytes on it and
    the bytes the run moved there per step (medians over rounds)."""
    import collections

    from megatron_ssd.commands.rok import _point

    plan = make_plan(_stage())

    def report(moved):
        phase = collections.defaultdict(int, step_s=[1.0], median_step_s=1.0, final_loss=2.0,
                                        tier_bytes_per_step={"slow-ssd": moved})
        return collections.defaultdict(int, phases=[phase], planner={"events": [{"plan": plan.to_dict()}]})

    point = _point("planner", [report(3.0 * MiB), report(5.0 * MiB), report(4.0 * MiB)])
    assert point["tier_bytes_per_step"] == {"slow-ssd": 4.0 * MiB}
    assert point["plan_moved_bytes"]["slow-ssd"] == plan.moved_to(SLOW.placement) > 0
    assert any(text.startswith("slow-ssd") for text in point["plan"]) and point["plan_same_every_round"]


def test_the_step_line_shows_the_bytes_moved_to_each_tier():
    from types import SimpleNamespace

    from megatron_ssd.commands.steps import step_line

    stats = SimpleNamespace(wall_s=0.5, peak_resident_bytes=64 * MiB, bytes_offloaded=2 * MiB,  # what it reads
                            tier_bytes={"slow-ssd": {"moved": 6 * MiB, "returned": 6 * MiB, "peak": 3 * MiB}})
    assert step_line("measured", 2.5, stats) == (
        "measured, loss 2.500, 0.50 s, peak act 64.0 MiB, wrote 2.0 MiB, moved to slow-ssd 6.0 MiB")
    stats.tier_bytes = {"slow-ssd": {"moved": 0, "returned": 0, "peak": 0}}
    assert step_line("measured", 2.5, stats).endswith("wrote 2.0 MiB")


def test_rok_imports_the_tier_modules_before_it_runs(tmp_path, monkeypatch):
    """rok reads its runs' plans in its own process, so it imports ``offload.tier_modules``
    too; one that cannot be imported is one error before any run starts."""
    from megatron_ssd.commands import rok
    from megatron_ssd.errors import ConfigError

    monkeypatch.setattr(rok, "rok_points", lambda *a, **k: pytest.fail("a run started"))
    with pytest.raises(ConfigError, match=r"offload.tier_modules: 'no_such_tiers' could not be imported"):
        rok.run_rok("configs/gpt-tiny.yaml", ["offload.tier_modules=[no_such_tiers]"])


def test_the_search_keeps_a_tiers_byte_budget():
    """A tier's ``TierRates.budget_bytes`` bounds what the plan moves to it for every
    micro-batch in flight, as the host pool's budget does."""
    stage = _stage()
    free = make_plan(stage)
    budget = free.moved_to(SLOW.placement) // 2
    assert budget > 0
    rates = dataclasses.replace(stage.io.tiers[SLOW.name], budget_bytes=budget)
    bounded = make_plan(dataclasses.replace(stage, io=dataclasses.replace(stage.io, tiers={SLOW.name: rates})))
    assert 0 < bounded.moved_to(SLOW.placement) <= budget
    assert bounded.exposed_s == 0.0


def test_a_tiers_budget_is_read_from_its_store_when_it_is_probed(tmp_path, monkeypatch):
    """``Tier.budget(store)`` is read with the tier's probe and priced as its
    ``TierRates.budget_bytes`` (NOTE [Probed tiers] in ``profiling.py``)."""
    from megatron_ssd.planner.measured_profile import with_probed_tiers
    from megatron_ssd.profiling import probe_tiers

    (tmp_path / "ssd").mkdir()
    (tmp_path / "ssd-slow").mkdir()
    store = _second_drive_group(OffloadConfig(paths=[str(tmp_path / "ssd")]), "cpu")
    seen = []
    budgeted = dataclasses.replace(SLOW, budget=lambda s: seen.append(s) or 48 * MiB)
    monkeypatch.setitem(TIERS, SLOW.placement, budgeted)
    try:
        probed = probe_tiers({SLOW.placement: store}, {})
    finally:
        store.close()
    write, read, budget = probed["slow-ssd"]
    assert write > 0 and read > 0 and budget == 48 * MiB and seen == [store]
    rates = with_probed_tiers(_stage(), probed).io.tiers["slow-ssd"]
    assert rates.budget_bytes == 48 * MiB and rates.write_bytes_per_s == write
