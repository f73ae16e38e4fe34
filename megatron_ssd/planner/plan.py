"""Choose KEEP / OFFLOAD / RECOMPUTE per layer from a measured stage profile.

:func:`make_plan` is a pure function: a :class:`~megatron_ssd.planner.profile.StageProfile`
in, a :class:`Plan` out, no I/O. It searches placements with the timeline model of
:mod:`megatron_ssd.planner.step_timeline`, judging them with the SSD bandwidths derated by
``safety_margin`` and reporting their predictions at the measured bandwidths::

    plan = make_plan(stage)                          # offload all that hides behind compute
    plan = make_plan(stage, PlanRequest(memory_budget=8 << 30))  # fit 8 GiB at the smallest step time
    print(plan.table())
    open("plan.json", "w").write(plan.to_json())

``docs/planner.md`` describes both goals and the JSON schema.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..config import from_dict, to_dict
from ..placement import MOVED, LayerChoice, Placement
from ..errors import ConfigError, shown
from .profile import IOProfile, LayerId, StageProfile
from .request import READ_AHEAD_MODES, PlanRequest
from .just_in_time import just_in_time
from .module_recompute import with_recompute
from .search import (GOAL_CAPACITY, GOAL_MAX_OFFLOAD, GOAL_MEMORY_BUDGET, Choices, PlacementSearch,
                     PlanInfeasibleError, replay)
from .step_timeline import Timeline, predict
from ..tier import TIERS, added
from ..units import MiB

__all__ = [
    "GOAL_CAPACITY",
    "GOAL_MAX_OFFLOAD",
    "GOAL_MEMORY_BUDGET",
    "PLAN_SCHEMA",
    "READ_AHEAD_MODES",
    "LayerPlan",
    "Plan",
    "PlanInfeasibleError",
    "PlanRequest",
    "make_plan",
]

PLAN_SCHEMA = "megatron_ssd.plan/3"
"""Value of the ``schema`` key of a plan's JSON form (``plan/3``: each layer's decision
is one ``choice`` object, and the bytes it moves off the device to any tier are its
``moved``). A choice that recomputes modules inside its layer carries a
``recompute`` list too; the key is written only then, so a plan without it reads as
before, and a choice without it (every plan written before it existed) recomputes no
module (``LayerChoice.from_dict``)."""
_PLAN_SCHEMA_2 = "megatron_ssd.plan/2"
"""The form before, still read: a layer's moved bytes were its ``offloaded``, whichever
tier they went to."""
_PLAN_SCHEMA_1 = "megatron_ssd.plan/1"
"""The earliest form, still read: a layer's ``placement``, ``offload_sites``,
``read_ahead`` and ``site_read_ahead`` side by side, and ``offloaded`` as in ``plan/2``."""
_RENAMED = {"prefetch_depth": "default_read_ahead", "read_ahead": "read_ahead_mode"}
"""Request fields under the names plans written before them carry (still read)."""
_REQUEST_FIELDS = [f.name for f in dataclasses.fields(PlanRequest)]



@dataclass
class LayerPlan:
    """What the plan decides for one layer and what the timeline model predicts for it."""

    layer_id: LayerId
    """The layer's id (as in the profile)."""
    choice: LayerChoice
    """The decision (placement, sites moved, read-ahead): what ``TensorCache.set_plan``
    applies (:meth:`Plan.choices`). Its ``read_ahead`` is an integer (layers ahead; on
    a KEEP or RECOMPUTE layer, the plan's default, unused), or, when the planner chose each
    site's read-issue point (``read_ahead_mode="auto"``, NOTE [Just-in-time reads] in
    ``just_in_time.py``), one per site in save order: 0 issues the site's read when the
    layer's own backward starts, to be done by the site's use point (NOTE [Site use
    times]); sites the layer keeps carry the layer's earliest."""
    bytes: int
    """Offloadable saved bytes of the layer for one micro-batch (moved when OFFLOAD,
    not saved when RECOMPUTE); with modules recomputed inside it, those left."""
    site_count: int = 1
    """How many sites the layer has (offloadable tensors it saves); with modules
    recomputed inside it, those left (NOTE [Recompute inside a layer] in
    ``module_recompute.py``)."""
    moved: int = 0
    """Bytes moved off the device and back per micro-batch, to whichever tier the
    placement names: the SSDs (OFFLOAD) or the host pool (HOST)."""
    write_s: float = 0.0
    """Predicted time the array spends writing the layer."""
    read_s: float = 0.0
    """Predicted time the array spends reading the layer back."""
    exposed_s: float = 0.0
    """Predicted wait of the layer's backward for its read."""
    forwarded: bool = False
    """Predicted to be served from memory because its write would finish too late."""
    forward_s: float = 0.0
    """Predicted forward wall time (with slowdown from concurrent I/O)."""
    backward_s: float = 0.0
    """Predicted backward wall time without the wait (with recompute and slowdown)."""

    @property
    def placement(self) -> Placement:
        """Where its saved activations live between forward and backward."""
        return self.choice.placement

    @property
    def offload_sites(self) -> Optional[int]:
        """OFFLOAD or HOST only: how many of the layer's sites, a prefix in save order,
        are moved, the others kept (NOTE [Sites]); None: all of them."""
        return self.choice.sites

    @property
    def read_ahead(self) -> int:
        """Its read is issued when the backward of the layer this many layers later
        starts (NOTE [Write and read issue points]); with per-site read-aheads, the
        earliest of its sites' (at least 1)."""
        ahead = self.choice.read_ahead
        return ahead if isinstance(ahead, int) else max(1, max(ahead or (1,)))

    @property
    def site_read_ahead(self) -> Optional[List[int]]:
        """Per site in save order, the read-ahead of that site's read, when the planner
        chose them one by one; None: every site at :attr:`read_ahead`."""
        ahead = self.choice.read_ahead
        return None if ahead is None or isinstance(ahead, int) else list(ahead)

    @property
    def read_ahead_text(self) -> str:
        """``3``, or ``0..3`` when its sites' read-aheads differ."""
        if self.site_read_ahead is None:
            return str(self.read_ahead)
        lo, hi = min(self.site_read_ahead), max(self.site_read_ahead)
        return str(hi) if lo == hi else f"{lo}..{hi}"

    @property
    def placement_text(self) -> str:
        """``keep``, ``offload``, ``host``, ``recompute``, or ``offload 3/7`` for a layer
        offloading 3 of its 7 sites (``host 3/7`` alike); ``+core_attn`` after it for each
        module recomputed inside the layer."""
        text = self.placement.value
        if self.placement in MOVED and self.offload_sites is not None:
            text = f"{text} {self.offload_sites}/{self.site_count}"
        return text + "".join(f" +{m}" for m in self.choice.recompute)


