"""``megatron-ssd rok``: the recompute-offload-keep curve, measured.

Each placement trains the same model in a fresh process (``megatron-ssd train ... --json``), so peaks and allocator state do
not leak from one placement into the next. Beside the planner and the fixed placements it
measures the peers' rules on the same cache and engines (:data:`PEERS`: Megatron's
fine-grained offloading and Transformer Engine's CPU offload on the host tier,
SSDTrain's keep-last on the SSD, Megatron's own selective and full recompute), each at
the settings asked, and the planner at budgets matching them.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Callable, Dict, List, Optional, Sequence

from .. import peer_rule
from ..peer_rule import first_layers_bound
from ..planner.measured_profile import median_or_zero
from ..config import MAX_BYTES, TrainConfig, load_config, to_dict
from ..placement import LayerChoice, Placement
from ..tier import added, load_tier_modules
from ..errors import ConfigError, MegatronSSDError
from ..io.scratch import default_offload_dir, make_private_dir
from ..io.pacing import parse_rate
from ..planner.plan import Plan
from ..planner.profile import StageProfile
from ..planner.search import replay
from ..planner.step_timeline import predict
from ..units import MiB
from .children import child
from .intervals import median_ci95, ratio_ci95
from .dominance import (BUDGET, KEEP_LAST, MEGATRON_FULL, MEGATRON_OFFLOAD, MEGATRON_SELECTIVE, TE_OFFLOAD,
                        add_dominance, format_dominance)
from .output import machine_info, write_json
from .rok_plot import plot_rok
from .steps import short_run_problems

__all__ = ["run_rok", "rok_points", "train_command", "PLACEMENTS", "PEERS", "PEER_HOST_POOL", "CURVES"]


def train_command(config_path: Optional[str], overrides: Sequence[str], json_path: str,
                  timeline: bool = True) -> List[str]:
    """The ``megatron-ssd train`` command line of one placement's run: no keep-everything
    phase of its own, and with ``timeline`` the allocator timeline's extra step (NOTE
    [Independent memory])."""
    return [sys.executable, "-m", "megatron_ssd.commands.cli", "train",
            *(["--config", config_path] if config_path else []), *overrides, "baseline_steps=0",
            f"allocator_timeline={'true' if timeline else 'false'}", "--json", json_path]


def _train_in_subprocess(config_path: Optional[str], overrides: Sequence[str]) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="megatron-ssd-rok-") as tmp:
        out = os.path.join(tmp, "point.json")
        cmd = train_command(config_path, overrides, out)
        print("$ " + " ".join(cmd), flush=True)
        load_before = os.getloadavg()
        with open(os.path.join(tmp, "train.log"), "w+", encoding="utf-8") as log:
            with child(cmd, stdout=log, stderr=subprocess.STDOUT, text=True) as proc:  # NOTE [Ending the children]
                returncode = proc.wait()
            log.seek(0)
            output = log.read()
        load_after = os.getloadavg()
        if returncode != 0 or not os.path.exists(out):
            raise MegatronSSDError(f"rok: a placement run failed (exit {returncode}):\n{output[-3000:]}")
        lines = output.splitlines()
        last = [l for l in lines if ": measured, loss" in l][-1:] or [l for l in lines if "loss" in l][-1:]
        print("  " + (last[0].strip() if last else "done") +
              f" (load average {load_before[0]:.2f} before, {load_after[0]:.2f} after)", flush=True)
        with open(out, encoding="utf-8") as fh:
            report = json.load(fh)
        # the machine's 1-minute load average when the run started and ended (others share it)
        report["load_average"] = [load_before[0], load_after[0]]
        return report


PLACEMENTS: Dict[str, List[str]] = {
    "keep": ["offload.planner.mode=keep"],
    "recompute": ["offload.planner.mode=recompute"],
    "offload-all": ["offload.planner.mode=offload"],
    "planner": ["offload.planner.mode=auto"],
    "keep-last": ["offload.planner.mode=static"],
}
"""The fixed ``rok`` placements and the overrides that select them; ``keep-last`` keeps
the last ``offload.keep_last_layers`` layers and offloads the others (SSDTrain's static
choice)."""

PEER_HOST_POOL = "4GiB"
"""The host pool the host-tier peers run with when the overrides set none: a bound, not an
allocation (on a CPU each blob maps its own memory)."""

PEERS: Dict[str, List[str]] = {
    **{p.name: ["offload.planner.mode=keep", f"offload.peer.rule={p.name}"] for p in peer_rule.PEERS},
    MEGATRON_SELECTIVE: ["offload.planner.mode=keep", "model.recompute_granularity=selective",
                         "model.recompute_modules=core_attn"],
    MEGATRON_FULL: ["offload.planner.mode=keep", "model.recompute_granularity=full"],
}
"""The peers' rules as ``rok`` placements (docs/planner.md, "The peers' rules, measured"):
Megatron's fine-grained activation offloading and Transformer Engine's CPU offload on the
host tier (``OffloadConfig.peer``), Megatron's own selective (core attention) and full
recompute run by megatron-core's code. SSDTrain's rule is ``keep-last``."""

CURVES: Dict[str, str] = {
    KEEP_LAST: "offload.keep_last_layers",
    **{p.name: f"offload.peer.{p.swept}" for p in peer_rule.PEERS},
}
"""The placements run once per setting (``--keep-last``, ``--fractions``, ``--te-layers``),
one point ``<placement>-<setting>`` each, and the field each setting sets."""

UNPAIRED = (MEGATRON_SELECTIVE, MEGATRON_FULL)
"""Placements run without paired steps: Megatron's recompute is built into the model, so
a keep step of a pair could not turn it off; their step time is the fresh-process ratio."""

MATCHED = (KEEP_LAST, *peer_rule.PEER_BY_NAME, MEGATRON_SELECTIVE, MEGATRON_FULL)
"""With ``--match-peers``, the points of these placements each get a planner point whose
budget is their measured peak by the cache's count. Under Megatron's recompute the
cache counts what the forward saves, not what the recompute rebuilds during backward, so
that budget is below the peak the peer reaches (a planner budget counts its own
recompute); a budget no plan can meet is reported infeasible."""


def _point(placement: str, reports: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """One ROK point from the reports of its runs (one per round).

    NOTE [Pooled rounds]: the step time is the median of every measured step of every
    round pooled together, and ``round_median_step_s`` keeps each round's own median so
    the spread stays visible. Rates and bytes are medians of the rounds' medians; peaks
    are maxima over rounds.
    """
    phases = [r["phases"][-1] for r in reports]
    med = lambda key: median_or_zero(p[key] for p in phases)  # noqa: E731
    pooled = [t for p in phases for t in p.get("step_s", [p["median_step_s"]])]
    losses = [p["final_loss"] for p in phases]
    point = {
        "placement": placement,
        "peak_activation_bytes": max(p["peak_activation_bytes"] for p in phases),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in reports),
        # NOTE [Independent memory] (train.py): measured without the cache's help
        "independent_peak_bytes": _max_of(phases, "independent_peak_bytes"),
        "independent_peak_source": phases[0].get("independent_peak_source"),
        "peak_rss_above_base_bytes": _max_of(phases, "peak_rss_above_base_bytes"),
        "rss_base_bytes": _max_of(phases, "rss_base_bytes"),
        "allocator_peak_bytes": _max_of(phases, "allocator_peak_bytes"),
        "median_step_s": median_or_zero(pooled),
        "round_median_step_s": [p["median_step_s"] for p in phases],
        "round_step_s": [list(p.get("step_s", [p["median_step_s"]])) for p in phases],
        "cpu_s_per_step": med("cpu_s_per_step"),
        "io_cpu_s_per_step": med("io_cpu_s_per_step"),
        "bytes_written": med("bytes_written_per_step"),
        "bytes_queued": med("bytes_queued_per_step"),
        "bytes_read": med("bytes_read_per_step"),
        "bytes_write_cancelled": med("bytes_write_cancelled_per_step"),
        "stall_s": med("stall_s_per_step"),
        "write_wait_s": med("write_wait_s_per_step"),
        "write_bytes_per_s": med("write_bytes_per_s"),
        "read_bytes_per_s": med("read_bytes_per_s"),
        "measured_steps": len(pooled),
        "rounds": len(reports),
        "final_loss": losses[0],
        "final_loss_same_every_round": all(l == losses[0] for l in losses),
        "load_average": [r.get("load_average") for r in reports],
        "bytes_to_host": med("bytes_to_host_per_step"),
        "peak_host_bytes": max(p.get("peak_host_bytes", 0) for p in phases),
    }
    moved_to = sorted({name for p in phases for name in p.get("tier_bytes_per_step") or {}})  # NOTE [Tiers]
    if moved_to:
        point["tier_bytes_per_step"] = {name: median_or_zero((p.get("tier_bytes_per_step") or {}).get(name, 0)
                                                             for p in phases) for name in moved_to}
    plans = [[e for e in r["planner"]["events"] if e["plan"] is not None] for r in reports]
    planned = plans[0]
    if planned:
        plan = planned[-1]["plan"]
        made = Plan.from_dict(plan)
        point["plan"] = [lp.placement_text for lp in made.layers]
        point["plan_same_every_round"] = all(
            p and [lp.placement_text for lp in Plan.from_dict(p[-1]["plan"]).layers] == point["plan"] for p in plans
        )
        point["predicted_exposed_s"] = plan["exposed_s"]
        point["predicted_step_s"] = plan["step_s"]
        point["predicted_peak_activation_bytes"] = plan["peak_activation_bytes"]
        point["predicted_counted_peak_bytes"] = plan_counted_peak_bytes(reports[0]["planner"].get("profile"), plan)
        point["plan_moved_bytes"] = {Placement.OFFLOAD.value: made.offloaded_bytes, Placement.HOST.value: made.hosted_bytes,
                                     **{p.value: moved for p in added() if (moved := made.moved_to(p))}}
        point["plan_io"] = plan["io"]  # the measured profile it was made from: bandwidths, compute_slowdown
        point["plan_keep_step_s"] = plan["keep_step_s"]
    paired = [r["paired"] for r in reports if r.get("paired")]
    if paired:  # NOTE [Paired steps]: every round's pairs pooled
        ratios = [x for p in paired for x in p["ratios"]]
        point["paired_ratios"] = ratios
        point["paired_x_keep"] = median_or_zero(ratios)
        point["paired_x_keep_ci95"] = median_ci95(ratios)
        point["paired_keep_step_s"] = median_or_zero([t for p in paired for t in p["keep_step_s"]])
        point["paired_step_s"] = median_or_zero([t for p in paired for t in p["offload_step_s"]])
        if planned and plan.get("pipeline_size", 1) == 1:
            point.update(prediction_parts(plan, reports[0]["config"]["num_microbatches"], point))
    return point


# NOTE [Two parts of a prediction's error]
# A planned point's predicted ratio is the plan's replayed step over the replay of the
# profile's KEEP step, and its paired ratio is the plan's measured steps over the keep
# steps measured beside them, later in the same process. The ratio's error is then two
# errors: the plan's step time against its prediction, and the paired keep steps against
# the profile's KEEP step (one step, NOTE [Warm-up steps] in ``profiling.py``).
# The second is no fault of the plan's price: on configs/gpt-ref-cpu.yaml (2026-12-07,
# rok-gpt-ref-cpu-s60.json) a point predicted at 1.088x and measured at 1.240x had its
# plan's step predicted 4.7% fast and its profile's KEEP step 8.7% above the paired keep
# steps. So each point reports both (docs/performance.md#two-parts-of-a-predictions-error).
# With one pipeline stage a step is its micro-batches one after the other, so the plan's
# per-micro-batch replay times the micro-batches is its step.


def prediction_parts(plan: Dict[str, Any], microbatches: int, point: Dict[str, Any]) -> Dict[str, float]:
    """The plan's predicted step, its error against the paired steps' median, and how far
    the profile's KEEP step was from the paired keep steps (NOTE [Two parts of a
    prediction's error]); empty where a median is missing."""
    if not point.get("paired_step_s") or not point.get("paired_keep_step_s"):
        return {}
    predicted = plan["step_s"] * microbatches
    return {"predicted_paired_step_s": predicted,
            "plan_step_error": predicted / point["paired_step_s"] - 1.0,
            "profile_keep_drift": plan["keep_step_s"] * microbatches / point["paired_keep_step_s"] - 1.0}


