"""The GPU check's results: one entry per part, merged into ``gpu-check.json``, and the
one-screen summary (``scripts/gpu_check.sh``; docs/getting-started.md, "GPU check").

A part's entry::

    {"name": "bench-io", "status": "passed", "reason": "", "numbers": {...}, "seconds": 21.4}

``status`` is ``passed``, ``failed`` or ``skipped``, and ``reason`` says why a part failed
or was skipped (never empty then). Each part writes its entry to a file of its own in the
run's work folder (:func:`write_part`); ``gpu_check.sh`` appends how long each part ran to
``timings.tsv`` there, and :func:`merge` joins both, in the order the parts ran.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from typing import Any, Dict, List, Optional

from megatron_ssd.errors import MegatronSSDError
from megatron_ssd.units import GiB, MiB

__all__ = ["STATUSES", "NO_CUDA", "part", "write_part", "read_part", "record", "parse_junit", "pytest_part",
           "merge", "format_summary", "exit_status"]

STATUSES = ("passed", "failed", "skipped")
NO_CUDA = "no CUDA device visible"
"""The reason every GPU part gives for skipping on a machine without one."""


def part(name: str, status: str, reason: str = "", **numbers: Any) -> Dict[str, Any]:
    """One part's entry; ``reason`` is required unless the part passed.

    Raises:
        MegatronSSDError: an unknown status, or a failed or skipped part without a reason.
    """
    if status not in STATUSES:
        raise MegatronSSDError(f"megatron_ssd: gpu-check part {name!r}: status = {status!r}: must be one of {STATUSES}")
    if status != "passed" and not reason.strip():
        raise MegatronSSDError(f"megatron_ssd: gpu-check part {name!r}: status = {status!r} needs a reason")
    return {"name": name, "status": status, "reason": reason, "numbers": numbers}


def write_part(path: str, entry: Dict[str, Any]) -> None:
    """Write ``entry`` to ``path`` whole (a temporary file renamed over it)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(entry, fh, indent=2, default=str)
    os.replace(tmp, path)


def finish_part(path: str, entry: Dict[str, Any], table: str = "") -> int:
    """A part's last step: write ``entry`` to ``path``, print ``table`` (if any) and the
    part's status line; exit status 0 (the check's own comes from the summary)."""
    write_part(path, entry)
    if table:
        print(table, flush=True)
    print(f"{entry['name']}: {entry['status']}" + (f": {entry['reason']}" if entry["reason"] else ""), flush=True)
    return 0


def import_problem(code: str, timeout_s: float) -> Optional[str]:
    """None when ``code`` (imports) runs in a fresh interpreter within ``timeout_s``, else
    why not, to follow the thing imported: ``took more than N s`` or ``failed: <the last
    line it printed to stderr>``."""
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"took more than {timeout_s:.0f} s"
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        return "failed: " + (lines[-1][:300] if lines else f"exit {proc.returncode}")
    return None


def read_part(path: str) -> Dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def record(path: str, name: str, status: str, reason: str) -> Dict[str, Any]:
    """Set a part's status from outside it (a timeout, a crash, a skip, the install).

    A result the part wrote before it was stopped keeps its numbers, under the new status
    and reason (a train part killed at its timeout keeps the placements it finished).
    """
    numbers = read_part(path).get("numbers", {}) if os.path.exists(path) else {}
    entry = part(name, status, reason, **numbers)
    write_part(path, entry)
    return entry


# ------------------------------------------------------------------ pytest


def parse_junit(path: str) -> Dict[str, Any]:
    """Counts of a pytest ``--junitxml`` file: passed, failed, errors, skipped, each skip
    reason with its count, and each failure's test id and first message line."""
    root = ET.parse(path).getroot()
    counts: Counter = Counter()
    reasons: Counter = Counter()
    failures: List[Dict[str, str]] = []
    for case in root.iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "errors"
                message = (child.get("message") or child.text or "").strip().splitlines()
                failures.append({"test": test, "outcome": child.tag, "message": (message or [""])[0][:300]})
            elif child.tag == "skipped":
                outcome = "skipped"
                reasons[_skip_reason(child.get("message") or "")] += 1
        counts[outcome] += 1
    return {"passed": counts["passed"], "failed": counts["failed"], "errors": counts["errors"],
            "skipped": counts["skipped"], "skip_reasons": dict(reasons.most_common()), "failures": failures}