@dataclass
class Plan:
    """Per-layer placements for one pipeline stage, with the predictions behind them."""

    layers: List[LayerPlan]
    """One entry per layer, in forward order."""
    goal: str
    """``max_offload``, ``memory_budget`` or ``capacity``."""
    peak_activation_bytes: int
    """Predicted peak resident saved-activation bytes of the stage."""
    step_s: float
    """Predicted forward + backward time of one micro-batch on the stage."""
    exposed_s: float
    """Predicted time backward waits for reads, per micro-batch."""
    slowdown_s: float
    """Predicted extra compute time from I/O in flight, per micro-batch."""
    keep_peak_activation_bytes: int
    """The same prediction with every layer KEEP (the reference)."""
    keep_step_s: float
    """Step time with every layer KEEP."""
    io: IOProfile
    """The measured I/O profile the predictions use (not derated)."""
    pipeline_rank: int = 0
    """The stage planned."""
    pipeline_size: int = 1
    """Number of pipeline stages."""
    microbatches_in_flight: int = 1
    """Micro-batches the stage holds at once (peak approximation)."""
    request: PlanRequest = field(default_factory=PlanRequest)
    """What the plan was asked for: its budget, bounds and read-ahead (JSON: its fields at
    the top level)."""
    write_busy_s: float = 0.0
    """Predicted array write time per micro-batch."""
    read_busy_s: float = 0.0
    """Predicted array read time per micro-batch."""
    extra: Dict[str, Any] = field(default_factory=dict)
    """Free-form notes (e.g. the profile's source); kept in JSON."""

    # ------------------------------------------------------------------ views

    @property
    def placements(self) -> List[Placement]:
        """Placements in forward order."""
        return [lp.placement for lp in self.layers]

    @property
    def write_bytes_per_s(self) -> float:
        """Predicted SSD write rate of this process while it computes: offloaded bytes per
        micro-batch over the predicted micro-batch step time."""
        return self.offloaded_bytes / self.step_s if self.step_s > 0 else 0.0

    def placement(self, layer_id: LayerId) -> Placement:
        """The placement of one layer; KeyError names the known ids if absent."""
        for lp in self.layers:
            if lp.layer_id == layer_id:
                return lp.placement
        raise KeyError(f"megatron_ssd: layer {layer_id!r} is not in the plan; known: {[lp.layer_id for lp in self.layers]}")

    def layers_with(self, placement: Placement) -> List[LayerId]:
        """Ids of the layers with ``placement``, in forward order."""
        return [lp.layer_id for lp in self.layers if lp.placement is Placement(placement)]

    def choices(self) -> Dict[LayerId, LayerChoice]:
        """Each layer's choice as ``TensorCache.set_plan`` applies it: an OFFLOAD or HOST
        layer's whole, a KEEP or RECOMPUTE layer's placement and the modules it
        recomputes inside it (it reads nothing back and moves no site)."""
        return {lp.layer_id: lp.choice if lp.placement in MOVED
                else LayerChoice(lp.placement, recompute=lp.choice.recompute) for lp in self.layers}

    @property
    def layer_choices(self) -> List[LayerChoice]:
        """Per layer in forward order, its whole choice, as :func:`predict` takes them."""
        return [lp.choice for lp in self.layers]

    @property
    def offloaded_bytes(self) -> int:
        """Bytes written to the SSD array per micro-batch."""
        return sum(lp.moved for lp in self.layers if lp.placement is Placement.OFFLOAD)

    @property
    def hosted_bytes(self) -> int:
        """Bytes copied into the host pool per micro-batch (HOST layers)."""
        return sum(lp.moved for lp in self.layers if lp.placement is Placement.HOST)

    def moved_to(self, placement: Placement) -> int:
        """Bytes moved to ``placement``'s tier per micro-batch."""
        return sum(lp.moved for lp in self.layers if lp.placement is placement)

    @property
    def host_pool_bytes(self) -> int:
        """Host-pool bytes the plan holds at its peak: one micro-batch's hosted bytes for
        each micro-batch in flight."""
        return self.hosted_bytes * self.microbatches_in_flight

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready dict; ``placement`` values are ``keep``, ``offload``, ``recompute``;
        a choice's ``recompute`` only where it names a module (:data:`PLAN_SCHEMA`)."""
        data: Dict[str, Any] = {"schema": PLAN_SCHEMA}
        for key, value in to_dict(self).items():
            if key != "request":
                data[key] = value
            if key == "io":  # the request's fields where plans always wrote them
                data.update(to_dict(self.request))
        for layer in data["layers"]:
            if not layer["choice"]["recompute"]:
                del layer["choice"]["recompute"]
        return data

    def to_json(self, indent: Optional[int] = 2) -> str:
        """The plan as JSON text (see ``docs/planner.md`` for the schema)."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        """Rebuild a plan from :meth:`to_dict` output; a wrong schema raises ConfigError."""
        data = dict(data)
        schema = data.pop("schema", None)
        if schema not in (PLAN_SCHEMA, _PLAN_SCHEMA_2, _PLAN_SCHEMA_1):
            raise ConfigError(f"Plan.schema = {schema!r}: must be {PLAN_SCHEMA!r} "
                              f"(or {_PLAN_SCHEMA_2!r} or {_PLAN_SCHEMA_1!r}, read too)")
        for old, new in _RENAMED.items():  # plans written before the rename
            if old in data:
                data.setdefault(new, data.pop(old))
        if isinstance(data.get("layers"), list):
            data["layers"] = [_with_choice(layer, schema) for layer in data["layers"]]
        data["request"] = {name: data.pop(name) for name in _REQUEST_FIELDS if name in data}
        plan = from_dict(cls, data)
        _check_loaded(plan)
        return plan

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """Parse JSON text written by :meth:`to_json`."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"Plan JSON: not valid JSON ({exc})") from None
        return cls.from_dict(data)

    def changes_from(self, old: "Plan") -> List[str]:
        """Each layer whose placement differs from ``old``'s, as ``layer 3: offload -> keep``
        (empty when the placement is the same): what a re-plan prints instead of the table."""
        before = {str(lp.layer_id): lp for lp in old.layers}
        out = []
        for lp in self.layers:
            was = before.get(str(lp.layer_id))
            if was is None or (was.placement, was.offload_sites, was.choice.recompute) != (
                    lp.placement, lp.offload_sites, lp.choice.recompute):
                out.append(f"layer {lp.layer_id}: {was.placement_text if was is not None else 'new'} "
                           f"-> {lp.placement_text}")
        return out

    def table(self) -> str:
        """A per-layer table and a summary line, for logs and the command line."""
        rows = [f"{'layer':>8}  {'placement':<22}  {'MiB':>9}  {'write ms':>9}  {'read ms':>9}  {'exposed ms':>10}"
                f"  {'read ahead':>10}"]
        for lp in self.layers:
            note = "  (forwarded)" if lp.forwarded else ""
            ahead = f"{lp.read_ahead_text:>10}" if lp.placement in MOVED else f"{'':>10}"
            rows.append(
                f"{str(lp.layer_id):>8}  {lp.placement_text:<22}  {lp.bytes / MiB:9.1f}  {lp.write_s * 1e3:9.2f}"
                f"  {lp.read_s * 1e3:9.2f}  {lp.exposed_s * 1e3:10.2f}  {ahead}{note}"
            )
        peak_ratio = self.peak_activation_bytes / self.keep_peak_activation_bytes if self.keep_peak_activation_bytes else 1.0
        step_ratio = self.step_s / self.keep_step_s if self.keep_step_s else 1.0
        budget = f", budget {self.request.memory_budget / MiB:.1f} MiB" if self.request.memory_budget is not None else ""
        if self.request.capacity_bytes is not None:
            budget += f", device capacity {self.request.capacity_bytes / MiB:.1f} MiB"
        if self.request.max_slowdown is not None and self.goal == GOAL_MAX_OFFLOAD:
            budget += f", step at most {1 + self.request.max_slowdown:.3f}x keep-everything"
        rows.append(
            f"goal {self.goal}{budget}; stage {self.pipeline_rank}/{self.pipeline_size} "
            f"x{self.microbatches_in_flight} micro-batch{'es' if self.microbatches_in_flight > 1 else ''}"
        )
        rows.append(
            f"peak {self.peak_activation_bytes / MiB:.1f} MiB ({peak_ratio:.1%} of keep-everything "
            f"{self.keep_peak_activation_bytes / MiB:.1f} MiB); step {self.step_s * 1e3:.2f} ms "
            f"({step_ratio:.3f}x keep-everything); exposed I/O {self.exposed_s * 1e3:.2f} ms; "
            f"I/O slowdown {self.slowdown_s * 1e3:.2f} ms"
        )
        if not self.io.drives_measured:  # NOTE [Unmeasured drives] in profile.py
            rows.append("drives: not measured (no profiling step moved a byte to them), so nothing is placed on them")
        if self.hosted_bytes:
            rows.append(f"host pool {self.host_pool_bytes / MiB:.1f} MiB of "
                        f"{(self.request.host_budget_bytes or 0) / MiB:.1f} MiB ({self.hosted_bytes / MiB:.1f} MiB per micro-batch)")
        for p in added():  # the tiers registered after the SSDs and the host pool (NOTE [Tiers])
            if moved := self.moved_to(p):
                rows.append(f"{p.value} ({TIERS[p].title}) {moved / MiB:.1f} MiB per micro-batch")
        if self.request.max_write_bytes_per_s is not None:
            rows.append(
                f"SSD writes {self.write_bytes_per_s / 1e6:.1f} MB/s of the {self.request.max_write_bytes_per_s / 1e6:.1f} MB/s "
                "the drives' endurance allows this process"
            )
        return "\n".join(rows)


