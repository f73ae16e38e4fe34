"""``offload.device_memory_cap`` (NOTE [Device memory cap]): enforced on CUDA through the
recording fake's calls, refused above the device's memory, told once and not enforced on
a CPU, and read by the planner as its capacity on constructed profiles."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_ssd import OffloadConfig, TensorCache
from megatron_ssd.adaptive import AdaptivePlanner
from megatron_ssd.cache import memory_cap
from megatron_ssd.cache.memory_cap import WorkingSet, apply_device_memory_cap, capacity_under_cap, out_of_memory
from megatron_ssd.config import PlannerConfig, load_config
from megatron_ssd.errors import ConfigError
from megatron_ssd.io.cuda import CUDA
from megatron_ssd.planner.plan import GOAL_CAPACITY, make_plan
from megatron_ssd.planner.profile import IOProfile, uniform_stage
from megatron_ssd.planner.request import PlanRequest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "io"))
from fake_cuda import FakeCuda  # noqa: E402

GB = 10**9
GiB = 1 << 30


def test_on_cuda_the_cap_sets_the_process_memory_fraction_of_its_device():
    cuda = FakeCuda()
    cuda.memory = 80 * GiB
    assert apply_device_memory_cap(20 * GiB, torch.device("cuda", 1), cuda) == 0.25
    assert cuda.fractions == [(0.25, 1)]
    assert apply_device_memory_cap(80 * GiB, torch.device("cuda", 0), cuda) == 1.0  # the whole device is a cap too
    assert apply_device_memory_cap(None, torch.device("cuda", 0), cuda) is None
    assert cuda.fractions == [(0.25, 1), (1.0, 0)]


def test_a_cap_above_the_device_is_refused_in_one_line_naming_field_value_and_rule():
    cuda = FakeCuda()
    cuda.memory = 80 * GiB
    with pytest.raises(ConfigError) as info:
        apply_device_memory_cap(81 * GiB, torch.device("cuda", 0), cuda)
    assert str(info.value) == ("megatron_ssd: OffloadConfig.device_memory_cap = 86973087744: must be <= 85899345920, "
                               "the memory of cuda:0 (80.00 GiB): a cap above the device bounds nothing")
    assert cuda.fractions == []


def test_on_a_cpu_the_cap_is_not_enforced_and_one_info_line_says_so(caplog, monkeypatch, offload_dir):
    monkeypatch.setattr(memory_cap, "_TOLD_CPU", set())
    config = OffloadConfig(paths=[offload_dir], min_free_bytes=0, device="cpu", device_memory_cap=2 * GiB)
    with caplog.at_level(logging.INFO, logger="megatron_ssd"):
        for _ in range(2):  # two caches, one line
            with TensorCache(config) as cache:
                assert cache.memory_fraction is None
    told = [r.getMessage() for r in caplog.records if "device_memory_cap" in r.getMessage()]
    assert told == ["megatron_ssd: offload.device_memory_cap = 2147483648 (2.00 GiB) is not enforced on a CPU "
                    "device; the planner reads it as its capacity"]


def test_the_cap_is_a_size_from_overrides_and_flags():
    assert OffloadConfig().device_memory_cap is None
    assert load_config(OffloadConfig, None, ["device_memory_cap=24GiB"]).device_memory_cap == 24 * GiB
    with pytest.raises(ConfigError, match=r"OffloadConfig.device_memory_cap = 0: must be > 0 bytes or null"):
        load_config(OffloadConfig, None, ["device_memory_cap=0"])


def _planner(planner: PlannerConfig, offload: OffloadConfig, device: str = "cpu") -> SimpleNamespace:
    """What ``AdaptivePlanner.activation_capacity`` reads: its config and a cache's."""
    binding = SimpleNamespace(resolved=lambda: torch.device(device, 0) if device == "cuda" else torch.device("cpu"))
    return SimpleNamespace(config=planner, cache=SimpleNamespace(config=offload, device=torch.device(device),
                                                                 binding=binding), cuda=CUDA, working_set=None)


def test_the_planner_reads_the_cap_as_its_capacity_on_a_cpu():
    assert AdaptivePlanner.activation_capacity(_planner(PlannerConfig(), OffloadConfig())) is None
    capped = _planner(PlannerConfig(), OffloadConfig(device_memory_cap=10 * GB))
    assert AdaptivePlanner.activation_capacity(capped) == int(10 * GB * 0.85) == capacity_under_cap(10 * GB, 0.15, 0)
    smaller = _planner(PlannerConfig(activation_capacity_bytes=3 * GB), OffloadConfig(device_memory_cap=10 * GB))
    assert AdaptivePlanner.activation_capacity(smaller) == 3 * GB


