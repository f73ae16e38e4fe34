"""``megatron-ssd rok --largest-within CAP`` (megatron_ssd.commands.rok_largest): the
search on fake probes, how a run's end becomes a probe, the rows and table, and one real
search on a tiny GPT."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest

from megatron_ssd.commands import rok_largest
from megatron_ssd.commands.cli import main
from megatron_ssd.commands.rok_largest import Probe, Search, largest_rows, largest_within, probe_bound
from megatron_ssd.errors import ConfigError
from megatron_ssd.units import MiB

ROOT = Path(__file__).resolve().parents[2]


def _fits_up_to(threshold, seen=None):
    def probe(size):
        if seen is not None:
            seen.append(size)
        return Probe(size, size <= threshold, "" if size <= threshold else "over", {"tokens_per_s": 100.0 * size})
    return probe


@pytest.mark.parametrize("limit", [1, 2, 5, 8, 64, 100])
def test_the_search_finds_the_largest_size_that_fits_within_the_bound(limit):
    for threshold in range(0, limit + 3):
        seen = []
        search = largest_within(_fits_up_to(threshold, seen), limit)
        assert search.largest == min(threshold, limit), (limit, threshold, seen)
        assert search.at_limit == (threshold >= limit)
        assert search.stopped == ""
        assert len(seen) == len(set(seen)) <= probe_bound(limit), (limit, threshold, seen)
        assert all(1 <= s <= limit for s in seen)
        assert [p.size for p in search.probes] == seen


def test_the_bound_grows_with_the_logarithm_of_the_limit():
    assert [probe_bound(n) for n in (1, 2, 8, 64, 100)] == [1, 2, 6, 12, 14]
    for limit in range(1, 300):
        assert probe_bound(limit) <= 2 * math.ceil(math.log2(limit)) + 2


def test_when_even_the_first_size_does_not_fit_the_answer_is_none():
    seen = []
    search = largest_within(_fits_up_to(0, seen), 64)
    assert (search.largest, seen, search.best()) == (0, [1], None)
    rows = largest_rows({"keep": search}, "micro-batch", {})
    assert rows[0]["largest"] == 0 and "tokens_per_s" not in rows[0]
    # a larger start that does not fit: the sizes below it are tried
    seen = []
    assert largest_within(_fits_up_to(2, seen), 64, start=4).largest == 2 and seen == [4, 2, 3]


def test_a_failed_probe_stops_the_search_with_its_reason():
    def probe(size):
        return Probe(size, None, "megatron-ssd train exited 1: boom") if size == 4 else Probe(size, True)

    search = largest_within(probe, 64)
    assert search.largest == 2 and search.stopped == "size 4: megatron-ssd train exited 1: boom"
    (row,) = largest_rows({"planner": search}, "micro-batch", {})
    assert row["status"] == "stopped" and row["reason"] == search.stopped


def test_a_limit_below_the_start_is_refused():
    with pytest.raises(ConfigError, match="rok: largest-limit = 0 with start 1"):
        largest_within(_fits_up_to(3), 0)


def test_rows_give_each_placement_its_largest_size_and_its_rate_over_keeps_at_keeps_largest():
    searches = {"keep": largest_within(_fits_up_to(2), 16), "recompute": largest_within(_fits_up_to(5), 16),
                "planner": None}
    rows = {r["placement"]: r for r in largest_rows(searches, "micro-batch", {"planner": "needs the cap"})}
    assert rows["keep"]["largest"] == 2 and rows["keep"]["x_keep_tokens_per_s"] == 1.0
    assert rows["recompute"]["largest"] == 5 and rows["recompute"]["tokens_per_s"] == 500.0
    assert rows["recompute"]["x_keep_tokens_per_s"] == 2.5 and rows["recompute"]["x_keep_largest"] == 2.5
    assert [p["size"] for p in rows["recompute"]["probes"]] == [1, 2, 4, 8, 6, 5]
    assert rows["planner"] == {"placement": "planner", "status": "skipped", "reason": "needs the cap"}
    # by sequence length: sizes are counted in 64-token steps
    (row,) = largest_rows({"keep": largest_within(_fits_up_to(3), 8)}, "seq-length", {})
    assert row["largest"] == 192 and row["by"] == "model.seq_length"
    table = rok_largest.format_largest(list(rows.values()), "micro-batch", 8 * MiB, "cpu", False)
    assert "largest micro-batch within 8.0 MiB (measured peak compared with it; not enforced on a CPU)" in table
    line = next(l for l in table.splitlines() if l.startswith("recompute"))
    assert line.split()[1:] == ["5", "-", "500", "2.500", "2.500", "6"]
    assert "planner               skipped: needs the cap" in table


# ------------------------------------------------------------------ a run's end, as a probe

def _report(peak_device=None, allocator=3 * MiB, rss=40 * MiB, device_step=None):
    return {"peak_device_bytes": peak_device,
            "config": {"micro_batch_size": 2, "num_microbatches": 2, "model": {"seq_length": 128}},
            "phases": [{"median_step_s": 0.5, "median_device_step_s": device_step, "measured_steps": 2,
                        "allocator_peak_bytes": allocator, "peak_rss_above_base_bytes": rss,
                        "cuda_peak_allocated_above_base_bytes": None, "peak_activation_bytes": MiB,
                        "bytes_written_per_step": 0, "bytes_to_host_per_step": 0}]}


@pytest.mark.parametrize("ending, fits, reason", [
    ((None, 1, "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"), False,
     "OutOfMemoryError: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
    ((None, 2, "megatron_ssd: memory_budget = 100 bytes (0.00 GiB) cannot be met on pipeline stage 0"), False,
     "cannot be met: megatron_ssd: memory_budget = 100 bytes (0.00 GiB) cannot be met on pipeline stage 0"),
    ((None, 1, "line one\nValueError: something else"), None, "megatron-ssd train exited 1: line one | ValueError: "
                                                             "something else"),
    ((None, None, ""), None, "timed out after 30 s"),
    ((_report(allocator=5 * MiB), 0, ""), False,
     "measured peak 5.0 MiB (allocator_peak_bytes) above the cap 4.0 MiB"),
    ((_report(allocator=None, rss=5 * MiB), 0, ""), False,
     "measured peak 5.0 MiB (peak_rss_above_base_bytes) above the cap 4.0 MiB"),
    ((_report(), 0, ""), True, ""),
    # train ran on after the error and recorded it (NOTE [Out of memory, recorded])
    (({"phases": [{"oom": "CUDA out of memory. Tried to allocate 2.00 GiB", "oom_step": 2,
                   "oom_peak_allocated_bytes": 5 * MiB}]}, 0, ""), False,
     "out of device memory at step 2: CUDA out of memory. Tried to allocate 2.00 GiB"),
])
def test_a_run_fits_when_it_ends_within_the_cap_and_does_not_when_it_runs_out_of_memory(monkeypatch, ending, fits,
                                                                                         reason):
    calls = []

    def run_train(cmd, json_path, timeout_s=None):
        calls.append(cmd)
        return ending

    monkeypatch.setattr(rok_largest, "run_train", run_train)
    probe = rok_largest.run_probe(str(ROOT / "configs" / "gpt-tiny.yaml"), ["offload.planner.mode=keep"],
                                  "micro-batch", 3, 4 * MiB, "cpu", timeout_s=30)
    assert (probe.fits, probe.reason) == (fits, reason)
    (cmd,) = calls
    assert "micro_batch_size=3" in cmd and "paired_steps=0" in cmd and "steps=3" in cmd
    assert "allocator_timeline=true" in cmd  # the CPU measure needs the timeline's step
    if fits:
        assert probe.numbers["tokens_per_s"] == 2 * 2 * 128 / 0.5 and probe.numbers["enforced"] is False


def test_on_a_gpu_the_probe_is_held_to_max_memory_allocated_and_timed_by_cuda_events(monkeypatch):
    monkeypatch.setattr(rok_largest, "run_train",
                        lambda cmd, json_path, timeout_s=None: (_report(peak_device=3 * MiB, allocator=9 * MiB,
                                                                        device_step=0.25), 0, ""))
    probe = rok_largest.run_probe(None, ["offload.planner.mode=keep"], "seq-length", 2, 4 * MiB, "cuda")
    assert probe.fits is True and probe.numbers["measured_peak_source"] == "cuda_max_memory_allocated"
    assert probe.numbers["step_timing"] == "cuda_events" and probe.numbers["tokens_per_s"] == 2 * 2 * 128 / 0.25


def test_a_probe_keeps_the_planners_last_plan_and_its_predicted_peak():
    """A probe over the cap says which plan ran there and what it was predicted at, so a
    model error is found from the JSON (gpt-tiny's probe at 24 measured 300.8 MiB against
    a 300 MiB cap, and its plan was not kept)."""
    from megatron_ssd.planner import IOProfile, LayerProfile, PlanRequest, StageProfile, make_plan

    stage = StageProfile([LayerProfile(i, 1.0, 2.0, 100 * MiB, recompute_s=1.0) for i in range(3)],
                         IOProfile(1e9, 1e9), other_s=0.5)
    plan = make_plan(stage, PlanRequest(memory_budget=150 * MiB, allow_recompute=True))
    report = _report()
    report["planner"] = {"events": [{"plan": None}, {"plan": plan.to_dict()}]}
    numbers = rok_largest.probe_numbers(report)
    assert numbers["plan"] == [lp.placement_text for lp in plan.layers]
    assert numbers["predicted_peak_bytes"] == plan.peak_activation_bytes <= 150 * MiB
    assert "plan" not in rok_largest.probe_numbers(_report())  # no planner: no plan


def test_the_planners_steps_cover_its_profiling_before_the_measured_ones():
    from megatron_ssd.profiling import profile_counts
    from megatron_ssd.config import TrainConfig, load_config

    tiny = str(ROOT / "configs" / "gpt-tiny.yaml")
    assert rok_largest.fewest_steps(tiny, ["offload.planner.mode=keep"]) == 3  # 1 warm-up, 2 measured
    planner = load_config(TrainConfig, tiny, []).offload.planner
    assert rok_largest.fewest_steps(tiny, ["offload.planner.mode=auto"]) == profile_counts(planner).total + 2


def test_the_curves_options_are_refused_with_the_search(capsys):
    assert main(["rok", "--largest-within", "1GiB", "--paired", "2", "--plot", "x.png"]) == 2
    assert ("rok: --largest-within with --plot, --paired: the search measures each placement's largest size, "
            "not the curve; drop them") in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--largest-within", "0"], "rok: --largest-within 0: must be a size > 0"),
    (["--largest-within", "1GiB", "--placements", "keep,budget"], "rok: placements = ['budget'] with --largest-within"),
    (["--largest-within", "1GiB", "--largest-limit", "0"], "rok: --largest-limit 0: must be >= 1"),
])
def test_bad_search_settings_are_one_line_before_any_run(capsys, args, message):
    assert main(["rok", "--config", str(ROOT / "configs" / "gpt-tiny.yaml"), *args]) == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------ a real search

TINY = ["model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=128",
        "model.vocab_size=256", "num_microbatches=1", "offload.min_tensor_bytes=4096"]


@pytest.mark.e2e
@pytest.mark.slow
def test_recompute_trains_a_larger_micro_batch_than_keep_within_the_same_cap(tmp_path):
    """Four short runs of a tiny GPT, each in its own process. The cap (4 MiB of live
    tensor bytes) sits between keep's measured peak at micro-batch 1 (2.59 MiB here) and at
    2 (5.82), and above recompute's at 2 (1.88): margins of a third or more, in bytes the
    allocator timeline counts whatever the machine's load, never in times. (Before the
    timeline counted the cache's saved tensors once, keep measured 6.7 and 13.3 MiB and
    the cap was 9 MiB: NOTE [Allocator timeline]; before it saw the previous step's
    gradients freed, 3.4 and 6.7 MiB with the cap at 5 MiB: NOTE [Frees of what came
    before].)"""
    out = io.StringIO()
    result = rok_largest.largest_searches(str(ROOT / "configs" / "gpt-tiny.yaml"),
                                          [*TINY, f"offload.paths={tmp_path}"], 4 * MiB, limit=2,
                                          placements=["keep", "recompute"], out=out)
    rows = {r["placement"]: r for r in result["rows"]}
    assert result["device"] == "cpu" and result["enforced"] is False
    assert rows["keep"]["largest"] == 1 and rows["recompute"]["largest"] == 2, json.dumps(result)[:3000]
    assert rows["recompute"]["largest_is_limit"] is True
    peak = {name: {p["size"]: p["measured_peak_bytes"] for p in rows[name]["probes"]} for name in rows}
    assert peak["recompute"][1] < peak["recompute"][2] < peak["keep"][1] < 4 * MiB < peak["keep"][2]
    assert all(p["measured_peak_source"] == "allocator_peak_bytes" for r in rows.values() for p in r["probes"])
    assert rows["recompute"]["x_keep_largest"] == 2.0 and rows["recompute"]["x_keep_tokens_per_s"] > 0
    lines = out.getvalue().splitlines()
    assert len(lines) == 4 and lines[0].startswith("largest keep: micro-batch 1: fits, peak ")
    assert lines[1].startswith("largest keep: micro-batch 2: does not fit: measured peak ")
