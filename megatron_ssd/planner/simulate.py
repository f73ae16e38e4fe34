"""What-if model: plan offloading for a model and hardware that are not at hand.

From model dimensions, a GPU's compute rate and an SSD array (a
:class:`~megatron_ssd.planner.simulation_spec.SimulationSpec`), :func:`simulate`
estimates each layer's saved bytes and compute time (:mod:`.estimates`), builds a
:class:`~megatron_ssd.planner.profile.StageProfile`, plans it with
:func:`~megatron_ssd.planner.plan.make_plan` and reports memory saved, step-time
overhead, the SSD write rate per GPU and the drives' projected lifetime::

    spec = SimulationSpec(num_layers=24, hidden=2048, heads=16, seq_len=2048,
                          micro_batch=4, ssd_count=4)
    print(simulate(spec).summary())

The spec and the estimates live in their own modules; their public names are importable
from here too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Union

from ..config import CAPACITY_RESERVE, to_dict
from ..placement import OUTSIDE
from ..errors import ConfigError
from .plan import Plan, PlanRequest, make_plan
from .profile import StageProfile
from .wear import SECONDS_PER_DAY, drive_lifetime_years
from .estimates import (layer_activation_bytes, layer_anatomy, layer_forward_flops, layer_site_bytes, layer_site_use,
                        stage_profile)
from .simulation_spec import GENERIC_DRIVE, MODEL_PRESETS, SimulationSpec, simulate_help, spec_from_overrides

__all__ = [
    "GENERIC_DRIVE",
    "MODEL_PRESETS",
    "simulate_help",
    "SimulationSpec",
    "spec_from_overrides",
    "SimulationResult",
    "simulate",
    "stage_profile",
    "layer_activation_bytes",
    "layer_forward_flops",
    "layer_anatomy",
    "layer_site_bytes",
    "layer_site_use",
    "drive_lifetime_years",
    "prediction_error",
    "activation_capacity",
    "state_bytes_per_param",
    "stage_parameters",
    "host_budget",
]


@dataclass
class SimulationResult:
    """What :func:`simulate` predicts for one stage."""

    spec: SimulationSpec
    """The input."""
    stage: StageProfile
    """The estimated stage profile."""
    plan: Plan
    """The planner's choice for it."""
    iteration_s: float
    """Predicted iteration time with the plan: (micro-batches + pp - 1) micro-batch steps."""
    keep_iteration_s: float
    """The same with every layer kept."""
    write_bytes_per_s_per_gpu: float
    """Average SSD write rate of one GPU over an iteration."""
    ssd_footprint_bytes: int
    """Bytes one GPU holds on the array at once (offloaded bytes x micro-batches in flight)."""
    ssd_capacity_share_bytes: float
    """The array capacity available to one GPU."""
    drive_bytes_per_day: float
    """Bytes written to each drive per day of training (duty cycle applied)."""
    lifetime_years: float
    """Drive TBW / bytes per day / 365 (infinite when nothing is written)."""

    @property
    def cpu_offload_host_bytes_per_node(self) -> int:
        """Host RAM that Megatron's own CPU-only activation offloading would hold on one
        node for the same saving: every saved byte sits in host memory instead (pinned,
        for the copies to overlap), for each of the node's GPUs."""
        return self.memory_saved_bytes * self.spec.gpus_per_node

    @property
    def memory_saved_bytes(self) -> int:
        """Keep-everything peak minus the planned peak."""
        return self.plan.keep_peak_activation_bytes - self.plan.peak_activation_bytes

    @property
    def memory_saved_fraction(self) -> float:
        """``memory_saved_bytes`` as a fraction of the keep-everything peak."""
        keep = self.plan.keep_peak_activation_bytes
        return self.memory_saved_bytes / keep if keep else 0.0

    @property
    def overhead_fraction(self) -> float:
        """Predicted iteration-time increase over keeping everything."""
        return self.iteration_s / self.keep_iteration_s - 1.0

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready dict: the spec, the plan and the derived numbers."""
        return {
            "spec": to_dict(self.spec),
            "plan": self.plan.to_dict(),
            "iteration_s": self.iteration_s,
            "keep_iteration_s": self.keep_iteration_s,
            "overhead_fraction": self.overhead_fraction,
            "memory_saved_bytes": self.memory_saved_bytes,
            "memory_saved_fraction": self.memory_saved_fraction,
            "write_bytes_per_s_per_gpu": self.write_bytes_per_s_per_gpu,
            "ssd_footprint_bytes": self.ssd_footprint_bytes,
            "ssd_capacity_share_bytes": self.ssd_capacity_share_bytes,
            "drive_bytes_per_day": self.drive_bytes_per_day,
            "lifetime_years": None if math.isinf(self.lifetime_years) else self.lifetime_years,
            "cpu_offload_host_bytes_per_node": self.cpu_offload_host_bytes_per_node,
            "host_pool_bytes_per_gpu": self.plan.host_pool_bytes,
        }

    def _partial_note(self) -> str:
        """`` (3 in part: 41% of their bytes)`` when some OFFLOAD layers offload only a
        prefix of their sites (NOTE [Sites])."""
        part = [lp for lp in self.plan.layers if lp.placement.value == "offload" and lp.offload_sites is not None]
        if not part:
            return ""
        share = sum(lp.moved for lp in part) / max(1, sum(lp.bytes for lp in part))
        return f" ({len(part)} in part: {share:.0%} of their bytes)"

    def summary(self) -> str:
        """A few lines for a terminal."""
        s, p, gb = self.spec, self.plan, 1e9
        counts = {pl: _count(p, pl) for pl in ("keep", "offload", "host", "recompute")}
        host = f"{counts['host']} host, " if p.request.host_budget_bytes else ""
        fits = "fits" if self.ssd_footprint_bytes <= self.ssd_capacity_share_bytes else "DOES NOT FIT"
        held = []
        if p.request.capacity_bytes is not None:
            held.append(f"held under the GPU's {p.request.capacity_bytes / gb:.2f} GB for activations "
                        f"({s.gpu_memory_bytes / gb:.0f} GB less model state and reserve)")
        if p.request.max_write_bytes_per_s is not None:
            held.append(f"writes held under {p.request.max_write_bytes_per_s / gb:.3f} GB/s per GPU for "
                        f"{s.target_lifetime_years:g} years of drive life")
        lines = [
            f"{s.arch.upper()} {s.total_layers} layers, h={s.hidden}, s={s.seq_len}, b={s.micro_batch}, "
            f"tp={s.tp}, pp={s.pp}{f', cp={s.cp}' if s.cp > 1 else ''}: stage {s.pipeline_rank} with {sum(1 for lp in p.layers if lp.layer_id not in OUTSIDE)} layers, "
            f"{p.microbatches_in_flight} micro-batch{'es' if p.microbatches_in_flight > 1 else ''} in flight",
            f"placements: {counts['keep']} keep, {counts['offload']} offload{self._partial_note()}, "
            f"{host}{counts['recompute']} recompute{_outside_note(p)}",
            f"peak activations {p.peak_activation_bytes / gb:.2f} GB vs {p.keep_peak_activation_bytes / gb:.2f} GB "
            f"kept: {self.memory_saved_bytes / gb:.2f} GB saved ({self.memory_saved_fraction:.0%})",
            f"iteration {self.iteration_s * 1e3:.1f} ms vs {self.keep_iteration_s * 1e3:.1f} ms kept "
            f"({self.overhead_fraction:+.1%}); exposed I/O {p.exposed_s * 1e3:.2f} ms per micro-batch",
            f"SSD writes {self.write_bytes_per_s_per_gpu / gb:.2f} GB/s per GPU; footprint "
            f"{self.ssd_footprint_bytes / gb:.1f} GB of {self.ssd_capacity_share_bytes / gb:.0f} GB ({fits})",
            f"each drive takes {self.drive_bytes_per_day / 1e12:.1f} TB/day: lifetime "
            f"{self.lifetime_years:.1f} years at {s.ssd_tbw_bytes / 1e15:.1f} PB TBW"
            + (f" ({s.drive})" if s.drive else "")
            + (f", {s.ssd_used_fraction:.0%} of it used" if s.ssd_used_fraction else ""),
        ]
        if p.request.host_budget_bytes:
            lines.append(f"host pool {p.host_pool_bytes / gb:.1f} GB of the GPU's {p.request.host_budget_bytes / gb:.1f} GB "
                         f"({s.host_ram_bytes_per_node / gb:.0f} GB per {s.gpus_per_node}-GPU node) at "
                         f"{s.host_bytes_per_s / gb:.0f} GB/s")
        if self.memory_saved_bytes > 0:
            lines.append(f"Megatron's CPU-only offloading would hold {self.cpu_offload_host_bytes_per_node / gb:.1f} GB "
                         f"of host RAM per {s.gpus_per_node}-GPU node for the same saving")
        lines[1:1] = held  # what bounded the plan, after the model line
        return "\n".join(lines)


def _count(plan: Plan, placement: str) -> int:
    """Transformer layers of ``plan`` with ``placement`` (not the embedding's tensors)."""
    return sum(1 for lp in plan.layers if lp.placement.value == placement and lp.layer_id not in OUTSIDE)


def _outside_note(plan: Plan) -> str:
    """``; embedding: offload`` when the plan moves the tensors saved before the first
    layer (NOTE [Sites outside the layers])."""
    moved = [f"{lp.layer_id}: {lp.placement_text}" for lp in plan.layers
             if lp.layer_id in OUTSIDE and lp.placement.value != "keep"]
    return "".join("; " + m for m in moved)


# NOTE [Simulated capacity]
# What a GPU has for saved activations in the what-if model: its memory less the
# ``CAPACITY_RESERVE`` share the runtime planner also leaves (temporaries, communication
# buffers, fragmentation) and less the model state of the stage. Megatron's mixed-precision
# layout keeps, per parameter, bf16 weights (2 bytes) and fp32 gradients (4) on every GPU,
# and fp32 master weights and two Adam moments (12); the distributed optimizer shards those
# 12 over the dp x cp GPUs that hold the same weights (Megatron's data-parallel group with
# context parallelism), so a stage holds 6 + 12 / (dp x cp) bytes per parameter with it and
# 18 without. Stage parameters: per layer 4h^2 + 2h x ffn (attention and MLP weights) over
# t, plus the embedding (vocab x h / t) on the first stage and the output layer on the last
# when they differ.
REPLICATED_BYTES_PER_PARAM = 6
OPTIMIZER_BYTES_PER_PARAM = 12


def state_bytes_per_param(spec: SimulationSpec) -> float:
    """Model-state bytes one GPU holds per parameter of its stage (NOTE [Simulated capacity])."""
    shards = spec.dp * spec.cp if spec.distributed_optimizer else 1
    return REPLICATED_BYTES_PER_PARAM + OPTIMIZER_BYTES_PER_PARAM / shards


def stage_parameters(spec: SimulationSpec) -> int:
    """Parameters one tensor-parallel rank of ``spec.pipeline_rank`` holds."""
    ffn = spec.ffn_hidden or 4 * spec.hidden
    per_layer = 4 * spec.hidden * spec.hidden + 2 * spec.hidden * ffn
    params = per_layer * (spec.total_layers // spec.pp)
    if spec.pipeline_rank == 0:
        params += spec.vocab * spec.hidden
    if spec.pipeline_rank == spec.pp - 1 and spec.pp > 1:
        params += spec.vocab * spec.hidden
    return params // spec.tp


def activation_capacity(spec: SimulationSpec) -> Optional[int]:
    """Bytes one GPU of ``spec`` has for saved activations (NOTE [Simulated capacity]);
    None without ``gpu_memory_bytes``.

    Raises:
        ConfigError: the model state alone does not fit the GPU.
    """
    if spec.gpu_memory_bytes is None:
        return None
    per_param = state_bytes_per_param(spec)
    state = per_param * stage_parameters(spec)
    capacity = int(spec.gpu_memory_bytes * (1 - CAPACITY_RESERVE) - state)
    if capacity <= 0:
        raise ConfigError(
            f"SimulationSpec.gpu_memory_bytes = {spec.gpu_memory_bytes:.3g}: the stage's model state alone takes "
            f"{state / 1e9:.1f} GB ({per_param:g} bytes x {stage_parameters(spec)} parameters) of the "
            f"{(1 - CAPACITY_RESERVE) * spec.gpu_memory_bytes / 1e9:.1f} GB usable; raise tp, pp or dp "
            "(with distributed_optimizer), or set gpu_memory_bytes=null for no limit"
        )
    return capacity


def host_budget(spec: SimulationSpec) -> Optional[int]:
    """One GPU's share of the node's host RAM for the host tier; None without one."""
    if spec.host_ram_bytes_per_node <= 0:
        return None
    return int(spec.host_ram_bytes_per_node / spec.gpus_per_node)


def simulate(spec: SimulationSpec) -> SimulationResult:
    """Estimate, plan and report one pipeline stage of ``spec``.

    Raises:
        ConfigError: ``spec`` breaks a rule.
        PlanInfeasibleError: ``spec.memory_budget`` cannot be met.
    """
    stage, drive = stage_profile(spec), spec.ssd
    years = spec.target_lifetime_years
    limit = None if years is None else drive.write_limit_bytes_per_s(years)
    plan = make_plan(stage, PlanRequest(
        memory_budget=spec.memory_budget, safety_margin=spec.safety_margin, default_read_ahead=spec.default_read_ahead,
        read_ahead_mode=spec.read_ahead_mode, allow_recompute=spec.allow_recompute, max_write_bytes_per_s=limit,
        capacity_bytes=activation_capacity(spec), host_budget_bytes=host_budget(spec)))
    slots = spec.num_microbatches + spec.pp - 1
    iteration = slots * plan.step_s
    written = plan.offloaded_bytes * spec.num_microbatches
    rate = written / iteration if iteration > 0 else 0.0
    return SimulationResult(
        spec=spec,
        stage=stage,
        plan=plan,
        iteration_s=iteration,
        keep_iteration_s=slots * plan.keep_step_s,
        write_bytes_per_s_per_gpu=rate,
        ssd_footprint_bytes=plan.offloaded_bytes * plan.microbatches_in_flight,
        ssd_capacity_share_bytes=drive.share(drive.capacity_bytes),
        drive_bytes_per_day=rate * drive.sharing / drive.count * SECONDS_PER_DAY * drive.duty_cycle,
        lifetime_years=drive.lifetime_years(rate),
    )


Number = Union[int, float]


def prediction_error(
    predicted: Union[Number, Mapping[str, Number]],
    measured: Union[Number, Mapping[str, Number]],
    scale: Optional[Number] = None,
) -> Union[float, dict]:
    """Relative error of a prediction: ``|predicted - measured| / measured``.

    Args:
        predicted: A number, or a mapping of named numbers (e.g. ``step_s``, ``exposed_s``).
        measured: The measured counterpart (same keys for a mapping).
        scale: Divide by this instead of ``measured``: use the step time when the
            measured value can be near zero (exposed I/O of a well-hidden plan).

    Returns:
        A float, or a dict with the same keys. 0 when both are 0; infinity when only
        ``measured`` is 0 and no ``scale`` is given.
    """
    if isinstance(predicted, Mapping):
        if not isinstance(measured, Mapping) or set(predicted) != set(measured):
            raise ConfigError(
                f"measured = {measured!r}: must be a mapping with the same keys as predicted ({sorted(predicted)})"
            )
        return {k: prediction_error(predicted[k], measured[k], scale) for k in predicted}
    denominator = abs(measured) if scale is None else abs(scale)
    difference = abs(predicted - measured)
    if denominator == 0:
        return 0.0 if difference == 0 else math.inf
    return difference / denominator
