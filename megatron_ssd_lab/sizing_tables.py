"""The H100 tables of ``docs/planner.md``: sizing, the peers against the planner, and the
drive classes where SSD offload lasts.

Computed here from ``simulate``'s model (``planner/simulate.py``) so a test can check the
docs hold what the code computes (``benchmarks/simulate_h100.py`` writes them to
``benchmarks/results/``)::

    rows = sizing_rows()          # each model and drive count: the plan, its wear, the host tier
    print(sizing_markdown(rows))
    rows = peer_rows()            # each peer point beside the planner at its memory
    print(peer_markdown(rows))
    rows = drive_rows()           # each drive preset under the 3-year wear bound
    print(drive_markdown(rows))

Every number is the timeline model's prediction (``planner/step_timeline.py``) for one GPU of
an 8-GPU H100 node, the stage ``simulate`` describes: the peers' rules are priced by
``planner/peers.py`` on the same stage, the planner plans it with ``make_plan``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from megatron_ssd.placement import EMBEDDING, OUTSIDE, Placement
from megatron_ssd.planner.drives import DRIVES, drive_preset
from megatron_ssd.planner.peers import (LayerAnatomy, PeerPoint, full_recompute, keep_everything, megatron_offload,
                                         price, selective_recompute, te_offload)
from megatron_ssd.planner.plan import Plan, PlanInfeasibleError, PlanRequest, make_plan
from megatron_ssd.planner.profile import StageProfile
from megatron_ssd.planner.simulate import (
    SimulationSpec,
    activation_capacity,
    host_budget,
    layer_anatomy,
    simulate,
    spec_from_overrides,
    stage_profile,
)
from megatron_ssd.planner.step_timeline import predict
from megatron_ssd.planner.wear import drive_lifetime_years, write_limit_bytes_per_s

__all__ = [
    "COMPARISON_DRIVE",
    "COMPARISON_DRIVES_PER_NODE",
    "FGO_FRACTIONS",
    "SIZING_DRIVES",
    "SIZING_HOST_RAM",
    "SIZING_MODELS",
    "drive_markdown",
    "drive_rows",
    "peer_markdown",
    "peer_points",
    "peer_rows",
    "sizing_markdown",
    "sizing_rows",
]

SIZING_MODELS = ("gpt-7b", "gpt-13b", "gpt-70b", "gpt-7b-32k", "gpt-13b-32k", "gpt-70b-32k")
"""The ``MODEL_PRESETS`` (``planner/simulation_spec.py``) of ``docs/planner.md``'s H100 tables:
7B / 13B / 70B GPTs at 4k and 32k tokens, each with its preset's parallel layout."""
SIZING_DRIVES = (2, 4, 8)
"""Drives per 8-GPU node in the sizing table (all eight GPUs share them)."""
SIZING_HOST_RAM = 256e9
"""Host RAM per node lent to the host tier in the tables' host-tier columns."""

FGO_FRACTIONS = (0.25, 0.5, 1.0)
"""Megatron fine-grained offload's ``activation_offload_fraction`` settings compared."""
COMPARISON_DRIVE = "solidigm-d7-p5810-800gb"
"""The drive preset of the peer table's SSD column: the cheapest class whose 3-year
bound lets the planner write at H100 speed (the drive table shows which do)."""
COMPARISON_DRIVES_PER_NODE = 8
"""Drives per 8-GPU node in both tables (a DGX H100 carries eight U.2 data drives), all
eight GPUs sharing them."""
GPUS_PER_NODE = 8
WEAR_YEARS = 3.0


