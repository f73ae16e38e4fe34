"""The job part's gates and its table (:mod:`.gpu_check_job`): pure functions over its rows.

A row is one run of one placement under one cap (or a status: out of memory, skipped,
inferred from another run). The gates say what the runs must show (docs/getting-started.md,
"GPU check"):

- ``within-cap``: every planner run stayed within its cap, by ``max_memory_allocated``
  (on a CPU, by the allocator timeline's live tensor bytes);
- ``no-slower-than-peer``: at each peer's measured peak, the planner's step is no slower
  than the peer's (NOTE [Planner against a peer]);
- ``recompute-below-keep``: this project's recompute peaked below keep;
- ``prediction``: keep's, recompute's and each planner run's predicted step and peak are
  within :data:`TOLERANCE` of the measured ones;
- ``profile-saved``: each planner run's profile is in the JSON, so a miss can be replayed.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from megatron_ssd.units import MiB
from megatron_ssd.commands.intervals import median_ci95

__all__ = ["TOLERANCE", "PEER_NAMES", "PLANNER", "gates", "gate_counts", "job_table"]

TOLERANCE = 0.10
"""How far a prediction may be from the measurement: 10%."""

PEER_NAMES = ("recompute", "megatron-full", "megatron-selective", "megatron-offload")
"""The placements the planner must match or beat at their measured peak."""

PLANNER = "planner-host"
"""The planner run the peers are compared with: the planner with the host tier."""


def _gate(name: str, status: str, detail: str, **numbers: Any) -> Dict[str, Any]:
    return {"gate": name, "status": status, "detail": detail, **numbers}


def _mib(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / MiB:.1f} MiB"


def _label(row: Dict[str, Any]) -> str:
    return f"{row['placement']} @{row['cap']}" if row.get("cap") not in (None, "none") else row["placement"]


def _ran(row: Dict[str, Any]) -> bool:
    return row.get("status") in ("ran", "inferred") and row.get("measured_peak_bytes") is not None


def _within_cap(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    out = []
    for r in rows:
        if not r["placement"].startswith("planner") or r.get("cap_bytes") is None or r.get("status") == "inferred":
            continue
        if r["status"] == "skipped":
            out.append(_gate("within-cap", "not checked", f"{_label(r)}: {r['reason']}"))
        elif r["status"] != "ran":
            out.append(_gate("within-cap", "failed", f"{_label(r)}: {r['status']}: {r['reason'][:200]}"))
        else:
            ok = r["measured_peak_bytes"] <= r["cap_bytes"]
            out.append(_gate("within-cap", "passed" if ok else "failed",
                             f"{_label(r)}: {_mib(r['measured_peak_bytes'])} {'<=' if ok else '>'} the cap "
                             f"{_mib(r['cap_bytes'])} ({r['measured_peak_source']})"))
    return out


def _interval(row: Dict[str, Any]) -> List[float]:
    times = row.get("step_times") or [row["step_time"]]
    return median_ci95(list(times)) if len(times) > 1 else [times[0], times[0]]


# NOTE [Planner against a peer]: a peer's run under a cap is compared with the planner run
# under the same cap when that run peaked at no more than the peer did (the planner then
# ran in the peer's memory or less); otherwise with the planner run capped at the peer's
# measured peak, when one ran. Paired steps (keep and the plan in one process) cannot run
# where keep does not fit the cap, so the steps compared are each run's own median: CUDA
# events on a GPU, wall time elsewhere. The planner is no slower when its median is at most
# the peer's, or when the two medians' 95% intervals overlap (within noise, said so); it
# fails only when its whole interval lies above the peer's.


def _no_slower(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    out = []
    for peer in rows:
        if peer["placement"] not in PEER_NAMES or peer.get("cap_bytes") is None or peer.get("fits") is not True:
            continue
        if peer.get("status") == "inferred":  # the run it stands for is compared under its own cap
            continue
        same = next((r for r in rows if r["placement"] == PLANNER and r.get("cap") == peer["cap"] and _ran(r)
                     and r.get("fits")), None)
        matched = next((r for r in rows if r["placement"] == PLANNER and r.get("matches") == peer["placement"]
                        and _ran(r) and r.get("fits")), None)
        planner = same if same is not None and same["measured_peak_bytes"] <= peer["measured_peak_bytes"] else matched
        if planner is None:
            why = (f"the planner @{peer['cap']} held {_mib(same['measured_peak_bytes'])}, more than the peer's "
                   f"{_mib(peer['measured_peak_bytes'])}, and no planner run at the peer's peak fit" if same
                   else f"no planner run @{peer['cap']} fit the cap")
            out.append(_gate("no-slower-than-peer", "not checked", f"{_label(peer)}: {why}"))
            continue
        p_lo, p_hi = _interval(planner)
        q_lo, q_hi = _interval(peer)
        faster = planner["step_time"] <= peer["step_time"]
        status = "passed" if faster or p_lo <= q_hi else "failed"
        how = "no slower" if faster else "within noise" if status == "passed" else "slower beyond noise"
        out.append(_gate("no-slower-than-peer", status,
                         f"{_label(peer)}: {_label(planner)} at {_mib(planner['measured_peak_bytes'])} steps "
                         f"{planner['step_time']:.4f} s (95% {p_lo:.4f}-{p_hi:.4f}) against {peer['step_time']:.4f} s "
                         f"(95% {q_lo:.4f}-{q_hi:.4f}) at {_mib(peer['measured_peak_bytes'])}: {how}",
                         planner=_label(planner), peer=_label(peer), timing=peer.get("step_timing")))
    return out


def _recompute_below_keep(rows: Sequence[Dict[str, Any]], keep: Optional[Dict[str, Any]]) -> List[Dict[str, Any]]:
    recompute = next((r for r in rows if r["placement"] == "recompute" and _ran(r)), None)
    if keep is None or recompute is None:
        return [_gate("recompute-below-keep", "not checked", "keep or recompute did not run")]
    a, b = recompute.get("peak_above_base_bytes"), keep.get("peak_above_base_bytes")
    ok = a is not None and b is not None and a < b
    return [_gate("recompute-below-keep", "passed" if ok else "failed",
                  f"{_label(recompute)}: {_mib(a)} above the pre-forward level, keep {_mib(b)}")]


def _predictions(rows: Sequence[Dict[str, Any]], keep: Optional[Dict[str, Any]]) -> List[Dict[str, Any]]:
    chosen = [keep] if keep is not None else []
    chosen += [r for r in rows if r.get("status") == "ran" and
               (r["placement"] == "recompute" or r["placement"].startswith("planner"))]
    out = []
    for r in chosen:
        step, peak = r.get("predicted_over_measured_step"), r.get("predicted_over_measured_peak")
        if step is None or peak is None:
            out.append(_gate("prediction", "not checked", f"{_label(r)}: no prediction (no planner profile to "
                                                          "predict it from)"))
            continue
        ok = abs(step - 1) <= TOLERANCE and abs(peak - 1) <= TOLERANCE
        out.append(_gate("prediction", "passed" if ok else "failed",
                         f"{_label(r)}: predicted/measured step {step:.3f}, peak {peak:.3f} (within "
                         f"{TOLERANCE:.0%}: {'yes' if ok else 'no'})"))
    return out


def _profiles(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    out = []
    for r in rows:
        if r["placement"].startswith("planner") and r.get("status") == "ran":
            ok = bool(r.get("profile"))
            out.append(_gate("profile-saved", "passed" if ok else "failed",
                             f"{_label(r)}: {'profile and plan in the JSON' if ok else 'its report has no profile'}"))
    return out


def gates(rows: Sequence[Dict[str, Any]], keep: Optional[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Every gate over the job's rows; ``keep`` is the uncapped keep row (or None)."""
    return [*_within_cap(rows), *_no_slower(rows), *_recompute_below_keep(rows, keep), *_predictions(rows, keep),
            *_profiles(rows)]


