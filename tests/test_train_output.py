"""What a user of ``megatron-ssd train`` / ``plan`` sees: step kinds, short runs, ratios
with their interval, plans as changes, progress lines, units, and the offload metrics
written to TensorBoard (NOTE [Step kinds])."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import types

import pytest


from megatron_ssd.commands.cli import main
from megatron_ssd.config import PlannerConfig, TrainConfig, load_config
from megatron_ssd.commands.steps import FEW_STEPS, format_comparison, format_plans, short_run_problems, step_kinds
from megatron_ssd.commands.train import format_summary

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [  # overrides of configs/gpt-tiny.yaml: a model that trains in about a second per step
    "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=64",
    "model.vocab_size=256", "micro_batch_size=2", "offload.min_tensor_bytes=4096",
]


def test_step_kinds_label_warm_up_profiling_and_measured_steps():
    auto = PlannerConfig(mode="auto", warmup_steps=1, profile_steps=2)
    assert step_kinds(auto, 6) == ["warm-up", "profile", "profile", "profile", "measured", "measured"]
    assert step_kinds(auto, 4) == ["warm-up", "profile", "profile", "profile"]
    assert step_kinds(PlannerConfig(mode="offload"), 3) == ["warm-up", "measured", "measured"]
    assert step_kinds(PlannerConfig(mode="keep"), 1) == ["warm-up"]


def test_short_runs_are_named_with_the_steps_they_need():
    assert short_run_problems(load_config(TrainConfig, None, ["steps=6"])) == []
    assert short_run_problems(load_config(TrainConfig, None, ["steps=5", "baseline_steps=1"])) == [
        "TrainConfig.baseline_steps = 1: its one step is the warm-up step, so keep-everything would be measured "
        "from it; must be 0 or >= 2",
        "TrainConfig.steps = 5: the planner uses 2 warm-up + 3 profiling steps (2 measured, 1 settling), so no step "
        "would run its plan; must be >= 6 to measure the planner's placement",
    ]
    assert short_run_problems(load_config(TrainConfig, None, ["steps=5", "offload.planner.settle_steps=0"])) == []
    assert short_run_problems(load_config(TrainConfig, None, ["steps=1", "offload.planner.mode=static"])) == [
        "TrainConfig.steps = 1: its one step is the warm-up step; must be >= 2"]


def test_a_short_train_exits_non_zero_before_building_anything(monkeypatch, capsys):
    from megatron_ssd.commands.train import TrainRecipe

    def no_setup(self):
        raise AssertionError("setup() must not run")

    monkeypatch.setattr(TrainRecipe, "setup", no_setup)
    assert main(["train", "--config", "configs/gpt-tiny.yaml", "steps=4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron_ssd: TrainConfig.steps = 4: the planner uses 2 warm-up + 3 profiling steps")
    assert "(or pass --allow-short to run anyway" in err
    assert main(["train", "--config", "configs/gpt-tiny.yaml", "steps=2", "--no-baseline"]) == 2


def _phase(name, steps, kind="measured"):
    return {"name": name, "peak_activation_bytes": 100 << 20, "median_step_s": sorted(steps)[len(steps) // 2],
            "step_s": steps, "measured_steps": len(steps) if kind == "measured" else 0, "measured_kind": kind}


def test_a_ratio_from_few_steps_carries_its_interval_and_a_warning():
    keep = _phase("keep-everything", [1.0, 1.1, 0.9])
    off = dict(_phase("offload (auto)", [1.2, 1.3, 1.1, 1.25]), peak_activation_bytes=40 << 20)
    line = format_comparison(keep, off)
    assert line.startswith("activation memory saved: 60.0 MiB (60% of keep-everything, by the cache's count), "
                           "step time 1.25x "
                           "keep-everything (95% interval ")
    assert "medians of 4 and 3 measured steps); WARNING: from 4 and 3 measured steps, too few" in line
    many = format_comparison(_phase("k", [1.0] * FEW_STEPS), _phase("o", [1.5] * FEW_STEPS))
    assert "step time 1.50x keep-everything (95% interval 1.50-1.50; medians of 5 and 5" in many
    assert "WARNING" not in many


def test_the_headline_memory_is_the_independent_measure_with_the_cache_count_after_it():
    """NOTE [Headline memory]: max_memory_allocated on a GPU, RSS on a CPU; the cache's
    count alone only where neither was measured."""
    gpu = {"independent_peak_source": "cuda_max_memory_allocated"}
    keep = dict(_phase("keep-everything", [1.0] * 5), independent_peak_bytes=1000 << 20, **gpu)
    off = dict(_phase("offload (auto)", [1.0] * 5), independent_peak_bytes=250 << 20, peak_activation_bytes=40 << 20,
               **gpu)
    line = format_comparison(keep, off)
    assert line.startswith("memory saved: 750.0 MiB (75% of keep-everything's peak; torch.cuda.max_memory_allocated "
                           "above the pre-forward level), activations counted by the cache 60.0 MiB, step time")
    cpu = {"independent_peak_source": "rss (vmhwm)"}
    line = format_comparison(dict(keep, **cpu), dict(off, **cpu))
    assert "(75% of keep-everything's peak; process RSS above the pre-forward level)" in line
    assert format_comparison(_phase("k", [1.0] * 5), _phase("o", [1.0] * 5)).startswith(
        "activation memory saved: 0.0 MiB (0% of keep-everything, by the cache's count)")


def test_an_unmeasured_phase_gets_no_ratio():
    line = format_comparison(_phase("keep-everything", [1.0, 1.0]),
                             _phase("offload (auto) [profile step]", [0.2], kind="profile"))
    assert line.endswith("; no step-time ratio: offload (auto) [profile step] has no measured step")
    assert "x keep-everything" not in line


def test_summary_table_has_a_unit_on_every_figure_and_one_unit_family():
    text = format_summary([dict(_phase("keep-everything", [1.0, 1.0]), bytes_written_per_step=0.0)])
    labels = [re.split(r"\s{2,}", line.strip())[0] for line in text.splitlines()[2:] if line.strip()]
    unitless = {"failed writes kept in memory", "final loss"}
    decimal = {"SSD writes per day (TB)"}  # the unit drive endurance is rated in (TBW, DWPD)
    for label in labels:
        assert label in unitless | decimal or label.endswith(("(MiB)", "(MiB/s)", "(s)")), label
    assert "GiB" not in text


def test_ssd_writes_per_day_are_in_decimal_terabytes():
    """Before: ``SSD writes per day (MiB)  7417086``, a number no drive rating is given in."""
    phase = dict(_phase("offload (auto)", [1.0, 1.0]), ssd_bytes_written_per_day=7417086 * 2**20)
    line = next(l for l in format_summary([phase]).splitlines() if l.startswith("SSD writes per day"))
    assert re.split(r"\s{2,}", line.strip()) == ["SSD writes per day (TB)", "7.78"]


def test_wear_and_host_rows_appear_only_when_they_apply():
    plain = dict(_phase("offload (auto)", [1.0, 1.0]), bytes_written_per_step=0.0)
    text = format_summary([plain])
    assert "projected drive lifetime" not in text and "host pool" not in text
    both = dict(plain, drive_lifetime_years=4.25, peak_host_bytes=3 << 20, bytes_to_host_per_step=6 << 20)
    text = format_summary([both])
    assert re.search(r"projected drive lifetime \(years\)\s+4\.2", text)
    assert re.search(r"peak host pool \(MiB\)\s+3\.0", text)
    assert re.search(r"copied to host memory per step \(MiB\)\s+6\.0", text)
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("SSD writes per day"))
    assert lines[at + 1].startswith("projected drive lifetime (years)")


def _plan(layers_offloaded, n=3):
    from megatron_ssd.planner import IOProfile, LayerProfile, StageProfile, make_plan

    stage = StageProfile(layers=[LayerProfile(i + 1, forward_s=1.0, backward_s=2.0, saved_bytes=10 << 20)
                                 for i in range(n)], io=IOProfile(write_bytes_per_s=1e9, read_bytes_per_s=1e9))
    plan = make_plan(stage).to_dict()
    for i, layer in enumerate(plan["layers"]):
        layer["choice"]["placement"] = "offload" if i < layers_offloaded else "keep"
    return plan


def test_plans_are_printed_once_then_as_changes():
    events = [{"step": 2, "reason": "profile", "plan": _plan(2)},
              {"step": 8, "reason": "drift: write_bw: median 10.0 MiB/s vs expected 20.0 MiB/s (-50.0%)",
               "plan": _plan(2)},
              {"step": 11, "reason": "drift: forward:1: median 2.00 ms vs expected 1.00 ms (+100.0%)",
               "plan": _plan(1)}]
    text = format_plans(events, steps=24)
    assert text.count("placement") == 2  # the table's header, and the unchanged re-plan
    lines = text.splitlines()
    assert lines[1] == "plan set after step 3 (profile):"
    assert lines[-2] == ("re-plan after step 9 (drift: write_bw: median 10.0 MiB/s vs expected 20.0 MiB/s "
                         "(-50.0%)): placement unchanged")
    assert lines[-1] == ("re-plan after step 12 (drift: forward:1: median 2.00 ms vs expected 1.00 ms (+100.0%)): "
                         "layer 2: offload -> keep")
    many = dict(events[1], reason="drift: " + "; ".join(f"forward:{i}: median 2.00 ms vs expected 1.00 ms (+100.0%)"
                                                         for i in range(5)))
    assert format_plans([events[0], many], steps=24).splitlines()[-1] == (
        "re-plan after step 9 (drift: forward:0: median 2.00 ms vs expected 1.00 ms (+100.0%); forward:1: median "
        "2.00 ms vs expected 1.00 ms (+100.0%); and 3 more (--json: planner.events)): placement unchanged")
    last = format_plans(events[:1], steps=3)
    assert "plan set after step 3 (profile; the run ended before a step ran it):" in last
    timed = format_plans([dict(events[0], search_s=4.531)], steps=3)
    assert "plan set after step 3 (profile; searched 4.53 s; the run ended before a step ran it):" in timed


def test_progress_is_plain_lines_off_a_terminal_and_a_bar_on_one():
    from megatron_ssd.commands.output import Progress

    plain = io.StringIO()
    p = Progress("offload (auto)", 2, plain)
    p.step("warm-up, loss 5.000")
    p.step("measured, loss 4.900")
    p.close()
    assert plain.getvalue() == ("offload (auto) 1/2: warm-up, loss 5.000\n"
                                "offload (auto) 2/2: measured, loss 4.900\n")

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    tty = Terminal()
    p = Progress("offload (auto)", 2, tty)
    p.step("warm-up, loss 5.000")
    p.step("measured, loss 4.900")
    p.close()
    assert "\r" in tty.getvalue() and "2/2" in tty.getvalue() and "measured, loss 4.900" in tty.getvalue()


class _Stats:
    bytes_offloaded, bytes_reloaded, bytes_forwarded, bytes_write_cancelled = 3 << 20, 2 << 20, 1 << 20, 1 << 19
    write_bytes_per_s, read_bytes_per_s = 1e9, 2e9
    stall_s, backpressure_wait_s = 0.25, 0.5
    peak_resident_bytes, peak_ssd_bytes, write_fallbacks = 7 << 20, 9 << 20, 0


class _Recorder:
    def __init__(self):
        self.scalars = []
        self.logged = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def log(self, data, step):
        self.logged.append((data, step))


def test_step_reporter_writes_through_megatrons_writers_at_its_iteration(monkeypatch):
    from megatron_ssd.megatron.integration import StepReporter
    from megatron_ssd.metrics import step_scalars

    tb, wandb = _Recorder(), _Recorder()
    global_vars = types.SimpleNamespace(
        _GLOBAL_ARGS=types.SimpleNamespace(curr_iteration=41), get_args=lambda: global_vars._GLOBAL_ARGS,
        get_tensorboard_writer=lambda: tb, get_wandb_writer=lambda: wandb)
    training = types.ModuleType("megatron.training")
    training.global_vars = global_vars
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    reporter = StepReporter(types.SimpleNamespace(layer_ids=[1]), None, interval=100, rank=3)
    reporter.on_step(_Stats())
    reporter.on_step(_Stats())  # an evaluation in the same iteration: not written again
    expected = step_scalars(_Stats())
    assert tb.scalars == [(tag, value, 42) for tag, value in expected.items()]
    assert wandb.logged == [(expected, 42)]
    assert expected["megatron-ssd/offloaded_bytes"] == 3 << 20 and expected["megatron-ssd/read_stall_s"] == 0.25
    global_vars._GLOBAL_ARGS.curr_iteration = 42
    reporter.on_step(_Stats())
    assert tb.scalars[-1][2] == 43


def _cli(tmp_path, *argv):
    proc = subprocess.run([sys.executable, "-m", "megatron_ssd.commands.cli", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.e2e
def test_train_labels_its_steps_and_writes_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator

    out, tb = tmp_path / "t.json", tmp_path / "tb"
    stdout = _cli(tmp_path, "train", "--config", "configs/gpt-tiny.yaml", *TINY, "steps=7", "baseline_steps=2",
                  "--tensorboard-dir", str(tb), "--json", str(out))
    data = json.loads(out.read_text())
    assert [s["kind"] for s in data["steps"]] == ["warm-up", "warm-up", "profile", "profile", "profile", "measured",
                                                  "measured"]
    keep, off = data["phases"]
    assert (keep["name"], keep["warmup_steps"], keep["measured_steps"]) == ("keep-everything", 1, 1)
    assert (off["name"], off["warmup_steps"], off["profile_steps"], off["measured_steps"]) == \
        ("offload (auto)", 2, 3, 2)
    assert len(off["step_s"]) == 2 and off["measured_kind"] == "measured"
    assert "offload (auto) 3/7: profile, loss " in stdout and "offload (auto) 6/7: measured, loss " in stdout
    # NOTE [Search time]: the plan's line says how long its search held the training thread
    searched = re.search(r"plan set after step 5 \(profile; searched (\d+\.\d\d) s\):", stdout)
    assert searched is not None, stdout
    (event,) = [e for e in data["planner"]["events"] if e["plan"]]
    assert event["search_s"] > 0 and f"{event['search_s']:.2f}" == searched.group(1)
    assert "WARNING: from 2 and 1 measured steps, too few" in stdout
    # NOTE [Auto host pool]: the planner phase's pool, and why, in the summary and the JSON
    assert "\nhost pool: 0 (auto: CPU device, the host is the same memory)\n" in stdout
    assert (data["host_pool"]["bytes"], data["host_pool"]["setting"]) == (0, "auto")

    acc = event_accumulator.EventAccumulator(str(tb))
    acc.Reload()
    from megatron_ssd.metrics import SCALARS

    assert sorted(acc.Tags()["scalars"]) == sorted("megatron-ssd/" + name for name in SCALARS)
    written = acc.Scalars("megatron-ssd/offloaded_bytes")
    assert [e.step for e in written] == [1, 2, 3, 4, 5, 6, 7]
    assert [e.value for e in written] == [float(s["bytes_offloaded"]) for s in data["steps"]]
    peaks = [e.value for e in acc.Scalars("megatron-ssd/peak_resident_bytes")]
    assert peaks == [float(s["peak_resident_bytes"]) for s in data["steps"]]


@pytest.mark.e2e
def test_plan_prints_the_plan_and_not_a_training_table(tmp_path):
    stdout = _cli(tmp_path, "plan", "--config", "configs/gpt-tiny.yaml", *TINY)
    assert "megatron-ssd plan: GPT 2 layers" in stdout
    assert "plan from 2 warm-up, 2 profiling and 1 settle steps:" in stdout
    assert "   layer  placement" in stdout and "goal max_offload" in stdout
    assert "peak activation memory (MiB)" not in stdout and "megatron-ssd train" not in stdout


@pytest.mark.e2e
def test_compare_prints_one_table_and_whether_the_losses_of_the_same_steps_are_identical(tmp_path):
    """``compare`` runs each fixed placement as a phase of its own and the planner at a
    budget of half keep's measured peak, every phase from the same weights and data (NOTE
    [Same start]); the job prints one table and says the losses are identical."""
    out = tmp_path / "train.json"
    printed = _cli(tmp_path, "train", "--config", "configs/gpt-tiny.yaml", *TINY, "compare=recompute,offload",
                   "budget_of_keep=0.5", "steps=8", "baseline_steps=3", "--json", str(out))
    report = json.loads(out.read_text())
    names = [p["name"] for p in report["phases"]]
    budget = int(report["phases"][0]["peak_activation_bytes"] * 0.5)
    assert names == ["keep-everything", "recompute", "offload-all", f"planner, budget {budget / (1 << 20):.1f} MiB"]
    assert report["planner"]["events"][-1]["plan"]["memory_budget"] == budget
    table = printed[printed.index("peak memory  cache count"):].splitlines()
    rows = {line.split("  ")[0]: line for line in table}
    assert rows["keep-everything"].endswith("every layer kept")
    assert rows["recompute"].endswith("every layer recomputed") and rows["offload-all"].endswith("every layer offloaded")
    # the planner's choice: a placement, then layers ("offload 1, 3", or "offload part of 2" when it moves a layer's
    # first sites only, which depends on the measured times)
    # (a placement may carry modules recomputed inside its layers: "offload +core_attn part of 2"; chosen so under load)
    assert re.search(r"\d+\.\d\d-\d+\.\d\d  (offload|recompute|keep|host)( \+\w+)* (part of )?\d", rows[names[-1]])
    assert "losses of the same steps (1-3, same weights and data): recompute, offload-all, planner, budget " in printed
    assert ": identical to keep-everything, bit for bit" in printed
    identity = report["losses_identical"]["phases"]
    assert all(r["first_difference"] is None and r["steps"] == 3 for r in identity.values())
    assert "peak activation memory, cache count (MiB)" not in printed  # the comparison table instead


@pytest.mark.e2e
def test_the_offload_phase_starts_from_keep_everythings_weights(tmp_path):
    out = tmp_path / "train.json"
    printed = _cli(tmp_path, "train", "--config", "configs/gpt-tiny.yaml", *TINY, "steps=5", "baseline_steps=3",
                   "offload.planner.mode=offload", "--json", str(out))
    report = json.loads(out.read_text())
    keep, off = report["phases"]
    assert keep["losses"] == off["losses"][:3]
    assert report["host_pool"]["line"] == "host pool: 0 (not built: planner.mode offload places nothing on the host)"
    assert ("losses of the same steps (1-3, same weights and data): offload (offload): identical to keep-everything, "
            "bit for bit") in printed


def test_loss_identity_names_the_first_step_that_differs():
    from megatron_ssd.commands.steps import format_loss_identity, loss_identity

    keep = {"name": "keep-everything", "losses": [9.0, 8.5, 8.25]}
    same = {"name": "offload-all", "losses": [9.0, 8.5, 8.25, 8.0]}
    other = {"name": "recompute", "losses": [9.0, 8.5000001]}
    identity = loss_identity([keep, same, other])
    assert identity["phases"]["offload-all"] == {"steps": 3, "first_difference": None}
    assert identity["phases"]["recompute"]["first_difference"] == {"step": 2, "loss": 8.5000001, "reference_loss": 8.5}
    assert format_loss_identity(identity) == (
        "losses of the same steps (1-2, same weights and data): offload-all: identical to keep-everything, bit for "
        "bit; recompute: differs from step 2 (8.5000001 against 8.5)")


def test_plan_summary_names_runs_of_layers_and_partial_ones():
    from megatron_ssd.commands.steps import plan_summary
    from megatron_ssd.placement import LayerChoice, Placement
    from megatron_ssd.planner import IOProfile, LayerPlan, Plan

    choices = [("embedding", LayerChoice(Placement.KEEP)), (1, LayerChoice(Placement.OFFLOAD)),
               (2, LayerChoice(Placement.OFFLOAD)), (3, LayerChoice(Placement.OFFLOAD, sites=1)),
               (4, LayerChoice(Placement.RECOMPUTE)), (5, LayerChoice(Placement.KEEP)),
               (6, LayerChoice(Placement.RECOMPUTE))]
    plan = Plan([LayerPlan(layer_id, choice, bytes=0, site_count=3) for layer_id, choice in choices], "max_offload",
                0, 0.0, 0.0, 0.0, 0, 0.0, IOProfile(1e9, 1e9))
    assert plan_summary(plan.to_dict()) == "offload 1-2, part of 3; recompute 4, 6; keep 5"
    # a report written with the earlier plan schema reads alike
    old = plan.to_dict()
    old["schema"] = "megatron_ssd.plan/1"
    old["layers"] = [{**{k: v for k, v in layer.items() if k != "choice"}, "placement": layer["choice"]["placement"],
                      "offload_sites": layer["choice"]["sites"], "read_ahead": 1, "site_read_ahead": None}
                     for layer in old["layers"]]
    assert plan_summary(old) == "offload 1-2, part of 3; recompute 4, 6; keep 5"


def test_compare_needs_keep_everything(capsys):
    assert main(["train", "--config", "configs/gpt-tiny.yaml", "compare=recompute", "--no-baseline"]) == 2
    assert "train: --no-baseline with compare = ['recompute']" in capsys.readouterr().err
    assert main(["train", "--config", "configs/gpt-tiny.yaml", "compare=offload,offload"]) == 2
    assert ("TrainConfig.compare = ['offload', 'offload']: must be distinct names of ['recompute', 'offload', "
            "'static', 'host']") in capsys.readouterr().err
    assert main(["train", "--config", "configs/gpt-tiny.yaml", "budget_of_keep=0.5", "steps=6"]) == 2
    assert "TrainConfig.steps = 6: the planner uses 2 warm-up" in capsys.readouterr().err  # a budget profiles recompute


def test_megatron_cores_two_notices_are_hidden_and_megatron_ssds_own_warnings_are_not(tmp_path, caplog, recwarn,
                                                                                      capsys):
    """Before: every run printed ``GPTModel IS DEPRECATED ...`` (megatron-core 0.19 logs it for
    each GPT built) and, at the first import without a cached ``.pyc``, a SyntaxWarning
    from megatron-core's own ``kv_block_allocator.py``."""
    import importlib.util
    import logging
    import warnings

    caplog.set_level(logging.WARNING)
    assert main(["train", "--config", os.path.join(REPO, "configs", "gpt-tiny.yaml"), *TINY, "num_microbatches=1",
                 "steps=2", "baseline_steps=0", "offload.planner.mode=keep", f"offload.paths={tmp_path}"]) == 0
    # what the first import compiles when no .pyc is cached (the module is imported by now)
    source = importlib.util.find_spec("megatron.core.inference.contexts.kv_block_allocator").origin
    with open(source, encoding="utf-8") as fh:
        compile(fh.read(), source, "exec")
    mine = str(tmp_path / "mine.py")
    compile("'\\-'", mine, "exec")  # the same warning from a file outside megatron-core
    logging.getLogger("megatron_ssd").warning("megatron_ssd's own notice")
    warnings.warn("megatron_ssd's own warning")

    messages = [r.getMessage() for r in caplog.records]
    assert "megatron_ssd's own notice" in messages
    assert not [m for m in messages if "GPTModel IS DEPRECATED" in m]
    shown = [(w.category, str(w.message), w.filename) for w in recwarn]
    assert (SyntaxWarning, "invalid escape sequence '\\-'", mine) in shown
    assert (UserWarning, "megatron_ssd's own warning", __file__) in shown
    assert not [w for w in shown if w[2] == source]