def peer_points(stage: StageProfile, anatomy: Mapping[Any, LayerAnatomy]) -> List[PeerPoint]:
    """The peers' settings the table compares on ``stage``: Megatron's fine-grained
    offload at :data:`FGO_FRACTIONS` (all dense modules, Transformer Engine's layer spec),
    Transformer Engine's CPU offload of half the layers and of all but two (its limit for
    full overlap), Megatron's selective recompute of core attention (its default) and of
    the MLP, and full recompute of every layer."""
    layers = sum(1 for layer in stage.layers if layer.layer_id not in OUTSIDE)
    points = [megatron_offload(stage, anatomy, f) for f in FGO_FRACTIONS]
    points += [te_offload(stage, anatomy, n) for n in sorted({layers // 2, layers - 2}) if n >= 1]
    points += [selective_recompute(stage, anatomy, ("core_attn",)), selective_recompute(stage, anatomy, ("mlp",)),
               full_recompute(stage)]
    return points


def _spec(model: str, drive: str, drives_per_node: int, host_ram: float) -> SimulationSpec:
    return spec_from_overrides([f"ssd_count={drives_per_node}", f"gpus_per_array={GPUS_PER_NODE}", f"drive={drive}",
                                f"host_ram_bytes_per_node={host_ram}"], model=model)


def _anatomy(spec: SimulationSpec, stage: StageProfile) -> Dict[Any, LayerAnatomy]:
    return {layer.layer_id: layer_anatomy(spec) for layer in stage.layers if layer.layer_id not in OUTSIDE}


def _layers(plan: Plan, placement: Placement) -> int:
    return sum(1 for lp in plan.layers if lp.placement is placement and lp.layer_id not in OUTSIDE)


class _Planner:
    """The planner on one model's stage, with and without the host tier and the SSDs,
    its plans cached by memory target (many peer points share one: the device's capacity)."""

    def __init__(self, spec: SimulationSpec, stage: StageProfile, lifetime_years: float) -> None:
        self.spec, self.stage = spec, stage
        self.capacity = activation_capacity(spec)
        self.limit = write_limit_bytes_per_s(spec.ssd_tbw_bytes, lifetime_years, spec.ssd_count,
                                             spec.gpus_per_array, spec.duty_cycle, spec.ssd_used_fraction)
        self.no_host = stage.with_io(dataclasses.replace(stage.io, host_bytes_per_s=None))
        self._cache: Dict[Tuple[str, Optional[int]], Any] = {}

    def plan(self, variant: str, target: Optional[int]) -> Any:
        """``host`` (host tier, no SSD writes), ``ssd`` (the drives under the wear bound,
        no host tier) or ``recompute`` (neither) at ``target`` bytes (None: no budget);
        a :class:`PlanInfeasibleError` when nothing meets it."""
        key = (variant, target)
        if key not in self._cache:
            stage = self.stage if variant == "host" else self.no_host
            try:
                self._cache[key] = make_plan(stage, PlanRequest(
                    memory_budget=target, safety_margin=self.spec.safety_margin,
                    default_read_ahead=self.spec.default_read_ahead, read_ahead_mode=self.spec.read_ahead_mode,
                    max_write_bytes_per_s=self.limit if variant == "ssd" else 0.0, capacity_bytes=self.capacity,
                    host_budget_bytes=host_budget(self.spec) if variant == "host" else None))
            except PlanInfeasibleError as err:
                self._cache[key] = err
        return self._cache[key]

    def summary(self, plan: Any) -> Dict[str, Any]:
        """A plan's row fields (or the reason there is none)."""
        if isinstance(plan, PlanInfeasibleError):
            return {"infeasible": str(plan)}
        s = self.spec
        slots = s.num_microbatches + s.pp - 1
        rate = plan.offloaded_bytes * s.num_microbatches / (slots * plan.step_s)
        life = drive_lifetime_years(rate, s.ssd_tbw_bytes, s.ssd_count, s.gpus_per_array, s.duty_cycle,
                                    s.ssd_used_fraction)
        return {
            "peak_bytes": plan.peak_activation_bytes,
            "saved_bytes": plan.keep_peak_activation_bytes - plan.peak_activation_bytes,
            "overhead_fraction": plan.step_s / plan.keep_step_s - 1.0,
            "host_bytes_per_node": plan.host_pool_bytes * s.gpus_per_node,
            "write_bytes_per_s_per_gpu": rate,
            "lifetime_years": None if math.isinf(life) else life,
            "host_layers": _layers(plan, Placement.HOST),
            "offload_layers": _layers(plan, Placement.OFFLOAD),
            "recompute_layers": _layers(plan, Placement.RECOMPUTE),
        }


def _layout(spec: SimulationSpec) -> str:
    return (f"tp{spec.tp}" + (f" pp{spec.pp}" if spec.pp > 1 else "") + (f" cp{spec.cp}" if spec.cp > 1 else "")
            + (f" dp{spec.dp}" if spec.dp > 1 else ""))


def _per_model(rows_of: Callable[..., list], models: Sequence[str], **kwargs: Any) -> list:
    """``rows_of(model, **kwargs)`` for each model, concatenated in the models' order. The
    models are independent, so they are planned in parallel, one spawned process per core
    (spawned, not forked: the caller may hold threads), which halves a 2-core machine's
    minutes of planning; the rows are the same as one after the other."""
    workers = min(len(models), os.cpu_count() or 1)
    if workers <= 1:
        return [row for model in models for row in rows_of(model, **kwargs)]
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return [row for rows in pool.map(functools.partial(rows_of, **kwargs), models) for row in rows]


def peer_rows(models: Sequence[str] = SIZING_MODELS, drive: str = COMPARISON_DRIVE,
              drives_per_node: int = COMPARISON_DRIVES_PER_NODE, host_ram: float = SIZING_HOST_RAM,
              lifetime_years: float = WEAR_YEARS,
              points: Callable[[StageProfile, Mapping[Any, LayerAnatomy]], List[PeerPoint]] = peer_points) -> list:
    """One row per model and peer setting (JSON-ready dicts): the peer's predicted peak,
    saving, step overhead and pinned host RAM per node; then the planner held to the same
    peak (or to the GPU's activation capacity when the peer's peak exceeds it) with the
    host tier (``host_ram`` bytes per node, no SSD writes) and with ``drives_per_node``
    ``drive`` drives under a ``lifetime_years`` wear bound (no host tier), recompute
    allowed in both."""
    drive_preset(drive)
    return _per_model(_peer_model_rows, models, drive=drive, drives_per_node=drives_per_node, host_ram=host_ram,
                      lifetime_years=lifetime_years, points=points)


def _peer_model_rows(model: str, drive: str, drives_per_node: int, host_ram: float, lifetime_years: float,
                     points: Callable[[StageProfile, Mapping[Any, LayerAnatomy]], List[PeerPoint]]) -> list:
    """The rows of :func:`peer_rows` for one model."""
    rows: list = []
    spec = _spec(model, drive, drives_per_node, host_ram)
    stage = stage_profile(spec)
    planner = _Planner(spec, stage, lifetime_years)
    keep = price(keep_everything(stage))
    in_flight = stage.microbatches_in_flight or 1
    for point in points(stage, _anatomy(spec, stage)):
        row: Dict[str, Any] = {
            "model": model, "seq_len": spec.seq_len, "layout": _layout(spec), "peer": point.peer,
            "setting": point.setting, "keep_peak_bytes": keep.peak_bytes, "activation_capacity_bytes": planner.capacity,
        }
        if point.refused:
            rows.append({**row, "refused": point.refused})
            continue
        tl = price(point)
        # the same placement at the bandwidths the planner judges by (derated by its safety margin)
        derated = predict(point.stage, point.choices, io=point.stage.io.derated(spec.safety_margin))
        fits = planner.capacity is None or tl.peak_bytes <= planner.capacity
        target = tl.peak_bytes if fits else planner.capacity
        row.update({
            "peer_peak_bytes": tl.peak_bytes, "peer_saved_bytes": keep.peak_bytes - tl.peak_bytes,
            "peer_fits": fits, "peer_overhead_fraction": tl.step_s / keep.step_s - 1.0,
            "peer_host_bytes_per_node": tl.hosted_bytes * in_flight * spec.gpus_per_node,
            "peer_host_layers": point.host_layers, "peer_recompute_layers": point.recompute_layers,
            "peer_forwarded_layers": len(tl.forwarded), "peer_exposed_s": tl.exposed_s,
            "peer_peak_bytes_derated": derated.peak_bytes,
            "peer_overhead_fraction_derated": derated.step_s / keep.step_s - 1.0,
            "target_bytes": target,
            "drive": drive, "drives_per_node": drives_per_node, "host_ram_bytes_per_node": host_ram,
            "wear_bound_years": lifetime_years,
        })
        for variant in ("host", "ssd"):
            summary = planner.summary(planner.plan(variant, target))
            row[f"planner_{variant}"] = summary
            row[f"planner_{variant}_dominates"] = _dominates(summary, row)
        rows.append(row)
    return rows


def _dominates(planned: Mapping[str, Any], row: Mapping[str, Any]) -> Optional[bool]:
    """Whether a planner point holds no more than the peer's peak at no more step
    overhead (``rok``'s rule, on predictions); None when the peer does not fit the GPU."""
    if not row["peer_fits"]:
        return None
    if "infeasible" in planned:
        return False
    return (planned["peak_bytes"] <= row["peer_peak_bytes"]
            and planned["overhead_fraction"] <= row["peer_overhead_fraction"] + 1e-9)


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB"


def _life(years: Optional[float]) -> str:
    if years is None:
        return "∞"
    return f"{years * 365:.0f} days" if years < 1 else f"{years:.1f} years"


def _planned(p: Mapping[str, Any], ssd: bool) -> str:
    if "infeasible" in p:
        return "infeasible"
    moved = f"{p['offload_layers']} / {p['recompute_layers']}" if ssd else f"{p['host_layers']} / {p['recompute_layers']}"
    extra = (f"{p['write_bytes_per_s_per_gpu'] / 1e9:.2f} GB/s, {_life(p['lifetime_years'])}" if ssd
             else _gb(p["host_bytes_per_node"]))
    return f"{_gb(p['saved_bytes'])}, {p['overhead_fraction']:+.1%}, {extra}, {moved}"


def peer_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """The table of :func:`peer_rows` as Markdown (GB = 10^9 bytes)."""
    out = [
        "| model | layout | peer setting | peer: peak (of capacity), saved, step overhead, pinned host RAM per node "
        "| planner, host tier: saved, overhead, pinned host RAM per node, host / recompute layers "
        "| planner, SSDs: saved, overhead, SSD writes per GPU, drive life, offload / recompute layers "
        "| planner dominates (host tier / SSDs) |",
        "|---|---|---|---|---|---|---|",
    ]
    word = {True: "yes", False: "**no**", None: "peer over capacity"}
    for r in rows:
        head = f"| {r['model']} | {r['layout']} | {r['peer']} {r['setting']} "
        if "refused" in r:
            out.append(head + "| refused by Megatron: pipeline parallelism | | | |")
            continue
        over = "" if r["peer_fits"] else ", over capacity"
        cap = r["activation_capacity_bytes"]
        peer = (f"{_gb(r['peer_peak_bytes'])} ({r['peer_peak_bytes'] / cap:.0%}{over}), {_gb(r['peer_saved_bytes'])}, "
                f"{r['peer_overhead_fraction']:+.1%}, {_gb(r['peer_host_bytes_per_node'])}")
        verdict = (word[None] if r["planner_host_dominates"] is None
                   else f"{word[r['planner_host_dominates']]} / {word[r['planner_ssd_dominates']]}")
        out.append(head + f"| {peer} | {_planned(r['planner_host'], False)} | {_planned(r['planner_ssd'], True)} "
                          f"| {verdict} |")
    return "\n".join(out)


def drive_rows(models: Sequence[str] = SIZING_MODELS, drives: Sequence[str] = tuple(DRIVES),
               drives_per_node: int = COMPARISON_DRIVES_PER_NODE, host_ram: float = SIZING_HOST_RAM,
               lifetime_years: float = WEAR_YEARS) -> list:
    """One row per model and drive preset (JSON-ready dicts): the planner without a
    budget (offload what hides, held to the GPU's capacity) with ``drives_per_node`` of
    the drive under a ``lifetime_years`` wear bound, beside the same planner with no SSD
    writes, first recomputing only, then with ``host_ram`` bytes per node of host tier."""
    return _per_model(_drive_model_rows, models, drives=tuple(drives), drives_per_node=drives_per_node,
                      host_ram=host_ram, lifetime_years=lifetime_years)


def _drive_model_rows(model: str, drives: Sequence[str], drives_per_node: int, host_ram: float,
                      lifetime_years: float) -> list:
    """The rows of :func:`drive_rows` for one model."""
    rows: list = []
    base = None
    for drive in drives:
        spec = _spec(model, drive, drives_per_node, host_ram)
        stage = stage_profile(spec)
        planner = _Planner(spec, stage, lifetime_years)
        if base is None:
            base = {"recompute_only": planner.summary(planner.plan("recompute", None)),
                    "host_tier": planner.summary(planner.plan("host", None))}
        preset = drive_preset(drive)
        rows.append({
            "model": model, "seq_len": spec.seq_len, "layout": _layout(spec), "drive": drive,
            "endurance_class": preset.endurance_class, "dwpd": preset.dwpd, "tbw_bytes": preset.tbw_bytes,
            "drives_per_node": drives_per_node, "wear_bound_years": lifetime_years,
            "write_limit_bytes_per_s_per_gpu": planner.limit,
            "keep_peak_bytes": price(keep_everything(stage)).peak_bytes,
            "activation_capacity_bytes": planner.capacity,
            "planner_ssd": planner.summary(planner.plan("ssd", None)),
            **base,
        })
    return rows


def drive_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """The table of :func:`drive_rows` as Markdown (GB = 10^9 bytes)."""
    out = [
        "| model | layout | drive (class, DWPD) | write bound per GPU | planner with SSDs: saved, overhead, SSD writes "
        "per GPU, drive life, offload / recompute layers | recompute only: saved, overhead "
        "| host tier: saved, overhead, pinned host RAM per node |",
        "|---|---|---|---:|---|---|---|",
    ]
    for r in rows:
        ssd, rec, host = r["planner_ssd"], r["recompute_only"], r["host_tier"]
        out.append(
            f"| {r['model']} | {r['layout']} | {r['drive']} ({r['endurance_class']}, {r['dwpd']:g}) "
            f"| {r['write_limit_bytes_per_s_per_gpu'] / 1e6:.0f} MB/s | {_planned(ssd, True)} "
            f"| {_gb(rec['saved_bytes'])}, {rec['overhead_fraction']:+.1%} "
            f"| {_gb(host['saved_bytes'])}, {host['overhead_fraction']:+.1%}, {_gb(host['host_bytes_per_node'])} |"
        )
    return "\n".join(out)


def _partly(plan: Plan) -> int:
    """Transformer layers of ``plan`` that move only a prefix of their sites."""
    return sum(1 for layer_id, choice in plan.choices().items() if choice.sites is not None and layer_id not in OUTSIDE)


def _placement_of(plan: Plan, layer_id: Any) -> Optional[str]:
    """The placement text of ``layer_id`` in ``plan`` (None: not on this stage)."""
    return next((lp.placement_text for lp in plan.layers if lp.layer_id == layer_id), None)


def sizing_rows(models: Sequence[str] = SIZING_MODELS, drives: Sequence[int] = SIZING_DRIVES,
                lifetime_years: float = 3.0, host_ram: float = SIZING_HOST_RAM) -> list:
    """One row per model and drive count on H100 nodes (``simulate``'s defaults, the
    node's 8 GPUs sharing its drives): the plan without a wear bound, the plan held to
    ``lifetime_years`` of the drives' endurance, and that plan with ``host_ram`` bytes of
    each node's RAM for the host tier. Each row is a JSON-ready dict."""
    return _per_model(_sizing_model_rows, models, drives=tuple(drives), lifetime_years=lifetime_years,
                      host_ram=host_ram)


def _sizing_model_rows(model: str, drives: Sequence[int], lifetime_years: float, host_ram: float) -> list:
    """The rows of :func:`sizing_rows` for one model."""
    rows: list = []
    for count in drives:
        base = [f"ssd_count={count}", "gpus_per_array=8"]
        free = simulate(spec_from_overrides([*base, "target_lifetime_years=null"], model=model))
        worn = simulate(spec_from_overrides([*base, f"target_lifetime_years={lifetime_years}"], model=model))
        hosted = simulate(spec_from_overrides([*base, f"target_lifetime_years={lifetime_years}",
                                               f"host_ram_bytes_per_node={host_ram}"], model=model))
        s = free.spec
        rows.append({
            "model": model, "seq_len": s.seq_len, "layout": _layout(s), "drives_per_node": count,
            "activation_capacity_bytes": free.plan.request.capacity_bytes,
            "keep_peak_bytes": free.plan.keep_peak_activation_bytes,
            "planned_peak_bytes": free.plan.peak_activation_bytes,
            "memory_saved_bytes": free.memory_saved_bytes,
            "offloaded_layers": _layers(free.plan, Placement.OFFLOAD),
            "partly_offloaded_layers": _partly(free.plan),
            "recomputed_layers": _layers(free.plan, Placement.RECOMPUTE),
            "embedding_placement": _placement_of(free.plan, EMBEDDING),
            "wear_bound_embedding_placement": _placement_of(worn.plan, EMBEDDING),
            "overhead_fraction": free.overhead_fraction,
            "write_bytes_per_s_per_gpu": free.write_bytes_per_s_per_gpu,
            "lifetime_years": None if math.isinf(free.lifetime_years) else free.lifetime_years,
            "cpu_offload_host_bytes_per_node": free.cpu_offload_host_bytes_per_node,
            "wear_bound_years": lifetime_years,
            "wear_bound_memory_saved_bytes": worn.memory_saved_bytes,
            "wear_bound_offloaded_layers": _layers(worn.plan, Placement.OFFLOAD),
            "wear_bound_partly_offloaded_layers": _partly(worn.plan),
            "wear_bound_overhead_fraction": worn.overhead_fraction,
            "wear_bound_write_bytes_per_s_per_gpu": worn.write_bytes_per_s_per_gpu,
            "host_ram_bytes_per_node": host_ram,
            "host_tier_memory_saved_bytes": hosted.memory_saved_bytes,
            "host_tier_overhead_fraction": hosted.overhead_fraction,
            "host_tier_hosted_layers": _layers(hosted.plan, Placement.HOST),
            "host_tier_recomputed_layers": _layers(hosted.plan, Placement.RECOMPUTE),
            "host_tier_pool_bytes_per_node": hosted.plan.host_pool_bytes * hosted.spec.gpus_per_node,
        })
    return rows


def sizing_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """The table of :func:`sizing_rows` as Markdown (GB = 10^9 bytes)."""
    gb = 1e9
    out = [
        "| model | layout | drives / node | kept peak | planned peak | saved | offload / recompute | step overhead "
        "| SSD writes per GPU | drive life | host RAM for CPU offload, per node | saved at 3-year wear bound "
        "| same + host tier: saved, host / recompute, pool per node |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        part = f" ({r['partly_offloaded_layers']} in part)" if r["partly_offloaded_layers"] else ""
        life = "∞" if r["lifetime_years"] is None else (
            f"{r['lifetime_years'] * 365:.0f} days" if r["lifetime_years"] < 1 else f"{r['lifetime_years']:.1f} years")
        out.append(
            f"| {r['model']} | {r['layout']} | {r['drives_per_node']} | {r['keep_peak_bytes'] / gb:.1f} GB "
            f"| {r['planned_peak_bytes'] / gb:.1f} GB | {r['memory_saved_bytes'] / gb:.1f} GB "
            f"({r['memory_saved_bytes'] / r['keep_peak_bytes']:.0%}) "
            f"| {r['offloaded_layers']}{part} / {r['recomputed_layers']} | {r['overhead_fraction']:+.1%} "
            f"| {r['write_bytes_per_s_per_gpu'] / gb:.2f} GB/s | {life} "
            f"| {r['cpu_offload_host_bytes_per_node'] / gb:.0f} GB "
            f"| {r['wear_bound_memory_saved_bytes'] / gb:.1f} GB ({r['wear_bound_overhead_fraction']:+.1%}) "
            f"| {r['host_tier_memory_saved_bytes'] / gb:.1f} GB ({r['host_tier_overhead_fraction']:+.1%}), "
            f"{r['host_tier_hosted_layers']} / {r['host_tier_recomputed_layers']}, "
            f"{r['host_tier_pool_bytes_per_node'] / gb:.0f} GB |"
        )
    return "\n".join(out)
