"""The timeline model on tiny stages whose events are worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_ssd.config import Placement
from megatron_ssd.errors import ConfigError
from megatron_ssd.planner.profile import IOProfile, LayerProfile, StageProfile
from megatron_ssd.planner.plan import make_plan
from megatron_ssd.planner.step_timeline import predict
from megatron_ssd.planner.request import PlanRequest

from layer_choices import choices_of

K, O, R = Placement.KEEP, Placement.OFFLOAD, Placement.RECOMPUTE


def two_layers(write_bw=100.0, read_bw=200.0, slowdown=0.0, **stage):
    """Layers of 1 s forward, 2 s backward, 100 saved bytes each."""
    layers = [LayerProfile(0, 1.0, 2.0, 100), LayerProfile(1, 1.0, 2.0, 100)]
    return StageProfile(layers=layers, io=IOProfile(write_bw, read_bw, slowdown), **stage)


def test_keep_everything_is_plain_compute():
    tl = predict(two_layers(), [K, K])
    assert tl.step_s == 6.0 and tl.compute_s == 6.0
    assert tl.exposed_s == 0.0 and tl.slowdown_s == 0.0
    assert tl.peak_bytes == 200
    assert tl.memory == [(0.0, 0), (1.0, 100), (2.0, 200), (4.0, 100), (6.0, 0)]
    assert tl.write_busy_s == 0.0 and tl.read_busy_s == 0.0


def test_offload_hidden_write_then_read():
    # write of layer 0 streams behind its forward: 0 -> 1 (100 B at 100 B/s), done when
    # the forward ends, so its bytes never wait in memory; read issued when backward of
    # layer 1 starts at 2, done at 2.5; backward of layer 0 starts at 4 without waiting.
    tl = predict(two_layers(), [O, K])
    lt = tl.layers[0]
    assert (lt.write_start, lt.write_end) == (0.0, 1.0)
    assert (lt.read_issue, lt.read_start, lt.read_end) == (2.0, 2.0, 2.5)
    assert (lt.backward_start, lt.backward_end) == (4.0, 6.0)
    assert tl.step_s == 6.0 and tl.exposed_s == 0.0
    assert tl.write_busy_s == 1.0 and tl.read_busy_s == 0.5 and tl.io_end_s == 2.5
    # layer 1 (kept) from 2 and layer 0's read buffer from 2: peak 200
    assert tl.memory == [(0.0, 0), (2.0, 200), (4.0, 100), (6.0, 0)]
    assert tl.peak_bytes == 200


def test_a_write_cannot_end_before_its_forward():
    # 100 B at 1000 B/s takes 0.1 s, but the last tensor is saved when the forward ends
    tl = predict(two_layers(write_bw=1000.0), [O, K])
    assert (tl.layers[0].write_start, tl.layers[0].write_end) == (0.0, 1.0)
    assert tl.write_busy_s == pytest.approx(0.1)


def test_late_read_is_exposed():
    # read takes 3 s: 2 -> 5; backward of layer 0 could start at 4, waits 1 s
    tl = predict(two_layers(read_bw=100.0 / 3), [O, K])
    assert tl.layers[0].stall_s == pytest.approx(1.0)
    assert tl.exposed_s == pytest.approx(1.0)
    assert tl.step_s == pytest.approx(7.0)
    # it may start at 4 (the previous backward ended), waits until 5, runs 2 s
    assert tl.layers[0].backward_start == pytest.approx(4.0)
    assert tl.layers[0].backward_end == pytest.approx(7.0)
    assert tl.layers[0].backward_s == pytest.approx(2.0)


def test_compute_slowdown_while_io_in_flight():
    # slowdown 0.5: forward of layer 1 runs 1 -> 2 under the write (2/3 done), then 1/3
    # alone: ends 7/3. The read runs 7/3 -> 16/3, all of backward 1 under it: 2 * 1.5 = 3
    # s, ending 16/3. Backward 0 runs alone: 16/3 -> 22/3.
    tl = predict(two_layers(read_bw=100.0 / 3, slowdown=0.5), [O, K])
    assert tl.layers[1].forward_end == pytest.approx(7 / 3)
    assert tl.layers[0].read_end == pytest.approx(16 / 3)
    assert tl.layers[1].backward_end == pytest.approx(16 / 3)
    assert tl.step_s == pytest.approx(22 / 3)
    assert tl.exposed_s == pytest.approx(0.0)
    assert tl.slowdown_s == pytest.approx(4 / 3)


def test_write_late_forwards_from_memory():
    # write 0 -> 2.5 (100 B at 40 B/s) but the read is due at 2: served from memory
    tl = predict(two_layers(write_bw=40.0), [O, K])
    assert tl.forwarded == [0]
    lt = tl.layers[0]
    assert lt.read_issue is None and lt.read_end is None
    assert tl.read_busy_s == 0.0 and tl.write_busy_s == 2.5 and tl.io_end_s == 2.5
    assert tl.step_s == 6.0 and tl.peak_bytes == 200
    assert tl.memory == [(0.0, 0), (1.0, 100), (2.0, 200), (4.0, 100), (6.0, 0)]


def test_recompute_holds_boundary_then_materializes():
    layers = [
        LayerProfile(0, 1.0, 2.0, 100, kept_bytes=5, recompute_s=0.5, boundary_bytes=10),
        LayerProfile(1, 1.0, 2.0, 100),
    ]
    tl = predict(StageProfile(layers, IOProfile(100.0, 100.0)), [R, K])
    assert tl.step_s == 6.5 and tl.compute_s == 6.5
    # boundary 10 from 1; layer 1 adds 100 at 2; at 4 layer 1 leaves and layer 0's
    # rerun forward materializes 105 until 6.5
    assert tl.memory == [(0.0, 0), (1.0, 10), (2.0, 110), (4.0, 115), (6.5, 0)]
    assert tl.peak_bytes == 115
    assert tl.parked_bytes == 110


def test_reads_queue_behind_writes_on_one_device():
    # layer 1 (500 B) writes 1 -> 6 and is forwarded at 3; the read of layer 0, issued at
    # 5, waits for the array until 6 and takes 2 s: backward 0 waits from 7 to 8.
    layers = [LayerProfile(0, 1.0, 2.0, 100), LayerProfile(1, 1.0, 2.0, 500), LayerProfile(2, 1.0, 2.0, 100)]
    tl = predict(StageProfile(layers, IOProfile(100.0, 50.0)), [O, O, K])
    assert tl.forwarded == [1]
    assert (tl.layers[0].read_issue, tl.layers[0].read_start, tl.layers[0].read_end) == (5.0, 6.0, 8.0)
    assert tl.exposed_s == 1.0 and tl.step_s == 10.0
    assert tl.peak_bytes == 600  # layers 1 and 2 from 3 to 5, then layer 1 and layer 0's read buffer


def test_read_ahead_moves_read_issue_earlier():
    layers = [LayerProfile(i, 1.0, 2.0, 100) for i in range(3)]
    stage = StageProfile(layers, IOProfile(1000.0, 1000.0))
    one = predict(stage, choices_of([O, O, K], 1))
    two = predict(stage, choices_of([O, O, K], 2))
    assert one.layers[0].read_issue == 5.0  # backward of layer 1 starts
    assert two.layers[0].read_issue == 3.0  # first backward starts
    assert two.layers[1].read_issue == 3.0
    assert two.microbatch_peak_bytes > one.microbatch_peak_bytes


def test_other_compute_runs_at_the_turn():
    tl = predict(two_layers(other_s=0.5), [O, K])
    assert tl.layers[1].backward_start == 2.5
    assert tl.layers[0].read_issue == 2.5
    assert tl.step_s == 6.5


def test_pipeline_stage_adds_parked_microbatches():
    one = predict(two_layers(), [O, K])
    three = predict(two_layers(pipeline_size=3, pipeline_rank=0), [O, K])
    assert three.parked_bytes == 100  # layer 1 kept; layer 0 offloaded, writes drained
    assert three.microbatch_peak_bytes == one.peak_bytes == 200
    assert three.peak_bytes == 200 + 2 * 100
    assert three.step_s == one.step_s


def test_bad_placements_rejected():
    with pytest.raises(ConfigError, match="choices: 1 given for 2 layers"):
        predict(two_layers(), [K])
    with pytest.raises(ConfigError, match=r"read_ahead = \[0, 0\]"):
        predict(two_layers(), choices_of([K, K], 0))
    with pytest.raises(ValueError):
        predict(two_layers(), ["sideways", "keep"])


def test_head_bytes_are_resident_between_the_last_forward_and_the_first_backward():
    """The output layer's and loss's saved tensors (``head_bytes``) exist while
    ``other_s`` runs, on top of every kept layer."""
    tl = predict(two_layers(other_s=0.5, head_bytes=50), [K, K])
    assert tl.peak_bytes == 250
    assert tl.memory == [(0.0, 0), (1.0, 100), (2.0, 250), (2.5, 200), (4.5, 100), (6.5, 0)]


# ------------------------------------------------------------------ NOTE [In-flight bound]


def _two_layers(bound):
    layers = [LayerProfile(i, 0.1, 0.2, 100, site_bytes=[50, 50]) for i in range(2)]
    # 5 s after the layers (the head): every write completes before backward, nothing is forwarded
    return StageProfile(layers, IOProfile(100.0, 100.0, max_inflight_bytes=bound), other_s=5.0)


def _forward_peak(tl) -> int:
    end = tl.layers[-1].forward_end
    return max(resident for time, resident in tl.memory if time <= end)


def test_the_in_flight_bound_makes_a_forward_wait_for_its_writes():
    """Sites of 50 bytes written at 100 B/s under a 100-byte bound: layer 0's two sites are
    admitted at once; layer 1's first waits for layer 0's first write (0.5 s), its second
    for layer 0's second (1.0 s), so layer 1's forward ends at 1.0 s instead of 0.2 s."""
    free = predict(_two_layers(None), [Placement.OFFLOAD] * 2)
    bound = predict(_two_layers(100), [Placement.OFFLOAD] * 2)
    assert free.write_wait_s == 0.0 and [lt.forward_end for lt in free.layers] == pytest.approx([0.1, 0.2])
    assert [lt.write_wait_s for lt in bound.layers] == pytest.approx([0.0, 0.8])
    assert bound.write_wait_s == pytest.approx(0.8) and bound.layers[1].forward_end == pytest.approx(1.0)
    assert bound.step_s == pytest.approx(free.step_s + 0.8)
    assert bound.slowdown_s == pytest.approx(free.slowdown_s)  # a wait is not a slowdown
    # the bytes waiting to be written: both layers' at the end of an unbounded forward,
    # one layer's when it must wait (layer 0's last write ends as layer 1's forward does)
    assert _forward_peak(free) == 200 and _forward_peak(bound) == 100


def test_a_bound_that_the_writes_fit_changes_nothing():
    free = predict(_two_layers(None), [Placement.OFFLOAD, Placement.KEEP])
    roomy = predict(_two_layers(10**6), [Placement.OFFLOAD, Placement.KEEP])
    assert roomy.step_s == free.step_s and roomy.peak_bytes == free.peak_bytes and roomy.write_wait_s == 0.0


def test_a_site_larger_than_the_bound_waits_only_for_an_empty_queue():
    """NOTE [Backpressure]: a blob over the bound is admitted once nothing is in flight."""
    layers = [LayerProfile(i, 0.1, 0.2, 300) for i in range(2)]
    tl = predict(StageProfile(layers, IOProfile(100.0, 100.0, max_inflight_bytes=100)), [Placement.OFFLOAD] * 2)
    assert tl.layers[1].write_wait_s == pytest.approx(3.0 - 0.2)  # layer 0's write ends at 3.0 s


def test_the_bound_is_checked():
    with pytest.raises(ConfigError, match=r"IOProfile.max_inflight_bytes = 0: must be an integer > 0 or null"):
        IOProfile(1.0, 1.0, max_inflight_bytes=0)


def test_the_hidden_offload_admits_no_write_wait():
    """Four layers of two 50-byte sites, written at 100 B/s under a 100-byte bound: each
    layer offloaded after the first makes the forward wait (0.8 s, then 1.7 s) while
    backward's reads still hide. Before: ``max_offload`` took three layers, a step 1.7 s
    longer than keep-everything's, as "hidden"; a wait is exposed I/O. A budget may still
    buy memory with waits."""
    layers = [LayerProfile(i, 0.1, 2.0, 100, site_bytes=[50, 50]) for i in range(4)]
    stage = StageProfile(layers, IOProfile(100.0, 100.0, max_inflight_bytes=100), other_s=5.0)
    waits = [predict(stage, [Placement.OFFLOAD] * n + [Placement.KEEP] * (4 - n)).write_wait_s for n in (1, 2, 3)]
    assert waits == pytest.approx([0.0, 0.8, 1.7])
    hidden = make_plan(stage, PlanRequest(safety_margin=0.0))
    assert hidden.placements == [Placement.KEEP] * 4 and hidden.step_s == hidden.keep_step_s  # layer 0 alone buys nothing
    budget = make_plan(stage, PlanRequest(memory_budget=300, safety_margin=0.0, allow_recompute=False))
    assert budget.peak_activation_bytes <= 300 and budget.step_s == pytest.approx(budget.keep_step_s + 0.7)


def test_the_cache_counts_neither_a_checkpoints_input_nor_what_recompute_rebuilds():
    """NOTE [What the cache counts]: a RECOMPUTE layer holds its input (10 bytes) until its
    backward ends and its saved bytes again during its backward; the tensor cache counts
    neither, so the peak it would measure is the KEEP layer's and the head's; without
    recompute the two peaks are one."""
    layers = [LayerProfile(0, 1.0, 2.0, 100, boundary_bytes=10), LayerProfile(1, 1.0, 2.0, 100, boundary_bytes=10)]
    stage = StageProfile(layers=layers, io=IOProfile(100.0, 200.0), other_s=0.5, head_bytes=30)
    tl = predict(stage, [K, R])
    assert tl.peak_bytes == 100 + 10 + 100  # layer 0 kept, layer 1's input and its rebuilt 100 bytes
    assert tl.counted_peak_bytes == 100 + 30  # layer 0 kept, and the head before backward
    assert [(start, end, n) for start, end, n in tl.uncounted] == [(2.0, tl.layers[1].backward_end, 10),
                                                                (tl.layers[1].backward_start,
                                                                 tl.layers[1].backward_end, 100)]
    kept = predict(stage, [K, K])
    assert kept.counted_peak_bytes == kept.peak_bytes == 200 + 30
    two = predict(StageProfile(layers=layers, io=IOProfile(100.0, 200.0), other_s=0.5, head_bytes=30,
                               microbatches_in_flight=2), [K, R])
    assert two.counted_peak_bytes == 130 + two.parked_bytes  # the parked micro-batch's bytes as in peak_bytes


# ------------------------------------------------------------------ NOTE [Working set by phase]


def _capped(head_working_bytes=0):
    """Two layers of 100 saved bytes and 10 input bytes, drives unmeasured (no OFFLOAD)."""
    layers = [LayerProfile(i, 1.0, 2.0, 100, boundary_bytes=10) for i in range(2)]
    return StageProfile(layers, IOProfile(None, None), other_s=0.5, head_working_bytes=head_working_bytes)


def test_the_head_working_set_is_held_over_the_heads_span_and_not_counted_by_the_cache():
    """``head_working_bytes`` stands beside the head's saved tensors while ``other_s``
    runs: in the predicted peak, out of the cache's count."""
    tl = predict(_capped(head_working_bytes=280), [K, K])
    assert tl.memory == [(0.0, 0), (1.0, 100), (2.0, 480), (2.5, 200), (4.5, 100), (6.5, 0)]
    assert tl.peak_bytes == 480 and tl.counted_peak_bytes == 200


