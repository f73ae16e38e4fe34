"""The host tier in the plan (NOTE [Host tier]): HOST layers copy to a bounded host pool
over their own link, the planner uses them for what the SSDs cannot take, within the
pool's budget, on constructed profiles."""

from __future__ import annotations

import pytest

from megatron_ssd.config import Placement
from megatron_ssd.errors import ConfigError
from megatron_ssd.planner import IOProfile, LayerProfile, Plan, StageProfile, make_plan, predict

GB = 10**9
K, O, H, R = Placement.KEEP, Placement.OFFLOAD, Placement.HOST, Placement.RECOMPUTE


def stage(host_bytes_per_s=GB / 0.004, n=8, in_flight=1) -> StageProfile:
    """n layers of 1 GB in 4 tensors, 10 ms forward and 20 ms backward; the SSDs take
    35 ms per layer each way (no whole layer hides with one layer of read-ahead), the
    host link 4 ms."""
    q = GB // 4
    io = IOProfile(GB / 0.035, GB / 0.035, host_bytes_per_s=host_bytes_per_s)
    return StageProfile(layers=[LayerProfile(i, 0.010, 0.020, GB, site_bytes=[q] * 4) for i in range(n)], io=io,
                        pipeline_size=in_flight, pipeline_rank=0)


def test_host_copies_run_on_their_own_link():
    st = stage()
    ssd, host = predict(st, [O] + [K] * 7), predict(st, [H] + [K] * 7)
    assert (ssd.write_busy_s, ssd.read_busy_s, ssd.host_busy_s) == pytest.approx((0.035, 0.035, 0.0))
    assert (host.write_busy_s, host.read_busy_s, host.host_busy_s) == pytest.approx((0.0, 0.0, 0.008))
    assert host.hosted_bytes == GB and host.offloaded_bytes == 0 and ssd.offloaded_bytes == GB
    # an SSD write in flight does not delay a host copy
    both = predict(st, [O, H] + [K] * 6)
    assert both.layers[1].write_end == pytest.approx(0.020)  # its forward's end, not after the SSD write
    with pytest.raises(ConfigError, match="'host' needs IOProfile.host_bytes_per_s"):
        predict(stage(host_bytes_per_s=None), [H] + [K] * 7)


def test_without_a_host_budget_nothing_is_hosted():
    plan = make_plan(stage(), read_ahead="fixed")
    assert plan.layers_with(H) == [] and plan.hosted_bytes == 0 and plan.host_budget_bytes is None
    with pytest.raises(ConfigError, match=r"host_budget_bytes = 1000: needs IOProfile.host_bytes_per_s"):
        make_plan(stage(host_bytes_per_s=None), host_budget_bytes=1000)
    with pytest.raises(ConfigError, match=r"host_budget_bytes = -1: must be None or an integer number of bytes >= 0"):
        make_plan(stage(), host_budget_bytes=-1)


def test_the_host_pool_takes_what_the_ssds_could_not_within_its_budget():
    st = stage()
    ssd_only = make_plan(st, read_ahead="fixed")
    plan = make_plan(st, read_ahead="fixed", host_budget_bytes=3 * GB)
    assert plan.offloaded_bytes == ssd_only.offloaded_bytes  # the SSDs' share is unchanged
    assert 0 < plan.hosted_bytes <= 3 * GB and plan.host_pool_bytes <= 3 * GB
    assert plan.peak_activation_bytes < ssd_only.peak_activation_bytes
    assert plan.exposed_s == 0.0 and plan.step_s == pytest.approx(plan.keep_step_s)
    hosted = [lp for lp in plan.layers if lp.placement is H]
    assert hosted and all(lp.offloaded > 0 for lp in hosted)
    assert "host pool" in plan.table() and any(lp.placement_text.startswith("host") for lp in plan.layers)
    again = Plan.from_json(plan.to_json())
    assert again.hosted_bytes == plan.hosted_bytes and again.host_budget_bytes == 3 * GB


def test_the_pool_holds_every_micro_batch_in_flight():
    """With 4 micro-batches in flight the pool holds four copies of what one hosts."""
    st = stage(in_flight=4)
    plan = make_plan(st, read_ahead="fixed", host_budget_bytes=2 * GB)
    assert plan.hosted_bytes * 4 <= 2 * GB and plan.host_pool_bytes == plan.hosted_bytes * 4


def test_a_budget_is_met_through_the_host_pool_before_recompute():
    """4 GB of the 8 kept: the SSDs carry half of four layers, so without the pool two
    layers are recomputed; hosting costs no step time and replaces them."""
    st = stage()
    without = make_plan(st, memory_budget=4 * GB, read_ahead="fixed")
    with_host = make_plan(st, memory_budget=4 * GB, read_ahead="fixed", host_budget_bytes=4 * GB)
    assert len(without.layers_with(R)) == 2 and with_host.layers_with(R) == []
    assert with_host.hosted_bytes > 0 and with_host.peak_activation_bytes <= 4 * GB
    assert with_host.step_s == pytest.approx(with_host.keep_step_s)
    assert with_host.step_s < without.step_s and with_host.host_pool_bytes <= 4 * GB
