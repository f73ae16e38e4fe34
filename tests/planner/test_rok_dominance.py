"""``rok --keep-last N,N`` (keep-last as a curve) and the dominance of planner points
over the fixed placements (NOTE [Dominance] in ``megatron_ssd/commands/dominance.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_ssd.commands.dominance import add_dominance, format_dominance
from megatron_ssd.commands.rok import rok_points
from megatron_ssd.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "configs", "gpt-tiny.yaml")
TINY_CLI = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=64",
            "model.vocab_size=256", "micro_batch_size=2", "offload.min_tensor_bytes=4096"]


def _point(name, live, step, paired=None, cache=100, rss=500):
    p = {"placement": name, "allocator_peak_bytes": live, "peak_activation_bytes": cache,
         "peak_rss_above_base_bytes": rss, "x_keep": step, "x_keep_ci95": [step - 0.05, step + 0.05]}
    if paired is not None:
        p["paired_x_keep"], p["paired_x_keep_ci95"] = paired, [paired - 0.02, paired + 0.02]
    return p


def test_dominance_compares_live_memory_and_paired_time_with_each_fixed_point():
    points = [
        _point("keep", 1000, 1.0),
        _point("offload-all", 600, 1.50, paired=1.50, cache=300),
        _point("keep-last-5", 800, 1.30, paired=1.10, cache=550),
        _point("keep-last-2", 650, 1.45, paired=1.40, cache=350),
        _point("recompute", 700, 1.60, cache=70),  # no pairs: compared on fresh ratios
        _point("budget-300", 500, 1.35, paired=1.30, cache=300, rss=450),
        _point("planner", 900, 1.00, paired=1.00, cache=700),
    ]
    add_dominance(points)
    by = {p["placement"]: p for p in points}
    assert "dominance" not in by["keep"] and "dominance" not in by["offload-all"]
    budget = {e["over"]: e for e in by["budget-300"]["dominance"]}
    assert list(budget) == ["offload-all", "keep-last-5", "keep-last-2", "recompute"]
    # below offload-all in live bytes, faster in pairs; same cache count does not matter
    assert budget["offload-all"]["dominates"] and budget["offload-all"]["cache_ratio"] == 1.0
    assert budget["offload-all"]["memory_ratio"] == 500 / 600 and budget["offload-all"]["time"] == "paired"
    assert budget["offload-all"]["rss_ratio"] == 450 / 500
    # less memory than keep-last-5 but slower in pairs (though faster fresh): not dominated
    assert not budget["keep-last-5"]["dominates"]
    assert budget["keep-last-5"]["time_ratio"] == pytest.approx(1.30 / 1.10)
    assert budget["keep-last-5"]["x_keep_ci95"] == [[1.28, 1.32], [1.08, 1.12]]
    assert budget["keep-last-2"]["dominates"]
    assert budget["recompute"]["time"] == "fresh" and budget["recompute"]["dominates"]
    assert by["budget-300"]["dominates"] == ["offload-all", "keep-last-2", "recompute"]
    assert by["planner"]["dominates"] == []  # fastest, but more memory than every fixed point
    text = format_dominance(points)
    assert "budget-300 vs offload-all: live memory 0.83x, step 0.867x (paired): dominates" in text
    assert "budget-300 vs keep-last-5: live memory 0.62x, step 1.182x (paired): less memory, more time" in text
    assert "planner vs keep-last-5: live memory 1.12x, step 0.909x (paired): more memory" in text


def test_dominance_falls_back_to_rss_without_an_allocator_peak():
    points = [_point("offload-all", None, 1.5), _point("budget-1", None, 1.2, rss=400)]
    add_dominance(points)
    (entry,) = points[1]["dominance"]
    assert entry["memory"] == "rss_above_base" and entry["memory_ratio"] == 400 / 500
    assert entry["dominates"] and entry["time"] == "fresh"


@pytest.mark.parametrize("kwargs, match", [
    ({"keep_last": [1], "placements": ["keep", "offload-all"]},
     r"rok: keep_last = \[1\]: needs 'keep-last' among the placements \['keep', 'offload-all'\]"),
    ({"keep_last": [0, 2]}, r"rok: keep_last = \[0, 2\]: each must be a distinct number of kept layers from 0 to 1 "
                            r"\(model.num_layers = 2; keeping all is the 'keep' placement\)"),
    ({"keep_last": [1, 1]}, r"rok: keep_last = \[1, 1\]: each must be a distinct"),
    ({"keep_last": [-1]}, r"rok: keep_last = \[-1\]: each must be"),
])
def test_rok_rejects_bad_keep_last_counts_before_running(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        rok_points(TINY, TINY_CLI, **kwargs)


@pytest.mark.e2e
def test_rok_keep_last_counts_are_points_of_their_own(tmp_path):
    """``--keep-last 0,1`` on a 2-layer GPT: two keep-last points where one stood, each
    with its count, the one keeping nothing writing more; the plot draws the curve."""
    out, plot = tmp_path / "rok.json", tmp_path / "rok.png"
    cmd = [sys.executable, "-m", "megatron_ssd.commands.cli", "rok", "--config", TINY, *TINY_CLI, "steps=3",
           "--placements", "keep,keep-last,offload-all", "--keep-last", "0,1", "--json", str(out), "--plot", str(plot)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    names = [p["placement"] for p in data["points"]]
    assert names == ["keep", "keep-last-0", "keep-last-1", "offload-all"]
    by = {p["placement"]: p for p in data["points"]}
    assert (by["keep-last-0"]["keep_last_layers"], by["keep-last-1"]["keep_last_layers"]) == (0, 1)
    assert by["keep-last-0"]["bytes_written"] > by["keep-last-1"]["bytes_written"] > 0
    assert by["keep-last-0"]["final_loss"] == by["keep-last-1"]["final_loss"] == by["keep"]["final_loss"]
    assert "dominance" not in by["keep-last-1"]  # fixed points are compared against, not compared
    assert plot.stat().st_size > 0


def test_the_peers_points_are_fixed_points_the_planner_is_compared_with():
    points = [
        _point("keep", 1000, 1.0),
        _point("megatron-offload-0.5", 700, 1.20, paired=1.18),
        _point("te-offload-4", 700, 1.30, paired=1.25),
        _point("megatron-selective", 900, 1.10),  # no pairs: Megatron's recompute is in the model
        _point("megatron-full", 400, 1.40),
        _point("budget-600", 650, 1.22, paired=1.20),
    ]
    add_dominance(points)
    entries = {e["over"]: e for e in points[-1]["dominance"]}
    assert list(entries) == ["megatron-offload-0.5", "te-offload-4", "megatron-selective", "megatron-full"]
    assert points[-1]["dominates"] == ["te-offload-4"]
    assert entries["megatron-selective"]["time"] == "fresh" and not entries["megatron-selective"]["dominates"]
    assert entries["megatron-offload-0.5"]["time"] == "paired"
    assert not entries["megatron-full"]["dominates"]  # less memory than the planner point


@pytest.mark.parametrize("kwargs, match", [
    ({"fractions": [0.5], "placements": ["keep", "te-offload"]},
     r"rok: fractions = \[0.5\]: needs 'megatron-offload' among the placements"),
    ({"fractions": [0.5, 1.5], "placements": ["keep", "megatron-offload"]},
     r"rok: fractions = \[0.5, 1.5\]: each must be a distinct activation_offload_fraction in \[0, 1\]"),
    ({"te_layers": [2], "placements": ["keep", "te-offload"]},
     r"rok: te_layers = \[2\]: each must be a distinct number of offloaded first layers from 1 to 1"),
    ({"te_layers": [1], "placements": ["keep"]}, r"rok: te_layers = \[1\]: needs 'te-offload'"),
    ({"match_peers": True, "placements": ["keep", "offload-all"]},
     r"rok: --match-peers with placements = \['keep', 'offload-all'\]: needs one of"),
    ({"host_throttle": "fast", "placements": ["keep", "te-offload"]}, r"host-throttle"),
    ({"placements": ["keep", "megatron-recompute"]}, r"rok: placements = \['megatron-recompute'\]: each must be one of"),
])
def test_rok_rejects_bad_peer_settings_before_running(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        rok_points(TINY, TINY_CLI, **kwargs)


@pytest.mark.e2e
def test_rok_runs_each_peer_at_its_settings_and_matches_a_budget_to_it(tmp_path):
    """The peers on a 2-layer GPT: megatron-offload at two fractions and te-offload at one
    layer (the host tier paced), Megatron's full recompute; a budget point at
    te-offload-1's measured peak; every loss the same as keep's."""
    out = tmp_path / "rok.json"
    cmd = [sys.executable, "-m", "megatron_ssd.commands.cli", "rok", "--config", TINY, *TINY_CLI, "steps=10",
           "offload.peer.min_tensor_elements=1024", "--placements", "keep,megatron-offload,te-offload,megatron-full",
           "--fractions", "0.5,1", "--te-layers", "1", "--match-peers", "--host-throttle", "1GiB",
           "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    by = {p["placement"]: p for p in data["points"]}
    assert list(by)[:5] == ["keep", "megatron-offload-0.5", "megatron-offload-1", "te-offload-1", "megatron-full"]
    assert by["megatron-offload-0.5"]["setting"] == {"offload_fraction": 0.5}
    assert by["te-offload-1"]["setting"] == {"num_layers": 1}
    assert 0 < by["megatron-offload-0.5"]["bytes_to_host"] < by["megatron-offload-1"]["bytes_to_host"]
    assert by["te-offload-1"]["bytes_to_host"] > 0 and by["megatron-full"]["bytes_to_host"] == 0
    assert by["megatron-full"]["peak_activation_bytes"] < by["keep"]["peak_activation_bytes"] / 2
    # one budget point per distinct peak: te-offload-1's copies run on a paced link, and when
    # they lag (two suites side by side) its peak can equal megatron-offload's, whose point
    # then matches all three
    matched = [p for p in data["points"] if "te-offload-1" in p.get("matches", [])]
    assert len(matched) == 1 and matched[0]["placement"] == f"budget-{by['te-offload-1']['peak_activation_bytes']}"
    budgets = [p for p in data["points"] if p.get("matches")]
    assert sorted(peer for p in budgets for peer in p["matches"]) == sorted(
        ["megatron-offload-0.5", "megatron-offload-1", "te-offload-1", "megatron-full"])
    assert len({p["placement"] for p in budgets}) == len(budgets)
    assert data["host_copy_bytes_per_s"] == 1 << 30
    assert all(len(p["load_average"]) == 1 for p in data["points"] if "load_average" in p)
    assert len({p["final_loss"] for p in data["points"] if "final_loss" in p}) == 1


@pytest.mark.e2e
def test_rok_with_a_paced_host_tier_lets_the_planner_host_layers(tmp_path):
    """``--host-throttle`` on a 2-layer GPT: the planner's run gets the host-tier peers'
    pool and plans it at the paced rate on its own link (NOTE [Paced host tier] in
    ``adaptive.py``), so its plan hosts a layer, which the run copies to the pool; the
    loss is keep's."""
    out = tmp_path / "rok.json"
    cmd = [sys.executable, "-m", "megatron_ssd.commands.cli", "rok", "--config", TINY, *TINY_CLI, "steps=8",
           "--placements", "keep,planner", "--host-throttle", "1GiB", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    by = {p["placement"]: p for p in json.loads(out.read_text())["points"]}
    planner = by["planner"]
    assert any(pl.startswith("host") for pl in planner["plan"]), planner["plan"]
    assert planner["plan_io"]["host_bytes_per_s"] == 1 << 30 and planner["plan_io"]["shared_host_link"] is False
    assert planner["bytes_to_host"] > 0 and by["keep"]["bytes_to_host"] == 0
    assert planner["final_loss"] == by["keep"]["final_loss"]
