"""The tables ``megatron-ssd train`` prints at the end of a run.

:func:`format_summary` lays out the phases' summaries (one column per phase: memory,
step time, bytes moved, wear) with the headline comparison under them;
:func:`format_drive_wear` adds the offload drives' SMART wear. The run that produces the
summaries is :mod:`.train`'s.
"""

from __future__ import annotations

from typing import Any, Dict, Sequence

from ..io.smart import PathWear
from ..units import TB, MiB
from .bench_io import wear_lines
from .steps import format_comparison

__all__ = ["format_summary", "format_drive_wear"]


def format_drive_wear(drives: Sequence[PathWear], assumed: float) -> str:
    """The offload drives' SMART wear after the run's table, as ``bench-io`` prints it, and
    whether the wear bound's ``drive_used_fraction`` is below what the drives report; empty
    when no offload path is on an NVMe drive (tmpfs, a virtual disk), whose wear no SMART
    log tells (the JSON's ``drive_wear`` still says why)."""
    if not any(d.drives for d in drives):
        return ""
    lines, used = wear_lines(drives)
    if used is not None and used > assumed:
        lines.append(f"  this run's wear bound assumed drive_used_fraction={assumed:g}: its drive lifetimes are "
                     "longer than the drives have left")
    return "\n".join(lines)


def format_summary(phases: Sequence[Dict[str, Any]]) -> str:
    """The summary table printed at the end of the job."""
    rows = [
        ("peak activation memory, cache count (MiB)", "peak_activation_bytes", 1 / MiB, "{:.1f}"),
        ("peak memory, measured (MiB)", "independent_peak_bytes", 1 / MiB, "{:.1f}"),
        ("  process RSS above start (MiB)", "peak_rss_above_base_bytes", 1 / MiB, "{:.1f}"),
        ("  allocator live tensors (MiB)", "allocator_peak_bytes", 1 / MiB, "{:.1f}"),
        ("  CUDA allocated above start (MiB)", "cuda_peak_allocated_above_base_bytes", 1 / MiB, "{:.1f}"),
        ("  CUDA reserved above start (MiB)", "cuda_peak_reserved_above_base_bytes", 1 / MiB, "{:.1f}"),
        ("process RSS at start (MiB)", "rss_base_bytes", 1 / MiB, "{:.0f}"),
        ("median step time (s)", "median_step_s", 1, "{:.3f}"),
        ("written per step (MiB)", "bytes_written_per_step", 1 / MiB, "{:.1f}"),
        ("read per step (MiB)", "bytes_read_per_step", 1 / MiB, "{:.1f}"),
        ("served from memory (MiB)", "bytes_forwarded_per_step", 1 / MiB, "{:.1f}"),
        ("writes cancelled (MiB)", "bytes_write_cancelled_per_step", 1 / MiB, "{:.1f}"),
        ("write bandwidth (MiB/s)", "write_bytes_per_s", 1 / MiB, "{:.0f}"),
        ("read bandwidth (MiB/s)", "read_bytes_per_s", 1 / MiB, "{:.0f}"),
        ("CPU time per step (s)", "cpu_s_per_step", 1, "{:.2f}"),
        ("  of it I/O threads (s)", "io_cpu_s_per_step", 1, "{:.2f}"),
        ("read stall per step (s)", "stall_s_per_step", 1, "{:.3f}"),
        ("write wait per step (s)", "write_wait_s_per_step", 1, "{:.3f}"),
        ("peak SSD footprint (MiB)", "peak_ssd_bytes", 1 / MiB, "{:.1f}"),
        # decimal TB, the unit of the drives' endurance ratings (TBW, DWPD x capacity)
        ("SSD writes per day (TB)", "ssd_bytes_written_per_day", 1 / TB, "{:.2f}"),
        ("failed writes kept in memory", "write_fallbacks", 1, "{:.0f}"),
        ("final loss", "final_loss", 1, "{:.4f}"),
    ]
    if any(p.get("drive_lifetime_years") is not None for p in phases):  # drive_tbw_bytes set, writes made
        at = next(i for i, r in enumerate(rows) if r[1] == "ssd_bytes_written_per_day") + 1
        rows.insert(at, ("projected drive lifetime (years)", "drive_lifetime_years", 1, "{:.1f}"))
    if any(p.get("peak_host_bytes") for p in phases):  # the host tier ran: its rows too
        rows[-2:-2] = [
            ("copied to host memory per step (MiB)", "bytes_to_host_per_step", 1 / MiB, "{:.1f}"),
            ("peak host pool (MiB)", "peak_host_bytes", 1 / MiB, "{:.1f}"),
        ]
    for tier in sorted({name for p in phases for name in p.get("tier_bytes_per_step") or {}}):  # NOTE [Tiers]
        rows.insert(-2, (f"moved to {tier} per step (MiB)", ("tier_bytes_per_step", tier), 1 / MiB, "{:.1f}"))
    names = [p["name"] for p in phases]
    width = max(len(r[0]) for r in rows) + 2
    colw = max(18, *(len(n) + 2 for n in names))
    lines = ["", "".ljust(width) + "".join(n.rjust(colw) for n in names)]
    for label, key, scale, fmt in rows:
        cells = []
        for p in phases:
            v = p.get(key) if isinstance(key, str) else (p.get(key[0]) or {}).get(key[1])
            cells.append(("-" if v is None else fmt.format(v * scale)).rjust(colw))
        lines.append(label.ljust(width) + "".join(cells))
    if len(phases) >= 2 and phases[0]["peak_activation_bytes"] and phases[-1].get("oom") is None:
        keep, off = phases[0], phases[-1]
        lines.append("\n" + format_comparison(keep, off))  # NOTE [Headline memory] in steps.py
    return "\n".join(lines)
