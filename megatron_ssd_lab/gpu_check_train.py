"""The GPU check's training part: one GPT sized for the GPU, one fresh process per placement.

``python -m megatron_ssd_lab.gpu_check train --result R --path DIR --budget-s 250``
(run by ``scripts/gpu_check.sh``) trains ``configs/gpt-gpu-check.yaml`` with keep,
recompute, offload-all and the planner (:data:`DEFAULT_PLACEMENTS`), each as
``megatron-ssd train`` in its own process under its own timeout, and reports per placement
CUDA ``max_memory_allocated`` above the pre-forward level, the step time and its ratio to
keep (paired steps timed by CUDA events, NOTE [Device step time]), the bytes moved, the
planner's predicted step and peak beside the measured ones, and whether the losses are
bit-identical to keep's. The ROK machinery does the arithmetic (``rok._point``,
``add_ratios``, ``add_predictions``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from megatron_ssd.units import MiB
from .gpu_check_report import NO_CUDA, import_problem, part, write_part

__all__ = ["CONFIG", "PLACEMENTS", "DEFAULT_PLACEMENTS", "train_part", "run_placement", "compare_losses",
           "placement_row"]

CONFIG = "configs/gpt-gpu-check.yaml"
"""The GPU check's workload (the file's comment gives the arithmetic behind its size)."""


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


PLACEMENTS: Dict[str, List[str]] = {
    "keep": ["offload.planner.mode=keep", "steps=6", "paired_steps=0"],
    "recompute": ["offload.planner.mode=recompute", "steps=6"],
    "offload-all": ["offload.planner.mode=offload", "steps=3"],
    "planner": ["offload.planner.mode=auto", "offload.io.engine=posix"],
    "planner-kvikio": ["offload.planner.mode=auto", "offload.io.engine=kvikio"],
}
"""Each training placement's overrides of :data:`CONFIG`, in the order they run. The
fixed placements run fewer steps than the planner (it profiles four steps before its
plan); losses are compared over the steps every run has."""

DEFAULT_PLACEMENTS = ("keep", "recompute", "offload-all", "planner")
"""What the part trains unless told otherwise: ``planner-kvikio``, a second planner run
with the kvikio engine, is left out of the GPU window (the ``kvikio`` tests of the
pytest-gpu part run that engine on the GPU; the job part needs the time)."""

PLACEMENT_TIMEOUT_S = {"keep": 60, "recompute": 60, "offload-all": 100, "planner": 80, "planner-kvikio": 80}
"""The most each placement's process may take, start-up included (less when the part's
budget is short)."""

MIN_PLACEMENT_S = 30
"""A placement is not started with less time than this left for it."""


def _pump(stream: Any, prefix: str, out: Any) -> None:
    for line in stream:
        print(f"{prefix}{line.rstrip()}", file=out, flush=True)


def run_placement(name: str, overrides: Sequence[str], json_path: str, timeout_s: float,
                  out: Any = sys.stdout) -> Tuple[Optional[Dict[str, Any]], str]:
    """``megatron-ssd train`` in a fresh process, its output prefixed and passed on as it
    comes; SIGTERM at ``timeout_s`` (so its offload files are removed), SIGKILL 15 s later.

    Returns:
        (the run's JSON report, "") or (None, why there is none).
    """
    cmd = [sys.executable, "-m", "megatron_ssd.commands.cli", "train", *overrides, "--json", json_path]
    print(f"[{name}] $ {' '.join(cmd)}", file=out, flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    pump = threading.Thread(target=_pump, args=(proc.stdout, f"[{name}] ", out), daemon=True)
    pump.start()
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        pump.join(timeout=5)
        return None, f"timed out after {timeout_s:.0f} s"
    pump.join(timeout=5)
    if rc != 0 or not os.path.exists(json_path):
        return None, f"megatron-ssd train exited {rc}; its output is in the log under [{name}]"
    with open(json_path, encoding="utf-8") as fh:
        return json.load(fh), ""


def _bits(losses: Sequence[float]) -> List[bytes]:
    """Each loss's 8 bytes: bit-identity, NaN included."""
    return [struct.pack("<d", float(x)) for x in losses]


def compare_losses(losses: Sequence[float], reference: Sequence[float]) -> Tuple[bool, int, Optional[int]]:
    """Whether the first steps both runs have are bit-identical: (identical, steps compared,
    the first differing step counted from 1, or None)."""
    n = min(len(losses), len(reference))
    for i, (a, b) in enumerate(zip(_bits(losses[:n]), _bits(reference[:n]))):
        if a != b:
            return False, n, i + 1
    return n > 0, n, None


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def placement_row(point: Dict[str, Any], report: Dict[str, Any], keep: Optional[Dict[str, Any]],
                  keep_report: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """One placement's numbers for the JSON and the table, from its ROK point (``rok._point``,
    ratios and predictions added) and its ``train`` report; ``keep`` is keep's point."""
    phase = report["phases"][-1]
    mbs = report["config"]["num_microbatches"]
    row = {
        "placement": point["placement"], "status": "passed", "reason": "",
        "engine": report["config"]["offload"]["io"]["engine"],
        "cuda_peak_allocated_above_base_bytes": phase.get("cuda_peak_allocated_above_base_bytes"),
        "cuda_peak_reserved_above_base_bytes": phase.get("cuda_peak_reserved_above_base_bytes"),
        "cuda_step_start_above_base_bytes": phase.get("cuda_step_start_above_base_bytes"),
        "cuda_live_blocks_after": phase.get("cuda_live_blocks_after"),
        "peak_device_bytes": report.get("peak_device_bytes"),
        "peak_activation_bytes": point["peak_activation_bytes"],
        "median_step_s": point["median_step_s"], "step_s": phase.get("step_s"),
        "median_device_step_s": phase.get("median_device_step_s"), "device_step_s": phase.get("device_step_s"),
        "x_keep": point.get("x_keep"), "x_keep_ci95": point.get("x_keep_ci95"),
        "x_keep_device": _ratio(phase.get("median_device_step_s"),
                                keep_report["phases"][-1].get("median_device_step_s") if keep_report else None),
        "paired_x_keep": point.get("paired_x_keep"), "paired_x_keep_ci95": point.get("paired_x_keep_ci95"),
        "paired_ratios": point.get("paired_ratios"), "paired_timing": (report.get("paired") or {}).get("timing"),
        "bytes_written": point["bytes_written"], "bytes_read": point["bytes_read"],
        "bytes_write_cancelled": point["bytes_write_cancelled"],
        "bytes_forwarded": phase.get("bytes_forwarded_per_step"),
        "write_bytes_per_s": point["write_bytes_per_s"], "read_bytes_per_s": point["read_bytes_per_s"],
        "stall_s": point["stall_s"], "write_wait_s": point["write_wait_s"],
        "plan": point.get("plan"),
        "predicted_step_s": point.get("predicted_step_s"),
        "predicted_peak_activation_bytes": point.get("predicted_peak_activation_bytes"),
        "predicted_counted_peak_bytes": point.get("predicted_counted_peak_bytes"),
        "predicted_exposed_s_per_step": point.get("predicted_exposed_s_per_step"),
        "measured_exposed_s_per_step": point.get("measured_exposed_s_per_step"),
        "final_loss": phase.get("final_loss"), "losses": phase.get("losses"),
    }
    # the plan's step is one micro-batch's forward and backward (Plan.step_s), in the
    # clock the profile was measured with: CUDA events on a GPU (NOTE [Device time])
    predicted_step = row["predicted_step_s"] * mbs if row["predicted_step_s"] is not None else None
    row["predicted_over_measured_step"] = _ratio(predicted_step, row["median_device_step_s"] or row["median_step_s"])
    # NOTE [What the cache counts]: the measured peak is the cache's count
    counted = row["predicted_counted_peak_bytes"] or row["predicted_peak_activation_bytes"]
    row["predicted_over_measured_peak"] = _ratio(counted, row["peak_activation_bytes"])
    if keep is not None and row["losses"] is not None and keep["losses"] is not None:
        same, n, first = compare_losses(row["losses"], keep["losses"])
        row.update(losses_identical_to_keep=same, losses_compared=n, first_differing_step=first)
    return row


def _kvikio_importable(timeout_s: float = 60) -> str:
    """Empty when ``import kvikio`` works in a fresh process, else why it does not."""
    if importlib.util.find_spec("kvikio") is None:
        return "kvikio is not installed (put its wheels in the wheel folder: scripts/gpu_wheels.sh)"
    problem = import_problem("import kvikio", timeout_s)
    return "" if problem is None else f"import kvikio {problem}"


def _workload(config: Any) -> str:
    m = config.model
    return (f"GPT {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, seq {m.seq_length}, "
            f"vocab {m.vocab_size}, {m.params_dtype}, micro-batch {config.micro_batch_size} x "
            f"{config.num_microbatches}")


def train_part(result_path: str, path: str, budget_s: float, config_path: str = CONFIG,
               placements: Optional[Sequence[str]] = None, out: Any = sys.stdout,
               clock: Callable[[], float] = time.monotonic) -> Dict[str, Any]:
    """Train :data:`CONFIG` once per placement, each in a fresh process, within ``budget_s``.

    After each placement the entry so far is written to ``result_path`` (status failed,
    "interrupted"), so a part killed at its timeout keeps what it measured. Failed when a
    placement failed or found no time, or when a placement's losses are not bit-identical
    to keep's; a placement whose engine is missing (kvikio) is skipped with the reason.
    """
    from megatron_ssd.config import TrainConfig, load_config
    from megatron_ssd.commands.rok import _point, add_predictions, add_ratios

    if not _cuda_available():
        return part("train", "skipped", NO_CUDA)
    deadline = clock() + budget_s
    names = list(placements or DEFAULT_PLACEMENTS)
    common = [f"offload.paths={path}", "baseline_steps=0", "device=cuda", "allocator_timeline=false"]
    config = load_config(TrainConfig, config_path, common)
    numbers: Dict[str, Any] = {"config": config_path, "workload": _workload(config), "offload_path": path,
                               "placements": []}
    skipped = {"planner-kvikio": _kvikio_importable()} if "planner-kvikio" in names else {}
    runs: Dict[str, Dict[str, Any]] = {}
    problems: Dict[str, Tuple[str, str]] = {}  # name -> (status, reason)
    with tempfile.TemporaryDirectory(prefix="megatron-ssd-gpu-check-") as tmp:
        for i, name in enumerate(names):
            if skipped.get(name):
                problems[name] = ("skipped", skipped[name])
                continue
            later = [n for n in names[i + 1:] if not skipped.get(n)]
            left = deadline - clock() - MIN_PLACEMENT_S * len(later)
            timeout = min(PLACEMENT_TIMEOUT_S.get(name, 60), left)
            if timeout < MIN_PLACEMENT_S:
                problems[name] = ("failed", f"time budget: {max(0.0, deadline - clock()):.0f} s left of the part's "
                                            f"{budget_s:.0f} s, a placement needs at least {MIN_PLACEMENT_S} s")
                continue
            report, why = run_placement(name, ["--config", config_path, *common, *PLACEMENTS[name]],
                                        os.path.join(tmp, f"{name}.json"), timeout, out)
            if report is None:
                problems[name] = ("failed", why)
            else:
                runs[name] = report
            numbers["placements"] = _rows(names, runs, problems, _point, add_ratios, add_predictions)
            write_part(result_path, part("train", "failed", f"interrupted after {name}", **numbers))
    rows = numbers["placements"] = _rows(names, runs, problems, _point, add_ratios, add_predictions)
    failed = [r for r in rows if r["status"] == "failed"]
    differ = [r for r in rows if r.get("losses_identical_to_keep") is False]
    numbers["expectations"] = _expectations(rows)
    ran = [r for r in rows if r["status"] == "passed"]
    compared = [r["losses_compared"] for r in ran if "losses_compared" in r]
    numbers["headline"] = (f"{len(ran)} placements ran; losses bit-identical to keep's over "
                           f"{min(compared, default=0)} steps"
                           + "".join(f"; {r['placement']} skipped: {r['reason']}" for r in rows
                                     if r["status"] == "skipped"))
    recompute_over = numbers["expectations"]["recompute_peak_below_keep"] is False
    if failed or differ or recompute_over:
        reasons = [f"{r['placement']}: {r['reason']}" for r in failed]
        reasons += [f"{r['placement']}: losses differ from keep's from step {r['first_differing_step']}"
                    for r in differ]
        if recompute_over:  # it never touches the drive: no offload path excuses it
            peak = _cuda_peaks(rows)
            reasons.append(f"recompute: peaked at {peak['recompute'] / MiB:.1f} MiB of CUDA memory above the "
                           f"pre-forward level, not below keep's {peak['keep'] / MiB:.1f} MiB (it holds only "
                           "each layer's input between forward and backward)")
        if "keep" in names and "keep" not in runs:
            reasons.append("no keep run: no ratios and no loss comparison")
        return part("train", "failed", "; ".join(reasons), **numbers)
    return part("train", "passed", **numbers)


def _rows(names: Sequence[str], runs: Dict[str, Dict[str, Any]], problems: Dict[str, Tuple[str, str]],
          point_of: Callable[..., Dict[str, Any]], add_ratios: Callable[..., None],
          add_predictions: Callable[..., None]) -> List[Dict[str, Any]]:
    """The table's rows, in run order: a measured row per run, a status row per problem."""
    points = {name: point_of(name, [report]) for name, report in runs.items()}
    ordered = [points[n] for n in names if n in points]
    add_ratios(ordered)
    add_predictions(ordered, runs)
    keep_row = None
    rows: List[Dict[str, Any]] = []
    for name in names:
        if name in points:
            row = placement_row(points[name], runs[name], keep_row, runs.get("keep"))
            if name == "keep":
                keep_row = row
                row.pop("losses_identical_to_keep", None)
            rows.append(row)
        elif name in problems:
            status, reason = problems[name]
            rows.append({"placement": name, "status": status, "reason": reason})
    if keep_row is None:
        for row in rows:
            if row["status"] == "passed":
                row["losses_identical_to_keep"] = None
    return rows


def _cuda_peaks(rows: Sequence[Dict[str, Any]]) -> Dict[str, Optional[int]]:
    """Each placement that ran: its CUDA peak above the pre-forward level."""
    return {r["placement"]: r.get("cuda_peak_allocated_above_base_bytes") for r in rows if r["status"] == "passed"}


def _expectations(rows: Sequence[Dict[str, Any]]) -> Dict[str, Optional[bool]]:
    """What the placements should show: offload-all and recompute below keep's CUDA peak.
    Recompute above keep fails the part (it never touches the drive); offload-all above
    keep does not (a slow offload path can make it miss)."""
    peak = _cuda_peaks(rows)
    keep = peak.get("keep")

    def below(name: str) -> Optional[bool]:
        return None if keep is None or peak.get(name) is None else peak[name] < keep

    return {"offload_all_peak_below_keep": below("offload-all"), "recompute_peak_below_keep": below("recompute")}
