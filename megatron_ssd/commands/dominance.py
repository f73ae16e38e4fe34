"""Which planner points of a ``rok`` run dominate which fixed placements (NOTE [Dominance]).

Pure functions over the points ``rok_points`` builds: no runs, no I/O.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..config import MEGATRON_OFFLOAD, TE_OFFLOAD  # noqa: F401 - the rok placements of the peers' rules
from ..peer_rule import PEER_BY_NAME

__all__ = ["BUDGET", "CURVE_PREFIXES", "FIXED", "KEEP_LAST", "MEGATRON_FULL", "MEGATRON_OFFLOAD", "MEGATRON_SELECTIVE",
           "TE_OFFLOAD", "add_dominance", "format_dominance"]

KEEP_LAST = "keep-last"
"""The ``rok`` placement that keeps the last ``offload.keep_last_layers`` layers and
offloads the others (SSDTrain's static choice); with ``--keep-last N,N`` it runs once per
N, one point ``keep-last-<N>`` each, so the rule is a curve, not one arbitrary N."""

BUDGET = "budget"
"""The ``rok`` placement that runs the planner with memory budgets (fractions of keep's
peak; one point ``budget-<bytes>`` each). It needs ``keep``, which measures that peak."""

MEGATRON_SELECTIVE = "megatron-selective"
"""Megatron's own selective recompute of core attention, run by megatron-core."""
MEGATRON_FULL = "megatron-full"
"""Megatron's own full recompute (uniform, one layer per checkpoint), run by megatron-core."""


# NOTE [Dominance]: a planner point dominates a fixed placement when it holds less memory
# at no more step time. Memory is, on a GPU, CUDA's max_memory_allocated above the
# pre-forward level (the activations live there; the allocator timeline counts host
# tensors only); elsewhere the allocator's peak of live tensor bytes (the ROK plot's axis,
# NOTE [Independent memory] in train.py), or RSS above the pre-forward level when a point
# has no allocator peak; the cache's own count and RSS are recorded beside it. Step time is the paired ratio to keep when both points have pairs (NOTE [Paired
# steps]: each ratio is taken against keep steps seconds apart, the drift of minutes
# cancels), else the fresh-process ratio. Medians are compared; each entry keeps both
# points' 95% intervals, so a reader can see whether the margin is beyond noise.
FIXED = ("recompute", "offload-all", MEGATRON_SELECTIVE, MEGATRON_FULL)
"""The fixed placements a planner point is compared with, beside every point of the
rules run at several settings (:data:`CURVE_PREFIXES`)."""

CURVE_PREFIXES = (KEEP_LAST, *PEER_BY_NAME)
"""Fixed rules measured at one or more settings: ``keep-last``, ``keep-last-N``, ..."""


def _is_fixed(name: str) -> bool:
    return name in FIXED or name.startswith(CURVE_PREFIXES)


def _is_planned(name: str) -> bool:
    return name == "planner" or name.startswith(BUDGET + "-")


def _memory(p: Dict[str, Any]) -> Tuple[str, Optional[int]]:
    if p.get("independent_peak_source") == "cuda_max_memory_allocated" and p.get("independent_peak_bytes"):
        return "cuda_allocated", p["independent_peak_bytes"]
    if p.get("allocator_peak_bytes") is not None:
        return "live", p["allocator_peak_bytes"]
    return "rss_above_base", p.get("peak_rss_above_base_bytes")


def add_dominance(points: List[Dict[str, Any]]) -> None:
    """Compare each planner point (``planner``, ``budget-*``) with each fixed placement
    measured beside it (NOTE [Dominance]): ``p["dominance"]`` has one entry per fixed
    point, and ``p["dominates"]`` names those it holds less memory than at no more step
    time."""
    fixed = [q for q in points if _is_fixed(q["placement"]) and "x_keep" in q]
    for p in points:
        if not _is_planned(p["placement"]) or "x_keep" not in p:
            continue
        entries = []
        for q in fixed:
            (kind, mem_p), (kind_q, mem_q) = _memory(p), _memory(q)
            if kind != kind_q or not mem_p or not mem_q:
                continue
            paired = "paired_x_keep" in p and "paired_x_keep" in q
            key = "paired_x_keep" if paired else "x_keep"
            interval = "paired_x_keep_ci95" if paired else "x_keep_ci95"
            entries.append({
                "over": q["placement"],
                "memory": kind,
                "memory_ratio": mem_p / mem_q,
                "cache_ratio": p["peak_activation_bytes"] / q["peak_activation_bytes"],
                "rss_ratio": _ratio(p.get("peak_rss_above_base_bytes"), q.get("peak_rss_above_base_bytes")),
                "time": "paired" if paired else "fresh",
                "time_ratio": p[key] / q[key],
                "x_keep": [p[key], q[key]],
                "x_keep_ci95": [p.get(interval), q.get(interval)],
                "dominates": mem_p < mem_q and p[key] <= q[key],
            })
        p["dominance"] = entries
        p["dominates"] = [e["over"] for e in entries if e["dominates"]]


def _ratio(a: Optional[int], b: Optional[int]) -> Optional[float]:
    return a / b if a and b else None


def format_dominance(points: Sequence[Dict[str, Any]]) -> str:
    """One line per planner point and fixed placement: memory and step-time ratios, and
    whether the planner point dominates (NOTE [Dominance])."""
    lines = []
    for p in points:
        for e in p.get("dominance", []):
            verdict = "dominates" if e["dominates"] else (
                "less memory, more time" if e["memory_ratio"] < 1 else "more memory")
            lines.append(f"{p['placement']} vs {e['over']}: {e['memory']} memory {e['memory_ratio']:.2f}x, "
                         f"step {e['time_ratio']:.3f}x ({e['time']}): {verdict}")
    return "\n".join(lines)