def _skip_reason(message: str) -> str:
    """pytest writes ``file.py:12: <reason>`` for a skip raised in a test body; keep the reason."""
    head, sep, tail = message.partition(": ")
    return tail if sep and ".py:" in head else message


def pytest_part(name: str, junit: str, rc: int, what: str) -> Dict[str, Any]:
    """The entry of a pytest run (``what`` names the tests) from its junit XML and exit status.

    Failed when a test failed or errored, when pytest exited non-zero without saying why
    in the XML, or when no test passed (every test skipped or deselected is no check).
    """
    if not os.path.exists(junit):
        return part(name, "failed", f"pytest exited {rc} without writing {os.path.basename(junit)}; see the log",
                    tests=what)
    counts = parse_junit(junit)
    numbers = {"tests": what, "exit_status": rc, **counts}
    bad = counts["failed"] + counts["errors"]
    if bad:
        names = ", ".join(f["test"].rsplit("::", 1)[-1] for f in counts["failures"][:3])
        return part(name, "failed", f"{bad} of {what} failed or errored ({names}{', ...' if bad > 3 else ''})",
                    **numbers)
    if rc not in (0, 5):
        return part(name, "failed", f"pytest exited {rc} (interrupted or a usage error); see the log", **numbers)
    if not counts["passed"]:
        reasons = "; ".join(f"{r} ({n})" for r, n in counts["skip_reasons"].items()) or "none collected"
        return part(name, "failed", f"no test of {what} passed: {reasons}", **numbers)
    return part(name, "passed", **numbers)


# ------------------------------------------------------------------ merging


def _timings(work: str) -> Dict[str, Dict[str, Any]]:
    """``timings.tsv``: one line per part, name, seconds, timeout (0: none) and exit status."""
    found: Dict[str, Dict[str, Any]] = {}
    path = os.path.join(work, "timings.tsv")
    if not os.path.exists(path):
        return found
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            fields = line.rstrip("\n").split("\t")
            if len(fields) == 4:
                name, seconds, timeout, rc = fields
                found[name] = {"seconds": float(seconds), "timeout_s": float(timeout) or None, "exit_status": int(rc)}
    return found


def merge(work: str, out: str, meta: Dict[str, Any]) -> Dict[str, Any]:
    """Join the parts of ``work`` (files ``NN-name.json``, in ``NN`` order) with their
    timings and ``meta`` into ``out/gpu-check.json``; return the report."""
    timings = _timings(work)
    parts = []
    for name in sorted(f for f in os.listdir(work) if f.endswith(".json") and f[:2].isdigit()):
        entry = read_part(os.path.join(work, name))
        entry.update(timings.get(entry["name"], {}))
        parts.append(entry)
    counts = Counter(p["status"] for p in parts)
    report = {
        **meta,
        "status": "failed" if counts["failed"] else "passed",
        "counts": {s: counts[s] for s in STATUSES},
        "parts": parts,
    }
    os.makedirs(out, exist_ok=True)
    write_part(os.path.join(out, "gpu-check.json"), report)
    return report


def exit_status(report: Dict[str, Any]) -> int:
    """0 when no part failed, 1 otherwise."""
    return 1 if report["counts"]["failed"] else 0


# ------------------------------------------------------------------ the summary


def _rate(n: Optional[float]) -> str:
    if not n:
        return "-"
    return f"{n / GiB:.1f} GiB/s" if n >= GiB else f"{n / MiB:.0f} MiB/s"


def _mib(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / MiB:.1f}"


def _num(n: Optional[float], fmt: str) -> str:
    return "-" if n is None or (isinstance(n, float) and math.isnan(n)) else format(n, fmt)