@pytest.mark.slow
def test_a_placement_that_runs_out_of_memory_is_recorded_and_the_others_run(monkeypatch, tmp_path):
    """NOTE [Out of memory, recorded]: keep-everything under a device-memory cap that is too
    small raises ``torch.OutOfMemoryError`` on a GPU; here the second micro-batch of the
    recompute phase's first step raises it, in-process, after its forward saved its
    activations. That phase is recorded (its error's first line, its step), the job says
    so, and the phases after it run from the same weights with losses identical to
    keep-everything's. The cap itself is reported as not enforced on a CPU."""
    import torch

    from megatron_ssd.commands import train as train_module

    real, calls = train_module.gpt_forward_step, []

    def forward_step(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 6:  # keep-everything ran calls 1-4 (2 steps x 2 micro-batches)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                         "capacity of 79.10 GiB\nOf the allocated memory ...")
        return out

    monkeypatch.setattr(train_module, "gpt_forward_step", forward_step)
    config = load_config(TrainConfig, os.path.join(REPO, "configs", "gpt-tiny.yaml"), TINY + [
        "device=cpu", "compare=recompute,offload", "baseline_steps=2", "steps=2", "offload.planner.mode=offload",
        f"offload.paths={tmp_path}", "offload.min_free_bytes=0", "offload.device_memory_cap=1GiB"])
    out = io.StringIO()
    report = train_module.TrainRecipe(config, out=out).run()
    printed = out.getvalue()
    keep, recompute, offload_all, final = report["phases"]
    assert (recompute["name"], recompute["oom"], recompute["oom_step"]) == (
        "recompute", "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB", 1)
    assert recompute["median_step_s"] is None and recompute["peak_activation_bytes"] is None
    assert all(p.get("oom") is None and p["measured_steps"] == 1 for p in (keep, offload_all, final))
    assert ("recompute: out of device memory at step 1 (CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
            "total capacity of 79.10 GiB); recorded, the other phases run") in printed
    row = next(line for line in printed.splitlines() if line.startswith("recompute "))
    assert row.endswith("out of device memory at step 1: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
                        "total capacity of 79.10 GiB")
    identity = report["losses_identical"]
    assert identity["reference"] == "keep-everything" and set(identity["phases"]) == {"offload-all", final["name"]}
    assert all(r["first_difference"] is None for r in identity["phases"].values())
    assert report["device_memory_cap"] == {
        "bytes": 1 << 30, "device": "cpu", "enforced": False, "fraction": None,
        "line": "device memory cap: 1.00 GiB, not enforced on a CPU device (the planner reads it as its capacity)"}
    assert "\ndevice memory cap: 1.00 GiB, not enforced on a CPU device" in printed


def test_a_layer_recomputing_modules_inside_it_is_named_so_in_the_summary_and_the_plan_line():
    """A plan that recomputes core attention in every layer reads so everywhere: the summary
    groups those layers apart (it read "keep 1-3" before), and each layer's placement
    text, which rok's JSON ``plan`` lists, says which modules and how many sites a host
    layer moves ("host 1/3", where it read "offload 1/3")."""
    from megatron_ssd.commands.steps import plan_summary
    from megatron_ssd.placement import LayerChoice, Placement
    from megatron_ssd.planner import IOProfile, LayerPlan, Plan

    attn = ("core_attn",)
    choices = [(1, LayerChoice(Placement.KEEP, recompute=attn)), (2, LayerChoice(Placement.KEEP, recompute=attn)),
               (3, LayerChoice(Placement.HOST, sites=1, recompute=attn)), (4, LayerChoice(Placement.KEEP))]
    plan = Plan([LayerPlan(layer_id, choice, bytes=0, site_count=3) for layer_id, choice in choices], "memory_budget",
                0, 0.0, 0.0, 0.0, 0, 0.0, IOProfile(1e9, 1e9, host_bytes_per_s=1e9))
    assert plan_summary(plan.to_dict()) == "host +core_attn part of 3; keep 4; keep +core_attn 1-2"
    assert [lp.placement_text for lp in plan.layers] == ["keep +core_attn", "keep +core_attn",
                                                         "host 1/3 +core_attn", "keep"]


def test_a_compared_placement_with_paired_steps_reads_its_pairs_ratio():
    """NOTE [Paired steps]: where a compared phase ran pairs with keep-everything, its row's
    ratio and interval are the pairs'; a phase without pairs keeps the ratio of the
    medians; the footer says which."""
    from megatron_ssd.commands.steps import format_choices

    def phase(name, step, paired=None):
        return {"name": name, "peak_activation_bytes": 1 << 20, "median_step_s": step, "step_s": [step] * 5,
                "measured_steps": 5, "independent_peak_bytes": 2 << 20, "independent_peak_source": "rss (vmhwm)",
                "paired": paired}

    pairs = {"pairs": 3, "median_ratio": 1.5, "ratio_ci95": [1.4, 1.6]}
    lines = format_choices([phase("keep-everything", 1.0), phase("recompute", 2.0, pairs), phase("offload-all", 3.0)],
                           None, TrainConfig()).splitlines()
    recompute, offload, footer = lines[4], lines[5], lines[6]
    assert recompute.split()[3:6] == ["2.000", "1.50", "1.40-1.60"]  # its medians' ratio would read 2.00
    assert offload.split()[3:6] == ["3.000", "3.00", "3.00-3.00"]
    assert footer.endswith("x keep: the median ratio of the pairs of steps each phase ran with keep-everything "
                           "after its own (at least 3), with a 95% interval")
    unpaired = format_choices([phase("keep-everything", 1.0), phase("recompute", 2.0)], None, TrainConfig())
    assert unpaired.endswith("its ratio to keep-everything's with a 95% interval")