def _max_of(phases: Sequence[Dict[str, Any]], key: str) -> Optional[int]:
    values = [p[key] for p in phases if p.get(key) is not None]
    return max(values) if values else None


def add_ratios(points: List[Dict[str, Any]]) -> None:
    """Add each point's step time relative to keep: pooled, per round, and its interval.

    ``round_ratios[r]`` divides the point's round-r median by keep's round-r median.
    Rounds interleave the placements, so a ratio within one round compares runs made
    minutes apart, and machine drift between rounds cancels out of it. ``x_keep_ci95``
    is the 95% interval of ``x_keep`` (NOTE [Stratified bootstrap]): a target such as
    "at most 1.03x keep" is met beyond noise only when the interval's top is below it.
    """
    keep = next((p for p in points if p["placement"] == "keep" and "median_step_s" in p), None)
    if keep is None:
        return
    for p in points:
        if "median_step_s" not in p:
            continue
        p["x_keep"] = p["median_step_s"] / keep["median_step_s"]
        p["round_ratios"] = [a / b for a, b in zip(p["round_median_step_s"], keep["round_median_step_s"])]
        p["x_keep_ci95"] = [1.0, 1.0] if p is keep else ratio_ci95(p["round_step_s"], keep["round_step_s"])


def rok_points(config_path: Optional[str], overrides: Sequence[str], budgets: Sequence[float] = (0.5,),
               rounds: int = 1, placements: Optional[Sequence[str]] = None,
               paired: int = 0, keep_last: Sequence[int] = (), fractions: Sequence[float] = (),
               te_layers: Sequence[int] = (), match_peers: bool = False,
               host_throttle: Optional[str] = None) -> List[Dict[str, Any]]:
    """Measure keep, recompute, offload-all, the planner, the peers' rules and planner
    budgets (fractions of keep's peak), each in a fresh process.

    With ``rounds > 1`` the whole sequence runs that many times, interleaved (keep,
    recompute, ..., keep, recompute, ...), and each point pools its rounds
    (NOTE [Pooled rounds]). ``placements`` restricts the placements (default: the fixed
    ones, the planner and the budgets; the peers of :data:`PEERS` only when named);
    budgets need ``keep`` among them. ``keep_last``, ``fractions`` and ``te_layers`` run
    ``keep-last``, ``megatron-offload`` and ``te-offload`` once per setting (points
    ``<placement>-<setting>``, :data:`CURVES`) instead of once with the configuration's.
    ``match_peers`` adds, after the first round, a budget point at each measured
    :data:`MATCHED` point's counted peak (``matches`` names it). ``paired`` adds that many
    pairs of steps to the run of every placement but keep and :data:`UNPAIRED`, budgets
    included (NOTE [Paired steps]), pooled over rounds into each point's
    ``paired_x_keep``. ``host_throttle`` paces the host tier's copies of every run to that
    rate (``offload.host_copy_bytes_per_s``, NOTE [Host copy rate]) and gives the planner's
    runs (``planner`` and the budgets) the host-tier peers' pool, which the planner then
    plans with (NOTE [Paced host tier] in ``adaptive.py``).
    """
    known = [*PLACEMENTS, *PEERS, BUDGET]
    names = list(placements or [*PLACEMENTS, BUDGET])
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"rok: placements = {unknown}: each must be one of {sorted(known)}")
    if BUDGET in names and "keep" not in names:
        raise ConfigError(f"rok: placements = {names}: {BUDGET!r} needs 'keep' (the budgets are fractions of its peak)")
    if match_peers and not any(n in MATCHED for n in names):
        raise ConfigError(f"rok: --match-peers with placements = {names}: needs one of {list(MATCHED)}")
    bad = [f for f in budgets if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1]
    if bad:
        raise ConfigError(f"rok: budgets = {list(budgets)}: each must be a fraction of keep's peak in (0, 1]")
    if BUDGET not in names or not budgets:
        budgets = ()
    names = [n for n in names if n != BUDGET]
    settings = {KEEP_LAST: _check_keep_last(config_path, overrides, names, keep_last),
                MEGATRON_OFFLOAD: _check_fractions(names, fractions),
                TE_OFFLOAD: _check_te_layers(config_path, overrides, names, te_layers)}
    if rounds < 1:
        raise ConfigError(f"rok: rounds = {rounds}: must be >= 1")
    if paired < 0 or (paired and names == ["keep"] and not budgets):
        raise ConfigError(f"rok: paired = {paired}: must be >= 0, and > 0 only with a placement other than keep "
                          "(pairs compare it with keep)")
    pairs = [f"paired_steps={paired}"] if paired else []
    common = list(overrides) + host_throttle_overrides(host_throttle)
    pool = [] if any(o.startswith("offload.host_pool_bytes=") for o in overrides) else [
        f"offload.host_pool_bytes={PEER_HOST_POOL}"]
    # with the host tier paced the planner plans it too (NOTE [Paced host tier] in adaptive.py):
    # its runs get the peers' pool, so both use the same tier
    planned_pool = pool if host_throttle is not None else []
    base = {**PLACEMENTS, "planner": [*PLACEMENTS["planner"], *planned_pool],
            **{name: [*extra, *(pool if name in peer_rule.PEER_BY_NAME else [])] for name, extra in PEERS.items()}}
    selected = {name: [*base[name], *(pairs if name != "keep" and name not in UNPAIRED else [])] for name in names}
    for curve, values in settings.items():  # one point per setting, where the placement stood in the order
        if not values:
            continue
        at = names.index(curve)
        names[at:at + 1] = [f"{curve}-{v:g}" for v in values]
        selected.update({f"{curve}-{v:g}": [*base[curve], f"{CURVES[curve]}={v}", *pairs] for v in values})
    checks = dict(selected)
    if budgets or match_peers:  # a budget's run profiles RECOMPUTE too (NOTE [Pricing recompute]); any budget selects it
        checks[BUDGET] = ["offload.planner.mode=auto", "offload.planner.memory_budget=1"]
    _check_measurable(config_path, common, checks)
    runs: Dict[str, List[Dict[str, Any]]] = {}
    infeasible: Dict[str, str] = {}
    extra_runs: List[tuple] = []
    matches: Dict[str, List[str]] = {}
    for r in range(rounds):
        print(f"-- round {r + 1} of {rounds}", flush=True)
        for name in names:
            runs.setdefault(name, []).append(_train_in_subprocess(config_path, [*common, *selected[name]]))
        if r == 0:
            keep_peak = runs["keep"][0]["phases"][-1]["peak_activation_bytes"] if budgets else 0
            wanted = [(int(keep_peak * fraction), None) for fraction in budgets]
            if match_peers:
                wanted += [(runs[n][0]["phases"][-1]["peak_activation_bytes"], n) for n in names
                           if any(n.startswith(m) for m in MATCHED)]
            for budget, peer in wanted:
                name = f"{BUDGET}-{budget}"
                if peer is not None:
                    matches.setdefault(name, []).append(peer)
                if all(name != n for n, _ in extra_runs):
                    extra_runs.append((name, ["offload.planner.mode=auto", *planned_pool,
                                              f"offload.planner.memory_budget={budget}",
                                              *pairs]))
        for name, extra in extra_runs:
            if name in infeasible:  # refused once: the budget is below what can be reached
                continue
            try:
                report = _train_in_subprocess(config_path, [*common, *extra])
            except MegatronSSDError as err:
                infeasible[name] = str(err).splitlines()[-1][:500]
                continue
            runs.setdefault(name, []).append(report)
    points = []
    for name in [*names, *(n for n, _ in extra_runs)]:
        if name not in runs:  # infeasible in the first round
            points.append({"placement": name, "infeasible": infeasible[name]})
        else:
            points.append(_point(name, runs[name]))
        if name in matches:
            points[-1]["matches"] = matches[name]
    for p in points:
        for curve, field in CURVES.items():
            if p["placement"].startswith(curve + "-") and p["placement"] in runs:
                section, key = field.rsplit(".", 1)
                config = runs[p["placement"]][0]["config"]
                for part in section.split("."):
                    config = config[part]
                p["setting"] = {key: config[key]}
                if curve == KEEP_LAST:
                    p["keep_last_layers"] = config[key]
        if p["placement"] in UNPAIRED and paired:
            p["paired_not_run"] = "Megatron's recompute is built into the model: a keep step could not turn it off"
    add_ratios(points)
    add_predictions(points, {name: rs[0] for name, rs in runs.items()})
    add_dominance(points)
    return points