def _part_line(p: Dict[str, Any]) -> str:
    """What one part says in the summary: its reason when not passed, else its headline."""
    n = p.get("numbers", {})
    detail = p["reason"]
    if p["status"] == "passed":
        if p["name"] == "copy-bandwidth":
            detail = (f"D2H {_rate(n.get('d2h_best_bytes_per_s'))}, H2D {_rate(n.get('h2d_best_bytes_per_s'))} "
                      f"(pinned, {_mib(n.get('bytes'))} MiB, best of {n.get('repeats')})")
        elif p["name"] == "bench-io":
            detail = (f"{n.get('path')}: write {_rate(n.get('best_write_bytes_per_s'))}, read "
                      f"{_rate(n.get('best_read_bytes_per_s'))} (best of {len(n.get('results', []))} settings, "
                      f"{_mib(n.get('bytes'))} MiB each)")
        elif p["name"].startswith("pytest"):
            detail = f"{n.get('passed')} passed, {n.get('skipped')} skipped"
        else:  # the part's own one-line headline (install, environment, train, pretrain, ...)
            detail = n.get("headline", "")
    seconds = p.get("seconds")
    took = f"{seconds:5.0f} s" if seconds is not None else "      "
    return f"  {p['name']:<16}{p['status']:<9}{took}  {detail}"


def _train_table(n: Dict[str, Any]) -> List[str]:
    rows = n.get("placements") or []
    if not rows:
        return []
    lines = [f"train: {n.get('workload', '')}; peak = CUDA max_memory_allocated above the pre-forward level; "
             "start = allocated when a step starts, above that level; paired x = CUDA-event step ratio to keep",
             f"  {'placement':<16}{'peak MiB':>10}{'start MiB':>11}{'step s':>9}{'x keep':>8}{'paired x':>10}{'written MiB':>13}"
             f"{'read MiB':>10}{'pred/meas step':>16}{'pred/meas peak':>16}  losses"]
    for r in rows:
        if r["status"] != "passed":
            lines.append(f"  {r['placement']:<16}{r['status']}: {r['reason'][:90]}")
            continue
        losses = "same" if r.get("losses_identical_to_keep") else ("DIFFER" if r.get("losses_identical_to_keep") is False
                                                                   else "-")
        lines.append(
            f"  {r['placement']:<16}{_mib(r.get('cuda_peak_allocated_above_base_bytes')):>10}"
            f"{_mib(r.get('cuda_step_start_above_base_bytes')):>11}"
            f"{_num(r.get('median_step_s'), '.3f'):>9}{_num(r.get('x_keep'), '.3f'):>8}"
            f"{_num(r.get('paired_x_keep'), '.3f'):>10}{_mib(r.get('bytes_written')):>13}{_mib(r.get('bytes_read')):>10}"
            f"{_num(r.get('predicted_over_measured_step'), '.3f'):>16}"
            f"{_num(r.get('predicted_over_measured_peak'), '.3f'):>16}  {losses}")
    return lines


def format_summary(report: Dict[str, Any]) -> str:
    """The one-screen summary: the verdict, one line per part, the training table."""
    c = report["counts"]
    lines = [f"megatron-ssd GPU check: {report['status'].upper()} ({c['passed']} passed, {c['failed']} failed, "
             f"{c['skipped']} skipped) in {report.get('elapsed_s', 0):.0f} s of a {report.get('budget_s', 0):.0f} s "
             f"budget; mode {report.get('mode')}"]
    skipped_for_cuda = [p["name"] for p in report["parts"] if p["status"] == "skipped" and NO_CUDA in p["reason"]]
    if report.get("mode") != "gpu":
        lines.append(f"NO GPU: {len(skipped_for_cuda)} parts skipped ({NO_CUDA}): {', '.join(skipped_for_cuda)}; "
                     "this run checked the script, not the GPU paths")
    lines += [_part_line(p) for p in report["parts"]]
    train = next((p for p in report["parts"] if p["name"] == "train"), None)
    if train is not None:
        lines += _train_table(train.get("numbers", {}))
    for p in report["parts"]:  # a part's own table (the job part's rows and gates)
        lines += p.get("numbers", {}).get("summary_lines") or []
    out = report.get("out")
    if out:
        lines.append(f"wrote {os.path.join(out, 'gpu-check.json')} and {os.path.join(out, 'gpu-check.log')}")
    return "\n".join(lines)
