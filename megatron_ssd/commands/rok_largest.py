"""``megatron-ssd rok --largest-within CAP``: per placement, the largest micro-batch (or
sequence length) whose run fits a device-memory cap, and its tokens per second.

    megatron-ssd rok --config configs/gpt-ref-cpu.yaml --largest-within 700MiB
    megatron-ssd rok --config configs/gpt-gpu-check.yaml --largest-within 20GiB \\
        --placements keep,recompute,planner,megatron-selective --json largest.json

Each probe is one ``megatron-ssd train`` run in a fresh process, as every ``rok``
placement is, a few steps long: a probe that runs out of memory ends only itself, and no
allocator state leaks into the next. The search (:func:`largest_within`) doubles the
size while it fits, then bisects between the largest size that fit and the smallest that
did not. One progress line per probe; then a table of each placement's largest size, its
tokens per second, and that rate over keep's at keep's largest size: how much bigger a
placement trains within the cap, and at what cost.

NOTE [Fits within a cap]
On a CUDA device a probe fits when its run ends without an out-of-memory error under
``offload.device_memory_cap`` = CAP (``torch.cuda.set_per_process_memory_fraction``:
every allocation of the process, weights included) and its ``max_memory_allocated``
is within CAP. On a CPU nothing enforces a cap, so a probe fits when its measured peak
is within CAP: the allocator timeline's peak of live tensor bytes above the step's start
(``allocator_peak_bytes``, the CPU counterpart of ``max_memory_allocated``: tensors,
not the free pages a heap keeps), or without one the process's RSS above its level
before the first forward. Weights and the gradients that live between steps are not in
either, so on a CPU the cap bounds what a step adds. A run the planner ends because no
plan meets the cap (``cannot be met``), or that the model-size check refuses, does not
fit either, nor one whose out-of-memory error ``train`` recorded and survived (NOTE [Out of
memory, recorded]). Any other failure stops that placement's search; its row says why. Where
``offload.device_memory_cap`` is not in this build, a GPU probe is compared like a CPU
one (``enforced: false``), and the planner, whose capacity the cap is, is skipped with
that reason.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..config import MAX_BYTES, OffloadConfig, TrainConfig, load_config
from ..errors import ConfigError
from ..tier import load_tier_modules
from ..units import MiB
from .children import ENDING_GRACE_S, child
from .steps import short_run_problems

__all__ = ["SEARCH_BY", "Probe", "Search", "largest_within", "probe_bound", "cap_supported", "run_probe",
           "largest_rows", "format_largest", "recorded_oom", "NOT_FITTING", "CAP_FIELD"]

CAP_FIELD = "device_memory_cap"
"""The ``OffloadConfig`` field that sets the device-memory cap (NOTE [Fits within a cap])."""

SEARCH_BY: Dict[str, tuple] = {"micro-batch": ("micro_batch_size", 1), "seq-length": ("model.seq_length", 64)}
"""What the search varies: the override it sets and the unit it counts in (a size ``n``
is ``n`` sequences per micro-batch, or ``n x 64`` tokens per sequence)."""

NOT_FITTING = re.compile(r"OutOfMemoryError|CUDA out of memory|\bMemoryError\b|cannot be met|the model needs at least")
"""What a run that did not fit prints: an out-of-memory error, the planner's 'cannot be
met', or the model-size check's refusal (NOTE [Fits within a cap])."""

MEASURED_STEPS = 2
"""Measured steps per probe: enough for a median and the allocator's settled state."""


@dataclass(frozen=True)
class Probe:
    """One probe of the search: a size and whether it fit."""

    size: int
    """The size tried, in the search's units."""
    fits: Optional[bool]
    """True or False; None when the run failed for another reason (the search stops)."""
    reason: str = ""
    """Why it did not fit, or why it failed."""
    numbers: Dict[str, Any] = field(default_factory=dict)
    """What the run measured (peak, step time, tokens per second)."""


@dataclass
class Search:
    """What :func:`largest_within` found."""

    largest: int
    """The largest size that fit; 0 when even the first size tried did not."""
    probes: List[Probe]
    """Every probe, in the order run."""
    stopped: str = ""
    """Why the search ended before it bracketed the answer (a failed run); empty otherwise."""
    at_limit: bool = False
    """The limit itself fit: the answer is at least ``largest``."""

    def best(self) -> Optional[Probe]:
        """The probe of the largest size that fit, or None."""
        return next((p for p in self.probes if p.fits and p.size == self.largest), None)


