"""The host tier in the plan (NOTE [Host tier]): HOST layers copy to a bounded host pool
over the device's host link, which SSD requests cross too (NOTE [Shared link]); the
planner hosts what both tiers would hide and gives the SSDs what the pool cannot take,
within the pool's budget (NOTE [Tier preference]), on constructed profiles."""

from __future__ import annotations

import pytest

from megatron_ssd.config import Placement
from megatron_ssd.errors import ConfigError
from megatron_ssd.planner import IOProfile, LayerProfile, ModuleProfile, Plan, StageProfile, make_plan, predict, PlanRequest

GB = 10**9
K, O, H, R = Placement.KEEP, Placement.OFFLOAD, Placement.HOST, Placement.RECOMPUTE


def stage(host_bytes_per_s=GB / 0.004, n=8, in_flight=1, write_s=0.035, read_s=0.035,
          shared=True) -> StageProfile:
    """n layers of 1 GB in 4 tensors, 10 ms forward and 20 ms backward; the SSDs take
    35 ms per layer each way (no whole layer hides with one layer of read-ahead), the
    host link 4 ms."""
    q = GB // 4
    io = IOProfile(GB / write_s, GB / read_s, host_bytes_per_s=host_bytes_per_s, shared_host_link=shared)
    return StageProfile(layers=[LayerProfile(i, 0.010, 0.020, GB, site_bytes=[q] * 4) for i in range(n)], io=io,
                        pipeline_size=in_flight, pipeline_rank=0)


def test_host_copies_run_on_the_link_not_on_the_ssd_queue():
    st = stage()
    ssd, host = predict(st, [O] + [K] * 7), predict(st, [H] + [K] * 7)
    assert (ssd.write_busy_s, ssd.read_busy_s, ssd.host_busy_s) == pytest.approx((0.035, 0.035, 0.0))
    assert (host.write_busy_s, host.read_busy_s, host.host_busy_s) == pytest.approx((0.0, 0.0, 0.008))
    assert host.hosted_bytes == GB and host.offloaded_bytes == 0 and ssd.offloaded_bytes == GB
    # an SSD write in flight does not queue a host copy behind it: its staging used the
    # link for 4 ms of its 35, and the host copy starts when its forward does
    both = predict(st, [O, H] + [K] * 6)
    assert (both.layers[1].write_start, both.layers[1].write_end) == pytest.approx((0.010, 0.020))
    with pytest.raises(ConfigError, match="'host' needs IOProfile.host_bytes_per_s"):
        predict(stage(host_bytes_per_s=None), [H] + [K] * 7)


def test_without_a_host_budget_nothing_is_hosted():
    plan = make_plan(stage(), PlanRequest(read_ahead_mode="fixed"))
    assert plan.layers_with(H) == [] and plan.hosted_bytes == 0 and plan.request.host_budget_bytes is None
    with pytest.raises(ConfigError, match=r"host_budget_bytes = 1000: needs IOProfile.host_bytes_per_s"):
        make_plan(stage(host_bytes_per_s=None), PlanRequest(host_budget_bytes=1000))
    with pytest.raises(ConfigError, match=r"PlanRequest.host_budget_bytes = -1: must be an integer >= 0 bytes or null"):
        make_plan(stage(), PlanRequest(host_budget_bytes=-1))


@pytest.mark.slow
def test_the_host_pool_takes_what_it_hides_within_its_budget_and_the_ssds_the_rest():
    st = stage()
    ssd_only = make_plan(st, PlanRequest(read_ahead_mode="fixed"))
    plan = make_plan(st, PlanRequest(read_ahead_mode="fixed", host_budget_bytes=3 * GB))
    assert [lp.placement for lp in plan.layers[:3]] == [H, H, H]  # the pool, full, takes the earliest
    assert 0 < plan.offloaded_bytes < ssd_only.offloaded_bytes  # the SSDs take part of what is left
    assert plan.hosted_bytes == 3 * GB and plan.host_pool_bytes == 3 * GB
    assert plan.peak_activation_bytes < ssd_only.peak_activation_bytes
    assert plan.exposed_s == 0.0 and plan.step_s == pytest.approx(plan.keep_step_s)
    hosted = [lp for lp in plan.layers if lp.placement is H]
    assert hosted and all(lp.moved > 0 for lp in hosted)
    assert "host pool" in plan.table() and any(lp.placement_text.startswith("host") for lp in plan.layers)
    again = Plan.from_json(plan.to_json())
    assert again.hosted_bytes == plan.hosted_bytes and again.request.host_budget_bytes == 3 * GB


