"""Process RSS with and without giving freed activation pages back (NOTE [Returning freed pages]).

Run::

    .venv/bin/python benchmarks/return_pages.py [--rounds 2] [--steps 5] [--runs DIR]

For each round, each placement (keep, offload, auto, recompute) and each value of
``offload.return_freed_pages`` (on, off), in that interleaved order, runs::

    megatron-ssd train --config configs/gpt-ref-cpu.yaml --no-baseline steps=N \\
        offload.planner.mode=MODE offload.return_freed_pages=on|off --json DIR/...

in a fresh process, and reads back each run's JSON: process RSS above the pre-forward
level (measured by the kernel, not by the cache), the cache's own count, bytes whose pages
were given back, heap-trim time, and the final loss. Writes
``benchmarks/results/return_pages.json``. ``--reuse`` only aggregates runs already in
``--runs`` (same file names).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MiB = 1 << 20
PLACEMENTS = ("keep", "offload", "auto", "recompute")


def _run_file(runs: str, mode: str, on: bool, rnd: int) -> str:
    return os.path.join(runs, f"{mode}-{'on' if on else 'off'}-{rnd}.json")


def _train(path: str, mode: str, on: bool, steps: int) -> None:
    cmd = [sys.executable, "-m", "megatron_ssd.commands.cli", "train", "--config", os.path.join(REPO, "configs", "gpt-ref-cpu.yaml"),
           "--no-baseline", f"steps={steps}", f"offload.planner.mode={mode}",
           f"offload.return_freed_pages={'on' if on else 'off'}", "--json", path]
    print(" ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)


def _point(path: str) -> Dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        result = json.load(fh)
    phase = result["phases"][-1]
    measured = result["steps"][-phase["measured_steps"]:] if phase.get("measured_steps") else result["steps"][-1:]
    return {
        "rss_above_pre_forward_mib": phase["peak_rss_above_base_bytes"] / MiB,
        "cache_count_mib": phase["peak_activation_bytes"] / MiB,
        "returned_mib_per_step": statistics.median(s.get("bytes_returned", 0) for s in measured) / MiB,
        "heap_trim_ms_per_step": statistics.median(s.get("heap_trim_s", 0.0) for s in measured) * 1e3,
        "final_loss": phase["final_loss"],
    }


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--runs", default=os.path.join(REPO, "benchmarks", "results", "return_pages_runs"))
    parser.add_argument("--reuse", action="store_true", help="aggregate the runs already in --runs")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "return_pages.json"))
    args = parser.parse_args(argv)
    os.makedirs(args.runs, exist_ok=True)
    points = []
    for rnd in range(1, args.rounds + 1):
        for mode in PLACEMENTS:
            for on in (True, False):
                path = _run_file(args.runs, mode, on, rnd)
                if not args.reuse:
                    _train(path, mode, on, args.steps)
                points.append({"round": rnd, "placement": mode, "return_freed_pages": on, **_point(path)})
    summary = {}
    for mode in PLACEMENTS:
        for on in (True, False):
            rss = [p["rss_above_pre_forward_mib"] for p in points if p["placement"] == mode and p["return_freed_pages"] == on]
            summary[f"{mode}/{'on' if on else 'off'}"] = statistics.mean(rss)
    keep, auto = summary["keep/on"], summary["auto/on"]
    saved = next(p["cache_count_mib"] for p in points if p["placement"] == "keep") - next(
        p["cache_count_mib"] for p in points if p["placement"] == "auto")
    out = {
        "command": "megatron-ssd train --config configs/gpt-ref-cpu.yaml --no-baseline steps=%d "
                   "offload.planner.mode=MODE offload.return_freed_pages=on|off" % args.steps,
        "points": points,
        "mean_rss_above_pre_forward_mib": summary,
        "planner_below_keep_mib": keep - auto,
        "cache_counted_saving_mib": saved,
        "planner_below_keep_share_of_counted_saving": (keep - auto) / saved if saved else None,
        "same_final_loss_everywhere": len({p["final_loss"] for p in points}) == 1,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
    }
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=1)
    for key, value in summary.items():
        print(f"{key:16s} {value:8.1f} MiB above pre-forward")
    print(f"planner below keep: {keep - auto:.1f} MiB of {saved:.1f} MiB counted saved "
          f"({out['planner_below_keep_share_of_counted_saving']:.0%}); same final loss everywhere: "
          f"{out['same_final_loss_everywhere']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
