"""StepMeasurement: what the cache reports of a step is typed as declared, and the planner
reads nothing else of it (the profile and the drift decision come out the same from the
measurement alone)."""

from __future__ import annotations

import dataclasses
import typing
from types import SimpleNamespace

import pytest

from megatron_ssd import OffloadConfig, TensorCache
from megatron_ssd.config import PlannerConfig
from megatron_ssd.planner import IOProfile, uniform_stage
from megatron_ssd.planner.drift import DriftDetector
from megatron_ssd.planner.measured_profile import stage_from_stats
from megatron_ssd.planner.measurement import LayerMeasurement, ModuleMeasurement, StepMeasurement
from megatron_ssd.workloads.parallel import destroy_parallel, init_parallel

from planned_gpt import planned_run

GB = 10**9


@pytest.fixture(scope="module")
def world():
    init_parallel(seed=1234)
    yield
    destroy_parallel()


def _is(value, hint) -> bool:
    """Whether ``value`` has the declared type ``hint`` (an int is not a float here: the
    cache fills float fields with floats)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        return any(_is(value, a) for a in args)
    if origin is list:
        return isinstance(value, list) and all(_is(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(_is(k, args[0]) and _is(v, args[1]) for k, v in value.items())
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, float)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if dataclasses.is_dataclass(hint):
        return isinstance(value, hint) and _typed(value, hint) == []
    return isinstance(value, hint)


def _typed(obj, cls):
    """The fields of ``obj`` declared by ``cls`` whose value is not of the declared type."""
    hints = typing.get_type_hints(cls)
    return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(cls) if not _is(getattr(obj, f.name), hints[f.name])]


def _alone(stats) -> StepMeasurement:
    """The planner's fields of a step and nothing else."""
    return StepMeasurement(**{f.name: getattr(stats, f.name) for f in dataclasses.fields(StepMeasurement)})


def test_a_real_step_is_a_typed_measurement_and_the_planner_reads_only_it(world, tmp_path):
    cfg = OffloadConfig(paths=[str(tmp_path)], min_tensor_bytes=4096)
    with TensorCache(cfg) as cache:
        _, stats, _ = planned_run(cache, PlannerConfig(mode="offload"), layers=2, hidden=64, vocab=128, seq=64, mbs=2,
                                  nmb=2, steps=3)
    assert stats and all(isinstance(s, StepMeasurement) for s in stats)
    for s in stats:
        assert _typed(s, StepMeasurement) == []
        assert [k for k, lc in s.layers.items() if _typed(lc, LayerMeasurement)] == []
    assert stats[-1].write_bytes_per_s > 0 and stats[-1].layers[1].microbatches == 2
    # the profile and the drift decisions from the measurements alone equal those from the stats
    measured = [_alone(s) for s in stats]
    assert stage_from_stats([], measured[1:]) == stage_from_stats([], stats[1:])
    profile = stage_from_stats([], stats[1:])
    full, alone = DriftDetector(window=2), DriftDetector(window=2)
    full.rebase(profile)
    alone.rebase(profile)
    for s, m in zip(stats, measured):
        assert full.observe_step_stats(s) == alone.observe_step_stats(m)