def test_the_pool_holds_every_micro_batch_in_flight():
    """With 4 micro-batches in flight the pool holds four copies of what one hosts."""
    st = stage(in_flight=4)
    plan = make_plan(st, PlanRequest(read_ahead_mode="fixed", host_budget_bytes=2 * GB))
    assert plan.hosted_bytes * 4 <= 2 * GB and plan.host_pool_bytes == plan.hosted_bytes * 4


@pytest.mark.slow
def test_a_budget_is_met_through_the_host_pool_before_recompute():
    """4 GB of the 8 kept: the SSDs carry half of four layers, so without the pool two
    layers are recomputed; hosting costs no step time and replaces them."""
    st = stage()
    without = make_plan(st, PlanRequest(memory_budget=4 * GB, read_ahead_mode="fixed"))
    with_host = make_plan(st, PlanRequest(memory_budget=4 * GB, read_ahead_mode="fixed", host_budget_bytes=4 * GB))
    assert len(without.layers_with(R)) == 2 and with_host.layers_with(R) == []
    assert with_host.hosted_bytes > 0 and with_host.peak_activation_bytes <= 4 * GB
    assert with_host.step_s == pytest.approx(with_host.keep_step_s)
    assert with_host.step_s < without.step_s and with_host.host_pool_bytes <= 4 * GB


# NOTE [Shared link] and NOTE [Tier preference]: pricing the two tiers


def test_an_ssd_request_occupies_the_shared_link_and_a_host_copy_waits_behind_it():
    """A 15 ms link: layer 0's SSD write stages its 1 GB over the link from 0 to 15 ms, so
    layer 1's host copy, issued when its forward starts at 10 ms, runs from 15 to 30 ms;
    on a CPU (``shared_host_link`` false) the copy starts at 10 ms, and without a link
    rate nothing but the SSD queue bounds the SSD write."""
    shared = predict(stage(host_bytes_per_s=GB / 0.015), [O, H] + [K] * 6)
    assert (shared.layers[1].write_start, shared.layers[1].write_end) == pytest.approx((0.015, 0.030))
    assert shared.layers[0].write_end == pytest.approx(0.035)  # the drives, slower than the link, bound it
    own = predict(stage(host_bytes_per_s=GB / 0.015, shared=False), [O, H] + [K] * 6)
    assert (own.layers[1].write_start, own.layers[1].write_end) == pytest.approx((0.010, 0.025))
    # a link slower than the drives caps the SSD too: the write ends when its staging does
    slow = predict(stage(host_bytes_per_s=GB / 0.050), [O] + [K] * 7)
    assert (slow.layers[0].write_end, slow.layers[0].read_end - slow.layers[0].read_start) == pytest.approx(
        (0.050, 0.050))
    no_link = predict(stage(host_bytes_per_s=None), [O] + [K] * 7)
    assert no_link.layers[0].write_end == pytest.approx(0.035)


def test_a_link_faster_than_the_drives_leaves_ssd_only_predictions_unchanged():
    """Where the link carries no host copy and is faster than the drives both ways, an
    SSD-only placement replays as it does without a link."""
    placements = [O, O, O, K, O, K, K, K]
    fast = predict(stage(), placements)
    alone = predict(stage(host_bytes_per_s=None), placements)
    assert (fast.step_s, fast.exposed_s, fast.peak_bytes, fast.io_end_s) == pytest.approx(
        (alone.step_s, alone.exposed_s, alone.peak_bytes, alone.io_end_s))
    assert [(lt.write_end, lt.read_end) for lt in fast.layers] == [(lt.write_end, lt.read_end) for lt in alone.layers]