def _check_measurable(config_path: Optional[str], overrides: Sequence[str], selected: Dict[str, List[str]]) -> None:
    """Refuse, before any run, a placement whose run would measure no step (NOTE [Step kinds]);
    ``selected`` maps each placement to the overrides its run adds."""

    for name, extra in selected.items():
        config = load_config(TrainConfig, config_path, [*overrides, *extra, "baseline_steps=0"])
        problems = short_run_problems(config)
        if problems:
            raise ConfigError(f"rok: placement {name!r}: {'; '.join(problems)}")


def _check_layer_counts(config_path: Optional[str], overrides: Sequence[str], names: Sequence[str],
                        counts: Sequence[int], field: str, placement: str, low: int, what: str,
                        why: str, most: Callable[[int], int] = lambda layers: layers - 1) -> List[int]:
    """Layer counts given to ``placement`` (``--keep-last``, ``--te-layers``), checked: distinct
    integers from ``low`` to ``most(the model's layer count)``, and ``placement`` selected."""
    values = list(counts)
    if not values:
        return values
    if placement not in names:
        raise ConfigError(f"rok: {field} = {values}: needs {placement!r} among the placements {list(names)}")
    layers = load_config(TrainConfig, config_path, overrides).model.num_layers
    bad = [n for n in values if isinstance(n, bool) or not isinstance(n, int) or not low <= n <= most(layers)]
    if bad or len(set(values)) != len(values):
        raise ConfigError(f"rok: {field} = {values}: each must be a distinct number of {what} from {low} to "
                          f"{most(layers)} (model.num_layers = {layers}; {why})")
    return values


