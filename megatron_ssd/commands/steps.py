"""What ``megatron-ssd train`` says about its steps: their kinds, runs too short to
measure, and the lines that compare phases, show plans and progress.

NOTE [Step kinds] is here; :mod:`megatron_ssd.commands.train` runs the phases and prints these.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..profiling import profile_counts, profile_schedule
from ..cache import StepStats
from ..config import OffloadConfig, PlannerConfig, TrainConfig
from ..placement import OUTSIDE
from ..units import MiB
from ..planner import Plan
from .intervals import ratio_ci95

__all__ = ["FEW_STEPS", "step_kinds", "may_profile_host", "short_run_problems", "step_line", "format_plans", "format_paired",
           "format_comparison", "memory_saved", "loss_identity", "format_loss_identity", "format_choices",
           "plan_summary"]

FEW_STEPS = 5
"""A step-time ratio from fewer measured steps than this (either side) is printed with a
warning next to its interval: a handful of steps cannot separate a few percent from noise."""


def step_kinds(config: PlannerConfig, steps: int, host: bool = False) -> List[str]:
    """What each step of a phase is: ``warm-up``, ``profile`` or ``measured`` (``host``:
    the planner profiles a host tier too, NOTE [Profiling steps] in ``profiling.py``).

    NOTE [Step kinds]: an ``auto`` phase runs ``warmup_steps`` warm-up steps, then its
    profiling steps (``profile_steps`` measured ones, every layer kept and then the
    default placement, with ``settle_steps`` untimed ones between, a RECOMPUTE block
    between those when ``recompute_profile_steps`` asks, and a HOST block last where the
    plan may use a host pool: NOTE [Profiling steps] in ``profiling.py``), and only the
    steps after those run the planner's placement;
    every other phase's first step warms up the allocator and the page cache. Only
    ``measured`` steps enter the summary; a phase with none is short
    (:func:`short_run_problems`).
    """
    if config.mode == "auto":
        head = ["warm-up"] * config.warmup_steps + ["profile"] * (len(profile_schedule(config, host))
                                                                   - config.warmup_steps)
    else:
        head = ["warm-up"]
    return (head + ["measured"] * steps)[:steps]


def may_profile_host(offload: OffloadConfig) -> bool:
    """Whether an ``auto`` planner of ``offload`` may profile a host tier (its HOST block,
    NOTE [Profiling steps] in ``profiling.py``): a pool that is not 0, paced on a CPU
    (``host_copy_bytes_per_s``), or on a GPU. Decided before any step, so on a GPU an
    ``auto`` pool counts though it may size to none (``AdaptivePlanner.profiles_host``
    says what the run does)."""
    if offload.host_pool_bytes == 0:
        return False
    return offload.host_copy_bytes_per_s is not None or torch.cuda.is_available()


def short_run_problems(config: TrainConfig) -> List[str]:
    """Why each phase of ``config`` would have no measured step (NOTE [Step kinds]); empty
    when every phase measures at least one."""
    problems = []
    if config.baseline_steps and "measured" not in step_kinds(PlannerConfig(mode="keep"), config.baseline_steps):
        problems.append(f"TrainConfig.baseline_steps = {config.baseline_steps}: its one step is the warm-up step, "
                        "so keep-everything would be measured from it; must be 0 or >= 2")
    planner = config.offload.planner
    if config.budget_of_keep is not None and planner.memory_budget is None:  # a budget adds recompute profiling
        planner = dataclasses.replace(planner, memory_budget=1)
    host = may_profile_host(config.offload)
    if "measured" not in step_kinds(planner, config.steps, host):
        if planner.mode == "auto":
            counts = profile_counts(planner, host)
            problems.append(
                f"TrainConfig.steps = {config.steps}: the planner uses {counts.warmup} warm-up + "
                f"{counts.measured + counts.settle} profiling steps ({counts.measured} measured, "
                f"{counts.settle} settling), so no step would run its plan; must be >= "
                f"{counts.total + 1} to measure the planner's placement")
        else:
            problems.append(f"TrainConfig.steps = {config.steps}: its one step is the warm-up step; must be >= 2")
    return problems


def step_line(kind: str, loss: float, stats: StepStats) -> str:
    """One progress line's text: what the step was, and its numbers with their units."""
    tiers = "".join(f", moved to {name} {counts['moved'] / MiB:.1f} MiB"  # NOTE [Tiers] in megatron_ssd/tier.py
                    for name, counts in sorted(stats.tier_bytes.items()) if counts.get("moved"))
    return (f"{kind}, loss {loss:.3f}, {stats.wall_s:.2f} s, peak act {stats.peak_resident_bytes / MiB:.1f} MiB, "
            f"wrote {stats.bytes_offloaded / MiB:.1f} MiB{tiers}")