def probe_bound(limit: int, start: int = 1) -> int:
    """The most probes :func:`largest_within` runs for ``limit`` and ``start``: the
    doublings up to the limit, the limit itself, and a bisection of the widest interval
    the doubling can leave (below ``start``, between two doublings, or below the limit)."""
    doublings = 0
    while start << (doublings + 1) <= limit:
        doublings += 1
    last = start << doublings
    widest = max(start, last // 2, limit - last)
    return doublings + 1 + (last < limit) + (widest - 1).bit_length()


def largest_within(probe: Callable[[int], Probe], limit: int, start: int = 1,
                   on_probe: Optional[Callable[[Probe, int], None]] = None) -> Search:
    """The largest size in ``[start, limit]`` that fits, assuming fitting is monotone
    (a size fits when every smaller one does).

    Doubles from ``start`` while the size fits, tries ``limit`` when the doubling passes
    it, then bisects between the largest size that fit and the smallest that did not; at
    most :func:`probe_bound` probes. A probe that neither fits nor fails to fit
    (``fits`` None) ends the search with what was found so far.

    Args:
        probe: runs one size; pure for the search's purposes.
        limit: the largest size worth trying (>= ``start``).
        start: the first size (>= 1).
        on_probe: called after each probe with it and its number (from 1).

    Raises:
        ConfigError: ``start`` < 1 or ``limit`` < ``start``.
    """
    if start < 1 or limit < start:
        raise ConfigError(f"rok: largest-limit = {limit} with start {start}: must be >= the start, and the start >= 1")
    probes: List[Probe] = []

    def run(size: int) -> Probe:
        p = probe(size)
        probes.append(p)
        if on_probe is not None:
            on_probe(p, len(probes))
        return p

    fit, unfit, size = 0, None, start
    while True:
        p = run(size)
        if p.fits is None:
            return Search(fit, probes, stopped=f"size {size}: {p.reason}")
        if not p.fits:
            unfit = size
            break
        fit = size
        if size == limit:
            return Search(fit, probes, at_limit=True)
        size = min(size * 2, limit)
    while unfit - fit > 1:
        mid = (fit + unfit) // 2
        p = run(mid)
        if p.fits is None:
            return Search(fit, probes, stopped=f"size {mid}: {p.reason}")
        if p.fits:
            fit = mid
        else:
            unfit = mid
    return Search(fit, probes)


# ------------------------------------------------------------------ real probes


def cap_supported() -> bool:
    """Whether this build's ``OffloadConfig`` has the device-memory cap field."""
    return CAP_FIELD in {f.name for f in dataclasses.fields(OffloadConfig)}


def fewest_steps(config_path: Optional[str], overrides: Sequence[str], measured: int = MEASURED_STEPS) -> int:
    """The fewest ``steps`` with which a run of ``overrides`` measures ``measured`` steps
    of its placement (NOTE [Step kinds]: the planner's profiling steps come first)."""
    steps = 2
    while short_run_problems(load_config(TrainConfig, config_path, [*overrides, f"steps={steps}", "baseline_steps=0"])):
        steps += 1
    return steps + measured - 1


def _tail(text: str, lines: int = 3) -> str:
    kept = [l.strip() for l in text.strip().splitlines() if l.strip()]
    return " | ".join(kept[-lines:])[-400:]


def run_train(cmd: Sequence[str], json_path: str, timeout_s: Optional[float] = None) -> tuple:
    """Run a ``megatron-ssd train`` command line in a fresh process, its output kept in a
    file (no pipe to fill); SIGTERM at ``timeout_s`` (so its offload files are removed),
    SIGKILL 15 s later. Returns (report or None, exit status, output)."""
    import json

    with tempfile.TemporaryFile(mode="w+", encoding="utf-8") as log:
        with child(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,  # NOTE [Ending the children]
                   env={**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=ENDING_GRACE_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                rc = None
        log.seek(0)
        output = log.read()
    if rc == 0 and os.path.exists(json_path):
        with open(json_path, encoding="utf-8") as fh:
            return json.load(fh), rc, output
    return None, rc, output


def recorded_oom(report: Dict[str, Any]) -> Optional[str]:
    """Why a run's placement ran out of device memory, when ``train`` recorded that (NOTE
    [Out of memory, recorded] in ``train.py``: the run then ends normally); else None."""
    phase = report["phases"][-1]
    if phase.get("oom") is None:
        return None
    return f"out of device memory at step {phase.get('oom_step')}: {phase['oom']}"


def probe_numbers(report: Dict[str, Any]) -> Dict[str, Any]:
    """What a probe's ``train`` report says about memory and speed, and the planner's
    last plan (per layer, as the plan line prints it) with its predicted peak."""
    phase = report["phases"][-1]
    cfg = report["config"]
    step = phase.get("median_device_step_s") or phase["median_step_s"]
    tokens = cfg["micro_batch_size"] * cfg["num_microbatches"] * cfg["model"]["seq_length"]
    plans = [e["plan"] for e in (report.get("planner") or {}).get("events", ()) if e.get("plan")]
    planned = {}
    if plans:
        from ..planner.plan import Plan

        planned = {"plan": [lp.placement_text for lp in Plan.from_dict(plans[-1]).layers],
                   "predicted_peak_bytes": plans[-1]["peak_activation_bytes"]}
    return {**planned,
        "micro_batch_size": cfg["micro_batch_size"], "seq_length": cfg["model"]["seq_length"],
        "tokens_per_step": tokens, "step_s": step, "tokens_per_s": tokens / step if step else None,
        "step_timing": "cuda_events" if phase.get("median_device_step_s") else "wall_s",
        "measured_steps": phase.get("measured_steps"),
        "peak_device_bytes": report.get("peak_device_bytes"),
        "cuda_peak_allocated_above_base_bytes": phase.get("cuda_peak_allocated_above_base_bytes"),
        "allocator_peak_bytes": phase.get("allocator_peak_bytes"),
        "peak_rss_above_base_bytes": phase.get("peak_rss_above_base_bytes"),
        "peak_activation_bytes": phase.get("peak_activation_bytes"),
        "bytes_written": phase.get("bytes_written_per_step"),
        "bytes_to_host": phase.get("bytes_to_host_per_step"),
    }


def measured_peak(numbers: Dict[str, Any], device: str) -> tuple:
    """(bytes, what they are) of the measure a probe is held to (NOTE [Fits within a cap])."""
    if device == "cuda" and numbers.get("peak_device_bytes") is not None:
        return numbers["peak_device_bytes"], "cuda_max_memory_allocated"
    if numbers.get("allocator_peak_bytes") is not None:
        return numbers["allocator_peak_bytes"], "allocator_peak_bytes"
    return numbers.get("peak_rss_above_base_bytes") or 0, "peak_rss_above_base_bytes"


def run_probe(config_path: Optional[str], overrides: Sequence[str], by: str, size: int, cap: int, device: str,
              timeout_s: Optional[float] = None) -> Probe:
    """Train ``size`` (in :data:`SEARCH_BY` ``by``'s units) with ``overrides`` in a fresh
    process, a few steps, and say whether it fit ``cap`` (NOTE [Fits within a cap]).
    The run gets the cap as ``offload.device_memory_cap`` where this build has it."""
    from .rok import train_command

    key, unit = SEARCH_BY[by]
    sized = [*overrides, f"{key}={size * unit}", "paired_steps=0"]
    enforce = cap_supported()
    if enforce:
        sized.append(f"offload.{CAP_FIELD}={cap}")
    try:
        steps = fewest_steps(config_path, sized)
    except ConfigError as err:  # a size the configuration refuses (the model-size check among them)
        text = str(err)
        return Probe(size, False if NOT_FITTING.search(text) else None, text.splitlines()[-1][:400])
    with tempfile.TemporaryDirectory(prefix="megatron-ssd-largest-") as tmp:
        out = os.path.join(tmp, "probe.json")
        cmd = train_command(config_path, [*sized, f"steps={steps}"], out, timeline=device != "cuda")
        report, rc, output = run_train(cmd, out, timeout_s)
    if report is None:
        if rc is None:
            return Probe(size, None, f"timed out after {timeout_s:.0f} s")
        match = NOT_FITTING.search(output)
        if match:
            return Probe(size, False, f"{match.group(0)}: {_tail(output, 1)}")
        return Probe(size, None, f"megatron-ssd train exited {rc}: {_tail(output)}")
    oom = recorded_oom(report)
    if oom is not None:
        return Probe(size, False, oom,
                     {"oom_peak_allocated_bytes": report["phases"][-1].get("oom_peak_allocated_bytes")})
    numbers = probe_numbers(report)
    peak, source = measured_peak(numbers, device)
    numbers.update(measured_peak_bytes=peak, measured_peak_source=source, cap_bytes=cap,
                   enforced=enforce and device == "cuda")
    if peak > cap:
        return Probe(size, False, f"measured peak {peak / MiB:.1f} MiB ({source}) above the cap {cap / MiB:.1f} MiB",
                     numbers)
    return Probe(size, True, "", numbers)


# ------------------------------------------------------------------ rows and the table


def largest_rows(searches: Dict[str, Optional[Search]], by: str, skipped: Dict[str, str]) -> List[Dict[str, Any]]:
    """One row per placement: its largest size, the numbers of that probe, its tokens per
    second over keep's at keep's largest size (``x_keep_tokens_per_s``), and every probe."""
    key, unit = SEARCH_BY[by]
    rows: List[Dict[str, Any]] = []
    for name, search in searches.items():
        if search is None:
            rows.append({"placement": name, "status": "skipped", "reason": skipped.get(name, "")})
            continue
        best = search.best()
        rows.append({
            "placement": name, "status": "measured" if not search.stopped else "stopped",
            "reason": search.stopped, "largest": search.largest * unit, "largest_is_limit": search.at_limit,
            "by": key, **({k: best.numbers.get(k) for k in ("tokens_per_s", "step_s", "step_timing",
                                                            "measured_peak_bytes", "measured_peak_source",
                                                            "bytes_written", "bytes_to_host")} if best else {}),
            "probes": [{"size": p.size * unit, "fits": p.fits, "reason": p.reason, **p.numbers}
                       for p in search.probes],
        })
    keep = next((r for r in rows if r["placement"] == "keep" and r.get("tokens_per_s")), None)
    for r in rows:
        if r.get("tokens_per_s") and keep is not None:
            r["x_keep_tokens_per_s"] = r["tokens_per_s"] / keep["tokens_per_s"]
            r["x_keep_largest"] = r["largest"] / keep["largest"]
    return rows


def format_largest(rows: Sequence[Dict[str, Any]], by: str, cap: int, device: str, enforced: bool) -> str:
    """The headline table: how much bigger each placement trains within the cap, and at
    what cost in tokens per second."""
    what = "micro-batch" if by == "micro-batch" else "seq length"
    how = ("enforced: set_per_process_memory_fraction" if enforced
           else "measured peak compared with it; not enforced" + (" on a CPU" if device != "cuda" else ""))
    lines = [f"largest {what} within {cap / MiB:.1f} MiB ({how})",
             f"{'placement':<22}{'largest ' + what:>20}{'peak MiB':>11}{'tokens/s':>11}"
             f"{'x keep size':>13}{'x keep tokens/s':>17}{'probes':>8}"]
    for r in rows:
        if r["status"] == "skipped":
            lines.append(f"{r['placement']:<22}skipped: {r['reason'][:100]}")
            continue
        peak = r.get("measured_peak_bytes")
        tps = r.get("tokens_per_s")
        largest = f"{r['largest']}{'+' if r['largest_is_limit'] else ''}" if r["largest"] else "none fits"
        lines.append(f"{r['placement']:<22}{largest:>20}{'-' if peak is None else f'{peak / MiB:.1f}':>11}"
                     f"{'-' if tps is None else f'{tps:.0f}':>11}"
                     f"{_ratio(r.get('x_keep_largest')):>13}{_ratio(r.get('x_keep_tokens_per_s')):>17}"
                     f"{len(r['probes']):>8}")
        if r["status"] == "stopped":
            lines.append(f"{'':<22}stopped: {r['reason'][:110]}")
    lines.append("x keep: this placement's largest size and its tokens/s over keep's at keep's largest size; "
                 "'+': the search's limit fit, so the largest is at least that")
    return "\n".join(lines)


def _ratio(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3f}"


# ------------------------------------------------------------------ the command


def _device(config: TrainConfig) -> str:
    import torch

    return "cuda" if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()) else "cpu"


def largest_searches(config_path: Optional[str], overrides: Sequence[str], cap: int, by: str = "micro-batch",
                     limit: int = 64, placements: Optional[Sequence[str]] = None,
                     timeout_s: Optional[float] = None, out: Any = None) -> Dict[str, Any]:
    """Search each placement's largest size within ``cap`` (NOTE [Fits within a cap]).

    Args:
        config_path, overrides: the workload, as ``rok`` takes it (``host_throttle`` and
            such already among the overrides).
        cap: the device-memory cap in bytes.
        by: a key of :data:`SEARCH_BY`.
        limit: the largest size tried, in the search's units.
        placements: ``rok`` placements (default keep, recompute, offload-all, planner).
        timeout_s: each probe's limit (None: none).
        out: where the progress lines go (default stdout).

    Returns:
        ``{"cap_bytes", "by", "unit", "limit", "device", "enforced", "rows"}``.

    Raises:
        ConfigError: an unknown placement or ``by``, a cap or limit below 1.
    """
    import sys

    from ..peer_rule import PEER_BY_NAME
    from .rok import PEER_HOST_POOL, PEERS, PLACEMENTS

    out = sys.stdout if out is None else out
    names = list(placements or ["keep", "recompute", "offload-all", "planner"])
    known = {**PLACEMENTS, **PEERS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"rok: placements = {unknown} with --largest-within: each must be one of {sorted(known)}")
    if by not in SEARCH_BY:
        raise ConfigError(f"rok: --largest-by {by!r}: must be one of {sorted(SEARCH_BY)}")
    if not 1 <= cap <= MAX_BYTES:  # NOTE [Bounded numbers] in config/rules.py
        raise ConfigError(f"rok: --largest-within {cap}: must be a size > 0 and <= {MAX_BYTES} bytes (1 EiB), such "
                          "as 600MiB")
    if limit < 1:
        raise ConfigError(f"rok: --largest-limit {limit}: must be >= 1")
    config = load_config(TrainConfig, config_path, overrides)
    device = _device(config)
    pool = [] if any(o.startswith("offload.host_pool_bytes=") for o in overrides) else [
        f"offload.host_pool_bytes={PEER_HOST_POOL}"]
    searches: Dict[str, Optional[Search]] = {}
    skipped: Dict[str, str] = {}
    for name in names:
        if name == "planner" and not cap_supported():
            searches[name] = None
            skipped[name] = (f"needs offload.{CAP_FIELD}, the planner's capacity (not in this build): a planner "
                             "run without it would plan for an unlimited device")
            print(f"largest {name}: skipped: {skipped[name]}", file=out, flush=True)
            continue
        extra = [*known[name], *(pool if name in PEER_BY_NAME else [])]

        def probe(size: int, extra: List[str] = extra) -> Probe:
            return run_probe(config_path, [*overrides, *extra], by, size, cap, device, timeout_s)

        def said(p: Probe, number: int, name: str = name) -> None:
            print(f"largest {name}: {_probe_line(p, by)} [probe {number}]", file=out, flush=True)

        searches[name] = largest_within(probe, limit, on_probe=said)
    rows = largest_rows(searches, by, skipped)
    return {"cap_bytes": cap, "by": by, "unit": SEARCH_BY[by][1], "limit": limit * SEARCH_BY[by][1],
            "device": device, "enforced": cap_supported() and device == "cuda",
            "probe_bound": probe_bound(limit), "rows": rows}


def _probe_line(p: Probe, by: str) -> str:
    key, unit = SEARCH_BY[by]
    what = f"{'micro-batch' if by == 'micro-batch' else 'seq length'} {p.size * unit}"
    if p.fits:
        n = p.numbers
        tps = n.get("tokens_per_s")
        return (f"{what}: fits, peak {n['measured_peak_bytes'] / MiB:.1f} MiB of {n['cap_bytes'] / MiB:.1f}, "
                f"{'-' if tps is None else f'{tps:.0f}'} tokens/s")
    return f"{what}: {'does not fit' if p.fits is False else 'failed'}: {p.reason[:160]}"


def run_largest(config_path: Optional[str], overrides: Sequence[str], cap: str, by: str = "micro-batch",
                limit: int = 64, placements: Optional[Sequence[str]] = None, json_path: Optional[str] = None,
                throttle: Optional[str] = None, host_throttle: Optional[str] = None) -> int:
    """``megatron-ssd rok --largest-within CAP``: search, print the table, write the JSON
    (``{"largest": ..., "workload", "machine"}``). ``throttle`` and ``host_throttle`` pace
    every probe as they pace ``rok``'s runs."""
    import contextlib

    from ..config import _parse_size, to_dict
    from .output import machine_info, write_json
    from .rok import _throttle_for, host_throttle_overrides

    cap_bytes = _parse_size("rok", "largest-within", cap)
    common = list(overrides) + host_throttle_overrides(host_throttle)
    config = load_config(TrainConfig, config_path, common)  # validate before spending minutes
    load_tier_modules(config.offload.tier_modules)  # its plans may name their tiers (NOTE [Tiers])
    limiter = None if throttle is None else _throttle_for(config, throttle)
    with limiter.applied() if limiter is not None else contextlib.nullcontext():  # probes inherit the group
        result = largest_searches(config_path, common, cap_bytes, by=by, limit=limit, placements=placements)
    print(format_largest(result["rows"], by, cap_bytes, result["device"], result["enforced"]))
    if json_path:
        write_json(json_path, {"largest": result, "workload": to_dict(config), "machine": machine_info(),
                               "throttle_bytes_per_s": None if limiter is None else limiter.write_bps})
    return 0