def _check_keep_last(config_path: Optional[str], overrides: Sequence[str], names: Sequence[str],
                     keep_last: Sequence[int]) -> List[int]:
    """The ``--keep-last`` counts: 0 (every layer offloaded) to one below the model's layer
    count (all kept is ``keep``), and ``keep-last`` selected."""
    return _check_layer_counts(config_path, overrides, names, keep_last, "keep_last", KEEP_LAST, 0, "kept layers",
                               "keeping all is the 'keep' placement")


def _check_fractions(names: Sequence[str], fractions: Sequence[float]) -> List[float]:
    """The ``--fractions`` of ``megatron-offload``: distinct numbers in [0, 1], and the
    placement selected."""
    values = list(fractions)
    if not values:
        return values
    if MEGATRON_OFFLOAD not in names:
        raise ConfigError(f"rok: fractions = {values}: needs {MEGATRON_OFFLOAD!r} among the placements {list(names)}")
    bad = [f for f in values if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1]
    if bad or len(set(values)) != len(values):
        raise ConfigError(f"rok: fractions = {values}: each must be a distinct activation_offload_fraction in [0, 1]")
    return values


def _check_te_layers(config_path: Optional[str], overrides: Sequence[str], names: Sequence[str],
                     counts: Sequence[int]) -> List[int]:
    """The ``--te-layers`` of ``te-offload``: 1 to the model's layers - 1 (Transformer
    Engine's bound), and the placement selected."""
    return _check_layer_counts(config_path, overrides, names, counts, "te_layers", TE_OFFLOAD, 1,
                               "offloaded first layers", "Transformer Engine keeps the last", first_layers_bound)