def gate_counts(found: Sequence[Dict[str, Any]]) -> Dict[str, int]:
    """How many gates passed, failed and were not checked."""
    return {s: sum(g["status"] == s for g in found) for s in ("passed", "failed", "not checked")}


def _num(x: Optional[float], fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def job_table(numbers: Dict[str, Any]) -> List[str]:
    """The summary's lines for the job part: one per row, then one per gate."""
    rows = numbers.get("rows") or []
    if not rows:
        return []
    lines = [f"job: {numbers.get('workload', '')}; caps {numbers.get('caps_text', '')}; peak = "
             f"{numbers.get('peak_measure', '')}; step = {numbers.get('step_measure', '')}",
             f"  {'placement':<20}{'cap':>7}  {'status':<15}{'fits':>5}{'peak MiB':>10}{'step s':>9}{'x keep':>8}"
             f"{'pred/meas step':>16}{'pred/meas peak':>16}"]
    for r in rows:
        head = f"  {r['placement']:<20}{r.get('cap', ''):>7}  {r['status']:<15}"
        if not _ran(r):
            lines.append(head + r.get("reason", "")[:100])
            continue
        head += f"{ {True: 'yes', False: 'no'}.get(r.get('fits'), '-'):>5}"
        lines.append(head + f"{r['measured_peak_bytes'] / MiB:>10.1f}{_num(r.get('step_time'), '.4f'):>9}"
                     f"{_num(r.get('x_keep_step'), '.3f'):>8}{_num(r.get('predicted_over_measured_step'), '.3f'):>16}"
                     f"{_num(r.get('predicted_over_measured_peak'), '.3f'):>16}"
                     + (f"  ({r['reason'][:60]})" if r.get("reason") else ""))
    found = numbers.get("gates") or []
    counts = gate_counts(found)
    lines.append(f"job gates ({'enforced' if numbers.get('gates_enforced') else 'reported, not enforced: '}"
                 f"{numbers.get('gates_note', '')}): {counts['passed']} passed, {counts['failed']} failed, "
                 f"{counts['not checked']} not checked")
    lines += [f"  {g['status']:<12}{g['gate']:<22}{g['detail'][:150]}" for g in found]
    return lines
