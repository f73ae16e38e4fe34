"""NOTE [Profiling within the capacity] and NOTE [Capacity guard]: a run given an
activation capacity below keep-everything's peak never holds more than the capacity, its
warm-up and profiling steps included, by the cache's count and by the allocator's live
bytes; keep-everything is priced without being run."""

from __future__ import annotations

import pytest
import torch

from megatron_ssd import IOConfig, OffloadConfig, TensorCache
from megatron_ssd.config import PlannerConfig
from megatron_ssd.memory import AllocatorTimeline
from megatron_ssd.workloads.harness import SGD, SyntheticData
from megatron_ssd.workloads.parallel import destroy_parallel, init_parallel

from planned_gpt import planned_run

VOCAB, SEQ, MBS, NMB, LAYERS = 128, 128, 4, 2, 4


@pytest.fixture(scope="module")
def world():
    init_parallel(seed=1234)
    yield
    destroy_parallel()


class StepTimelines:
    """One :class:`AllocatorTimeline` per training step: opened when the step's data is
    made, closed at its optimizer step (the schedule runs between the two)."""

    def __init__(self, data):
        self.data, self.peaks, self._open = data, [], None
        self.sgd = SGD(lr=0.1)

    def __call__(self, step):
        self._open = AllocatorTimeline().__enter__()
        return self.data(step)

    def optimizer_step(self, chunks, step):
        self._open.__exit__(None, None, None)
        self.peaks.append(self._open.peak_bytes)
        self.sgd(chunks, step)


def _run(cache=None, planner_config=None, steps=7):
    """The planned run under ``cache``; None: keep-everything through a cache that keeps
    every layer (so its count is the cache's). Also each step's allocator peak."""
    if cache is None:
        cache = TensorCache(OffloadConfig(paths=["/unused"], min_tensor_bytes=4096, device="cpu"), engine=_NoIO())
        planner_config = PlannerConfig(mode="keep")
    timelines = StepTimelines(SyntheticData("gpt", MBS, SEQ, VOCAB, seed=2))
    result, stats, planner = planned_run(cache, planner_config, layers=LAYERS, hidden=128, vocab=VOCAB, seq=SEQ,
                                         mbs=MBS, nmb=NMB, steps=steps, data=timelines,
                                         optimizer_step=timelines.optimizer_step)
    return result, stats, planner, timelines.peaks


class _NoIO:
    """An engine keep-everything never calls."""

    paths = ()

    def stats(self):
        from megatron_ssd.io.base import EngineStats

        return EngineStats()

    def close(self):
        pass


def _config(tmp_path, **planner):
    return OffloadConfig(paths=[str(tmp_path)], min_tensor_bytes=4096, io=IOConfig(max_inflight_bytes=1 << 20),
                         planner=PlannerConfig(mode="auto", warmup_steps=1, profile_steps=2, **planner))


def test_a_capacity_below_keep_everything_holds_every_step_within_it(world, tmp_path):
    keep_result, keep_stats, _, keep_alloc = _run(steps=3)
    keep_count = max(s.peak_resident_bytes for s in keep_stats)
    capacity = keep_count * 2 // 5
    config = _config(tmp_path, activation_capacity_bytes=capacity)
    with TensorCache(config) as cache:
        result, stats, planner, alloc = _run(cache, config.planner, steps=7)
    # bit-identical to keep-everything
    assert all(torch.equal(a, b) for a, b in zip(keep_result.losses, result.losses[:3], strict=True))
    # every step, warm-up and profiling included, within the capacity by the cache's count ...
    assert max(s.peak_resident_bytes for s in stats) <= capacity < keep_count
    # ... keep-everything was never run: the first step measured what it would hold
    assert planner.fits == {"keep": False, "recompute": True}
    assert planner.fit_bytes["keep"] == pytest.approx(keep_count, rel=0.02)
    assert "keep" not in planner.placed and planner.placed[0] == "offload"
    assert planner.plan is not None and planner.plan.peak_activation_bytes <= capacity
    # ... and by the allocator's live bytes: every step holds at least half of the counted
    # difference less than keep-everything's steps
    keep_peak = max(keep_alloc[1:])
    assert max(alloc) <= keep_peak - (keep_count - capacity) // 2, (alloc, keep_alloc)


def test_a_capacity_keep_everything_fits_still_profiles_keep(world, tmp_path):
    _, keep_stats, _, _ = _run(steps=2)
    keep_count = max(s.peak_resident_bytes for s in keep_stats)
    config = _config(tmp_path, activation_capacity_bytes=keep_count * 3)
    with TensorCache(config) as cache:
        _, stats, planner, _ = _run(cache, config.planner, steps=7)
    assert planner.fits["keep"] is True
    assert planner.placed[0] == "offload" and "keep" in planner.placed  # measured after the first step
    assert planner.plan is not None


def test_no_capacity_keeps_the_schedule_unchanged(world, tmp_path):
    config = _config(tmp_path)
    with TensorCache(config) as cache:
        _, _, planner, _ = _run(cache, config.planner, steps=5)
    assert planner.capacity_at_start is None and planner.fits == {}
    assert planner.placed[:2] == ["keep", "keep"]