def plan_counted_peak_bytes(profile: Optional[Dict[str, Any]], plan: Dict[str, Any]) -> Optional[int]:
    """A plan's (``Plan.to_dict``) predicted peak as the tensor cache counts it (NOTE [What
    the cache counts] in ``planner/step_timeline.py``), replayed on the profile it was made
    from (a ``StageProfile.to_dict``); None without one."""
    if not profile:
        return None
    return replay(StageProfile.from_dict(profile), Plan.from_dict(plan).layer_choices).counted_peak_bytes


def add_predictions(points: List[Dict[str, Any]], reports: Dict[str, Dict[str, Any]]) -> None:
    """Predict each fixed placement's exposed I/O and peak from the planner run's profile.

    The planner point already carries its own prediction; keep, recompute, offload-all and
    keep-last get the timeline model's prediction for their placement, so every measured point can
    be compared with the model (``predicted_exposed_s`` is per step: per micro-batch times
    micro-batches).
    """

    profile = (reports.get("planner") or {}).get("planner", {}).get("profile")
    if not profile:
        return
    stage = StageProfile.from_dict(profile)
    fixed = {"keep": stage.fixed(Placement.KEEP), "recompute": stage.fixed(Placement.RECOMPUTE),
             "offload-all": stage.fixed(Placement.OFFLOAD)}
    for p in points:
        report = reports.get(p["placement"])
        if report is None:
            continue
        mbs = report["config"]["num_microbatches"]
        offload = report["config"]["offload"]  # prefetch_layers in reports written before
        read_ahead = offload.get("default_read_ahead", offload.get("prefetch_layers"))
        if p["placement"].startswith(KEEP_LAST):
            fixed[p["placement"]] = stage.fixed(Placement.OFFLOAD, offload["keep_last_layers"])
        if p["placement"] in fixed:
            t = predict(stage, [LayerChoice(f, read_ahead=read_ahead) for f in fixed[p["placement"]]])
            p["predicted_exposed_s"] = t.exposed_s
            p["predicted_step_s"] = t.step_s
            p["predicted_peak_activation_bytes"] = t.peak_bytes
            p["predicted_counted_peak_bytes"] = t.counted_peak_bytes  # NOTE [What the cache counts] in planner/holds.py
        if "predicted_exposed_s" in p:
            p["predicted_exposed_s_per_step"] = p["predicted_exposed_s"] * mbs
            p["measured_exposed_s_per_step"] = p["stall_s"] + p["write_wait_s"]