def test_a_working_set_split_by_phase_fits_the_recomputing_plan_that_the_whole_one_rules_out():
    """A step whose working set is 20 bytes inside the layers and 300 outside them, under
    a cap of 400: charging all 300 against every instant leaves a capacity of 100, and no
    placement fits (RECOMPUTE of both peaks at 120 in backward); charged by phase the
    capacity is 380 with 280 held over the head, keep-everything (480 there, as on the
    device: 200 + 300 > 400) is ruled out and a recomputing plan fits."""
    from megatron_ssd.planner.request import PlanRequest
    from megatron_ssd.planner.search import PlanInfeasibleError

    cap, inside, outside = 400, 20, 300
    with pytest.raises(PlanInfeasibleError):
        make_plan(_capped(), PlanRequest(capacity_bytes=cap - outside))
    split = _capped(head_working_bytes=outside - inside)
    plan = make_plan(split, PlanRequest(capacity_bytes=cap - inside))
    assert R in [c.placement for c in plan.layer_choices]
    assert predict(split, plan.layer_choices).peak_bytes <= cap - inside
    assert predict(split, [K, K]).peak_bytes > cap - inside


# ------------------------------------------------------------------ NOTE [Working set by layer]


def _by_layer():
    """Two layers of 100 saved and 10 input bytes whose forward peaked at 130 (saved so far
    and temporaries) and whose backward needs 15 beyond its saved bytes."""
    layers = [LayerProfile(i, 1.0, 2.0, 100, boundary_bytes=10, forward_peak_bytes=130, backward_working_bytes=15)
              for i in range(2)]
    return StageProfile(layers, IOProfile(None, None), other_s=0.5)


