"""Reads site by site: each moved site's read at its own read-ahead, waited for at its use
point in the layer's backward (NOTE [Write and read issue points], NOTE [Site use
times]); writes site by site from each site's save point (NOTE [Site save times]); on
constructed profiles."""

from __future__ import annotations

import pytest

from megatron_ssd.config import Placement
from megatron_ssd.errors import ConfigError
from megatron_ssd.placement import LayerChoice
from megatron_ssd.planner import IOProfile, LayerProfile, Plan, StageProfile, make_plan, predict, PlanRequest

from layer_choices import choices_of
from megatron_ssd.planner.simulate import spec_from_overrides, stage_profile

K, O = Placement.KEEP, Placement.OFFLOAD


def three_layers(site_use=(0.5, 0.0)) -> StageProfile:
    """Layer 0 saves two 100-byte sites, the first used halfway through its 2 s backward,
    the second at its start; layers 1 and 2 keep 100 bytes each. Forward 1 s, backward
    2 s per layer; the array writes and reads 200 B/s."""
    first = LayerProfile(0, 1.0, 2.0, 200, site_bytes=[100, 100],
                         site_use=None if site_use is None else list(site_use))
    rest = [LayerProfile(i, 1.0, 2.0, 0, kept_bytes=100) for i in (1, 2)]
    return StageProfile([first, *rest], IOProfile(200.0, 200.0))


def test_a_site_used_late_is_read_when_its_own_layer_backward_starts():
    stage = three_layers()
    # forward 0-3; layer 0's write 0-1; backward of layer 2 3-5, of layer 1 5-7, of layer 0 7-9
    whole = predict(stage, choices_of([O, K, K], 1))
    reads = [(r.site, r.issue, r.start, r.end) for r in whole.layers[0].reads]
    assert reads == [(1, 5.0, 5.0, 5.5), (0, 5.0, 5.5, 6.0)]  # needed first
    assert whole.step_s == 9.0 and whole.exposed_s == 0.0
    assert whole.peak_bytes == 300  # from 5: layer 1's 100 and both read buffers
    split = predict(stage, choices_of([O, K, K], [[0, 1], 1, 1]))
    reads = [(r.site, r.issue, r.start, r.end) for r in split.layers[0].reads]
    # site 0 is read from 7, when layer 0's backward starts, and needed at 7 + 0.5 * 2
    assert reads == [(1, 5.0, 5.0, 5.5), (0, 7.0, 7.0, 7.5)]
    assert split.step_s == 9.0 and split.exposed_s == 0.0
    assert split.peak_bytes == 200
    assert (split.layers[0].read_issue, split.layers[0].read_start, split.layers[0].read_end) == (5.0, 5.0, 7.5)


def test_without_use_points_every_site_is_needed_when_the_backward_starts():
    tl = predict(three_layers(site_use=None), choices_of([O, K, K], [[0, 1], 1, 1]))
    lt = tl.layers[0]
    assert lt.stall_s == pytest.approx(0.5) and tl.exposed_s == pytest.approx(0.5)
    assert (lt.backward_start, lt.backward_end, lt.backward_s) == (7.0, 9.5, 2.0)
    assert tl.step_s == 9.5


def test_a_stall_at_a_use_point_waits_mid_backward():
    # read at 100 B/s: site 0 read 7-8, needed at 8: no wait; at 50 B/s: 7-9, waits 1 s at 8
    stage = three_layers()
    slow = stage.with_io(IOProfile(200.0, 50.0))
    tl = predict(slow, choices_of([O, K, K], [[0, 2], 1, 1]))
    lt = tl.layers[0]
    assert [(r.site, r.issue, r.end) for r in lt.reads] == [(1, 3.0, 5.0), (0, 7.0, 9.0)]
    assert lt.stall_s == pytest.approx(1.0)
    assert (lt.backward_start, lt.backward_end) == (7.0, 10.0)


def test_auto_plan_reads_a_late_used_site_late():
    plan = make_plan(three_layers(), PlanRequest(read_ahead_mode="auto"))
    assert plan.placements == [O, K, K]
    lp = plan.layers[0]
    assert (lp.read_ahead, lp.site_read_ahead, lp.read_ahead_text) == (1, [0, 1], "0..1")
    assert plan.choices() == {0: LayerChoice(O, None, (0, 1)), 1: LayerChoice(K), 2: LayerChoice(K)}
    assert plan.peak_activation_bytes == 200 and plan.exposed_s == 0.0 and plan.step_s == 9.0
    assert "0..1" in plan.table()
    again = Plan.from_json(plan.to_json())
    assert again.layers[0].site_read_ahead == [0, 1]
    assert predict(three_layers(), again.layer_choices).peak_bytes == 200
    # the fixed mode reads every site default_read_ahead ahead
    fixed = make_plan(three_layers(), PlanRequest(read_ahead_mode="fixed"))
    assert fixed.layers[0].site_read_ahead is None and fixed.peak_activation_bytes == 300


def test_auto_plan_without_use_points_keeps_one_read_ahead_per_layer():
    plan = make_plan(three_layers(site_use=None), PlanRequest(read_ahead_mode="auto"))
    assert plan.placements == [O, K, K]
    assert plan.layers[0].site_read_ahead is None and plan.layers[0].read_ahead == 1
    assert plan.peak_activation_bytes == 300


def saved_late(save, write_bytes_per_s=200.0, bound=None) -> StageProfile:
    """Layer 0 (forward 1 s) saves two 100-byte sites, at ``save`` shares of its forward;
    layers 1 and 2 (forward 0.2 s and 0.5 s) keep 100 bytes each."""
    first = LayerProfile(0, 1.0, 2.0, 200, site_bytes=[100, 100], site_save=save)
    rest = [LayerProfile(1, 0.2, 2.0, 0, kept_bytes=100), LayerProfile(2, 0.5, 2.0, 0, kept_bytes=100)]
    return StageProfile([first, *rest], IOProfile(write_bytes_per_s, 200.0, max_inflight_bytes=bound))