def host_throttle_overrides(host_throttle: Optional[str]) -> List[str]:
    """The train override that paces the host tier's copies to ``--host-throttle`` (NOTE
    [Host copy rate] in ``io/pacing.py``); none without it."""
    if host_throttle is None:
        return []
    rate = parse_rate("rok", "host-throttle", host_throttle)
    if not rate or not 0 < rate <= MAX_BYTES:  # NOTE [Bounded numbers]
        raise ConfigError(f"rok: --host-throttle {host_throttle!r}: must be a rate > 0 and <= {MAX_BYTES} bytes "
                          "(1 EiB) per second, such as 1GiB")
    return [f"offload.host_copy_bytes_per_s={rate}"]


def _throttle_for(config: TrainConfig, rate: str) -> Any:
    """The blkio throttle (``megatron_ssd_lab.blkio.BlkioThrottle``) of the disk holding the
    first offload path (or the default offload directory); one ConfigError naming the reason
    when it cannot be set. The throttle is a benchmark tool of the repository's lab package,
    which the wheel does not ship: it is imported here, when ``--throttle`` is given."""
    nbytes = parse_rate("rok", "throttle", rate)
    if not nbytes or not 0 < nbytes <= MAX_BYTES:  # NOTE [Bounded numbers]
        raise ConfigError(f"rok: --throttle {rate!r}: must be a rate > 0 and <= {MAX_BYTES} bytes (1 EiB) per "
                          "second, such as 250MiB")
    try:
        from megatron_ssd_lab.blkio import BlkioThrottle, blkio_available
    except ImportError:
        raise ConfigError(f"rok: --throttle {rate}: needs megatron_ssd_lab, the repository's lab package, which "
                          "the wheel does not ship; run rok in the checkout's environment (make builds it) or put "
                          "the checkout on PYTHONPATH") from None
    reason = blkio_available()
    if reason is not None:
        raise ConfigError(f"rok: --throttle {rate}: {reason}")
    path = config.offload.paths[0] if config.offload.paths else make_private_dir(default_offload_dir())
    return BlkioThrottle(path, nbytes, nbytes)