def test_a_layers_forward_peak_and_backward_working_set_are_held_over_its_spans_uncounted():
    """Worked by hand: layer 1's forward runs beside layer 0's 100 kept bytes (100 + 130);
    each backward holds 15 beside what is kept; the cache counts neither."""
    tl = predict(_by_layer(), [K, K])
    assert tl.memory == [(0.0, 130), (1.0, 230), (2.0, 200), (2.5, 215), (4.5, 115), (6.5, 0)]
    assert tl.peak_bytes == 230 and tl.counted_peak_bytes == 200


def test_gradients_freed_at_the_start_are_credited_until_each_backward_makes_them_again():
    """NOTE [Gradients remade each step], worked by hand on the stage above: each layer's
    backward makes 20 of gradients again, the head's 8, all 48 freed when the step starts.
    So the step holds 48 less from its start, 40 less from the head's (2.0), 20 less from
    layer 1's backward (2.5) and nothing less from layer 0's (4.5); the peak moves from
    layer 1's forward end (230) to its backward (215 - 20); the cache counts none of it."""
    stage = _by_layer()
    stage = dataclasses.replace(stage, layers=[dataclasses.replace(layer, grad_bytes=20) for layer in stage.layers],
                                head_grad_bytes=8)
    tl = predict(stage, [K, K])
    assert tl.memory == [(0.0, 82), (1.0, 182), (2.0, 160), (2.5, 195), (4.5, 115), (6.5, 0)]
    assert tl.peak_bytes == 195 and tl.counted_peak_bytes == 200
    assert predict(_by_layer(), [K, K]).peak_bytes == 230  # without the term: as before


def test_a_recomputed_layer_holds_its_forward_peak_again_in_backward_with_two_input_sized_gradients():
    """RECOMPUTE runs the forward again in backward: beyond its 100 rebuilt bytes it holds
    the larger of its backward working set (15) and its forward peak with two gradients of
    its input's size less the rebuilt bytes (130 + 2 x 10 - 100 = 50); its input (10) is held
    from its forward's end."""
    from megatron_ssd.planner.holds import backward_working_bytes

    layer = _by_layer().layers[1]
    assert backward_working_bytes(layer, R) == 50 and backward_working_bytes(layer, K) == 15
    tl = predict(_by_layer(), [K, R])
    assert tl.peak_bytes == 100 + 10 + 100 + 50
    assert tl.counted_peak_bytes == 100  # only layer 0's kept bytes reach the cache