_REASONS_SHOWN = 2
"""A re-plan line quotes this many drift reasons; the JSON's ``planner.events`` has all."""


def _short_reason(reason: str) -> str:
    """A drift reason cut to its first :data:`_REASONS_SHOWN` measurements."""
    if not reason.startswith("drift: "):
        return reason
    parts = reason[len("drift: "):].split("; ")
    if len(parts) <= _REASONS_SHOWN:
        return reason
    rest = len(parts) - _REASONS_SHOWN
    return f"drift: {'; '.join(parts[:_REASONS_SHOWN])}; and {rest} more (--json: planner.events)"


def format_plans(events: Sequence[Dict[str, Any]], steps: int) -> str:
    """The plans a phase set: the first as a table, each later one as its changes."""
    lines: List[str] = []
    previous: Optional[Plan] = None
    for event in events:
        if event["plan"] is None:
            continue
        plan = Plan.from_dict(event["plan"])
        applied = "" if event["step"] + 1 < steps else "; the run ended before a step ran it"
        searched = f"; searched {event['search_s']:.2f} s" if event.get("search_s") is not None else ""
        when = f"after step {event['step'] + 1} ({_short_reason(event['reason'])}{searched}{applied})"
        if previous is None:
            lines += ["", f"plan set {when}:", plan.table()]
        else:
            changes = plan.changes_from(previous)
            lines.append(f"re-plan {when}: " + ("; ".join(changes) if changes else "placement unchanged"))
        previous = plan
    return "\n".join(lines)


def format_paired(paired: Dict[str, Any]) -> str:
    """The paired steps' line (NOTE [Paired steps]): the median ratio and its interval."""
    lo, hi = paired["ratio_ci95"]
    return (f"paired steps: offload {paired['median_ratio']:.3f}x keep-everything "
            f"(median of {paired['pairs']} pairs; 95% interval {lo:.3f}-{hi:.3f})")


_INDEPENDENT = {"cuda_max_memory_allocated": "torch.cuda.max_memory_allocated above the pre-forward level"}
"""How the headline names its measure, by ``independent_peak_source``; RSS otherwise."""


def memory_saved(keep: Dict[str, Any], off: Dict[str, Any]) -> str:
    """The headline's memory part (NOTE [Headline memory])."""
    counted = keep["peak_activation_bytes"] - off["peak_activation_bytes"]
    k, o = keep.get("independent_peak_bytes"), off.get("independent_peak_bytes")
    if not k or o is None:
        return (f"activation memory saved: {counted / MiB:.1f} MiB "
                f"({100 * counted / keep['peak_activation_bytes']:.0f}% of keep-everything, by the cache's count)")
    source = keep.get("independent_peak_source") or ""
    how = _INDEPENDENT.get(source, "process RSS above the pre-forward level")
    return (f"memory saved: {(k - o) / MiB:.1f} MiB ({100 * (k - o) / k:.0f}% of keep-everything's peak; {how}), "
            f"activations counted by the cache {counted / MiB:.1f} MiB")