def format_rok(points: Sequence[Dict[str, Any]]) -> str:
    """The ROK table: measured peaks (``live``: allocator timeline; ``RSS+``: process RSS
    above its pre-forward level), the cache's own count, ``x keep`` pooled with its 95%
    interval and its range over rounds, bytes written to the SSDs and copied to the host
    tier per step."""
    lines = [f"{'placement':<22}{'live MiB':>10}{'RSS+ MiB':>10}{'cache MiB':>11}{'peak RSS MiB':>14}"
             f"{'step s':>9}{'x keep':>8}"
             f"{'95% interval':>14}{'per round':>13}{'I/O CPU s':>11}{'written MiB':>13}{'to host MiB':>13}"]
    for p in points:
        if "median_step_s" not in p:
            lines.append(f"{p['placement']:<22}  infeasible: {p.get('infeasible', '')[:60]}")
            continue
        ratios = p.get("round_ratios") or []
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if len(ratios) > 1 else ""
        lo, hi = p.get("x_keep_ci95") or (float("nan"), float("nan"))
        interval = f"{lo:.3f}-{hi:.3f}" if lo == lo else ""
        lines.append(
            f"{p['placement']:<22}{_mib(p.get('allocator_peak_bytes')):>10}{_mib(p.get('peak_rss_above_base_bytes')):>10}"
            f"{p['peak_activation_bytes'] / MiB:>11.1f}{p['peak_rss_bytes'] / MiB:>14.0f}"
            f"{p['median_step_s']:>9.3f}{p.get('x_keep', float('nan')):>8.3f}{interval:>14}{spread:>13}"
            f"{p['io_cpu_s_per_step']:>11.2f}{p['bytes_written'] / MiB:>13.1f}{p.get('bytes_to_host', 0) / MiB:>13.1f}"
        )
    return "\n".join(lines)


