"""Per-layer keep / offload / recompute planning from measured compute and SSD bandwidth.

Pure functions over measurements, no I/O: a :class:`StageProfile` (per-layer compute
time and saved bytes, SSD bandwidth) goes in, :func:`make_plan` returns a :class:`Plan`.
:func:`stage_from_stats` builds the profile from the cache's measured steps
(:class:`StepMeasurement`), :func:`predict` is the timeline model behind the plan,
:class:`DriftDetector` says when to plan again, :func:`simulate` answers what-if
questions for other hardware. See ``docs/planner.md``.
"""

from .drift import DriftDecision, DriftDetector
from .plan import (
    GOAL_CAPACITY,
    GOAL_MAX_OFFLOAD,
    GOAL_MEMORY_BUDGET,
    PLAN_SCHEMA,
    LayerPlan,
    Plan,
    PlanInfeasibleError,
    PlanRequest,
    make_plan,
)
from .measured_profile import stage_from_stats
from .measurement import LayerMeasurement, ModuleMeasurement, StepMeasurement
from .module_recompute import recomputed_layer, with_recompute
from .profile import IOProfile, LayerProfile, ModuleProfile, StageProfile, uniform_stage
from .simulate import (
    MODEL_PRESETS,
    SimulationResult,
    SimulationSpec,
    drive_lifetime_years,
    layer_activation_bytes,
    layer_forward_flops,
    prediction_error,
    simulate,
    spec_from_overrides,
    stage_profile,
)
from .step_timeline import LayerTimeline, Timeline, predict

__all__ = [
    "DriftDecision",
    "DriftDetector",
    "GOAL_CAPACITY",
    "GOAL_MAX_OFFLOAD",
    "GOAL_MEMORY_BUDGET",
    "IOProfile",
    "LayerMeasurement",
    "LayerPlan",
    "LayerProfile",
    "LayerTimeline",
    "MODEL_PRESETS",
    "ModuleMeasurement",
    "ModuleProfile",
    "PLAN_SCHEMA",
    "Plan",
    "PlanInfeasibleError",
    "PlanRequest",
    "SimulationResult",
    "SimulationSpec",
    "StageProfile",
    "StepMeasurement",
    "Timeline",
    "drive_lifetime_years",
    "layer_activation_bytes",
    "layer_forward_flops",
    "make_plan",
    "predict",
    "prediction_error",
    "recomputed_layer",
    "simulate",
    "spec_from_overrides",
    "stage_from_stats",
    "stage_profile",
    "uniform_stage",
    "with_recompute",
]