# ---------------------------------------------------------------------- planning


def make_plan(stage: StageProfile, request: Optional[PlanRequest] = None) -> Plan:
    """Choose a placement per layer of ``stage``.

    Without a budget (goal ``max_offload``): the lowest predicted peak whose I/O the
    timeline model hides (no stall, no forwarding and, with ``max_slowdown``, a step within
    that fraction of keep-everything's), with the bandwidths derated by ``safety_margin``.
    With a budget (goal ``memory_budget``): the shortest predicted step whose peak fits.
    Either way the search of :mod:`~megatron_ssd.planner.search` chooses, over each layer's
    whole choice set (keep, a prefix of its sites on each tier, recompute, modules
    recomputed inside it): a greedy start, a local search and a branch and bound that,
    where it ends within its work, proves the plan the model's optimum (NOTE [Search]).

    Args:
        stage: The measured (or simulated) stage.
        request: The goal, bounds and read-ahead (:class:`PlanRequest`, which checks
            its fields when it is made); None: ``PlanRequest()``, the ``max_offload`` goal.

    Returns:
        The :class:`Plan`, its predictions at the measured bandwidths.

    Raises:
        ConfigError: A field of the request breaks its rule, or the stage cannot take it.
        PlanInfeasibleError: No placement meets ``memory_budget``.
    """
    if not isinstance(stage, StageProfile):
        raise ConfigError(f"stage = {type(stage).__name__}: must be a StageProfile")
    if request is None:
        request = PlanRequest()
    elif not isinstance(request, PlanRequest):
        raise ConfigError(f"request = {type(request).__name__}: must be a PlanRequest")
    unknown = [name for name in stage.io.tiers if name not in TIERS]
    if unknown:
        raise ConfigError(f"IOProfile.tiers[{unknown[0]!r}]: no tier of that name is registered "
                          "(megatron_ssd.tier.register, or offload.tier_modules: docs/extending.md)")
    if request.host_budget_bytes and stage.io.host_bytes_per_s is None:
        raise ConfigError(f"host_budget_bytes = {request.host_budget_bytes}: needs IOProfile.host_bytes_per_s, the "
                          "host tier's copy bandwidth")
    r = request
    memory_budget, capacity_bytes, default_read_ahead = r.memory_budget, r.capacity_bytes, r.default_read_ahead
    derated = stage.io.derated(r.safety_margin)

    def choose(read_ahead: int, full: bool = True) -> Tuple[Choices, str, Timeline]:
        search = PlacementSearch(stage, derated, read_ahead, r.max_write_bytes_per_s, r.host_budget_bytes or 0,
                                 r.max_slowdown, greedy_only=r.search == "greedy" or not full)
        if memory_budget is None:
            choice, goal = search.max_offload(), GOAL_MAX_OFFLOAD
            over = capacity_bytes is not None and search.check(choice).peak_bytes > capacity_bytes
        else:
            over = capacity_bytes is not None and memory_budget > capacity_bytes
            if not over:
                choice, goal = search.meet_budget(memory_budget, r.allow_recompute), GOAL_MEMORY_BUDGET
        if over:  # the device's capacity binds: meet it as the budget
            choice, goal = search.meet_budget(capacity_bytes, r.allow_recompute, "capacity_bytes"), GOAL_CAPACITY
        return choice, goal, replay(stage, choice, read_ahead)

    n = len(stage.layers)
    if r.read_ahead_mode == "fixed":
        choice, goal, _ = choose(default_read_ahead)
        choices = [dataclasses.replace(c, read_ahead=default_read_ahead) for c in choice]
    else:
        limits = PlacementSearch(stage, derated, default_read_ahead, r.max_write_bytes_per_s, r.host_budget_bytes or 0)
        choices, goal = just_in_time(stage, choose, default_read_ahead, r.safety_margin, limits.allowed)
    tl = replay(stage, choices)
    keep = predict(stage, [Placement.KEEP] * n)
    return _build(stage, tl, keep, goal, request, choices)