def test_on_cuda_the_capacity_is_the_cap_less_the_reserve_and_what_is_allocated_between_steps(monkeypatch):
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2 * GB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * GB))
    uncapped = _planner(PlannerConfig(), OffloadConfig(), "cuda")
    assert AdaptivePlanner.activation_capacity(uncapped) == int(80 * GB * 0.85) - 2 * GB
    capped = _planner(PlannerConfig(), OffloadConfig(device_memory_cap=10 * GB), "cuda")
    assert AdaptivePlanner.activation_capacity(capped) == int(10 * GB * 0.85) - 2 * GB
    loose = _planner(PlannerConfig(), OffloadConfig(device_memory_cap=80 * GB), "cuda")  # the device binds first
    assert AdaptivePlanner.activation_capacity(loose) == int(80 * GB * 0.85) - 2 * GB


def test_a_measured_working_set_replaces_the_reserve_under_the_cap():
    """NOTE [Working set under a cap]: the H200 check's numbers, constructed."""
    cap, resident = int(4.67 * GiB), 3346 << 20
    measured = WorkingSet(resident, 0, peak_allocated=int(4.55 * GiB), peak_reserved=int(4.55 * GiB) + (40 << 20))
    assert measured.room == measured.working_bytes + measured.fragmentation_bytes == int(4.55 * GiB) + (40 << 20) - resident
    assert capacity_under_cap(cap, 0.15, resident, measured.room) == cap - resident - measured.room == 86_905_979
    assert capacity_under_cap(cap, 0.15, resident) == int(cap * 0.85) - resident  # not measured: the reserve
    assert capacity_under_cap(cap, 0.15, resident, cap) == 0 and measured.shortfall(cap) is None
    assert WorkingSet(resident, 0, cap, cap).shortfall(cap).startswith(
        f"megatron_ssd: offload.device_memory_cap = {cap} (4.67 GiB) leaves no room for activations: {resident} bytes")


def test_the_head_backward_is_not_one_layer_and_sets_the_head_working_set_where_larger():
    """NOTE [Working set of the head's backward]: the head's entry of ``by_layer`` is the
    head's, not a layer's, and the larger of it and the outside peak beyond the head's
    saved bytes is the head's working set (gpt-tiny's micro-batch 22, in MiB)."""
    MiB = 1 << 20
    by_layer = {1: (160 * MiB, 46 * MiB), "head": (0, 13 * MiB)}
    measured = WorkingSet(0, 0, 222 * MiB, 222 * MiB, (138 * MiB, 182 * MiB), by_layer)
    assert (measured.layer_bytes, measured.head_backward_bytes) == (160 * MiB, 13 * MiB)
    planner = SimpleNamespace(working_set=measured)
    assert AdaptivePlanner._head_working_bytes(planner, 187 * MiB) == 13 * MiB  # outside peak below the saved
    assert AdaptivePlanner._head_working_bytes(planner, 150 * MiB) == 32 * MiB  # outside peak beyond them
    assert WorkingSet(0, 0, 1, 1, (1, 2)).head_backward_bytes == 0  # not measured by layer


def test_a_plan_under_the_cap_fits_it_where_the_uncapped_plan_does_not():
    """On a constructed profile (8 layers of 1 GB whose I/O all hides): uncapped, the
    planner's goal is to hide I/O and it holds more than the cap leaves; with the cap's
    capacity it meets it."""
    stage = uniform_stage(8, 1.0, 2.0, GB, IOProfile(GB / 1.5, GB / 1.5))
    free = make_plan(stage)
    cap = int(free.peak_activation_bytes / 2 / 0.85)
    capacity = AdaptivePlanner.activation_capacity(_planner(PlannerConfig(), OffloadConfig(device_memory_cap=cap)))
    plan = make_plan(stage, PlanRequest(capacity_bytes=capacity))
    assert plan.goal == GOAL_CAPACITY and plan.peak_activation_bytes <= capacity < free.peak_activation_bytes


@pytest.mark.parametrize("err, first", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nSee documentation"),
     "CUDA out of memory. Tried to allocate 2.00 GiB."),
    (RuntimeError("CUDA error: out of memory\nCompile with TORCH_USE_CUDA_DSA"), "CUDA error: out of memory"),
    (ValueError("wrapped"), None),
    (RuntimeError("some other failure"), None),
])
def test_out_of_memory_is_told_apart_and_named_by_its_first_line(err, first):
    assert out_of_memory(err) == first


def test_an_out_of_memory_error_raised_from_inside_another_is_found():
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 MiB.")
        except torch.OutOfMemoryError as inner:
            raise RuntimeError("the step failed") from inner
    except RuntimeError as outer:
        assert out_of_memory(outer) == "CUDA out of memory. Tried to allocate 8.00 MiB."
