"""The planner at run time: a real GPT, real files, the plan it sets, and the commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_ssd import IOConfig, OffloadConfig, Placement, TensorCache
from megatron_ssd.config import PlannerConfig
from megatron_ssd.workloads.parallel import destroy_parallel, init_parallel

from planned_gpt import planned_run
from megatron_ssd.planner import IOProfile, StageProfile
from megatron_ssd.adaptive import AdaptivePlanner
from megatron_ssd.planner.measured_profile import stage_from_stats

VOCAB, SEQ, MBS, NMB, LAYERS = 128, 64, 4, 2, 4
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_CLI = [  # overrides of configs/gpt-tiny.yaml for the command-line runs below
    "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=64",
    "model.vocab_size=256", "micro_batch_size=2", "offload.min_tensor_bytes=4096",
]


@pytest.fixture(scope="module")
def world():
    init_parallel(seed=1234)
    yield
    destroy_parallel()


def _run(cache=None, planner_config=None, steps=6):
    return planned_run(cache, planner_config, layers=LAYERS, hidden=64, vocab=VOCAB, seq=SEQ, mbs=MBS, nmb=NMB,
                       steps=steps)


@pytest.mark.slow
def test_planned_run_is_bit_identical_and_sets_a_plan(world, tmp_path):
    stock, _, _ = _run()
    cfg = OffloadConfig(paths=[str(tmp_path)], min_tensor_bytes=4096, io=IOConfig(max_inflight_bytes=1 << 20))
    with TensorCache(cfg) as cache:
        planned, stats, planner = _run(cache, PlannerConfig(mode="auto", warmup_steps=1, profile_steps=2))
        placements = {layer: cache.placement(layer) for layer in cache.layer_ids}
    assert all(torch.equal(a, b) for a, b in zip(stock.losses, planned.losses, strict=True))
    assert [n for n in stock.grads if not torch.equal(stock.grads[n], planned.grads[n])] == []
    # NOTE [Profiling steps]: warm-up and profile step with every layer kept, one
    # settle step and one profile step with the default placement, then the plan.
    assert [s.bytes_offloaded > 0 for s in stats[:4]] == [False, False, True, True]
    assert [e.reason for e in planner.events][:1] == ["profile"]
    plan = planner.plan
    # the tensors saved before the first layer plan as pseudo-layer "embedding" (kept here)
    assert [lp.layer_id for lp in plan.layers] == ["embedding", 1, 2, 3, 4]
    assert plan.layers[0].placement is Placement.KEEP
    assert placements == {lp.layer_id: lp.placement for lp in plan.layers[1:]}
    # Which layers move depends on the measured times, so on the machine's load (a loaded
    # run offloaded the layer backward needs first, its read hidden by the head's time):
    # the plan's decisions on constructed profiles are tested in test_planner_plan.py.
    profile = planner.profile
    assert isinstance(profile, StageProfile)
    assert all(l.saved_bytes > 0 and l.forward_s > 0 and l.backward_s > 0 for l in profile.layers[1:])
    assert profile.io.write_bytes_per_s > 0 and profile.io.read_bytes_per_s > 0
    assert profile.io.max_inflight_bytes == 1 << 20  # NOTE [In-flight bound]: the engine's, with on_backpressure wait
    # Bytes saved outside the layers (the logits above all) are the last stage's head bytes,
    # resident between the last layer's forward and the first layer's backward.
    assert profile.head_bytes >= VOCAB * SEQ * MBS * 4
    assert profile.layers[0].kept_bytes < VOCAB * SEQ * MBS * 4


@pytest.mark.slow
def test_runtime_plan_honours_the_drive_wear_limit(world, tmp_path):
    """The measured plan under a drive endurance too small for any write: nothing is
    offloaded, the plan carries the limit, and training stays bit-identical."""
    stock, _, _ = _run(steps=5)
    cfg = OffloadConfig(paths=[str(tmp_path)], min_tensor_bytes=4096, io=IOConfig(max_inflight_bytes=1 << 20))
    # 1 MB of endurance to last 3 years: ~1e-8 B/s, below any layer's write rate.
    worn = PlannerConfig(mode="auto", warmup_steps=1, profile_steps=2, drive_tbw_bytes=10**6)
    with TensorCache(cfg) as cache:
        planned, stats, planner = _run(cache, worn, steps=5)
    assert all(torch.equal(a, b) for a, b in zip(stock.losses, planned.losses, strict=True))
    plan = planner.plan
    assert plan.request.max_write_bytes_per_s == pytest.approx(1e6 / (3 * 365 * 86400))
    assert plan.offloaded_bytes == 0 and Placement.OFFLOAD not in plan.placements
    assert stats[-1].bytes_offloaded == 0


@pytest.mark.slow
def test_runtime_plan_fits_the_activation_capacity(world, tmp_path):
    """A CPU has no measured capacity; a configured one holds the measured plan under it
    (here half of keep-everything's predicted peak), bit-identical."""
    stock, _, _ = _run(steps=6)
    cfg = OffloadConfig(paths=[str(tmp_path)], min_tensor_bytes=4096, io=IOConfig(max_inflight_bytes=1 << 20))
    auto = PlannerConfig(mode="auto", warmup_steps=1, profile_steps=2)
    with TensorCache(cfg) as cache:
        _, _, free = _run(cache, auto, steps=4)
        assert free.activation_capacity() is None and free.plan.request.capacity_bytes is None
    capacity = free.plan.keep_peak_activation_bytes // 2
    with TensorCache(cfg) as cache:  # a capacity profiles RECOMPUTE too: 6 steps before the plan
        planned, _, held = _run(cache, PlannerConfig(**{**auto.__dict__, "activation_capacity_bytes": capacity}), steps=6)
    assert all(torch.equal(a, b) for a, b in zip(stock.losses, planned.losses, strict=True))
    assert held.plan.request.capacity_bytes == capacity
    assert held.plan.peak_activation_bytes <= capacity


@pytest.mark.slow
def test_budget_run_profiles_recompute_and_prices_it_from_the_steps(world, tmp_path):
    """NOTE [Pricing recompute]: with a memory budget the profile adds a RECOMPUTE block
    (a settle step, then a measured one) between KEEP and OFFLOAD; each recomputable
    layer's ``recompute_s`` is one stage-wide factor times its forward, the factor being
    what the RECOMPUTE step's layers took beyond the KEEP step's, over their forward.
    Training stays bit-identical through every kind of step."""
    stock, _, _ = _run(steps=7)
    cfg = OffloadConfig(paths=[str(tmp_path)], min_tensor_bytes=4096, io=IOConfig(max_inflight_bytes=1 << 20))
    with TensorCache(cfg) as cache:
        _, kept, _ = _run(cache, PlannerConfig(mode="keep"), steps=2)
    with TensorCache(cfg) as cache:
        budget = PlannerConfig(mode="auto", warmup_steps=1, memory_budget=kept[-1].peak_resident_bytes // 2)
        planned, stats, planner = _run(cache, budget, steps=7)
    assert all(torch.equal(a, b) for a, b in zip(stock.losses, planned.losses, strict=True))
    assert [n for n in stock.grads if not torch.equal(stock.grads[n], planned.grads[n])] == []
    keep_peak = stats[1].peak_resident_bytes
    # warm-up, KEEP; settle, RECOMPUTE (a fraction of the memory, nothing written); settle, OFFLOAD
    assert [s.bytes_offloaded > 0 for s in stats[:6]] == [False, False, False, False, True, True]
    assert [s.peak_resident_bytes < keep_peak // 2 for s in stats[:4]] == [False, False, True, True]
    keep, recompute = stats[1], stats[3]
    layers = planner.profile.layers
    assert layers[0].layer_id == "embedding" and layers[0].recompute_s is None
    inside = [l for l in layers if l.recomputable]
    extra = sum((recompute.layers[l.layer_id].forward_s + recompute.layers[l.layer_id].backward_s)
                / recompute.layers[l.layer_id].microbatches for l in inside) - sum(l.forward_s + l.backward_s
                                                                                for l in inside)
    factor = max(1.0, extra / sum(l.forward_s for l in inside))
    assert keep.layers[1].forward_s / keep.layers[1].microbatches == pytest.approx(layers[1].forward_s)
    for l in inside:
        assert l.recompute_s == pytest.approx(factor * l.forward_s)
    assert planner.plan.request.memory_budget == budget.memory_budget


def test_recompute_factor_from_constructed_steps():
    """The factor is the summed extra over the summed forward, not a per-layer ratio;
    layers' clocks may split recompute work unevenly, the sum is what the step took."""
    from types import SimpleNamespace

    from megatron_ssd.planner.measured_profile import _recompute_factor
    from megatron_ssd.planner import LayerProfile

    def counters(times, microbatches=2):
        return SimpleNamespace(layers={i: SimpleNamespace(forward_s=f * microbatches, backward_s=b * microbatches,
                                                         write_wait_s=0.0, stall_s=0.0, microbatches=microbatches)
                                       for i, (f, b) in times.items()})

    def per_layer(steps, layer_id):
        lc = steps[-1].layers.get(layer_id)
        return None if lc is None else {"fwd": lc.forward_s / lc.microbatches, "bwd": lc.backward_s / lc.microbatches}

    layers = [LayerProfile("embedding", 0.0, 0.0, 10, recomputable=False),
              LayerProfile(1, 0.1, 0.2, 10), LayerProfile(2, 0.1, 0.2, 10)]
    # layer 1 took 0.5 s more, layer 2 0.1 s more: 0.6 s over 0.2 s of forward, 3x each
    steps = [counters({1: (0.1, 0.7), 2: (0.1, 0.3)})]
    assert _recompute_factor(steps, layers, per_layer) == pytest.approx(3.0)
    # never below 1: a forward run again costs at least that forward (NOTE [Pricing recompute])
    assert _recompute_factor([counters({1: (0.1, 0.15), 2: (0.1, 0.2)})], layers, per_layer) == 1.0
    assert _recompute_factor([counters({1: (0.1, 0.25), 2: (0.1, 0.3)})], layers, per_layer) == pytest.approx(1.0)
    assert _recompute_factor([], layers, per_layer) is None


@pytest.mark.slow
def test_a_keeping_engine_bounds_no_forward_in_the_profile(world, tmp_path):
    """``io.on_backpressure: keep`` keeps a tensor the bound refuses instead of waiting, so
    the planner's profile carries no in-flight bound (NOTE [In-flight bound])."""
    cfg = OffloadConfig(paths=[str(tmp_path)], min_tensor_bytes=4096,
                        io=IOConfig(max_inflight_bytes=1 << 20, on_backpressure="keep"))
    with TensorCache(cfg) as cache:
        _, _, planner = _run(cache, PlannerConfig(mode="auto", warmup_steps=1, profile_steps=2))
    assert planner.profile.io.max_inflight_bytes is None


def test_fixed_modes_place_every_layer(world, tmp_path):
    for mode in ("keep", "offload", "recompute"):
        with TensorCache(OffloadConfig(paths=[str(tmp_path)], min_tensor_bytes=4096)) as cache:
            _, stats, planner = _run(cache, PlannerConfig(mode=mode), steps=2)
            assert {cache.placement(l) for l in cache.layer_ids} == {Placement(mode)}
            written = stats[-1].bytes_offloaded
            assert (written > 0) == (mode == "offload")



def test_a_profile_whose_steps_moved_nothing_has_no_drive_bandwidth():
    """OFFLOAD steps that wrote and read nothing (``offload.keep_last_layers`` at least the
    layer count keeps every layer) measure no bandwidth: the profile's are null, not +inf."""
    from types import SimpleNamespace

    from megatron_ssd.planner.measured_profile import _io_profile

    def step(write_bps, read_bps):
        layer = SimpleNamespace(forward_s=0.8, write_wait_s=0.0, backward_s=1.5, stall_s=0.0, microbatches=1)
        return SimpleNamespace(layers={1: layer}, write_bytes_per_s=write_bps, read_bytes_per_s=read_bps,
                               write_busy_s=0.0, read_busy_s=0.0, microbatches=1)

    io = _io_profile([step(0.0, 0.0), step(0.0, 0.0)], [1], 2.0)
    assert (io.write_bytes_per_s, io.read_bytes_per_s) == (None, None)
    assert io.compute_slowdown == pytest.approx(0.15)
    io = _io_profile([step(2e9, 0.0), step(4e9, 0.0)], [1], None)  # written, nothing read back: reads as writes
    assert (io.write_bytes_per_s, io.read_bytes_per_s) == (3e9, 3e9)
    assert _io_profile([], [1], None) == IOProfile(None, None)


@pytest.mark.e2e
def test_auto_mode_keeping_every_layer_finishes_with_its_summary(tmp_path):
    """``offload.keep_last_layers`` >= the layer count with the planner on ``auto``: its
    OFFLOAD profiling steps move nothing, so the drives' bandwidth is not measured and the
    plan keeps every layer, says why, and the run ends with its summary and exit 0.
    Before, the plan offloaded every layer as if writing cost no time, and the run exited
    2 after its last step with "IOProfile.write_bytes_per_s = inf: must be a finite
    number" and no summary."""
    out = tmp_path / "keep.json"
    cmd = [sys.executable, "-m", "megatron_ssd.commands.cli", "train", "--config",
           os.path.join(REPO, "configs", "gpt-tiny.yaml"), "--no-baseline", "--allow-short", *TINY_CLI,
           "steps=6", "offload.keep_last_layers=99", f"offload.paths={tmp_path}", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "final loss" in proc.stdout and "plan set after step 5 (profile; searched " in proc.stdout
    assert "drives: not measured (no profiling step moved a byte to them), so nothing is placed on them" in proc.stdout
    data = json.loads(out.read_text())
    assert data["planner"]["profile"]["io"]["write_bytes_per_s"] is None
    [event] = data["planner"]["events"]
    assert {layer["choice"]["placement"] for layer in event["plan"]["layers"]} == {"keep"}
    assert sum(s["bytes_offloaded"] for s in data["steps"]) == 0


def test_stage_from_stats_needs_a_step():
    with pytest.raises(ValueError, match="megatron_ssd: stage_from_stats needs at least one measured step"):
        stage_from_stats([], [])


def test_profile_schedule_settles_each_kind_before_measuring_it():
    """NOTE [Profiling steps]: warm-up steps run the first measured kind, KEEP steps come
    first, and settle steps of the default placement run between the kinds."""
    from megatron_ssd.profiling import ProfileStep, profile_schedule

    K, D = Placement.KEEP, None
    def kinds(host=False, **kw):
        kw.setdefault("warmup_steps", 1)
        return [(p.placement, p.measured) for p in profile_schedule(PlannerConfig(**kw), host=host)]
    assert kinds() == [(K, False), (K, True), (D, False), (D, True)]
    # NOTE [Warm-up steps]: by default the first KEEP step measured is a process's third
    assert [(p.placement, p.measured) for p in profile_schedule(PlannerConfig())] == [
        (K, False), (K, False), (K, True), (D, False), (D, True)]
    assert kinds(warmup_steps=2, profile_steps=3, settle_steps=2) == [
        (K, False), (K, False), (K, True), (K, True), (D, False), (D, False), (D, True)]
    assert kinds(profile_steps=1) == [(D, False), (D, True)]  # OFFLOAD only: nothing to settle
    assert kinds(settle_steps=0, warmup_steps=0) == [(K, True), (D, True)]
    # NOTE [Pricing recompute]: a limit RECOMPUTE may meet adds a settled RECOMPUTE block
    R = Placement.RECOMPUTE
    assert kinds(memory_budget=1 << 30) == [(K, False), (K, True), (R, False), (R, True), (D, False), (D, True)]
    assert kinds(activation_capacity_bytes=1 << 30) == kinds(memory_budget=1 << 30)
    assert kinds(memory_budget=1 << 30, allow_recompute=False) == kinds()
    assert kinds(memory_budget=1 << 30, recompute_profile_steps=0) == kinds()
    assert kinds(recompute_profile_steps=2, settle_steps=0) == [(K, False), (K, True), (R, True), (R, True), (D, True)]
    assert kinds(memory_budget=1 << 30, profile_steps=1) == [(R, False), (R, True), (D, False), (D, True)]
    assert profile_schedule(PlannerConfig(mode="static")) == []
    assert ProfileStep(K, True).measured
    # NOTE [Pricing host copies]: a host pool to plan with adds a settled HOST block, last
    H = Placement.HOST
    assert kinds(host=True) == [(K, False), (K, True), (D, False), (D, True), (H, False), (H, True)]
    assert kinds(profile_steps=1, host=True) == [(D, False), (D, True)]  # no KEEP steps: nothing to price against


def test_slowdown_is_spread_over_the_time_io_is_in_flight():
    """NOTE [Slowdown while in flight]: 0.3 s of extra compute per micro-batch while I/O
    was in flight for 0.9 s means compute ran 0.5 slower then (0.3 / (0.9 - 0.3)), not
    0.15 slower over the whole 2 s."""
    from types import SimpleNamespace

    from megatron_ssd.planner.measured_profile import _slowdown_in_flight

    def step(forward, backward, write_busy, read_busy, microbatches=1):
        layer = SimpleNamespace(forward_s=forward * microbatches, write_wait_s=0.0, backward_s=backward * microbatches,
                                stall_s=0.0, microbatches=microbatches)
        return SimpleNamespace(layers={1: layer}, write_busy_s=write_busy, read_busy_s=read_busy,
                               microbatches=microbatches)

    assert _slowdown_in_flight(step(0.8, 1.5, 0.4, 0.5), [1], 2.0) == pytest.approx(0.5)
    assert _slowdown_in_flight(step(0.8, 1.5, 0.8, 1.0, microbatches=2), [1], 2.0) == pytest.approx(0.5)
    assert _slowdown_in_flight(step(0.6, 1.3, 0.4, 0.5), [1], 2.0) == 0.0  # faster than KEEP: no slowdown
    assert _slowdown_in_flight(step(0.8, 1.5, 0.0, 0.0), [1], 2.0) == pytest.approx(0.15)  # nothing in flight
    assert _slowdown_in_flight(step(0.8, 1.5, 0.1, 0.1), [1], 2.0) == pytest.approx(0.3 / 0.02)  # held at w / 10


@pytest.mark.e2e
def test_rok_json_schema(tmp_path):
    """``megatron-ssd rok`` on a very small model: one point per placement, each measured."""
    out = tmp_path / "rok.json"
    cmd = [
        sys.executable, "-m", "megatron_ssd.commands.cli", "rok", "--config", os.path.join(REPO, "configs", "gpt-tiny.yaml"),
        *TINY_CLI, "num_microbatches=1", "steps=8", "--paired", "2", "--json", str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "planner: paired steps " in proc.stdout
    data = json.loads(out.read_text())
    assert set(data) >= {"points", "workload", "machine"}
    names = [p["placement"] for p in data["points"]]
    assert names[:5] == ["keep", "recompute", "offload-all", "planner", "keep-last"]
    assert names[5].startswith("budget-")
    for p in data["points"][:5]:
        assert {"placement", "peak_activation_bytes", "peak_rss_bytes", "median_step_s", "bytes_written"} <= set(p)
        assert p["median_step_s"] > 0 and p["peak_rss_bytes"] > 0
        # NOTE [Independent memory]: measured beside the cache's count, for every placement
        assert p["independent_peak_bytes"] == p["peak_rss_above_base_bytes"] >= 0
        assert p["rss_base_bytes"] > 0 and p["allocator_peak_bytes"] > 0
    by = {p["placement"]: p for p in data["points"]}
    assert by["keep"]["bytes_written"] == 0 and by["offload-all"]["bytes_written"] > 0
    assert by["keep"]["bytes_write_cancelled"] == 0 and by["offload-all"]["bytes_write_cancelled"] >= 0
    assert by["offload-all"]["peak_activation_bytes"] < by["keep"]["peak_activation_bytes"]
    assert by["recompute"]["peak_activation_bytes"] < by["keep"]["peak_activation_bytes"]
    # keep-last: the last keep_last_layers (1 of 2) kept, the other offloaded, predicted like the others.
    # What each sends to the drive, not what the drive finished: offload-all's last layer, needed
    # first in backward, often has its writes cancelled (served from memory) on a slow disk.
    assert 0 < by["keep-last"]["bytes_queued"] < by["offload-all"]["bytes_queued"]
    assert by["keep"]["bytes_queued"] == 0
    # offloading the last layer too buys nothing: its read is due when the first backward starts
    assert by["keep-last"]["predicted_peak_activation_bytes"] == by["offload-all"]["predicted_peak_activation_bytes"]
    # every saved tensor is a storage allocated in the step; recompute rebuilds what it does not count
    # No order between the allocator's peak and the cache's count: the peak is what the step
    # adds above its start, and the step frees the previous step's gradients first (NOTE
    # [Frees of what came before]), which on this tiny model outweigh its activations.
    # each layer's placement_text: "offload", "offload 2/5", "keep +core_attn", ...
    assert all(pl.split()[0] in ("keep", "offload", "recompute") for pl in by["planner"]["plan"])
    planned = by["planner"]
    assert planned["plan_io"]["compute_slowdown"] >= 0 and planned["plan_io"]["write_bytes_per_s"] > 0
    assert planned["plan_keep_step_s"] > 0 and set(planned["plan_moved_bytes"]) == {"offload", "host"} \
        and planned["plan_moved_bytes"]["host"] == 0  # no host pool here
    # NOTE [Two parts of a prediction's error]: one micro-batch a step here
    assert planned["predicted_paired_step_s"] == planned["predicted_step_s"]
    assert planned["plan_step_error"] == planned["predicted_step_s"] / planned["paired_step_s"] - 1
    assert planned["profile_keep_drift"] == planned["plan_keep_step_s"] / planned["paired_keep_step_s"] - 1
    assert "planner: predicted " in proc.stdout and "from the paired keep steps" in proc.stdout
    # NOTE [What the cache counts]: the plan replayed on its profile; what recomputation holds is left out
    assert planned["predicted_counted_peak_bytes"] <= planned["predicted_peak_activation_bytes"]
    if "recompute" not in planned["plan"]:
        assert planned["predicted_counted_peak_bytes"] == planned["predicted_peak_activation_bytes"]
    assert by["keep"]["predicted_counted_peak_bytes"] == by["keep"]["predicted_peak_activation_bytes"]
    assert by["recompute"]["predicted_counted_peak_bytes"] < by["recompute"]["predicted_peak_activation_bytes"]
    assert data["workload"]["model"]["num_layers"] == 2
    # --paired: every placement but keep gets its pairs, budgets included (NOTE [Paired steps])
    assert "paired_ratios" not in by["keep"]
    for p in data["points"][1:]:
        assert len(p.get("paired_ratios", ())) == 2, (p["placement"], {k: v for k, v in p.items() if "pair" in k
                                                                        or k in ("plan", "error", "reason")})
        lo, hi = p["paired_x_keep_ci95"]
        assert lo <= p["paired_x_keep"] <= hi
        assert p["paired_keep_step_s"] > 0 and p["paired_step_s"] > 0
        assert f"{p['placement']}: paired steps " in proc.stdout


def _train_json(tmp_path, name, *overrides):
    out = tmp_path / f"{name}.json"
    cmd = [
        sys.executable, "-m", "megatron_ssd.commands.cli", "train", "--config", os.path.join(REPO, "configs", "gpt-tiny.yaml"),
        "--no-baseline", *TINY_CLI, "steps=3", "offload.planner.mode=offload", "offload.keep_last_layers=0",
        *overrides, "--json", str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout, json.loads(out.read_text())


@pytest.mark.e2e
def test_paired_steps_alternate_keep_and_offload_and_leave_the_phase_alone(tmp_path):
    """NOTE [Paired steps]: keep steps write nothing, offload steps write what the offload
    phase wrote; each ratio is offload over keep of its own pair; the offload phase's
    results (losses, steps, plan events) are those of the same run without pairs."""
    stdout, data = _train_json(tmp_path, "paired", "paired_steps=3")
    _, plain = _train_json(tmp_path, "plain")
    paired = data["paired"]
    assert paired["pairs"] == 3 and len(paired["keep_step_s"]) == len(paired["offload_step_s"]) == 3
    assert paired["keep_bytes_written"] == 0
    # What a step queues for writing is fixed by the plan; how much of it is written rather
    # than cancelled (a tensor backward wanted before its write ran, NOTE [Cancelled writes])
    # depends on timing, so the comparison is of the two together, step by step.
    queued = {s["bytes_offloaded"] + s["bytes_write_cancelled"] for s in data["steps"] if s["kind"] == "measured"}
    assert len(queued) == 1 and queued.pop() == (paired["offload_bytes_written_per_step"]
                                                 + paired["offload_bytes_write_cancelled_per_step"]) > 0
    assert paired["ratios"] == [o / k for o, k in zip(paired["offload_step_s"], paired["keep_step_s"])]
    lo, hi = paired["ratio_ci95"]
    assert lo <= paired["median_ratio"] <= hi
    assert "paired steps: offload " in stdout and "(median of 3 pairs; 95% interval " in stdout
    assert (paired["settle_steps"], paired["steps_run"]) == (2, 3 * 2 * 3)  # each timed step after two settle steps
    assert plain["paired"] is None
    _, settled = _train_json(tmp_path, "settled", "paired_steps=1", "paired_settle_steps=0")
    assert (settled["paired"]["settle_steps"], settled["paired"]["steps_run"]) == (0, 1 * 2 * 1)
    assert settled["phases"][-1]["final_loss"] == plain["phases"][-1]["final_loss"]
    assert data["phases"][-1]["final_loss"] == plain["phases"][-1]["final_loss"]
    assert len(data["steps"]) == len(plain["steps"]) == 3
    assert data["planner"]["events"] == plain["planner"]["events"]


@pytest.mark.e2e
def test_no_pair_runs_where_keep_everything_does_not_fit_the_capacity(tmp_path):
    """NOTE [Paired steps]: under a capacity keep-everything does not fit, a pair's keep
    step would run under the capacity guard, offloading; no pair runs, and the JSON and
    the summary say why."""
    stdout, data = _train_json(tmp_path, "capped", "offload.planner.mode=auto", "steps=8", "paired_steps=2",
                               "offload.planner.activation_capacity_bytes=1MiB")
    assert data["planner"]["fits"]["keep"] is False and data["paired"] is None
    fit = data["planner"]["fit_bytes"]
    assert data["paired_not_run"] == (f"keep-everything ({fit['keep'] / 2**20:.1f} MiB) does not fit the activation "
                                      "capacity (1.0 MiB): a pair's keep step would run under the capacity guard, "
                                      "offloading, and not be keep")
    assert f"paired steps: not run: {data['paired_not_run']}" in stdout
    assert len(data["steps"]) == 8  # no step beyond the phase's


@pytest.mark.e2e
def test_train_json_carries_independent_memory_and_the_profiled_step_changes_nothing(tmp_path):
    """NOTE [Independent memory]: RSS above the pre-forward level per phase and per step;
    ``allocator_timeline`` adds the allocator peak from one more, unrecorded, step."""
    stdout, data = _train_json(tmp_path, "timeline", "allocator_timeline=true")
    _, plain = _train_json(tmp_path, "plain")
    phase, plain_phase = data["phases"][-1], plain["phases"][-1]
    assert phase["rss_method"] in ("vmhwm", "sampled") and phase["rss_base_bytes"] > 0
    assert len(phase["rss_peak_per_step_bytes"]) == 3
    assert phase["independent_peak_bytes"] == phase["peak_rss_above_base_bytes"] >= 0
    assert phase["allocator_peak_bytes"] > 0 and plain_phase["allocator_peak_bytes"] is None
    assert phase["cuda_peak_allocated_above_base_bytes"] is None
    assert "peak memory, measured (MiB)" in stdout and "allocator live tensors (MiB)" in stdout
    assert phase["final_loss"] == plain_phase["final_loss"]
    assert len(data["steps"]) == len(plain["steps"]) == 3
    assert data["planner"]["events"] == plain["planner"]["events"]
    # each offload path's drive wear (NVMe SMART), or why none was read (docs/ssd-sizing.md)
    [wear] = data["drive_wear"]
    assert f"offload to {wear['path']}" in stdout and (wear["drives"] or wear["reason"])


def test_plan_that_does_not_fit_the_free_space_is_refused(tmp_path, monkeypatch):
    """Bad input before the planned offload starts: the footprint must fit the paths."""
    from megatron_ssd.errors import ConfigError
    from megatron_ssd.io import rundir
    from megatron_ssd.planner import IOProfile, LayerProfile, StageProfile, make_plan

    stage = StageProfile(
        layers=[LayerProfile(i, forward_s=1.0, backward_s=2.0, saved_bytes=100 << 20) for i in range(4)],
        io=IOProfile(write_bytes_per_s=1e9, read_bytes_per_s=1e9),
    )
    plan = make_plan(stage)
    assert plan.offloaded_bytes >= 200 << 20  # layers 0 and 1; layer 2's read buffer lands on the peak
    monkeypatch.setattr(rundir, "check_free_space", lambda path, minimum: 10 << 20)  # 10 MiB free
    with pytest.raises(ConfigError, match=r"planned SSD footprint = \d+ bytes .* have 10485760 bytes free"):
        rundir.check_space_for_plan([str(tmp_path)], plan.offloaded_bytes)
    with TensorCache(OffloadConfig(paths=[str(tmp_path)], min_free_bytes=0)) as cache:
        planner = AdaptivePlanner(cache, PlannerConfig(mode="auto"))
        with pytest.raises(ConfigError, match="planned SSD footprint"):
            planner._check_space(plan)


@pytest.mark.e2e
def test_rok_rounds_pool_steps_and_count_io_cpu(tmp_path):
    """``--rounds 2``: every point pools both rounds' steps, and keeps each round's median
    and its ratio to keep's median of the same round; I/O CPU time is counted only when
    something is written; ``--paired`` pairs are pooled over the rounds."""
    out = tmp_path / "rok.json"
    cmd = [
        sys.executable, "-m", "megatron_ssd.commands.cli", "rok", "--config", os.path.join(REPO, "configs", "gpt-tiny.yaml"),
        *TINY_CLI, "num_microbatches=1", "steps=6", "--rounds", "2", "--placements", "keep,offload-all,planner",
        "--paired", "1", "--json", str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("-- round ") == 2
    data = json.loads(out.read_text())
    assert data["rounds"] == 2
    names = [p["placement"] for p in data["points"]]
    assert names == ["keep", "offload-all", "planner"]  # exactly those named: no budget point
    keep, off, planner = data["points"][:3]
    assert len(planner["paired_ratios"]) == 2  # one pair per round, pooled
    for p in (keep, off):
        assert p["rounds"] == 2 and len(p["round_median_step_s"]) == 2
        assert p["measured_steps"] == 2 * 5  # steps=6: one warm-up step, five measured, per round
        assert p["final_loss_same_every_round"] is True
        assert "plan" not in p  # fixed placements set no plan
        assert p["cpu_s_per_step"] > 0
    assert keep["round_ratios"] == [1.0, 1.0] and keep["x_keep"] == 1.0 and keep["x_keep_ci95"] == [1.0, 1.0]
    assert [len(r) for r in off["round_step_s"]] == [5, 5]
    assert planner["measured_steps"] == 2 * 1  # 2 warm-up + 3 profiling steps, then one with the plan
    lo, hi = off["x_keep_ci95"]
    assert lo <= off["x_keep"] <= hi
    assert keep["io_cpu_s_per_step"] == 0.0
    assert off["io_cpu_s_per_step"] > 0.0 and off["bytes_written"] > 0
    assert off["round_ratios"] == [a / b for a, b in zip(off["round_median_step_s"], keep["round_median_step_s"])]


def test_ratio_interval_separates_a_real_slowdown_from_noise():
    """NOTE [Stratified bootstrap]: the same steps give an interval around 1.0; steps
    10% slower in every round give one around 1.10 that excludes 1.0; the fixed seed
    makes the interval reproducible; no steps give nan."""
    import math

    from megatron_ssd.commands.intervals import ratio_ci95

    rounds = [[5.0, 5.1, 4.9, 5.2, 4.8, 5.05, 4.95], [5.5, 5.4, 5.6, 5.3, 5.7, 5.45, 5.55]]
    lo, hi = ratio_ci95(rounds, rounds)
    assert lo < 1.0 < hi and hi - lo < 0.1
    slower = [[t * 1.10 for t in r] for r in rounds]
    lo, hi = ratio_ci95(slower, rounds)
    assert 1.0 < lo < 1.10 < hi
    assert ratio_ci95(slower, rounds) == [lo, hi]
    assert all(math.isnan(x) for x in ratio_ci95([[]], [[]]))


@pytest.mark.parametrize("kwargs, match", [
    ({"placements": ["keep", "offlaod-all"]}, r"rok: placements = \['offlaod-all'\]: each must be one of"),
    ({"rounds": 0}, r"rok: rounds = 0: must be >= 1"),
    ({"budgets": [0.3, 1.5]}, r"rok: budgets = \[0.3, 1.5\]: each must be a fraction of keep's peak in \(0, 1\]"),
    ({"paired": 2, "placements": ["keep"]}, r"rok: paired = 2: must be >= 0, and > 0 only with a placement other "
                                            r"than keep \(pairs compare it with keep\)"),
    ({"paired": -1}, r"rok: paired = -1: must be >= 0"),
    ({"placements": ["planner", "budget"]}, r"rok: placements = \['planner', 'budget'\]: 'budget' needs 'keep'"),
    ({"placements": ["keep", "planner"], "overrides": ["steps=4"]},
     r"rok: placement 'planner': TrainConfig.steps = 4: the planner uses 2 warm-up \+ 3 profiling steps \(2 "
     r"measured, 1 settling\), so no step would run its plan; must be >= 6"),
])
def test_rok_rejects_bad_arguments_before_running(kwargs, match):
    from megatron_ssd.errors import ConfigError
    from megatron_ssd.commands.rok import rok_points

    with pytest.raises(ConfigError, match=match):
        rok_points(None, kwargs.pop("overrides", []), **kwargs)


def test_rok_throttle_unavailable_is_one_error_before_anything_runs(monkeypatch, tmp_path):
    from megatron_ssd.commands import rok
    from megatron_ssd.errors import ConfigError
    from megatron_ssd_lab import blkio

    monkeypatch.setattr(blkio, "blkio_available", lambda: "no cgroup-v1 blkio hierarchy with throttling at /x")
    monkeypatch.setattr(rok, "rok_points", lambda *a, **k: pytest.fail("rok ran without its throttle"))
    config = os.path.join(REPO, "configs", "gpt-tiny.yaml")
    with pytest.raises(ConfigError, match=r"rok: --throttle 64MiB: no cgroup-v1 blkio hierarchy with throttling"):
        rok.run_rok(config, TINY_CLI, throttle="64MiB")
    monkeypatch.setattr(blkio, "blkio_available", lambda: None)
    with pytest.raises(ConfigError, match=r"rok: --throttle '0': must be a rate > 0"):
        rok.run_rok(config, [*TINY_CLI, f"offload.paths={tmp_path}"], throttle="0")


def test_rok_throttle_without_the_lab_package_says_what_is_missing(monkeypatch):
    """The wheel does not ship megatron_ssd_lab; ``rok --throttle`` (its cgroup throttle)
    then stops with one line before anything runs, and rok without it needs no lab."""
    from megatron_ssd.commands import rok
    from megatron_ssd.errors import ConfigError

    monkeypatch.setitem(sys.modules, "megatron_ssd_lab.blkio", None)  # what an installed wheel sees
    monkeypatch.setattr(rok, "rok_points", lambda *a, **k: pytest.fail("rok ran without its throttle"))
    config = os.path.join(REPO, "configs", "gpt-tiny.yaml")
    with pytest.raises(ConfigError, match=r"^megatron_ssd: rok: --throttle 64MiB: needs megatron_ssd_lab, the "
                                          r"repository's lab package, which the wheel does not ship"):
        rok.run_rok(config, TINY_CLI, throttle="64MiB")


@pytest.mark.e2e
@pytest.mark.skipif(__import__("megatron_ssd_lab.blkio", fromlist=["x"]).blkio_available() is not None,
                    reason="needs root and the cgroup-v1 blkio hierarchy (blkio throttling)")
def test_rok_runs_every_placement_throttled_and_removes_its_group(tmp_path):
    """rok's throttle group is ``megatron-ssd-<rok's pid>``; that one is gone after it.
    Only its own group is checked: a suite beside this one makes and removes groups of
    its own meanwhile (it failed so with two suites side by side)."""
    from megatron_ssd_lab.blkio import BLKIO_ROOT

    out, log = tmp_path / "rok.json", tmp_path / "rok.log"
    cmd = [sys.executable, "-m", "megatron_ssd.commands.cli", "rok", "--config", os.path.join(REPO, "configs", "gpt-tiny.yaml"),
           *TINY_CLI, "num_microbatches=1", "steps=4", f"offload.paths={tmp_path}", "--placements", "keep,offload-all",
           "--throttle", "64MiB", "--json", str(out)]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, text=True)
        assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]
    data = json.loads(out.read_text())
    assert data["throttle_bytes_per_s"] == 64 << 20
    assert [p["placement"] for p in data["points"]] == ["keep", "offload-all"]
    assert not os.path.exists(os.path.join(BLKIO_ROOT, f"megatron-ssd-{proc.pid}"))


@pytest.mark.slow
def test_the_host_tier_is_planned_on_a_gpu_only_and_runs_bit_identical(world, tmp_path, monkeypatch):
    """On a CPU the host pool saves nothing, so the runtime planner gives it no budget.
    With the budget a GPU would give (the pool's size, at a fixed link speed standing in
    for the measured one), the plan hosts layers and training stays bit-identical."""
    stock, _, _ = _run(steps=7)
    cfg = OffloadConfig(paths=[str(tmp_path)], min_tensor_bytes=4096, host_pool_bytes=64 << 20,
                        io=IOConfig(max_inflight_bytes=1 << 20))
    auto = PlannerConfig(mode="auto", warmup_steps=1, profile_steps=2)
    with TensorCache(cfg) as cache:
        _, _, cpu = _run(cache, auto, steps=5)
        assert cpu.host_budget() is None and cpu.plan.request.host_budget_bytes is None and not cpu.plan.layers_with("host")
    monkeypatch.setattr(AdaptivePlanner, "host_budget", lambda self: self.cache.host.capacity_bytes)
    monkeypatch.setattr(AdaptivePlanner, "host_bandwidth", lambda self: 1e12)
    with TensorCache(cfg) as cache:
        # the SSDs take nothing here (a budget of 0 bytes per second of writes), so what moves goes to the host
        wear = PlannerConfig(**{**auto.__dict__, "drive_tbw_bytes": 1, "drive_lifetime_years": 3.0})
        planned, stats, gpu = _run(cache, wear, steps=7)  # the profile's HOST block adds two steps
        assert gpu.profiles_host and gpu.placed[-2:] == ["host", "host"]
        assert gpu.plan.request.host_budget_bytes == 64 << 20 and gpu.profile.io.host_bytes_per_s == 1e12
        hosted = gpu.plan.layers_with("host")
        assert hosted and gpu.plan.offloaded_bytes == 0
        assert {cache.placement(l) for l in hosted} == {Placement.HOST}
        assert stats[-1].bytes_to_host > 0 and stats[-1].bytes_offloaded == 0
    assert all(torch.equal(a, b) for a, b in zip(stock.losses, planned.losses, strict=True))


@pytest.mark.slow
def test_a_paced_host_tier_is_planned_on_a_cpu(world, tmp_path):
    """With the host tier's copies paced (NOTE [Paced host tier] in ``adaptive.py``) the
    CPU planner's host budget is the pool and its bandwidth the pace, on a link of its
    own; before, a CPU planner gave the pool no budget whatever the pace."""
    cfg = OffloadConfig(paths=[str(tmp_path)], min_tensor_bytes=4096, host_pool_bytes=64 << 20,
                        host_copy_bytes_per_s=1 << 30, io=IOConfig(max_inflight_bytes=1 << 20))
    with TensorCache(cfg) as cache:
        _, _, planner = _run(cache, PlannerConfig(mode="auto", warmup_steps=1, profile_steps=2), steps=6)
        assert planner.host_budget() == 64 << 20 and planner.host_bandwidth() == float(1 << 30)
        # NOTE [Pricing host copies]: a settled HOST block prices the copies
        assert planner.placed == ["keep", "keep", "default", "default", "host", "host"]
        assert planner.profile.io.host_compute_slowdown >= 0.0
        assert planner.plan.request.host_budget_bytes == 64 << 20
        assert planner.profile.io.host_bytes_per_s == float(1 << 30) and planner.profile.io.shared_host_link is False


@pytest.mark.gpu
def test_host_link_bandwidth_is_measured_on_the_gpu():
    from megatron_ssd.profiling import measure_host_bandwidth

    bw = measure_host_bandwidth(torch.device("cuda", torch.cuda.current_device()), nbytes=64 << 20)
    assert 1e9 < bw < 1e12  # PCIe or NVLink-C2C: between 1 GB/s and 1 TB/s


def test_host_link_bandwidth_needs_a_cuda_device():
    from megatron_ssd.profiling import measure_host_bandwidth
    from megatron_ssd.errors import ConfigError

    with pytest.raises(ConfigError, match="device = cpu: the host tier is measured on a CUDA device"):
        measure_host_bandwidth(torch.device("cpu"))