def _build(
    stage: StageProfile,
    tl: Timeline,
    keep: Timeline,
    goal: str,
    request: PlanRequest,
    choices: Sequence[LayerChoice],
) -> Plan:
    layers = []
    for layer, lt, choice in zip(with_recompute(stage, choices).layers, tl.layers, choices):
        rates = stage.io.rates(lt.placement) if lt.placement in MOVED else None
        write_s = 0.0 if lt.write_end is None or rates is None else lt.moved_bytes / rates.write_bytes_per_s
        read_s = 0.0 if lt.read_end is None else lt.read_end - lt.read_start
        layers.append(
            LayerPlan(
                layer_id=layer.layer_id,
                choice=choice if choice.moved else dataclasses.replace(choice, sites=None),
                bytes=layer.saved_bytes,
                site_count=len(layer.sites),
                moved=lt.moved_bytes,
                write_s=write_s,
                read_s=read_s,
                exposed_s=lt.stall_s,
                forwarded=lt.forwarded,
                forward_s=lt.forward_s,
                backward_s=lt.backward_s,
            )
        )
    return Plan(
        layers=layers,
        goal=goal,
        peak_activation_bytes=tl.peak_bytes,
        step_s=tl.step_s,
        exposed_s=tl.exposed_s,
        slowdown_s=tl.slowdown_s,
        keep_peak_activation_bytes=keep.peak_bytes,
        keep_step_s=keep.step_s,
        io=stage.io,
        request=request,
        pipeline_rank=stage.pipeline_rank,
        pipeline_size=stage.pipeline_size,
        microbatches_in_flight=stage.microbatches_in_flight or 1,
        write_busy_s=tl.write_busy_s,
        read_busy_s=tl.read_busy_s,
    )