def _mib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / MiB:.1f}"


def run_rok(config_path: Optional[str], overrides: Sequence[str], json_path: Optional[str] = None,
            plot_path: Optional[str] = None, rounds: int = 1, placements: Optional[Sequence[str]] = None,
            paired: int = 0, throttle: Optional[str] = None, budgets: Sequence[float] = (0.5,),
            keep_last: Sequence[int] = (), fractions: Sequence[float] = (), te_layers: Sequence[int] = (),
            match_peers: bool = False, host_throttle: Optional[str] = None) -> int:
    """``megatron-ssd rok``: the measured recompute-offload-keep curve; with ``throttle``
    (a rate such as ``250MiB``), every placement runs with the offload disk throttled to
    it (NOTE [blkio throttle]); with ``host_throttle`` the host tier's copies are paced
    to that rate (NOTE [Host copy rate])."""
    config = load_config(TrainConfig, config_path, overrides)  # validate before spending minutes
    load_tier_modules(config.offload.tier_modules)  # its plans may name their tiers (NOTE [Tiers])
    limit = None if throttle is None else _throttle_for(config, throttle)
    with limit.applied() if limit is not None else contextlib.nullcontext():  # placements inherit the group
        points = rok_points(config_path, overrides, budgets=budgets, rounds=rounds, placements=placements,
                            paired=paired, keep_last=keep_last, fractions=fractions, te_layers=te_layers,
                            match_peers=match_peers, host_throttle=host_throttle)
    print(format_rok(points))
    dominance = format_dominance(points)
    if dominance:
        print(dominance)
    for p in points:
        if "paired_x_keep" in p:
            lo, hi = p["paired_x_keep_ci95"]
            print(f"{p['placement']}: paired steps {p['paired_x_keep']:.3f}x keep "
                  f"(median of {len(p['paired_ratios'])} pairs; 95% interval {lo:.3f}-{hi:.3f})")
        if "plan_step_error" in p:  # NOTE [Two parts of a prediction's error]
            print(f"{p['placement']}: predicted {p['predicted_step_s'] / p['plan_keep_step_s']:.3f}x keep: its step "
                  f"{p['predicted_paired_step_s']:.3f} s, measured {p['paired_step_s']:.3f} s "
                  f"({100 * p['plan_step_error']:+.1f}%); the profile's keep step "
                  f"{100 * p['profile_keep_drift']:+.1f}% from the paired keep steps")
    if json_path:
        write_json(json_path, {"points": points, "rounds": rounds, "workload": to_dict(config),
                               "machine": machine_info(),
                               "throttle_bytes_per_s": None if limit is None else limit.write_bps,
                               "host_copy_bytes_per_s": (None if host_throttle is None else
                                                         parse_rate("rok", "host-throttle", host_throttle))})
    if plot_path:
        plot_rok(points, plot_path, title=os.path.basename(config_path or "rok"))
    return 0