def test_a_measurement_names_every_field():
    with pytest.raises(TypeError, match="missing"):
        StepMeasurement(wall_s=1.0, microbatches=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        StepMeasurement(1.0, 1, 0.0, 0.0, 0.0, 0.0, 0, 0, 1, {})  # type: ignore[misc]
    assert ModuleMeasurement().freed_sites == [] and LayerMeasurement().modules == {}


def _step(forward_s, write_wait_s, write_bytes_per_s=2 * GB, busy_s=5.0):
    """Four layers of two micro-batches each, forward ``forward_s`` (write waits
    ``write_wait_s`` in it) and backward 5 s with 1 s of read stalls; a 10 s step."""
    layers = {i: LayerMeasurement(forward_s=forward_s, write_wait_s=write_wait_s, backward_s=5.0, stall_s=1.0,
                                  microbatches=2) for i in range(4)}
    return StepMeasurement(wall_s=10.0, microbatches=2, write_bytes_per_s=write_bytes_per_s, read_bytes_per_s=4 * GB,
                           write_busy_s=busy_s, read_busy_s=busy_s, backpressure_keeps=0, peak_saved_bytes=0,
                           peak_open_microbatches=1, layers=layers)


def _decide(step):
    detector = DriftDetector(threshold=0.15, window=3)
    detector.rebase(uniform_stage(4, 1.0, 2.0, GB, IOProfile(2 * GB, 4 * GB)))
    return [detector.observe_step_stats(step) for _ in range(3)][-1]


def test_drift_reads_the_typed_fields_of_constructed_measurements():
    """Waits and stalls come off the layers' times, a bandwidth over a short busy time is
    no sample (NOTE [Short I/O samples]), and a missing field is an error, not a default."""
    assert not _decide(_step(3.0, 1.0)).replan  # 1 s forward and 2 s backward per micro-batch, as planned
    slow = _decide(_step(3.0, 0.0))  # the waits not taken off: 1.5 s forward
    assert slow.replan and any(r.startswith("forward of the stage") for r in slow.reasons)
    assert not _decide(_step(3.0, 1.0, write_bytes_per_s=GB, busy_s=0.5)).replan  # 5% of the step: a burst
    halved = _decide(_step(3.0, 1.0, write_bytes_per_s=GB))
    assert halved.replan and halved.profile.io.write_bytes_per_s == pytest.approx(GB)
    partial = SimpleNamespace(**{f.name: getattr(_step(3.0, 1.0), f.name) for f in dataclasses.fields(StepMeasurement)
                                 if f.name != "write_busy_s"})
    with pytest.raises(AttributeError, match="write_busy_s"):
        _decide(partial)


def _waiting_step(wall_s, write_wait_s, stall_s):
    """Two layers, one micro-batch: each forward 1 s of compute plus ``write_wait_s``, each
    backward 2 s plus ``stall_s``; ``wall_s`` for the whole step."""
    layers = {i: LayerMeasurement(forward_s=1.0 + write_wait_s, write_wait_s=write_wait_s, backward_s=2.0 + stall_s,
                                  stall_s=stall_s, microbatches=1, saved_bytes=GB, site_bytes=[GB]) for i in (1, 2)}
    return StepMeasurement(wall_s=wall_s, microbatches=1, write_bytes_per_s=GB, read_bytes_per_s=GB, write_busy_s=4.0,
                           read_busy_s=4.0, backpressure_keeps=0, peak_saved_bytes=2 * GB, peak_open_microbatches=1,
                           layers=layers)


def test_time_outside_the_layers_does_not_count_their_waits_again():
    """NOTE [Time outside the layers]: an OFFLOAD step that waited 2 s per layer for writes
    and 1 s for reads, 0.5 s outside the layers, prices keep-everything at 6.5 s (the waits
    off the layers, the 0.5 s outside them), not at the 12.5 s it ran; KEEP steps give the
    same 0.5 s."""
    offload = [_waiting_step(12.5, 2.0, 1.0), _waiting_step(12.7, 2.0, 1.0), _waiting_step(12.4, 2.0, 1.0)]
    stage = stage_from_stats([], offload)
    assert [(l.forward_s, l.backward_s) for l in stage.layers] == [(1.0, 2.0), (1.0, 2.0)]
    assert stage.other_s == pytest.approx(0.5)
    keep = stage_from_stats([_waiting_step(6.5, 0.0, 0.0), _waiting_step(6.6, 0.0, 0.0)], offload)
    assert keep.other_s == pytest.approx(0.55)
    two = StepMeasurement(**{**{f.name: getattr(offload[0], f.name) for f in dataclasses.fields(StepMeasurement)},
                             "wall_s": 25.0, "microbatches": 2,
                             "layers": {i: dataclasses.replace(lc, forward_s=2 * lc.forward_s,
                                                               backward_s=2 * lc.backward_s, microbatches=2)
                                        for i, lc in offload[0].layers.items()}})
    assert stage_from_stats([], [two]).other_s == pytest.approx(0.5)  # per micro-batch


def _host_step(extra_s: float, hosted: int):
    """Two layers, one micro-batch: each forward 1 s and backward 2 s of compute, plus
    ``extra_s`` each in a HOST step, with ``hosted`` bytes copied out (and back)."""
    layers = {i: LayerMeasurement(forward_s=1.0 + extra_s / 2, backward_s=2.0 + extra_s / 2, microbatches=1,
                                  saved_bytes=GB, site_bytes=[GB], hosted_bytes=hosted) for i in (1, 2)}
    return StepMeasurement(wall_s=6.0 + 2 * extra_s, microbatches=1, write_bytes_per_s=GB, read_bytes_per_s=GB,
                           write_busy_s=1.0, read_busy_s=1.0, backpressure_keeps=0, peak_saved_bytes=2 * GB,
                           peak_open_microbatches=1, layers=layers)


def test_host_steps_price_the_host_copies_as_offload_steps_price_the_drives():
    """NOTE [Pricing host copies]: the HOST steps' compute took 0.8 s more than the KEEP
    steps' 6 s while the link carried 2 GB out and back at 2 GB/s (2 s in flight), so
    compute ran 0.8 / (2 - 0.8) slower while a copy was in flight. Without HOST steps, or
    without KEEP steps to compare with, the copies are priced at nothing, as before."""
    keep, offload = _host_step(0.0, 0), _host_step(0.0, 0)
    stage = stage_from_stats([keep], [offload], host_steps=[_host_step(0.4, GB)], host_bytes_per_s=2 * GB)
    assert stage.io.host_bytes_per_s == 2 * GB
    assert stage.io.host_compute_slowdown == pytest.approx(0.8 / 1.2)
    assert stage_from_stats([keep], [offload], host_steps=[], host_bytes_per_s=2 * GB).io.host_compute_slowdown == 0
    assert stage_from_stats([], [offload], host_steps=[_host_step(0.4, GB)],
                            host_bytes_per_s=2 * GB).io.host_compute_slowdown == 0
    assert stage_from_stats([keep], [offload]).io.host_bytes_per_s is None