def _with_choice(layer: Any, schema: str) -> Any:
    """A JSON layer with its ``choice`` checked (:meth:`LayerChoice.from_dict`); a
    ``plan/1`` layer's four decision fields become that one ``choice`` first, and an
    older layer's ``offloaded`` its ``moved``."""
    if not isinstance(layer, Mapping):
        return layer  # from_dict names the bad entry
    layer = dict(layer)
    if schema != PLAN_SCHEMA and "offloaded" in layer:
        layer.setdefault("moved", layer.pop("offloaded"))
    if schema == _PLAN_SCHEMA_1:
        placement, sites = layer.pop("placement", None), layer.pop("offload_sites", None)
        ahead, per_site = layer.pop("read_ahead", 1), layer.pop("site_read_ahead", None)
        layer["choice"] = {"placement": placement, "sites": sites,
                           "read_ahead": per_site if per_site is not None else ahead}
    if "choice" in layer:
        layer["choice"] = LayerChoice.from_dict(layer.get("layer_id"), layer["choice"])
    return layer


_LAYER_AMOUNTS = ("bytes", "moved", "site_count", "write_s", "read_s", "exposed_s", "forward_s", "backward_s")
_PLAN_AMOUNTS = ("peak_activation_bytes", "step_s", "exposed_s", "slowdown_s", "keep_peak_activation_bytes",
                 "keep_step_s", "write_busy_s", "read_busy_s")