def format_comparison(keep: Dict[str, Any], off: Dict[str, Any]) -> str:
    """The last line: memory saved, and the step-time ratio with its 95% interval, or why
    there is none (NOTE [Step kinds]); a warning when either side has few steps.

    NOTE [Headline memory]: the memory saved is measured by something other than the
    cache: on a GPU ``torch.cuda.max_memory_allocated`` above the level before the
    phase's first forward, on a CPU the process's RSS above it (the phases'
    ``independent_peak_bytes``, :class:`~megatron_ssd.memory.PhaseMemory`). The cache's
    own count follows it; it alone is shown only where no independent measure exists.
    """
    memory = memory_saved(keep, off)
    unmeasured = [p["name"] for p in (keep, off) if p.get("measured_kind", "measured") != "measured"]
    if unmeasured:
        return f"{memory}; no step-time ratio: {', '.join(unmeasured)} has no measured step"
    ratio = off["median_step_s"] / keep["median_step_s"] if keep["median_step_s"] else float("nan")
    lo, hi = ratio_ci95([off["step_s"]], [keep["step_s"]])
    n_off, n_keep = off["measured_steps"], keep["measured_steps"]
    few = min(n_off, n_keep) < FEW_STEPS
    warning = (f"; WARNING: from {n_off} and {n_keep} measured steps, too few for a ratio to mean much "
               f"(at least {FEW_STEPS} each)") if few else ""
    return (f"{memory}, step time {ratio:.2f}x keep-everything (95% interval {lo:.2f}-{hi:.2f}; "
            f"medians of {n_off} and {n_keep} measured steps){warning}")


