"""How much the measured price of a host copy moves between fresh profiles.

    python benchmarks/host_price_spread.py                # writes benchmarks/results/host-price-spread.json
    python benchmarks/host_price_spread.py --runs 1 --profile-steps 2   # a look

An ``auto`` planner that may use the host tier prices a host copy by the HOST profiling
block's compute beyond the KEEP block's (``IOProfile.host_compute_slowdown``, NOTE
[Pricing host copies] in ``megatron_ssd/planner/measured_profile.py``). Every process
measures it afresh, so a plan's cost of a hosted byte is only as steady as that estimate.
This runs ``megatron-ssd train`` ``--runs`` times per ``--profile-steps`` value, each a
fresh process with the host link paced (``--host-throttle``), and reads from each
report's profile:

- ``host_compute_slowdown`` (``s``);
- what it charges a step that hosts every layer while compute runs beside the copies:
  ``w * s / (1 + s)`` seconds per micro-batch, ``w`` the copies' time in flight (each
  layer's saved bytes out and back at the paced rate). The timeline slows compute by
  ``1 / (1 + s)`` while a copy is in flight, so this is the extra compute time it
  predicts; unlike ``s`` it moves in proportion to the measured extra, not up to ten
  times faster (NOTE [Slowdown while in flight]).

Run it on an otherwise idle machine: it measures the spread a profile's own noise
gives, and load that comes and goes between processes adds its own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_ssd.commands.output import machine_info, write_json  # noqa: E402
from megatron_ssd.config import TrainConfig, load_config  # noqa: E402
from megatron_ssd.io.pacing import parse_rate  # noqa: E402
from megatron_ssd.profiling import profile_counts  # noqa: E402


def one_run(config: str, profile_steps: int, rate: float) -> Dict[str, Any]:
    """One fresh ``train`` process profiling with ``profile_steps``; its profile's price."""
    overrides = [f"offload.host_copy_bytes_per_s={int(rate)}", "offload.planner.mode=auto",
                 "offload.host_pool_bytes=4GiB", f"offload.planner.profile_steps={profile_steps}", "baseline_steps=0"]
    planner = load_config(TrainConfig, config, overrides).offload.planner
    steps = profile_counts(planner, host=True).total + 1  # the profile, then one step of its plan
    with tempfile.TemporaryDirectory(prefix="megatron-ssd-host-price-") as tmp:
        out = os.path.join(tmp, "report.json")
        cmd = [sys.executable, "-m", "megatron_ssd.commands.cli", "train", "--config", config, *overrides,
               f"steps={steps}", "--json", out]
        started = time.monotonic()
        subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
        with open(out, encoding="utf-8") as fh:
            report = json.load(fh)
    profile = report["planner"]["profile"]
    s = profile["io"]["host_compute_slowdown"]
    hosted = sum(layer["saved_bytes"] for layer in profile["layers"] if layer.get("recomputable", True))
    in_flight = 2 * hosted / rate
    return {"host_compute_slowdown": s, "in_flight_s": in_flight, "priced_extra_s": in_flight * s / (1 + s),
            "compute_slowdown": profile["io"]["compute_slowdown"], "seconds": time.monotonic() - started,
            "load_average": list(os.getloadavg()[:2])}


def summary(values: List[float]) -> Dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values),
            "spread_of_median": (max(values) - min(values)) / statistics.median(values) if statistics.median(values) else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(REPO, "configs", "gpt-deep-cpu.yaml"))
    parser.add_argument("--runs", type=int, default=4, help="fresh processes per --profile-steps value")
    parser.add_argument("--profile-steps", default="2,6", help="offload.planner.profile_steps values, comma-separated")
    parser.add_argument("--host-throttle", default="1GiB", help="the host link's paced rate")
    parser.add_argument("--json", default=os.path.join(REPO, "benchmarks", "results", "host-price-spread.json"))
    args = parser.parse_args()
    rate = parse_rate("host_price_spread", "host-throttle", args.host_throttle)
    results: Dict[str, Any] = {"config": os.path.relpath(args.config, REPO), "host_bytes_per_s": rate,
                               "machine": machine_info(), "by_profile_steps": {}}
    for ps in (int(x) for x in args.profile_steps.split(",")):
        runs = []
        for i in range(args.runs):
            runs.append(one_run(args.config, ps, rate))
            r = runs[-1]
            print(f"profile_steps={ps} run {i + 1}/{args.runs}: host_compute_slowdown {r['host_compute_slowdown']:.3f}, "
                  f"priced extra {r['priced_extra_s']:.3f} s of {r['in_flight_s']:.3f} s in flight "
                  f"({r['seconds']:.0f} s, load average {r['load_average'][0]:.2f})", flush=True)
        results["by_profile_steps"][str(ps)] = {
            "runs": runs,
            "host_compute_slowdown": summary([r["host_compute_slowdown"] for r in runs]),
            "priced_extra_s": summary([r["priced_extra_s"] for r in runs]),
        }
    write_json(args.json, results)


if __name__ == "__main__":
    main()