def _check_loaded(plan: Plan) -> None:
    """What a plan read back must hold (a plan the planner made always does): amounts
    that are finite and not negative, at most the layer's sites moved, each layer once,
    integer layer ids not negative, a stage inside its pipeline.

    Raises:
        ConfigError: naming the field, the value and the rule.
    """
    def amount(owner: str, name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ConfigError(f"{owner}.{name} = {shown(value)}: must be a finite number >= 0")

    for name in _PLAN_AMOUNTS:
        amount("Plan", name, getattr(plan, name))
    if plan.microbatches_in_flight < 1 or not 0 <= plan.pipeline_rank < max(plan.pipeline_size, 1):
        raise ConfigError(f"Plan.pipeline_rank = {plan.pipeline_rank}: must be in [0, pipeline_size = "
                          f"{plan.pipeline_size}), with microbatches_in_flight = {plan.microbatches_in_flight} >= 1")
    seen = set()
    for lp in plan.layers:
        owner = f"Plan.layers[{lp.layer_id!r}]"
        if isinstance(lp.layer_id, int) and not isinstance(lp.layer_id, bool) and lp.layer_id < 0:
            raise ConfigError(f"{owner}.layer_id = {lp.layer_id}: must be >= 0 (or a name such as 'embedding')")
        if str(lp.layer_id) in seen:
            raise ConfigError(f"{owner}.layer_id = {lp.layer_id!r}: must name each layer once")
        seen.add(str(lp.layer_id))
        for name in _LAYER_AMOUNTS:
            amount(owner, name, getattr(lp, name))
        if lp.choice.sites is not None and lp.choice.sites > lp.site_count:
            raise ConfigError(f"{owner}.choice.sites = {lp.choice.sites}: must be at most site_count = "
                              f"{lp.site_count}")