def loss_identity(phases: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Whether each later phase's losses equal the first phase's (keep-everything's),
    step for step over the steps both ran (NOTE [Same start] in ``train.py``): per phase
    ``None`` when all are equal (bit for bit), else the first step (1-based) that differs
    with both losses. A phase that ran out of memory is left out (NOTE [Out of memory,
    recorded]); when keep-everything did, the first phase that ran is the reference."""
    ran = [p for p in phases if p.get("oom") is None]
    if len(ran) < 2:
        return {}
    reference = ran[0].get("losses") or []
    out: Dict[str, Any] = {"reference": ran[0]["name"], "phases": {}}
    for p in ran[1:]:
        losses = p.get("losses") or []
        n = min(len(losses), len(reference))
        first = next((i for i in range(n) if losses[i] != reference[i]), None)
        out["phases"][p["name"]] = {"steps": n, "first_difference": None if first is None else
                                    {"step": first + 1, "loss": losses[first], "reference_loss": reference[first]}}
    return out


def format_loss_identity(identity: Dict[str, Any]) -> str:
    """One line: which phases' losses equal keep-everything's bit for bit, over how many
    steps, and where the others first differ."""
    if not identity:
        return ""
    same = [name for name, r in identity["phases"].items() if r["first_difference"] is None]
    steps = min(r["steps"] for r in identity["phases"].values())
    parts = []
    if same:
        parts.append(f"{', '.join(same)}: identical to {identity['reference']}, bit for bit")
    for name, r in identity["phases"].items():
        d = r["first_difference"]
        if d is not None:
            parts.append(f"{name}: differs from step {d['step']} ({d['loss']!r} against {d['reference_loss']!r})")
    return f"losses of the same steps (1-{steps}, same weights and data): " + "; ".join(parts)


def _runs(ids: Sequence[Any]) -> str:
    """``1-3, 5`` for consecutive integer ids; the ids as given otherwise."""
    if not all(isinstance(i, int) for i in ids):
        return ", ".join(str(i) for i in ids)
    out: List[str] = []
    start = prev = None
    for i in list(ids) + [None]:
        if start is not None and i is not None and i == prev + 1:
            prev = i
            continue
        if start is not None:
            out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = i
    return ", ".join(out)


def plan_summary(plan: Optional[Dict[str, Any]]) -> str:
    """A plan's placements in words: ``offload 1-2, part of 3; recompute 4-5; keep 6``,
    a layer that recomputes modules inside it grouped apart (``keep +core_attn 7-8``; the
    layers inside the model; the tensors saved outside them are left out)."""
    if not plan:
        return "no plan"
    groups: Dict[str, List[Any]] = {}
    partial: Dict[str, List[Any]] = {}
    kinds: List[str] = []
    for layer in Plan.from_dict(plan).layers:
        if layer.layer_id in OUTSIDE:
            continue
        kind = layer.placement.value + "".join(f" +{m}" for m in layer.choice.recompute)
        kinds.append(kind)
        if layer.offload_sites is not None and layer.offload_sites < layer.site_count:
            partial.setdefault(kind, []).append(layer.layer_id)
        else:
            groups.setdefault(kind, []).append(layer.layer_id)
    order = {"offload": 0, "host": 1, "recompute": 2, "keep": 3}
    parts = []
    for kind in sorted(dict.fromkeys(kinds), key=lambda k: (order[k.split()[0]], k)):
        whole, part = groups.get(kind, []), partial.get(kind, [])
        text = ", ".join(x for x in (_runs(whole), f"part of {_runs(part)}" if part else "") if x)
        parts.append(f"{kind} {text}")
    return "; ".join(parts)


_FIXED_WORDS = {"keep-everything": "every layer kept", "recompute": "every layer recomputed",
                "offload-all": "every layer offloaded", "host": "every layer to host memory"}


def format_choices(phases: Sequence[Dict[str, Any]], plan: Optional[Dict[str, Any]], config: TrainConfig) -> str:
    """The comparison table of ``train`` with ``compare``: per phase, its independent peak
    memory (NOTE [Headline memory]), the cache's count, its median step and ratio to
    keep-everything with the ratio's 95% interval (its paired steps' where it ran them,
    NOTE [Paired steps]), and what it placed; then the line on the losses
    (:func:`format_loss_identity`)."""
    keep = phases[0]
    source = next((p.get("independent_peak_source") for p in phases if p.get("independent_peak_source")), "")
    measure = ("torch.cuda.max_memory_allocated above the pre-forward level" if source in _INDEPENDENT
               else "process RSS above the pre-forward level")
    name_w = max(len(p["name"]) for p in phases) + 2
    lines = ["", f"{'':<{name_w}}{'peak memory':>12}{'cache count':>13}{'step':>9}{'x keep':>8}"
                 f"{'95% interval':>15}  placement",
             f"{'':<{name_w}}{'MiB':>12}{'MiB':>13}{'s':>9}"]
    for p in phases:
        if p.get("oom") is not None:  # NOTE [Out of memory, recorded]
            lines.append(f"{p['name']:<{name_w}}{'-':>12}{'-':>13}{'-':>9}{'-':>8}{'':>15}  out of device memory at "
                         f"step {p['oom_step']}: {p['oom']}")
            continue
        peak = p.get("independent_peak_bytes")
        ratio = p["median_step_s"] / keep["median_step_s"] if keep["median_step_s"] else float("nan")
        if p is keep or keep.get("oom") is not None:
            interval = ""
        else:
            if p.get("paired"):  # NOTE [Paired steps]: the machine's drift cancelled out
                ratio, (lo, hi) = p["paired"]["median_ratio"], p["paired"]["ratio_ci95"]
            else:
                lo, hi = ratio_ci95([p["step_s"]], [keep["step_s"]])
            interval = f"{lo:.2f}-{hi:.2f}"
        if p is phases[-1] and plan is not None:
            what = plan_summary(plan)
        elif p["name"] == "keep-last":
            what = f"last {config.offload.keep_last_layers} kept, the others offloaded"
        else:
            what = _FIXED_WORDS.get(p["name"], "")
        ratio_text = "-" if keep.get("oom") is not None else f"{ratio:.2f}"  # no reference to divide by
        lines.append(f"{p['name']:<{name_w}}{'-' if peak is None else f'{peak / MiB:.1f}':>12}"
                     f"{p['peak_activation_bytes'] / MiB:>13.1f}{p['median_step_s']:>9.3f}{ratio_text:>8}"
                     f"{interval:>15}  {what}")
    steps = min((p.get("measured_steps", 0) for p in phases if p.get("oom") is None), default=0)
    pairs = min((p["paired"]["pairs"] for p in phases[1:] if p.get("paired")), default=0)
    ratio = (f"x keep: the median ratio of the pairs of steps each phase ran with keep-everything after its own "
             f"(at least {pairs}), with a 95% interval" if pairs else "its ratio to keep-everything's with a 95% interval")
    lines.append(f"peak memory: {measure}; cache count: the saved activations the cache held; step: median of "
                 f"the measured steps (at least {steps} per phase); {ratio}")
    return "\n".join(lines)
