"""The ROK plot: peak memory against median step time, one marker per ``rok`` point.

``megatron-ssd rok --plot PATH`` draws it after measuring; a plot can be redrawn from the
JSON ``rok --json`` wrote, without running anything::

    python -m megatron_ssd.commands.rok_plot benchmarks/results/rok-gpt-ref-cpu.json out.png --title gpt-ref-cpu.yaml

One memory measure for the whole plot (:func:`memory_measure`), one marker shape and
colour per kind of placement (:data:`KINDS`, one legend entry each; the rules run at
several settings are joined by a line), and each point named by a label placed where it
overlaps no other label and no marker (:func:`place_labels`).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..errors import MegatronSSDError
from ..units import MiB
from ..peer_rule import PEER_BY_NAME, PEERS
from .dominance import BUDGET, KEEP_LAST, MEGATRON_FULL, MEGATRON_SELECTIVE

__all__ = ["KINDS", "budget_label", "point_label", "point_kind", "memory_measure", "draw_rok", "place_labels",
           "plot_rok"]

_PEER_MARKS = (("^", "C4"), ("v", "C5"), ("<", "C8"), (">", "C9"))
"""Markers and colours for the peers' rules (``peer_rule.PEERS``), in their order."""

KINDS: Dict[str, Tuple[str, str, str]] = {
    "fixed": ("keep / recompute / offload-all", "o", "C0"),
    "planner": ("planner", "*", "C3"),
    BUDGET: ("planner at a memory budget", "D", "C1"),
    KEEP_LAST: ("keep the last N layers (SSDTrain)", "s", "C2"),
    **{p.name: (p.title, *_PEER_MARKS[i % len(_PEER_MARKS)]) for i, p in enumerate(PEERS)},
    "megatron-recompute": ("Megatron's own recompute", "P", "C6"),
    "other": ("other", "X", "C7"),
}
"""Each kind of point: its legend entry, marker and colour, in legend order."""

CURVE_KINDS = (BUDGET, KEEP_LAST, *PEER_BY_NAME)
"""Kinds run at several settings: their points are joined in the order of the setting."""

MEASURES: Tuple[Tuple[str, str], ...] = (
    ("cuda", "CUDA memory allocated above the pre-forward level (MiB)"),
    ("allocator_peak_bytes", "peak live tensor bytes above the pre-forward level (MiB)"),
    ("peak_rss_above_base_bytes", "peak process RSS above the pre-forward level (MiB)"),
    ("peak_activation_bytes", "peak activation bytes, the cache's count (MiB)"),
)
"""The plot's memory measure, the first every point has: on a GPU CUDA's
``max_memory_allocated`` above the pre-forward level, elsewhere the allocator timeline's
live tensor bytes, then RSS, then the cache's own count (NOTE [Dominance] in
``dominance.py`` ranks them the same way)."""


def point_kind(name: str) -> str:
    """The :data:`KINDS` key of the ``rok`` point named ``name``."""
    if name == "planner":
        return "planner"
    if name in ("keep", "recompute", "offload-all"):
        return "fixed"
    if name in (MEGATRON_SELECTIVE, MEGATRON_FULL):
        return "megatron-recompute"
    for prefix in CURVE_KINDS:
        if name == prefix or name.startswith(prefix + "-"):
            return prefix
    return "other"


def _setting(name: str) -> Optional[float]:
    """The number after a curve point's prefix (``keep-last-5``: 5.0), None without one."""
    tail = name.rsplit("-", 1)[-1]
    try:
        return float(tail)
    except ValueError:
        return None


def _number(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".")


def budget_label(budget_bytes: int, keep_bytes: Optional[int] = None) -> str:
    """A budget point's label: ``"budget 648 MiB (0.5x keep)"``; without keep's peak (the
    cache's count, which budgets are fractions of) only the MiB."""
    mib = budget_bytes / MiB
    text = f"budget {mib:.0f} MiB" if mib >= 10 else f"budget {mib:.1f} MiB"
    if keep_bytes:
        text += f" ({_number(budget_bytes / keep_bytes)}x keep)"
    return text


def point_label(point: Dict[str, Any], keep_bytes: Optional[int] = None) -> str:
    """The label of ``point`` on the plot: a budget point's budget in MiB and as a fraction
    of ``keep_bytes``; any other point's placement name."""
    name = point["placement"]
    if point_kind(name) == BUDGET:
        budget = _setting(name)
        if budget is not None:
            return budget_label(int(budget), keep_bytes)
    return name


def _memory(point: Dict[str, Any], key: str) -> Optional[int]:
    if key == "cuda":
        if point.get("independent_peak_source") != "cuda_max_memory_allocated":
            return None
        return point.get("independent_peak_bytes")
    return point.get(key)


def memory_measure(points: Sequence[Dict[str, Any]]) -> Tuple[str, str]:
    """The first of :data:`MEASURES` that every measured point has: (key, axis label)."""
    measured = [p for p in points if "median_step_s" in p]
    for key, label in MEASURES:
        if all(_memory(p, key) is not None for p in measured):
            return key, label
    return MEASURES[-1]


def _overlap(a: Any, b: Any) -> float:
    """The area two display boxes share."""
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


_RING = ((1, 1, "left", "bottom"), (1, -1, "left", "top"), (-1, 1, "right", "bottom"), (-1, -1, "right", "top"),
         (0, 1.5, "center", "bottom"), (0, -1.5, "center", "top"), (1.5, 0, "left", "center"),
         (-1.5, 0, "right", "center"))
