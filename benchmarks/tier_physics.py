"""What each tier can hide within a 1.05x step, per GPU class: the table of
docs/performance.md's "What each tier can hide" section, from the planner's own model.

    python benchmarks/tier_physics.py --markdown   # writes benchmarks/results/tier-physics.json

For each workload, GPU class and tier setup, the smallest predicted peak of saved
activations whose predicted step is at most 1.05x keep-everything's, found by bisecting
``make_plan``'s memory budget with recompute off (so only the tiers move bytes), at the
model's bandwidths (``safety_margin=0``) and a fixed read-ahead of two layers (the H200
check's). "Hidden" is the share of keep-everything's peak that plan removes.

Workloads:

1. ``h2048``: the H200 check's GPT (16 layers, hidden 2048, sequence 2048, bf16,
   micro-batch 1), on the profile rebuilt from its measurements
   (benchmarks/results/gpu-check-h200.json, docs/performance.md "The GPU check on an
   H200"): 16 layers of 1.6 ms forward and 3.2 ms backward, each saving sites of 8, 24,
   128, 8, 8, 8, 32, 32 and 8 MiB (4.3 GB a step). On the A100 its times are multiplied
   by 989 / 312, the ratio of the two GPUs' dense bf16 peaks (the same efficiency
   assumed).
2. ``h8192``: the same GPT at hidden 8192 (64 heads), its stage from ``megatron-ssd
   simulate``'s estimates (``flash_attention=false`` as in the check's model, which
   saves each head's s x s attention scores; the GPU's dense bf16 peak, simulate's
   default 45% MFU);
3. ``h8192-flash``: the same with fused attention (``flash_attention=true``, as with
   Transformer Engine), which saves no s x s tensor: more compute per saved byte.

GPU classes: H100 and H200 (989 TFLOPS dense bf16, a PCIe Gen5 x16 link of about 50 GB/s
each way in practice; the H200 check measured 51.5 GiB/s pinned copies), A100 (312
TFLOPS, PCIe Gen4 x16, about 25 GB/s). Tier setups: the host tier alone (a pool larger
than the activations); the SSDs alone, over the same link (NOTE [Shared link]): the
check's disk (2.0 GB/s write, 1.8 read), one, four or eight Gen5 enterprise drives (10
GB/s write, 14 read each, DESIGN's Micron 9550 figures); and the host tier with a pool of
a quarter of the activations, alone and with four Gen5 drives (host RAM shared by eight
GPUs).

Pure arithmetic: no GPU needed, the same numbers on every machine.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_ssd.commands.output import write_json  # noqa: E402
from megatron_ssd.errors import MegatronSSDError  # noqa: E402
from megatron_ssd.planner import IOProfile, LayerProfile, StageProfile, make_plan, PlanRequest  # noqa: E402
from megatron_ssd.planner.simulate import spec_from_overrides, stage_profile  # noqa: E402

MiB = 1 << 20
STEP_BOUND = 1.05
"""The predicted step each plan may take, relative to keep-everything's."""
READ_AHEAD = 2
"""Layers of read-ahead (the H200 check's)."""
CHECK_SITES_MIB = [8, 24, 128, 8, 8, 8, 32, 32, 8]
"""One layer's saved tensors in the H200 check's GPT, in save order."""

GPUS: Dict[str, Tuple[float, float]] = {
    "H100": (989e12, 50e9),
    "H200": (989e12, 50e9),
    "A100": (312e12, 25e9),
}
"""Per GPU class: dense bf16 FLOP/s and the host link's practical bytes per second each way."""

GEN5 = (10e9, 14e9)
"""One Gen5 enterprise drive's write and read bytes per second."""

SETUPS: List[Tuple[str, Optional[Tuple[float, float]], Optional[float]]] = [
    ("host tier", None, 1.0),
    ("check's disk (2.0 GB/s)", (2.0e9, 1.8e9), None),
    ("1 Gen5 drive", GEN5, None),
    ("4 Gen5 drives", (4 * GEN5[0], 4 * GEN5[1]), None),
    ("8 Gen5 drives", (8 * GEN5[0], 8 * GEN5[1]), None),
    ("host, pool 1/4", None, 0.25),
    ("host, pool 1/4 + 4 Gen5", (4 * GEN5[0], 4 * GEN5[1]), 0.25),
]
"""Tier setups: name, SSD (write, read) bytes per second or None, host pool as a share of
keep-everything's peak or None."""


def check_stage(flops: float) -> StageProfile:
    """The H200 check's workload rebuilt from its measurements, its times scaled to ``flops``."""
    scale = 989e12 / flops
    sites = [m * MiB for m in CHECK_SITES_MIB]
    layers = [LayerProfile(i, 0.0016 * scale, 0.0032 * scale, sum(sites), site_bytes=sites) for i in range(16)]
    return StageProfile(layers=layers, io=IOProfile(None, None))


