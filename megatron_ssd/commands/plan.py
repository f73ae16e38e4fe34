"""``megatron-ssd plan``: profile the configured model and print the plan it gets."""

from __future__ import annotations

from typing import Optional, Sequence

from ..profiling import profile_counts
from .steps import may_profile_host
from ..config import TrainConfig, load_config, to_dict
from ..errors import MegatronSSDError
from ..planner.plan import Plan
from .output import machine_info, write_json
from .train import TrainRecipe

__all__ = ["run_plan"]


def run_plan(config_path: Optional[str], overrides: Sequence[str], json_path: Optional[str] = None) -> int:
    """Profile the configured model (the ``auto`` planner's warm-up, profiling and settle
    steps, NOTE [Profiling steps]), print the plan it sets, optionally save it as JSON."""
    config = load_config(TrainConfig, config_path, overrides)
    planner = config.offload.planner
    planner.mode = "auto"
    config.baseline_steps = 0
    counts = profile_counts(planner, may_profile_host(config.offload))
    config.steps = counts.total
    report = TrainRecipe(config, command="plan").run(print_summary=False)
    events = [e for e in report["planner"]["events"] if e["plan"] is not None]
    if not events:
        raise MegatronSSDError("plan: the profile produced no plan (too few steps?)")
    plan = events[-1]["plan"]
    print(f"\nplan from {counts.warmup} warm-up, {counts.measured} profiling and {counts.settle} settle steps:")
    print(Plan.from_dict(plan).table())
    if json_path:
        write_json(json_path, {**plan, "workload": to_dict(config), "machine": machine_info()})
    return 0