_DISTANCES = (6, 14, 24, 36, 50)  # points from the marker; beyond the first, a leader line joins them


def place_labels(ax: Any, anchors: Sequence[Tuple[float, float]], texts: Sequence[str],
                 marker_px: float = 5.0, fontsize: float = 8) -> List[Any]:
    """Annotate each anchor (data coordinates) with its text, each label where it overlaps
    no label placed before it, no marker and nothing outside the axes.

    Deterministic: the candidates are tried in a fixed order (the eight directions at
    :data:`_DISTANCES`), the first free one is taken, and where none is free the one that
    overlaps least. Call it once the axes' limits and position are final.

    Returns:
        The annotations, in the order of ``anchors``.
    """
    from matplotlib.transforms import Bbox

    renderer = ax.figure.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    pixels = ax.transData.transform(list(anchors)) if anchors else []
    taken = [Bbox.from_extents(x - marker_px, y - marker_px, x + marker_px, y + marker_px) for x, y in pixels]
    labels = []
    for anchor, text in zip(anchors, texts):
        best = None
        for distance in _DISTANCES:
            for dx, dy, ha, va in _RING:
                note = ax.annotate(text, anchor, xytext=(dx * distance, dy * distance), textcoords="offset points",
                                   ha=ha, va=va, fontsize=fontsize)
                box = note.get_window_extent(renderer)
                outside = box.width * box.height - _overlap(box, frame)
                cost = outside + sum(_overlap(box, t) for t in taken)
                note.remove()
                if best is None or cost < best[0]:
                    best = (cost, box, (dx * distance, dy * distance), ha, va, distance)
                if cost == 0:
                    break
            if best[0] == 0:
                break
        _, box, offset, ha, va, distance = best
        leader = None  # far from its marker, a thin line joins the label to it
        if distance > _DISTANCES[0]:
            leader = {"arrowstyle": "-", "color": "0.6", "linewidth": 0.6, "shrinkA": 1, "shrinkB": marker_px}
        labels.append(ax.annotate(text, anchor, xytext=offset, textcoords="offset points", ha=ha, va=va,
                                  fontsize=fontsize, arrowprops=leader))
        taken.append(box)
    return labels


def draw_rok(points: Sequence[Dict[str, Any]], title: str = "") -> Any:
    """The ROK figure of ``points`` (``rok_points``' list, or a ``rok --json`` file's
    ``points``); infeasible points, which have no step time, are left out.

    Returns:
        The matplotlib Figure (Agg backend); the caller saves and closes it.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key, axis_label = memory_measure(points)
    measured = [p for p in points if "median_step_s" in p and _memory(p, key) is not None]
    keep = next((p for p in points if p["placement"] == "keep"), None)
    keep_bytes = keep.get("peak_activation_bytes") if keep else None
    fig, ax = plt.subplots(figsize=(8.4, 4.8), dpi=120)
    by_kind: Dict[str, List[Dict[str, Any]]] = {}
    for p in measured:
        by_kind.setdefault(point_kind(p["placement"]), []).append(p)
    for kind, (label, marker, color) in KINDS.items():
        group = by_kind.get(kind, [])
        if not group:
            continue
        if kind == "fixed":  # the legend names the fixed placements drawn, no other
            drawn = {p["placement"] for p in group}
            label = " / ".join(n for n in ("keep", "recompute", "offload-all") if n in drawn)
        curve = kind in CURVE_KINDS and len(group) > 1
        if curve:  # joined in the order of the setting (budget, N, fraction)
            group = sorted(group, key=lambda p: (_setting(p["placement"]) is None, _setting(p["placement"]) or 0.0))
        ax.plot([p["median_step_s"] for p in group], [_memory(p, key) / MiB for p in group],
                linestyle="--" if curve else "none", linewidth=1, marker=marker, markersize=7, color=color,
                label=label)
    ax.margins(x=0.12, y=0.12)
    ax.set_xlabel("median step time (s)")
    ax.set_ylabel(axis_label)
    ax.set_title(title or "recompute / offload / keep")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    ax.set_xlim(ax.get_xlim())  # the labels below must not move the limits they were placed in
    ax.set_ylim(ax.get_ylim())
    place_labels(ax, [(p["median_step_s"], _memory(p, key) / MiB) for p in measured],
                 [point_label(p, keep_bytes) for p in measured])
    return fig


def plot_rok(points: Sequence[Dict[str, Any]], path: str, title: str = "") -> None:
    """Write :func:`draw_rok`'s figure of ``points`` to the PNG ``path``; say so."""
    import matplotlib.pyplot as plt

    fig = draw_rok(points, title)
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Redraw a ROK plot from a ``rok --json`` file."""
    parser = argparse.ArgumentParser(prog="python -m megatron_ssd.commands.rok_plot", description=main.__doc__)
    parser.add_argument("json", help="a file megatron-ssd rok --json wrote")
    parser.add_argument("png", help="the plot to write")
    parser.add_argument("--title", default="", help="the plot's title (default: the JSON file's name)")
    args = parser.parse_args(argv)
    with open(args.json, encoding="utf-8") as fh:
        data = json.load(fh)
    points = data.get("points") if isinstance(data, dict) else None
    if not isinstance(points, list):
        raise MegatronSSDError(f"rok_plot: {args.json}: has no 'points' list; must be a file megatron-ssd rok "
                               "--json wrote")
    plot_rok(points, args.png, title=args.title or os.path.basename(args.json))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