def simulated_stage(flops: float, flash: bool = False) -> StageProfile:
    """The check's GPT at hidden 8192 from simulate's estimates."""
    spec = spec_from_overrides(["num_layers=16", "hidden=8192", "heads=64", "seq_len=2048", "vocab=32768",
                                "micro_batch=1", f"flash_attention={'true' if flash else 'false'}",
                                f"gpu_flops={flops}", "gpu_memory_bytes=null", "target_lifetime_years=null"])
    return stage_profile(spec)


WORKLOADS = {
    "h2048": check_stage,
    "h8192": simulated_stage,
    "h8192-flash": lambda flops: simulated_stage(flops, flash=True),
}
"""The workloads by name, each a stage for a GPU's dense bf16 FLOP/s."""


def hidden_share(stage: StageProfile, link: float, ssd: Optional[Tuple[float, float]],
                 pool: Optional[float]) -> Dict[str, Any]:
    """The most of keep's peak a plan within ``STEP_BOUND`` removes with these tiers."""
    write, read = ssd if ssd is not None else (None, None)
    stage = stage.with_io(IOProfile(write, read, host_bytes_per_s=link))
    keep = make_plan(stage, PlanRequest(safety_margin=0.0, default_read_ahead=READ_AHEAD, allow_recompute=False))
    keep_peak, keep_step = keep.keep_peak_activation_bytes, keep.keep_step_s
    host = None if pool is None else int(pool * keep_peak)

    def plan_at(budget: int):
        try:
            plan = make_plan(stage, PlanRequest(memory_budget=budget, safety_margin=0.0, default_read_ahead=READ_AHEAD,
                             allow_recompute=False, host_budget_bytes=host))
        except MegatronSSDError:
            return None
        return plan if plan.step_s <= STEP_BOUND * keep_step * (1 + 1e-9) else None

    lo, hi, best = 0, keep_peak, None  # bisect on the budget: the smallest that a bounded plan meets
    for _ in range(14):
        mid = (lo + hi) // 2
        plan = plan_at(mid)
        if plan is not None:
            best, hi = plan, mid
        else:
            lo = mid
    peak = keep_peak if best is None else best.peak_activation_bytes
    return {"keep_peak_bytes": keep_peak, "keep_step_s": keep_step, "peak_bytes": peak,
            "hidden": 1 - peak / keep_peak, "step_s": keep_step if best is None else best.step_s,
            "hosted_bytes": 0 if best is None else best.hosted_bytes,
            "offloaded_bytes": 0 if best is None else best.offloaded_bytes}


def rows() -> List[Dict[str, Any]]:
    out = []
    for workload, build in WORKLOADS.items():
        for gpu, (flops, link) in GPUS.items():
            stage = build(flops)
            for name, ssd, pool in SETUPS:
                row = {"workload": workload, "gpu": gpu, "link_bytes_per_s": link, "setup": name,
                       **hidden_share(stage, link, ssd, pool)}
                print(f"{workload} {gpu} {name}: {row['hidden']:.1%}", file=sys.stderr, flush=True)
                out.append(row)
    return out


def markdown(table: List[Dict[str, Any]]) -> str:
    gpus = list(GPUS)
    lines = []
    for workload in WORKLOADS:
        sub = [r for r in table if r["workload"] == workload]
        first = sub[0]
        lines.append(f"{workload}: keep peak {first['keep_peak_bytes'] / 1e9:.1f} GB; keep step "
                     + ", ".join(f"{g} {next(r for r in sub if r['gpu'] == g)['keep_step_s'] * 1e3:.1f} ms"
                                 for g in gpus))
        lines.append("")
        lines.append("| tiers | " + " | ".join(f"{g} ({GPUS[g][1] / 1e9:.0f} GB/s link)" for g in gpus) + " |")
        lines.append("|---|" + "---:|" * len(gpus))
        for name, _, _ in SETUPS:
            cells = [next(r for r in sub if r["gpu"] == g and r["setup"] == name)["hidden"] for g in gpus]
            lines.append(f"| {name} | " + " | ".join(f"{c:.0%}" for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=os.path.join(REPO, "benchmarks", "results", "tier-physics.json"))
    parser.add_argument("--markdown", action="store_true", help="print the Markdown tables too")
    args = parser.parse_args()
    table = rows()
    write_json(args.json, {"step_bound": STEP_BOUND, "read_ahead": READ_AHEAD, "gpus": GPUS, "rows": table})
    if args.markdown:
        print(markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
