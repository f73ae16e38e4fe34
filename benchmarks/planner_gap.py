"""How far the placement search is from the best plan its own model knows, and what it costs.

    python benchmarks/planner_gap.py                 # writes benchmarks/results/planner-gap.json
    python benchmarks/planner_gap.py --quick         # fewer cases, for a look (not the committed numbers)

For every case, the exhaustive oracle (``megatron_ssd_lab/planner_oracle.py``) enumerates the
whole per-layer choice set and judges each plan as the search does; the search and the
greedy search it starts from (:class:`~megatron_ssd.planner.greedy.Greedy`, the search
before this one) are run on the same case. Cases:

- ``random``: seeded random 5-layer stages (1 to 3 sites a layer, CPU-like to H100-like
  compute-to-bandwidth ratios, with and without the in-flight bound, a host pool, modules
  to recompute inside a layer, pipeline micro-batches), budgets 0.3 to 0.8 of keep's
  peak, with and without recompute, and one case in five ``max_offload``;
- ``h200-check``: the H200 GPU check's GPT layer (9 sites) rebuilt as in
  ``benchmarks/tier_physics.py``, cut to 3 layers, with its 2 GB/s disk and with 4 Gen5
  drives, with and without a host pool of a quarter of keep's peak, with and without
  recompute, at budgets 0.3, 0.5 and 0.7;
- ``cpu-plateau``: the 2-layer GPT profile measured on a loaded 2-core machine that the
  greedy search once called infeasible (``tests/planner/test_planner_plan.py``), cycled to
  3 layers, at budgets 0.3 to 0.8, with and without recompute.

It writes, per set and over all: the ratio of the search's predicted step to the optimum's
(median, p90, p99, max) and the greedy's; the budgets it called infeasible that are not;
``max_offload``'s peak against the lowest hidden one; the share proven optimal by the
branch and bound; and the search's time on one core at 8, 32, 128 and 512 layers (the
H200 check's layer, 2 GB/s disk, host pool, budget half of keep's peak). Every number is
the model's: no GPU and no training, the same on every machine but the times (a few
minutes to tens of minutes on two CPU cores; ``--workers`` sets the processes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_ssd.commands.output import Progress, machine_info, write_json  # noqa: E402
from megatron_ssd.placement import Placement  # noqa: E402
from megatron_ssd.planner import IOProfile, LayerProfile, ModuleProfile, StageProfile  # noqa: E402
from megatron_ssd.planner.greedy import Greedy  # noqa: E402
from megatron_ssd.planner.search import PlanInfeasibleError, replay  # noqa: E402
from megatron_ssd.planner.step_timeline import predict  # noqa: E402
from megatron_ssd_lab.planner_oracle import Case, cycled, optimum, random_case  # noqa: E402

MiB = 1 << 20
GEN5 = (10e9, 14e9)
CHECK_SITES_MIB = [8, 24, 128, 8, 8, 8, 32, 32, 8]
GOALS = {"p99": 1.01, "max": 1.03, "false_infeasible": 0, "max_offload_at_lowest": 0.99, "seconds_at_128": 1.0}


def check_layer(i: int) -> LayerProfile:
    """The H200 check's GPT layer (benchmarks/tier_physics.py), its core attention (the
    128 MiB site) recomputable inside it."""
    sites = [m * MiB for m in CHECK_SITES_MIB]
    return LayerProfile(i, 0.0016, 0.0032, sum(sites), recompute_s=0.0016, boundary_bytes=8 * MiB, site_bytes=sites,
                        site_use=[0.95, 0.9, 0.8, 0.75, 0.7, 0.6, 0.3, 0.2, 0.1],
                        modules=[ModuleProfile("core_attn", 0.0003, [2])])


def check_stage(n: int, ssd: Tuple[float, float], host: Optional[float] = 50e9) -> StageProfile:
    return StageProfile(layers=[check_layer(i) for i in range(n)],
                        io=IOProfile(ssd[0], ssd[1], host_bytes_per_s=host, max_inflight_bytes=256 * MiB),
                        other_s=0.002, head_bytes=64 * MiB)


def cases(quick: bool) -> List[Tuple[str, Case]]:
    out: List[Tuple[str, Case]] = []
    for seed in range(40 if quick else 200):
        out.append(("random", random_case(random.Random(seed), layers=5)))
    for disk in ((2.0e9, 1.8e9), (4 * GEN5[0], 4 * GEN5[1])):
        stage = check_stage(3, disk)
        for pool in (None, 0.25):
            for recompute in (True, False):
                for share in ((0.5,) if quick else (0.3, 0.5, 0.7)):
                    out.append(("h200-check", Case(stage, share, recompute, pool, read_ahead=2)))
    sys.path.insert(0, os.path.join(REPO, "tests", "planner"))
    from test_planner_plan import PLATEAU_STAGE  # the stored measured profile
    plateau = cycled(StageProfile.from_dict(PLATEAU_STAGE), 3)
    for share in ((0.5,) if quick else (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)):
        for recompute in (True, False):
            out.append(("cpu-plateau", Case(plateau, share, recompute, None, read_ahead=2)))
    return out


def run_case(item: Tuple[int, str, Case]) -> Dict[str, Any]:
    number, name, case = item
    search = case.search()
    budget = case.budget()
    row: Dict[str, Any] = {"case": number, "set": name, "goal": "max_offload" if budget is None else "memory_budget",
                           "budget_share": case.budget_share, "recompute": case.allow_recompute,
                           "host_share": case.host_share, "layers": len(case.stage.layers)}
    started = time.perf_counter()
    oracle = optimum(case)
    row["oracle_s"] = time.perf_counter() - started
    row["oracle_plans"], row["oracle_judged"] = oracle.plans, oracle.judged
    started = time.perf_counter()
    try:
        chosen = search.max_offload() if budget is None else search.meet_budget(budget, case.allow_recompute)
        tl = replay(case.stage, chosen, case.read_ahead, io=search.derated)
    except PlanInfeasibleError:
        tl = None
    row["search_s"], row["replays"], row["proven"] = time.perf_counter() - started, search.replays, search.proven
    greedy = Greedy(case.stage, search.derated, case.read_ahead, case.max_write_bytes_per_s, search.host_budget_bytes,
                    case.max_slowdown)
    built = greedy.first_fit() if budget is None else greedy.fit_budget(budget, case.allow_recompute)
    gtl = None if built is None else replay(case.stage, built, case.read_ahead, io=search.derated)
    if budget is None:
        row.update(oracle_peak=oracle.peak_bytes, search_peak=tl and tl.peak_bytes, greedy_peak=gtl and gtl.peak_bytes)
    else:
        row.update(oracle_step_s=oracle.step_s, search_step_s=tl and tl.step_s, greedy_step_s=gtl and gtl.step_s)
    return row


def quantiles(values: List[float]) -> Dict[str, Optional[float]]:
    if not values:
        return {"n": 0, "median": None, "p90": None, "p99": None, "max": None}
    v = sorted(values)
    at = lambda q: v[min(len(v) - 1, int(q * len(v)))]  # noqa: E731
    return {"n": len(v), "median": statistics.median(v), "p90": at(0.9), "p99": at(0.99), "max": v[-1]}


def summary(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    feasible = [r for r in rows if r["goal"] == "memory_budget" and r["oracle_step_s"] is not None]
    ratios = [r["search_step_s"] / r["oracle_step_s"] for r in feasible if r["search_step_s"] is not None]
    greedy = [r["greedy_step_s"] / r["oracle_step_s"] for r in feasible if r["greedy_step_s"] is not None]
    hidden = [r for r in rows if r["goal"] == "max_offload" and r["oracle_peak"] is not None]
    return {
        "cases": len(rows),
        "ratio_to_optimum": quantiles(ratios),
        "greedy_ratio_to_optimum": quantiles(greedy),
        "at_optimum_within_1pct": sum(x <= 1.01 for x in ratios) / len(ratios) if ratios else None,
        "false_infeasible": sum(r["search_step_s"] is None for r in feasible),
        "greedy_false_infeasible": sum(r["greedy_step_s"] is None for r in feasible),
        "slower_than_greedy": sum(1 for r in feasible if r["search_step_s"] is not None and r["greedy_step_s"]
                                  is not None and r["search_step_s"] > r["greedy_step_s"] * (1 + 1e-9)),
        "infeasible_budgets": sum(1 for r in rows if r["goal"] == "memory_budget" and r["oracle_step_s"] is None),
        "called_feasible_where_oracle_found_none": sum(1 for r in rows if r["goal"] == "memory_budget"
                                                       and r["oracle_step_s"] is None and r["search_step_s"] is not None),
        "max_offload_cases": len(hidden),
        "max_offload_at_lowest": (sum(r["search_peak"] == r["oracle_peak"] for r in hidden) / len(hidden)
                                  if hidden else None),
        "max_offload_peak_gap_of_keep": quantiles([(r["search_peak"] - r["oracle_peak"]) / r["oracle_peak"]
                                                   for r in hidden]),
        "proven_optimal": sum(bool(r["proven"]) for r in rows) / len(rows) if rows else None,
        "search_s": quantiles([r["search_s"] for r in rows]),
        "replays": quantiles([float(r["replays"]) for r in rows]),
    }


def timing(layers: int) -> Dict[str, Any]:
    """The search's time at ``layers`` layers on one core (this process)."""
    from megatron_ssd.planner.search import PlacementSearch, collector_paused
    stage = check_stage(layers, (2.0e9, 1.8e9))
    keep = predict(stage, [Placement.KEEP] * layers).peak_bytes
    search = PlacementSearch(stage, stage.io.derated(0.1), 2, None, keep // 4, None)
    started = time.perf_counter()
    chosen = search.meet_budget(keep // 2, True)
    seconds = time.perf_counter() - started
    greedy = Greedy(stage, stage.io.derated(0.1), 2, None, keep // 4, None)
    started = time.perf_counter()
    with collector_paused():  # as the search runs it, planner.search=greedy included (NOTE [Collector paused])
        built = greedy.fit_budget(keep // 2, True)
    greedy_s = time.perf_counter() - started
    tl = replay(stage, chosen, 2, io=search.derated)
    gtl = replay(stage, built, 2, io=search.derated) if built is not None else None
    return {"layers": layers, "seconds": seconds, "replays": search.replays, "proven": search.proven,
            "step_over_keep": tl.step_s / search._shortest_step_s, "greedy_seconds": greedy_s,
            "greedy_step_over_keep": gtl.step_s / search._shortest_step_s if gtl else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=os.path.join(REPO, "benchmarks", "results", "planner-gap.json"))
    parser.add_argument("--quick", action="store_true", help="fewer cases, for a look")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--timing-layers", default="8,32,128,512")
    args = parser.parse_args()
    items = [(i, name, case) for i, (name, case) in enumerate(cases(args.quick))]
    rows: List[Dict[str, Any]] = []
    progress = Progress("cases", len(items), sys.stdout)
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        for row in pool.map(run_case, items, chunksize=1):
            rows.append(row)
            progress.step(f"{row['set']} {row['goal']}: search {row['search_s']:.2f} s, oracle {row['oracle_s']:.1f} s")
    progress.close()
    sets = sorted({r["set"] for r in rows})
    times = []
    for n in [int(x) for x in args.timing_layers.split(",") if x]:
        times.append(timing(n))
        print(json.dumps(times[-1]), flush=True)
    result = {"benchmark": "planner_gap", "machine": machine_info(), "goals": GOALS, "quick": args.quick,
              "all": summary(rows), "sets": {s: summary([r for r in rows if r["set"] == s]) for s in sets},
              "timing": times, "rows": rows}
    print(json.dumps({k: result[k] for k in ("all", "sets", "timing")}, indent=1))
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