@pytest.mark.parametrize("bound", [None, 100])
def test_a_site_saved_late_is_written_after_its_save_point(bound):
    # Without save points both sites are written 0-1 s, done as the forward ends: 100
    # bytes resident at 1.2 s (layer 1's). Saved at 0.9 s, the second is written 0.9-1.4
    # s, so its 100 bytes stay resident past layer 1's forward end, beside layer 1's kept
    # 100: 200 at 1.2 s. The first, written 0-0.5 s, has left by then (each site leaves
    # when its own write ends; held to the layer's last write, 300 were resident). The
    # peak, 200, is also the backward's (layer 0's read buffers).
    choices = choices_of([O, K, K], [[0, 0], 1, 1])
    early = predict(saved_late(None, bound=bound), choices)
    late = predict(saved_late([0.0, 0.9], bound=bound), choices)
    assert (early.layers[0].write_end, early.peak_bytes) == (1.0, 200) and early.memory[1] == (1.2, 100)
    assert late.layers[0].write_end == pytest.approx(1.4)
    assert late.layers[0].site_writes == [(0.5, 100), (pytest.approx(1.4), 100)]
    assert late.peak_bytes == 200 and late.memory[1:4] == [(1.0, 100), (1.2, 200), (pytest.approx(1.4), 100)]
    assert late.step_s == early.step_s == pytest.approx(8.7)


def test_a_site_saved_late_and_not_admitted_holds_the_rest_of_its_forward():
    # At 100 B/s under a 100-byte bound the first site is written 0-1 s, so the second,
    # saved at 0.9 s, is admitted at 1 s, and the 0.1 s of forward after its save point
    # runs after that: the forward ends at 1.1 s, 0.1 s of write wait. Without save points
    # the forward ran past 1 s anyway: no wait.
    choices = choices_of([O, K, K], [[0, 0], 1, 1])
    late = predict(saved_late([0.0, 0.9], write_bytes_per_s=100.0, bound=100), choices).layers[0]
    assert (late.forward_end, late.write_wait_s) == (pytest.approx(1.1), pytest.approx(0.1))
    early = predict(saved_late(None, write_bytes_per_s=100.0, bound=100), choices).layers[0]
    assert (early.forward_end, early.write_wait_s, early.write_end) == (1.0, 0.0, 2.0)


def test_a_site_of_no_bytes_holds_back_nothing():
    # Layer 0 saves 100 bytes at 0.1 s and 100 at 0.9 s; between them in site order a site
    # of no bytes (saved first by another layer) with no save time of its own (0). It is
    # written by nobody, so under a bound the forward ends at 1 s with no write wait; were
    # it admitted after the first site, the whole forward would run after 0.1 s: 1.1 s.
    first = LayerProfile(0, 1.0, 2.0, 200, site_bytes=[100, 0, 100], site_save=[0.1, 0.0, 0.9])
    rest = [LayerProfile(1, 0.2, 2.0, 0, kept_bytes=100), LayerProfile(2, 0.5, 2.0, 0, kept_bytes=100)]
    stage = StageProfile([first, *rest], IOProfile(1000.0, 200.0, max_inflight_bytes=1000))
    lt = predict(stage, choices_of([O, K, K], [[0, 0, 0], 1, 1])).layers[0]
    assert (lt.forward_end, lt.write_wait_s) == (1.0, 0.0)
    assert lt.write_end == pytest.approx(1.0)  # the last site, saved at 0.9 s, written in 0.1 s


def test_save_points_are_validated():
    with pytest.raises(ConfigError, match=r"site_save = \[0.5\]: must have one entry per site \(2\)"):
        LayerProfile(0, 1.0, 2.0, 200, site_bytes=[100, 100], site_save=[0.5])


def test_per_site_read_aheads_are_validated():
    stage = three_layers()
    with pytest.raises(ConfigError, match=r"read_ahead\[0\] = \[0\]: must have one read-ahead per site \(2\)"):
        predict(stage, choices_of([O, K, K], [[0], 1, 1]))
    with pytest.raises(ConfigError, match=r"each an integer >= 1 or a list of integers >= 0"):
        predict(stage, choices_of([O, K, K], [[0, -1], 1, 1]))
    with pytest.raises(ConfigError, match=r"site_use = \[0.5\]: must have one entry per site \(2\)"):
        LayerProfile(0, 1.0, 2.0, 200, site_bytes=[100, 100], site_use=[0.5])
    with pytest.raises(ConfigError, match=r"site_use = \[0.5, 1.5\]: must be a list of numbers in \[0, 1\] or null"):
        LayerProfile(0, 1.0, 2.0, 200, site_bytes=[100, 100], site_use=[0.5, 1.5])


def test_simulate_takes_attention_sites_as_used_after_the_mlp():
    # gpt-13b at 4k, fused attention: the MLP is 16 s b h^2 of forward FLOPs, the
    # attention 8 s b h^2 + 4 b s^2 h, so attention's tensors are needed after
    # 16 h / (24 h + 4 s) of the layer's backward
    spec = spec_from_overrides([], "gpt-13b")
    layer = stage_profile(spec).layers[1]
    h, s = spec.hidden, spec.seq_len
    share = round(16 * h / (24 * h + 4 * s), 6)
    assert layer.site_use == [share] * (len(layer.sites) - 5) + [0.0] * 5
    assert share == pytest.approx(0.588235)