@pytest.mark.slow
def test_a_plan_on_both_tiers_prices_the_host_copies_behind_the_ssd_staging():
    """8 ms of link per GB, the SSDs 25 ms per GB written, a 3 GB pool and a 3 GB budget:
    offloading layers 0 and 1 and hosting 2 to 4 meets the budget at keep's step time.
    Layer 1's write waits for the drives until 25 ms and stages over the link until 33 ms,
    so layer 2's host copy, issued at 20 ms, runs from 33 to 41 ms; it still hides. On a
    link of the host tier's own (a CPU) the copy starts at 20 ms. The search's plan ties
    with it (2 GB to the drives, 3 GB hosted, keep's step: the greedy start alone chooses
    exactly it; the search may return another plan of the same cost)."""
    st = stage(host_bytes_per_s=GB / 0.008, write_s=0.025, read_s=0.010)
    placements = [O, O, H, H, H, K, K, K]
    for search in ("greedy", "full"):
        plan = make_plan(st, PlanRequest(memory_budget=3 * GB, read_ahead_mode="fixed", host_budget_bytes=3 * GB, search=search))
        assert plan.peak_activation_bytes <= 3 * GB and plan.exposed_s == 0.0
        assert plan.step_s == pytest.approx(plan.keep_step_s)
        assert (plan.offloaded_bytes, plan.hosted_bytes) == (2 * GB, 3 * GB)
        assert search == "full" or [lp.placement for lp in plan.layers] == placements
    tl = predict(st, placements)
    assert tl.peak_bytes <= 3 * GB and tl.exposed_s == 0.0
    assert (tl.layers[2].write_start, tl.layers[2].write_end) == pytest.approx((0.033, 0.041))
    own = predict(stage(host_bytes_per_s=GB / 0.008, write_s=0.025, read_s=0.010, shared=False), placements)
    assert (own.layers[2].write_start, own.layers[2].write_end) == pytest.approx((0.020, 0.030))


@pytest.mark.slow
def test_a_hidden_host_copy_beats_the_ssd():
    """The SSDs hide whole layers here (20 ms writes, 10 ms reads): without a pool the
    planner offloads four; with room in the pool it hosts them instead (no drive wear,
    a faster copy), under either goal."""
    st = stage(write_s=0.020, read_s=0.010, host_bytes_per_s=GB / 0.005)
    ssd_only = make_plan(st, PlanRequest(read_ahead_mode="fixed"))
    assert ssd_only.layers_with(O) and ssd_only.hosted_bytes == 0
    hosted = make_plan(st, PlanRequest(read_ahead_mode="fixed", host_budget_bytes=8 * GB))
    assert hosted.offloaded_bytes == 0 and hosted.hosted_bytes >= ssd_only.offloaded_bytes
    assert hosted.peak_activation_bytes <= ssd_only.peak_activation_bytes and hosted.exposed_s == 0.0
    budget = make_plan(st, PlanRequest(memory_budget=5 * GB, read_ahead_mode="fixed", host_budget_bytes=8 * GB))
    assert budget.offloaded_bytes == 0 and budget.hosted_bytes == 3 * GB
    assert budget.step_s == pytest.approx(budget.keep_step_s)


@pytest.mark.slow
def test_a_full_pool_spills_to_the_ssds():
    """A 3 GB pool on a stage where the SSDs hide three whole layers and the link every
    one: the pool takes three layers and the SSDs more, where filling the SSDs first
    (three layers) left the pool one layer whose copy still lowered the peak. The greedy
    search stopped at a 4 GB derated peak (3 GB measured: three layers hosted, two
    offloaded); the search interleaves the tiers and reaches a lower peak at both.
    Under a 3 GB budget the plan meets it without recompute."""
    st = stage(write_s=0.025, read_s=0.010, host_bytes_per_s=GB / 0.005)
    plan = make_plan(st, PlanRequest(read_ahead_mode="fixed", host_budget_bytes=3 * GB))
    assert plan.hosted_bytes == 3 * GB and plan.offloaded_bytes >= 2 * GB
    derated = predict(st, plan.layer_choices, io=st.io.derated(plan.request.safety_margin))
    assert derated.peak_bytes < 4 * GB and plan.peak_activation_bytes < 3 * GB and plan.exposed_s == 0.0
    assert plan.peak_activation_bytes < make_plan(st, PlanRequest(read_ahead_mode="fixed")).peak_activation_bytes
    budget = make_plan(st, PlanRequest(memory_budget=3 * GB, read_ahead_mode="fixed", host_budget_bytes=3 * GB))
    assert budget.layers_with(R) == [] and budget.hosted_bytes == 3 * GB and budget.offloaded_bytes > 0
    assert budget.step_s == pytest.approx(budget.keep_step_s)


