"""NOTE [Profiling within the capacity] and NOTE [Capacity guard]: a run given an
activation capacity below keep-everything's peak never holds more than the capacity, its
warm-up and profiling steps included, by the cache's count and by the allocator's live
bytes; keep-everything is priced without being run. NOTE [Working set under a cap]: on CUDA
under a cap the first step's measured working set sets the capacity."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_ssd import IOConfig, OffloadConfig, TensorCache
from megatron_ssd.adaptive import FIRST_STEP_GUARD, AdaptivePlanner
from megatron_ssd.cache.memory_cap import capacity_under_cap
from megatron_ssd.config import PlannerConfig
from megatron_ssd.memory import AllocatorTimeline
from megatron_ssd.workloads.harness import SGD, SyntheticData
from megatron_ssd.workloads.parallel import destroy_parallel, init_parallel

from planned_gpt import planned_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "io"))
from fake_cuda import FakeCuda  # noqa: E402

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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_capacity_keep_everything_fits_still_profiles_keep(world, tmp_path):
    _, keep_stats, _, _ = _run(steps=2)
    keep_count = max(s.peak_resident_bytes for s in keep_stats)
    config = _config(tmp_path, activation_capacity_bytes=keep_count * 3)
    with TensorCache(config) as cache:
        _, stats, planner, _ = _run(cache, config.planner, steps=7)
    assert planner.fits["keep"] is True
    assert planner.placed[0] == "offload" and "keep" in planner.placed  # measured after the first step
    assert planner.plan is not None


@pytest.mark.slow
def test_no_capacity_keeps_the_schedule_unchanged(world, tmp_path):
    config = _config(tmp_path)
    with TensorCache(config) as cache:
        _, _, planner, _ = _run(cache, config.planner, steps=5)
    assert planner.capacity_at_start is None and planner.fits == {}
    assert planner.placed[:2] == ["keep", "keep"]


# NOTE [Working set under a cap]: the first step under a cap on CUDA runs with the guard at
# FIRST_STEP_GUARD and its measured peak sets the capacity, on constructed numbers through
# the recording fake's memory calls.

MiB, GiB = 1 << 20, 1 << 30
H200_CAP = int(4.67 * GiB)  # 30% of keep's peak above the weights
H200_RESIDENT = 3346 * MiB  # keep's weights and gradients, allocated between steps (3.27 GiB)


class _CudaCache:
    """What the planner reads of a cache on ``cuda:0``: its config, device, guard and plan."""

    def __init__(self, cap, planner):
        self.config = OffloadConfig(device_memory_cap=cap, planner=planner)
        self.device = torch.device("cuda", 0)
        self.binding = SimpleNamespace(resolved=lambda: torch.device("cuda", 0))
        self.policy = SimpleNamespace(resident_limit=None)
        self.host = None

    def set_plan(self, plan, default=None):
        pass


def _first_step(saved):
    """A first step's statistics, as far as the planner reads them: one micro-batch that
    saved ``saved`` bytes at its peak."""
    return SimpleNamespace(backpressure_keeps=0, microbatches=1, peak_saved_bytes=saved, peak_open_microbatches=1,
                           layers={})


def _capped_planner(cap, resident, planner=None):
    cuda = FakeCuda()
    cuda.memory = 140 * GiB
    cuda.allocated = resident
    config = planner or PlannerConfig(mode="auto")
    cache = _CudaCache(cap, config)
    return AdaptivePlanner(cache, config, cuda=cuda), cache, cuda


def test_the_h200_case_leaves_the_measured_working_set_and_fragmentation_free(caplog):
    planner, cache, cuda = _capped_planner(H200_CAP, H200_RESIDENT)
    # the reserve fraction gave 4.67 x 0.85 - 3.27 = 0.70 GiB, which the step's working set did not fit beside
    assert planner.capacity_at_start == capacity_under_cap(H200_CAP, 0.15, H200_RESIDENT) == 753_682_874
    # the first step runs with the guard at the small limit, its peaks measured from its start
    assert cache.policy.resident_limit == FIRST_STEP_GUARD == 0
    assert cuda.peak_resets == [0] and planner.placed == ["offload"]
    peak, reserved = int(4.55 * GiB), int(4.55 * GiB) + 40 * MiB
    cuda.peak = (peak, reserved)
    with caplog.at_level(logging.WARNING, logger="megatron_ssd"):
        planner.on_step(_first_step(saved=15 * GiB))
    working, fragmentation = peak - H200_RESIDENT - FIRST_STEP_GUARD, 40 * MiB
    assert (planner.working_set.working_bytes, planner.working_set.fragmentation_bytes) == (working, fragmentation)
    assert working == 1_376_990_003  # 1.28 GiB, more than the 0.70 GiB the reserve left
    capacity = H200_CAP - H200_RESIDENT - working - fragmentation
    assert planner.capacity_at_start == cache.policy.resident_limit == capacity == 86_905_979
    assert H200_RESIDENT + working + fragmentation + capacity == H200_CAP
    assert planner.fit_bytes["capacity"] == capacity and planner.fits["keep"] is False
    assert [r for r in caplog.records if "device_memory_cap" in r.getMessage()] == []  # room is left
    # later steps: the working set stays, what is allocated between steps is read again
    cuda.allocated = H200_RESIDENT + 16 * MiB
    assert planner.activation_capacity() == capacity - 16 * MiB
    assert planner.summary()["working_set"] == {"resident": H200_RESIDENT, "guard": 0, "peak_allocated": peak,
                                                "peak_reserved": reserved, "working_bytes": working,
                                                "fragmentation_bytes": fragmentation,
                                                "by_phase": None, "by_layer": None, "head_bytes": 0}  # one number on CUDA


def test_a_working_set_the_cap_cannot_hold_is_one_line_naming_cap_resident_and_need(caplog):
    planner, cache, cuda = _capped_planner(H200_CAP, H200_RESIDENT)
    cuda.peak = (H200_CAP - 64 * MiB, H200_CAP + 32 * MiB)  # fragmentation takes it past the cap
    with caplog.at_level(logging.WARNING, logger="megatron_ssd"):
        planner.on_step(_first_step(saved=15 * GiB))
    need = H200_CAP + 32 * MiB
    assert planner.working_set.need == need
    assert [r.getMessage() for r in caplog.records if "device_memory_cap" in r.getMessage()] == [
        f"megatron_ssd: offload.device_memory_cap = {H200_CAP} (4.67 GiB) leaves no room for activations: "
        f"{H200_RESIDENT} bytes (3.27 GiB) allocated between steps, a working set of {H200_CAP - 64 * MiB - H200_RESIDENT} "
        f"(1.34 GiB) and {96 * MiB} (0.09 GiB) reserved but unallocated, measured in the first step with the cache "
        f"holding at most 0 bytes, need {need} (4.70 GiB); every later step offloads as the first did, and a plan "
        "needs a larger cap"]
    assert planner.capacity_at_start == cache.policy.resident_limit == 0


def test_a_first_step_out_of_memory_under_the_cap_is_one_line_naming_cap_resident_and_reserved():
    planner, _, cuda = _capped_planner(H200_CAP, H200_RESIDENT)
    cuda.peak = (int(4.42 * GiB), int(4.42 * GiB) + int(157.8 * MiB))  # the H200 run's, when it asked for 128 MiB
    assert planner.out_of_memory_line() == (
        f"megatron_ssd: offload.device_memory_cap = {H200_CAP} (4.67 GiB) does not hold the first step with the "
        f"cache holding at most 0 bytes of activations: {H200_RESIDENT} bytes (3.27 GiB) allocated before it, and it "
        "had reserved 4911404154 (4.57 GiB) when it needed more")
    planner.on_step(_first_step(saved=15 * GiB))
    assert planner.out_of_memory_line() is None  # a later step's is the train command's record alone
    assert _capped_planner(None, H200_RESIDENT)[0].out_of_memory_line() is None


def test_without_a_cap_or_on_a_cpu_the_capacity_and_the_first_guard_are_as_before(offload_dir):
    planner, cache, cuda = _capped_planner(None, H200_RESIDENT)
    uncapped = int(140 * GiB * 0.85) - H200_RESIDENT
    assert planner.capacity_at_start == cache.policy.resident_limit == uncapped
    cuda.peak = (int(4.55 * GiB), int(4.6 * GiB))
    planner.on_step(_first_step(saved=15 * GiB))
    assert planner.working_set is None and cuda.peak_resets == [] and cuda.calls_named("peak_memory") == []
    assert planner.capacity_at_start == cache.policy.resident_limit == uncapped
    config = OffloadConfig(paths=[offload_dir], min_free_bytes=0, device="cpu", device_memory_cap=H200_CAP,
                           planner=PlannerConfig(mode="auto"))
    with TensorCache(config) as cpu_cache:
        on_cpu = AdaptivePlanner(cpu_cache, config.planner, cuda=cuda)
        assert on_cpu.capacity_at_start == cpu_cache.policy.resident_limit == int(H200_CAP * 0.85)
        on_cpu.on_step(_first_step(saved=15 * GiB))
        assert on_cpu.working_set is None and on_cpu.capacity_at_start == int(H200_CAP * 0.85)
    assert cuda.peak_resets == [] and cuda.calls_named("peak_memory") == []


@pytest.mark.e2e
def test_on_a_cpu_the_first_step_measures_the_working_set_and_every_step_stays_under_the_cap(tmp_path):
    """NOTE [Working set under a cap] on a CPU: the train command brackets the first step
    with the allocator timeline (the measure ``rok --largest-within`` holds a CPU run to),
    the capacity becomes the cap less that step's working set, and the final step's
    allocator peak is under the cap. Before, the capacity was the cap less 15% and
    gpt-tiny's steps ran over a 300 MiB cap from micro-batch 3 on (307.5 MiB)."""
    import json
    import os
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    cap = 200 << 20
    out = tmp_path / "capped.json"
    cmd = [sys.executable, "-m", "megatron_ssd.commands.cli", "train", "--config", str(repo / "configs" / "gpt-tiny.yaml"),
           "--no-baseline", "steps=6", "micro_batch_size=3", "num_microbatches=1", f"offload.paths={tmp_path}",
           f"offload.device_memory_cap={cap}", "allocator_timeline=true", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=600, env={**os.environ})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    working = data["planner"]["working_set"]
    assert working["resident"] == 0 and working["guard"] == 0 and working["fragmentation_bytes"] == 0
    inside, outside = working["by_phase"]  # NOTE [Working set by phase]
    assert 0 < inside < cap and 0 < outside < cap
    # NOTE [Working set by layer]: each layer's forward peak and backward working set are in
    # the profile, held over its spans, so the capacity is the whole cap
    by_layer = dict(working["by_layer"])
    head = by_layer.pop("head")  # NOTE [Working set of the head's backward]: measured too, not a layer
    assert head[0] == 0 and 0 < head[1] <= data["planner"]["profile"]["head_working_bytes"]
    layers = data["planner"]["profile"]["layers"]
    measured = [layer for layer in layers if str(layer["layer_id"]) in by_layer]
    assert len(measured) == len(by_layer) == data["config"]["model"]["num_layers"]
    assert all(layer["forward_peak_bytes"] == by_layer[str(layer["layer_id"])][0] > layer["saved_bytes"] // 2
               and layer["backward_working_bytes"] == by_layer[str(layer["layer_id"])][1] > 0 for layer in measured)
    assert working["working_bytes"] == 0 and working["head_bytes"] == outside
    # NOTE [Gradients remade each step]: each backward makes its weights' gradients again
    # (fp32: 12h^2 + 13h parameters a layer), the first layer's span the embeddings' too,
    # the head's the final norm's; each step frees them at its start, so they are credited
    model = data["config"]["model"]
    h, v, s = model["hidden_size"], model["vocab_size"], model["seq_length"]
    layer_grads = 4 * (12 * h * h + 13 * h)
    grads = {layer["layer_id"]: layer["grad_bytes"] for layer in measured}
    assert grads == {1: layer_grads + 4 * (v * h + s * h), **{i: layer_grads for i in range(2, len(measured) + 1)}}
    assert data["planner"]["profile"]["head_grad_bytes"] == 4 * 2 * h
    assert data["planner"]["fit_bytes"]["capacity"] == cap
    plans = [e["plan"] for e in data["planner"]["events"] if e["plan"]]
    assert plans and all(p["peak_activation_bytes"] <= cap for p in plans)
    assert data["phases"][-1]["allocator_peak_bytes"] <= cap
