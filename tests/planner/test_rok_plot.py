"""The ROK plot (``megatron_ssd/commands/rok_plot.py``): budget labels a person reads, one
marker per point, one legend entry per kind of marker, labels that overlap nothing."""

from __future__ import annotations

import itertools
import json

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.text import Text  # noqa: E402
import pytest  # noqa: E402

from megatron_ssd.commands import rok_plot  # noqa: E402
from megatron_ssd.commands.rok_plot import budget_label, draw_rok, point_label  # noqa: E402
from megatron_ssd.errors import MegatronSSDError  # noqa: E402
from megatron_ssd.units import MiB  # noqa: E402

KEEP = 881395712  # keep's peak by the cache's count; the budgets below are fractions of it


def _point(name, step, live_mib, cache=100 * MiB):
    return {"placement": name, "median_step_s": step, "allocator_peak_bytes": int(live_mib * MiB),
            "peak_rss_above_base_bytes": 2 * int(live_mib * MiB), "peak_activation_bytes": cache}


def test_budget_points_are_labelled_in_mib_and_as_a_fraction_of_keep():
    """Before: the plot named them by their bytes, ``budget-679806976``."""
    assert budget_label(679806976, 2 * 679806976) == "budget 648 MiB (0.5x keep)"
    assert point_label({"placement": "budget-440697856"}, KEEP) == "budget 420 MiB (0.5x keep)"
    assert point_label({"placement": "budget-308488499"}, KEEP) == "budget 294 MiB (0.35x keep)"
    assert point_label({"placement": "budget-440697856"}) == "budget 420 MiB"
    assert budget_label(5 * MiB + MiB // 2, 11 * MiB) == "budget 5.5 MiB (0.5x keep)"
    assert point_label({"placement": "keep-last-5"}, KEEP) == "keep-last-5"
    assert point_label({"placement": "megatron-offload-0.5"}, KEEP) == "megatron-offload-0.5"


POINTS = [
    _point("keep", 2.0, 1770, cache=KEEP),
    _point("offload-all", 4.8, 930),
    _point("planner", 2.05, 1630),
    _point("keep-last-1", 4.4, 960),
    _point("keep-last-5", 2.8, 1320),
    _point("keep-last-3", 3.8, 1225),
    _point("budget-440697856", 2.7, 830),
    _point("budget-308488499", 2.8, 640),
    _point("budget-572907212", 2.6, 1015),
    _point("megatron-full", 4.2, 300),
    {"placement": "budget-10", "infeasible": "no plan meets it"},  # not drawn
]


def test_one_marker_per_point_and_one_legend_entry_per_kind_of_marker():
    """Before: three markers per point (live, RSS, cache count) and a legend of measures,
    not of what the points are."""
    fig = draw_rok(POINTS, "t")
    try:
        ax = fig.axes[0]
        assert len(ax.collections) == 0  # every marker is on a line below
        drawn = {(x, y) for line in ax.lines for x, y in zip(line.get_xdata(), line.get_ydata())}
        assert sum(len(line.get_xdata()) for line in ax.lines) == len(drawn) == 10
        assert drawn == {(p["median_step_s"], p["allocator_peak_bytes"] / MiB) for p in POINTS if "median_step_s" in p}
        legend = ax.get_legend()
        assert [t.get_text() for t in legend.get_texts()] == [
            "keep / offload-all", "planner", "planner at a memory budget", "keep the last N layers (SSDTrain)",
            "Megatron's own recompute"]
        assert [h.get_marker() for h in legend.legend_handles] == [line.get_marker() for line in ax.lines]
        assert len({line.get_marker() for line in ax.lines}) == len(ax.lines)  # one meaning per marker
        budgets = next(line for line in ax.lines if line.get_label() == "planner at a memory budget")
        assert list(budgets.get_ydata()) == [640, 830, 1015]  # a curve, in the order of the budget
        assert sorted(t.get_text() for t in ax.texts) == sorted([
            "keep", "offload-all", "planner", "keep-last-1", "keep-last-5", "keep-last-3",
            "budget 420 MiB (0.5x keep)", "budget 294 MiB (0.35x keep)", "budget 546 MiB (0.65x keep)",
            "megatron-full"])
        assert ax.get_ylabel() == "peak live tensor bytes above the pre-forward level (MiB)"
    finally:
        plt.close(fig)


def test_the_memory_axis_is_one_measure_for_every_point():
    gpu = [dict(p, independent_peak_source="cuda_max_memory_allocated", independent_peak_bytes=7 * MiB)
           for p in POINTS[:3]]
    assert rok_plot.memory_measure(gpu)[0] == "cuda"
    no_live = [dict(p, allocator_peak_bytes=None) if p["placement"] == "planner" else p for p in POINTS]
    assert rok_plot.memory_measure(no_live)[0] == "peak_rss_above_base_bytes"


def test_labels_overlap_neither_each_other_nor_a_marker_nor_leave_the_axes():
    """A crowd of points a few pixels apart, like the peers' run (before, their labels were
    drawn on top of each other)."""
    crowd = [_point(f"budget-{(400 + 20 * i) * MiB}", 4.0 + 0.03 * (i % 4), 1000 + 25 * i) for i in range(10)]
    points = [_point("keep", 3.0, 1800, cache=2000 * MiB), _point("megatron-full", 4.2, 300),
              _point("te-offload-2", 4.1, 1400), _point("te-offload-4", 4.8, 1000), *crowd]
    fig = draw_rok(points, "crowd")
    try:
        ax = fig.axes[0]
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        boxes = [Text.get_window_extent(t, renderer) for t in ax.texts]  # the text, not its leader line
        assert len(boxes) == len(points)
        for a, b in itertools.combinations(boxes, 2):
            assert rok_plot._overlap(a, b) == 0, (a, b)
        frame = ax.get_window_extent(renderer)
        markers = ax.transData.transform([(p["median_step_s"], p["allocator_peak_bytes"] / MiB) for p in points])
        for box in boxes:
            assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            for x, y in markers:
                assert not (box.x0 - 4 < x < box.x1 + 4 and box.y0 - 4 < y < box.y1 + 4), (box, x, y)
    finally:
        plt.close(fig)


def test_a_plot_is_redrawn_from_a_rok_json_file(tmp_path, capsys):
    data = tmp_path / "rok.json"
    data.write_text(json.dumps({"points": POINTS, "rounds": 1}))
    out = tmp_path / "plots" / "rok.png"
    assert rok_plot.main([str(data), str(out), "--title", "gpt-ref-cpu.yaml"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out == f"wrote {out}\n"
    data.write_text(json.dumps({"workload": {}}))
    with pytest.raises(MegatronSSDError, match=r"^megatron_ssd: rok_plot: .*rok.json: has no 'points' list"):
        rok_plot.main([str(data), str(out)])