def test_the_clean_up_turns_a_recomputed_layer_into_a_host_one_when_that_is_free():
    """No drives; a 2.4 GB budget of the 8 GB kept. The greedy search recomputes layer 1
    while its host copy would not yet lower the peak; once the layers around it are
    recomputed, hosting it holds the budget and saves its 5 ms recompute, so the
    clean-up hosts it (before, it stayed recomputed: a 0.26 s step)."""
    sizes = [(0.020, 0.020, 2), (0.005, 0.040, 1), (0.020, 0.020, 1), (0.010, 0.020, 2), (0.010, 0.040, 2)]
    st = StageProfile(layers=[LayerProfile(i, f, b, g * GB) for i, (f, b, g) in enumerate(sizes)],
                      io=IOProfile(None, None, host_bytes_per_s=50 * GB))
    plan = make_plan(st, PlanRequest(memory_budget=int(2.4 * GB), host_budget_bytes=8 * GB))
    assert [lp.placement for lp in plan.layers] == [R, H, R, R, K]
    assert plan.step_s == pytest.approx(0.255) and plan.peak_activation_bytes <= int(2.4 * GB)


# NOTE [Pricing host copies]: copies that cost compute time


def cpu_stage(host_slowdown: float) -> StageProfile:
    """Four CPU layers of 1 GB in two sites, 0.5 GB of it core attention's scores (its
    forward 2 ms, a fiftieth of the layer's), a host link that hides every copy, no drives:
    ``host_slowdown`` is what a copy in flight costs the compute on the same cores."""
    half = GB // 2
    layers = [LayerProfile(i, 0.100, 0.200, GB, site_bytes=[half, half], site_use=[0.9, 0.1],
                           modules=[ModuleProfile("core_attn", 0.002, [1])]) for i in range(4)]
    return StageProfile(layers=layers, io=IOProfile(None, None, host_bytes_per_s=GB / 0.01,
                                                    host_compute_slowdown=host_slowdown, shared_host_link=False))


def test_a_host_copy_in_flight_slows_compute_by_the_measured_factor():
    """A 1 GB copy at 100 GB/s is 10 ms each way: with the factor at 1, compute runs at
    half speed for those 20 ms, 10 ms longer in all; at 0, not at all."""
    free, costly = cpu_stage(0.0), cpu_stage(1.0)
    plan = [H, K, K, K]
    assert predict(free, plan).step_s == pytest.approx(predict(free, [K] * 4).step_s)
    assert predict(costly, plan).step_s == pytest.approx(predict(costly, [K] * 4).step_s + 0.010)
    assert predict(costly, plan).slowdown_s == pytest.approx(0.010)


def test_where_host_copies_cost_compute_recompute_inside_a_layer_wins():
    """Keeping 2.5 GB of 4: priced at nothing, hosting 1.5 GB meets it at keep's step; when
    compute runs at half speed while a copy is in flight (the factor 1, about what a CPU's
    memory copies into fresh pages cost: NOTE [Pricing host copies]), hosting half a layer
    costs 5 ms (10 ms of copies) and recomputing its core attention 2 ms, so the plan
    recomputes core attention in three layers instead (the fourth's would be rebuilt
    while every layer's bytes are still held)."""
    budget = int(2.5 * GB)
    free = make_plan(cpu_stage(0.0), PlanRequest(memory_budget=budget, read_ahead_mode="fixed", host_budget_bytes=4 * GB))
    assert free.hosted_bytes >= 1.5 * GB and free.step_s == pytest.approx(free.keep_step_s)
    assert not any(lp.choice.recompute for lp in free.layers)
    costly = make_plan(cpu_stage(1.0), PlanRequest(memory_budget=budget, read_ahead_mode="fixed", host_budget_bytes=4 * GB))
    assert costly.hosted_bytes == 0 and costly.peak_activation_bytes <= budget
    assert sum(bool(lp.choice.recompute) for lp in costly.layers) == 3
    assert costly.step_s == pytest.approx(costly.keep_step_s + 0.006)
