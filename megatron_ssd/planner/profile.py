"""Measurements the planner plans from: per-layer compute and bytes, SSD bandwidth.

A :class:`StageProfile` is everything the planner knows about one pipeline stage: its
transformer layers in forward order (:class:`LayerProfile`), the SSD array it offloads to
(:class:`IOProfile`) and where it sits in the pipeline. The runtime profiler fills one
from measured steps; :func:`megatron_ssd.planner.estimates.stage_profile` fills one from
model dimensions. It round-trips through JSON so a profile measured once can be planned from
again (``megatron-ssd plan profile.json``)::

    stage = StageProfile.from_json(open("profile.json").read())
    print(make_plan(stage).table())

Each field's rules are on its annotation and run as config fields' do
(:func:`~megatron_ssd.config.validate`), each class's ``_check`` holding the rules that
compare fields; validation raises :class:`~megatron_ssd.errors.ConfigError` naming the
field, the value and the rule.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Annotated, Any, Dict, List, Mapping, Optional, Sequence, Union

from ..config import (AtLeast, Boolean, InRange, Integer, ListOf, NonNegative, Number, OneOf, OneOfKinds, Positive,
                      from_dict, to_dict)
from ..config import _broken, _fail, _settle
from ..placement import OUTSIDE, RECOMPUTE_MODULES, Placement, default_placement
from ..tier import DRIVES_LINK, HOST_LINK, TIERS
from ..errors import ConfigError

__all__ = ["LayerId", "LayerProfile", "ModuleProfile", "IOProfile", "TierRates", "StageProfile", "uniform_stage"]

LayerId = Union[str, int]
"""How a layer is named: its index in the stage or a module path."""


# NOTE [Sites]
# A site is one saved tensor's place in a layer: its layer and its position among the
# distinct offloadable storages that layer's forward saves (after dedup, at least
# ``min_tensor_bytes``), counted from 0 in save order. The same code path saves the same
# tensors in the same order every micro-batch, so a site names "the attention softmax
# output of layer 5" from one step to the next. Placement is per layer, refined by a
# site count: an OFFLOAD layer with ``offload_sites = k`` offloads its first k sites and
# keeps the rest. The prefix is the right share to move: the first-saved tensors are
# written earliest (the most forward compute left to hide their write) and used last in
# the layer's backward, which consumes its saved tensors roughly in reverse order, so
# their reads have the most time too. RECOMPUTE stays a whole-layer choice. The cache
# numbers sites the same way (``Entry.site``), reports their bytes per layer
# (``LayerMeasurement.site_bytes``) and applies a plan's site counts
# (``LayerChoice.sites`` in ``TensorCache.set_plan``).
# A storage another layer saved first (the attention mask every layer saves) keeps its
# place in this layer's count too, as a site of no bytes here: its bytes are its first
# layer's. Otherwise the numbering would depend on the other layers' placements. On
# configs/gpt-ref-cpu.yaml the mask (0.25 MiB) is layer 1's in every profiling step, so
# layer 8 numbered the attention probabilities site 3; a plan recomputing layers 1-7 (whose
# saves then reach the cache no more) made the mask layer 8's site 3 and the
# probabilities site 4, so "move 4 sites" moved 70 MiB instead of the 182 MiB the plan
# priced, and the step ran 33 MiB over a 500 MiB cap at micro-batch 14.

# NOTE [Site use times]
# A layer's backward does not need all its saved tensors at once: it runs its ops in
# reverse, so the MLP's tensors are unpacked first and the attention's a share of the
# layer's backward later. ``LayerProfile.site_use`` gives, per site, the share of the
# layer's backward that has run when backward first unpacks it. The cache measures it
# (``LayerMeasurement.site_use_s``: seconds from the layer's backward start to the site's
# first unpack, kept layers included) and the profile divides by the layer's backward
# time; ``simulate`` estimates it from the FLOPs of the blocks backward runs first. The
# timeline lets a layer's backward run up to a site's use point before it waits for
# that site's read, and the planner issues each site's read as late as that allows
# (NOTE [Just-in-time reads] in ``just_in_time.py``), down to the start of the layer's own
# backward.

# NOTE [Site save times]
# A layer's forward does not save its tensors at once either: the attention's are saved
# early, the MLP's late, and a site's write cannot start before the site is saved.
# ``LayerProfile.site_save`` gives, per site, the share of the layer's forward that has
# run when the site is saved. The cache measures it (``LayerMeasurement.site_save_s``:
# seconds from the layer's forward start to the site's save) and the profile divides by
# the layer's forward time. The timeline issues each moved site's write no earlier than
# that point, so a large site saved late in the last moved layer (an MLP projection's
# output) may still be writing, and resident, when the layers after it run (NOTE [Write
# and read issue points] in ``step_timeline.py``). Writes are admitted in save order,
# whatever the sites' order, and a site of no bytes (saved first by another layer, NOTE
# [Sites]) writes nothing and admits nothing: its save point, 0 when no save of its own
# was timed, must not hold back the forward. ``None`` (profiles from estimates, or
# written before the field): every site counts as saved when its forward starts.


@dataclass
class ModuleProfile:
    """What recomputing one module inside a layer changes (NOTE [Recompute inside a layer]
    in ``module_recompute.py``), measured in the steps that keep every layer."""

    name: Annotated[str, OneOf(*RECOMPUTE_MODULES)]
    """The module, by megatron-core's ``recompute_modules`` name."""

    forward_s: Annotated[float, Number(NonNegative())]
    """Its forward time per micro-batch, in seconds: what recomputing it adds to the
    layer's backward."""

    freed_sites: Annotated[List[int], ListOf(Integer(NonNegative()))]
    """The layer's sites (indices in save order, NOTE [Sites]) that recomputing it frees:
    the tensors saved while it ran that are not its inputs (its checkpoint saves those)."""

    held_bytes: Annotated[int, Integer(NonNegative())] = 0
    """Bytes of its inputs that its checkpoint saves and the layer saves nowhere else
    (0 on megatron-core's layers: the module saves them itself)."""

    def __post_init__(self) -> None:
        _settle(self)

    def _check(self) -> None:
        if len(set(self.freed_sites)) != len(self.freed_sites):
            raise _broken(self, "freed_sites", "must name each site once")


@dataclass
class LayerProfile:
    """Measured (or estimated) cost of one transformer layer for one micro-batch."""

    layer_id: Annotated[LayerId, OneOfKinds(str, int, noun="a string or an integer")]
    """The layer's name: its index within the stage or a module path. Unique per stage."""

    forward_s: Annotated[float, Number(NonNegative())]
    """Forward compute time of the layer, in seconds, with no I/O running."""

    backward_s: Annotated[float, Number(NonNegative())]
    """Backward compute time of the layer, in seconds, without recompute and without
    time spent waiting for reads."""

    saved_bytes: Annotated[int, Integer(NonNegative())]
    """Bytes of tensors the layer saves for backward that may be offloaded, counted once
    per storage (after deduplication)."""

    kept_bytes: Annotated[int, Integer(NonNegative())] = 0
    """Bytes the layer saves for backward that are never offloaded (tensors under the
    size threshold, skipped tensors). Held in memory whatever the placement, except
    under RECOMPUTE, which saves none of them."""

    recompute_s: Optional[Annotated[float, Number(NonNegative())]] = None
    """Time to run the forward again during backward under RECOMPUTE, in seconds;
    ``None`` means equal to ``forward_s``."""

    boundary_bytes: Annotated[int, Integer(NonNegative())] = 0
    """Bytes a RECOMPUTE layer still holds between forward and backward: its input.
    0 when the previous layer keeps that tensor anyway (its output is saved there)."""

    site_bytes: Optional[Annotated[List[int], ListOf(Integer(NonNegative()))]] = None
    """The layer's offloadable saved tensors one by one, in the order its forward saves
    them (its *sites*, NOTE [Sites]); they sum to ``saved_bytes``. A plan may offload a
    prefix of them and keep the rest. ``None``: one site of ``saved_bytes``."""

    site_use: Optional[Annotated[List[float], ListOf(Number(InRange(0, 1)))]] = None
    """Per site (as ``site_bytes``), the share of the layer's backward, from 0 to 1,
    that has run when backward first unpacks it (NOTE [Site use times]): a site read
    need only be complete by then. ``None``: every site is needed when the layer's
    backward starts."""

    site_save: Optional[Annotated[List[float], ListOf(Number(InRange(0, 1)))]] = None
    """Per site (as ``site_bytes``), the share of the layer's forward, from 0 to 1, that
    has run when the forward saves it (NOTE [Site save times]): the site's write starts no
    earlier. ``None``: every site counts as saved when the forward starts."""

    recomputable: Annotated[bool, Boolean()] = True
    """Whether RECOMPUTE may be chosen. False for the tensors a micro-batch saves before
    its first layer (layer id ``embedding``, NOTE [Sites outside the layers]): nothing
    runs their forward again."""

    modules: Optional[List[ModuleProfile]] = None
    """The modules a plan may recompute inside this layer (``LayerChoice.recompute``),
    each with what recomputing it frees and costs (NOTE [Recompute inside a layer] in
    ``module_recompute.py``). ``None``: none (profiles written before the field)."""

    rebuilt_bytes: Annotated[int, Integer(NonNegative())] = 0
    """Bytes the layer's backward rebuilds by recomputing modules inside it, held from its
    backward's start to its end. 0 in a measured profile; set on the layer a plan's
    ``LayerChoice.recompute`` derives from it (``module_recompute.recomputed_layer``)."""

    forward_peak_bytes: Annotated[int, Integer(NonNegative())] = 0
    """The most the layer's forward held at once beyond the other layers' saved tensors:
    what it has saved so far and its temporaries (attention scores and the like), held
    over its forward's span in the timeline. Measured under a device-memory cap in the
    first step on a CPU (NOTE [Working set by layer] in ``adaptive.py``); 0: not measured,
    the capacity leaves room for one working set instead."""

    grad_bytes: Annotated[int, Integer(NonNegative())] = 0
    """Gradients the layer's backward makes again each step, which the step freed at its
    start (a loop that sets gradients to None between steps): the replay credits the step
    with them from its start and holds them from the layer's backward on (NOTE [Gradients
    remade each step] in ``holds.py``). Measured in the first step under a device-memory
    cap on a CPU; 0: kept between steps, or not measured."""

    backward_working_bytes: Annotated[int, Integer(NonNegative())] = 0
    """What the layer's backward needs beyond its saved tensors: its gradients and their
    temporaries, less the saved tensors already used and freed. Held over its backward's
    span (NOTE [Working set by layer] in ``adaptive.py``); 0: not measured."""

    def __post_init__(self) -> None:
        _settle(self)

    def _error_owner(self) -> str:
        """Errors name the layer: ``LayerProfile(layer_id=3).forward_s = -1.0: ...``."""
        return f"LayerProfile(layer_id={self.layer_id!r})"

    def _check(self) -> None:
        """The rules that compare fields: the sites sum to the saved bytes, one use each."""
        if self.site_bytes is not None and sum(self.site_bytes) != self.saved_bytes:
            raise _broken(self, "site_bytes", f"must sum to saved_bytes = {self.saved_bytes}")
        for name in ("site_use", "site_save"):
            if getattr(self, name) is not None and len(getattr(self, name)) != len(self.sites):
                raise _broken(self, name, f"must have one entry per site ({len(self.sites)})")
        if self.modules is not None:
            names = [m.name for m in self.modules if isinstance(m, ModuleProfile)]
            if len(names) != len(self.modules) or len(set(names)) != len(names):
                raise _broken(self, "modules", "must be ModuleProfile entries, one per module name")
            beyond = [s for m in self.modules for s in m.freed_sites if s >= len(self.sites)]
            if beyond:
                raise _broken(self, "modules", f"freed_sites must be sites of the layer (< {len(self.sites)})")

    @property
    def sites(self) -> List[int]:
        """The bytes of each site in save order (``site_bytes``, else one site of
        ``saved_bytes``; none when the layer saves nothing offloadable)."""
        if self.site_bytes is not None:
            return list(self.site_bytes)
        return [self.saved_bytes] if self.saved_bytes else []

    def use_at(self, site: int) -> float:
        """The share of the layer's backward run when ``site`` is first needed
        (``site_use``, else 0)."""
        return 0.0 if self.site_use is None else float(self.site_use[site])

    def saved_at(self, site: int) -> float:
        """The share of the layer's forward run when ``site`` is saved (``site_save``,
        else 0)."""
        return 0.0 if self.site_save is None else float(self.site_save[site])

    def with_sites(self, order: Sequence[int], **changes: Any) -> "LayerProfile":
        """This layer with only the sites in ``order``, in that order, each keeping its
        bytes, use point and save point (None when none are left), and ``changes``
        applied; its saved bytes are left to ``changes``."""
        def pick(values: Optional[List[Any]]) -> Optional[List[Any]]:
            return None if values is None or not order else [values[s] for s in order]
        return dataclasses.replace(self, site_bytes=pick(self.sites), site_use=pick(self.site_use),
                                   site_save=pick(self.site_save), **changes)

    def moved_bytes(self, sites: Optional[int] = None) -> int:
        """Bytes moved to a tier when the first ``sites`` sites are (None: all)."""
        if sites is None:
            return self.saved_bytes
        return sum(self.sites[:sites])

    @property
    def recompute_time(self) -> float:
        """Seconds the forward takes again under RECOMPUTE (``recompute_s`` or ``forward_s``)."""
        return self.forward_s if self.recompute_s is None else self.recompute_s


_MARGIN = Number(InRange(0, 1, hi_open=True))
"""The rule of a bandwidth derating (``safety_margin``)."""


# NOTE [Unmeasured drives]
# The planner prices OFFLOAD with the drives' bandwidths, measured in the profile's OFFLOAD
# steps. Those steps run the default placement, which keeps the last
# ``offload.keep_last_layers`` layers: with that at least the layer count they move
# nothing, and nothing is measured. Such a profile's bandwidths are ``None``, and a plan
# from it places no layer on the drives (the search offers no OFFLOAD move, the timeline
# refuses one) and its table says so. Before, they were +inf: the plan offloaded every
# layer as if writing cost no time, and a plan holding +inf could not be read back from
# JSON, so ``megatron-ssd train`` trained every step and then exited 2 with
# "IOProfile.write_bytes_per_s = inf: must be a finite number" and no summary.


@dataclass
class TierRates:
    """Measured speed of one storage tier (NOTE [Tiers] in ``megatron_ssd/tier.py``), as
    ``IOProfile.rates`` gives it for every tier."""

    write_bytes_per_s: Annotated[float, Number(Positive())]
    """Bytes per second moved to the tier (forward)."""
    read_bytes_per_s: Annotated[float, Number(Positive())]
    """Bytes per second moved back (backward)."""
    compute_slowdown: Annotated[float, Number(NonNegative())] = 0.0
    """Fractional slowdown of compute while a transfer of the tier is in flight."""
    max_inflight_bytes: Optional[Annotated[int, Integer(Positive())]] = None
    """A drive tier: most bytes of writes its engine holds queued or in flight (NOTE
    [In-flight bound] in ``step_timeline.py``); None: no bound."""
    budget_bytes: Optional[Annotated[int, Integer(NonNegative())]] = None
    """Most bytes it may hold for the stage's micro-batches in flight; None: no bound
    but the plan's."""

    def __post_init__(self) -> None:
        _settle(self)

    def derated(self, margin: float) -> "TierRates":
        """Rates times ``1 - margin``, the slowdown divided by it (``IOProfile.derated``)."""
        return dataclasses.replace(self, write_bytes_per_s=self.write_bytes_per_s * (1 - margin),
                                   read_bytes_per_s=self.read_bytes_per_s * (1 - margin),
                                   compute_slowdown=self.compute_slowdown / (1 - margin))


def _checked_rates(write: float, read: float, slowdown: float, inflight: Optional[int]) -> TierRates:
    """A built-in tier's :class:`TierRates` from an ``IOProfile``'s fields, which its own
    rules checked: made without checking them again (the replay asks for them per tier
    on every prediction)."""
    rates = object.__new__(TierRates)
    rates.__dict__.update(write_bytes_per_s=write, read_bytes_per_s=read, compute_slowdown=slowdown,
                          max_inflight_bytes=inflight, budget_bytes=None)
    return rates


@dataclass
class IOProfile:
    """Measured speed of the SSD array as the I/O engine sees it, of the host link, and of
    any other storage tier registered (``tiers``; :meth:`rates` gives every tier's alike)."""

    write_bytes_per_s: Optional[Annotated[float, Number(Positive())]]
    """Sustained write bandwidth of the whole array, in bytes per second, measured with
    the engine's block size and thread count (bytes written / time a write was in flight).
    ``None``: not measured, because no profiling step moved a byte to the drives
    (NOTE [Unmeasured drives]); nothing is placed on them then."""

    read_bytes_per_s: Optional[Annotated[float, Number(Positive())]]
    """Sustained read bandwidth of the whole array, in bytes per second; ``None`` exactly
    when ``write_bytes_per_s`` is."""

    compute_slowdown: Annotated[float, Number(NonNegative())] = 0.0
    """Fractional slowdown of compute while any I/O is in flight: 0.25 means a layer
    that takes 1 s alone takes 1.25 s under I/O. Measured by timing a layer with and
    without a concurrent transfer; about 0 on a GPU with GPUDirect Storage, large on a
    CPU with few cores where the I/O threads compete for cycles."""

    host_bytes_per_s: Optional[Annotated[float, Number(Positive())]] = None
    """Copy bandwidth between the compute device and the host-memory pool, in bytes per
    second each way (a GPU's PCIe link to pinned memory: about 25e9 on PCIe 4 x16, 50e9
    on PCIe 5 x16). ``None``: no host tier to plan with (``Placement.HOST``) and no link
    that SSD traffic crosses. Host copies slow compute by ``host_compute_slowdown`` while
    in flight; with ``shared_host_link`` the SSD's requests cross the same link (NOTE
    [Shared link] in ``step_timeline.py``)."""

    host_compute_slowdown: Annotated[float, Number(NonNegative())] = 0.0
    """Fractional slowdown of compute while a host-tier copy is in flight (the host link
    busy), as ``compute_slowdown`` is for the drives' I/O: about 0 on a GPU, whose copy
    engines run the copies; on a CPU, whose host-tier copies are memory copies into fresh
    pages on the cores compute runs on, measured from HOST profiling steps against KEEP
    ones (NOTE [Pricing host copies] in ``planner/measured_profile.py``). 0 in profiles
    written before the field."""

    max_inflight_bytes: Optional[Annotated[int, Integer(Positive())]] = None
    """Most bytes of SSD writes the engine holds queued or in flight
    (``io.max_inflight_bytes`` with ``io.on_backpressure: wait``); a forward whose next
    tensor would take them over waits until enough writes complete (NOTE [In-flight bound]
    in ``step_timeline.py``). ``None``: no bound (profiles written before the field)."""

    shared_host_link: Annotated[bool, Boolean()] = True
    """Whether the SSD's writes and reads cross the host link too, each occupying it for
    its bytes / ``host_bytes_per_s`` (NOTE [Shared link] in ``step_timeline.py``): true on
    a GPU, whose SSD bytes cross its PCIe link to the host (staged through pinned memory,
    or by GPUDirect Storage over the same link); false on a CPU, where the drives are
    written from memory in place and a paced host tier (``offload.host_copy_bytes_per_s``)
    is a link of its own. Without ``host_bytes_per_s`` it has no effect."""

    tiers: Dict[str, TierRates] = dataclasses.field(default_factory=dict)
    """Rates of the storage tiers registered beyond the SSDs and the host pool
    (``megatron_ssd.tier.register``), by tier name; a tier without rates here is not
    planned with. Empty in profiles written before the field."""

    def __post_init__(self) -> None:
        if not isinstance(self.tiers, Mapping) or not all(isinstance(v, (TierRates, Mapping)) for v in self.tiers.values()):
            raise _broken(self, "tiers", "must be a mapping of tier names to TierRates fields")
        self.tiers = {k: v if isinstance(v, TierRates) else from_dict(TierRates, v) for k, v in self.tiers.items()}
        _settle(self)

    def rates(self, placement: Placement) -> Optional[TierRates]:
        """A moved placement's rates, the same form for every tier: the SSDs' from
        ``write_bytes_per_s``, ``read_bytes_per_s``, ``compute_slowdown`` and
        ``max_inflight_bytes``; the host pool's from ``host_bytes_per_s`` (both ways) and
        ``host_compute_slowdown``; another tier's from ``tiers``. None: not measured, so
        not planned with."""
        if placement is Placement.OFFLOAD:
            if self.write_bytes_per_s is None or self.read_bytes_per_s is None:
                return None
            return _checked_rates(self.write_bytes_per_s, self.read_bytes_per_s, self.compute_slowdown,
                                  self.max_inflight_bytes)
        if placement is Placement.HOST:
            h = self.host_bytes_per_s
            return None if h is None else _checked_rates(h, h, self.host_compute_slowdown, None)
        return self.tiers.get(placement.value)

    def link_slowdowns(self) -> Dict[str, float]:
        """Per link, the compute slowdown while it carries a transfer (NOTE [Tiers] in
        ``tier.py``): the drives' queue's, the host link's, then each link of a tier with
        rates in :attr:`tiers`, the largest of the tiers naming it."""
        out = {DRIVES_LINK: self.compute_slowdown, HOST_LINK: self.host_compute_slowdown}
        for name, rates in self.tiers.items():
            tier = TIERS.get(name)
            if tier is not None:
                out[tier.link] = max(out.get(tier.link, 0.0), rates.compute_slowdown)
        return out

    def _check(self) -> None:
        """The drives' speed is known in both directions or not at all."""
        if (self.write_bytes_per_s is None) != (self.read_bytes_per_s is None):
            raise _broken(self, "read_bytes_per_s", "must be null exactly when write_bytes_per_s is")

    @property
    def drives_measured(self) -> bool:
        """Whether the drives' bandwidths are known, so OFFLOAD can be priced (NOTE
        [Unmeasured drives])."""
        return self.write_bytes_per_s is not None

    def derated(self, margin: float) -> "IOProfile":
        """This profile with every known bandwidth multiplied by ``1 - margin`` and every
        compute slowdown divided by it: transfers take longer, and slow compute more while
        they run. The slowdowns are measured from one or two profiling steps and vary by
        tens of percent from run to run on a loaded CPU (docs/performance.md, "Host copies
        priced"), so a plan held to ``max_slowdown`` keeps headroom on them too."""
        broken = _MARGIN.check(margin)
        if broken is not None:
            raise ConfigError(f"safety_margin = {margin!r}: {broken}")
        def scaled(bandwidth: Optional[float]) -> Optional[float]:
            return None if bandwidth is None else bandwidth * (1 - margin)

        return dataclasses.replace(self, write_bytes_per_s=scaled(self.write_bytes_per_s),
                                   read_bytes_per_s=scaled(self.read_bytes_per_s),
                                   host_bytes_per_s=scaled(self.host_bytes_per_s),
                                   compute_slowdown=self.compute_slowdown / (1 - margin),
                                   host_compute_slowdown=self.host_compute_slowdown / (1 - margin),
                                   tiers={name: r.derated(margin) for name, r in self.tiers.items()})


@dataclass
class StageProfile:
    """One pipeline stage: its layers, its SSD array and its place in the pipeline."""

    layers: List[LayerProfile]
    """The stage's transformer layers in forward order."""

    io: IOProfile
    """The SSD array this stage offloads to."""

    pipeline_rank: Annotated[int, Integer(NonNegative())] = 0
    """This stage's index in the pipeline, from 0."""

    pipeline_size: Annotated[int, Integer(AtLeast(1))] = 1
    """Number of pipeline stages (1 without pipeline parallelism)."""

    microbatches_in_flight: Optional[Annotated[int, Integer(AtLeast(1))]] = None
    """Most micro-batches whose forward has run and whose backward has not, at once, on
    this stage. ``None`` means the 1F1B value ``pipeline_size - pipeline_rank`` (1
    without pipelining). Set it when the schedule differs (interleaved: more)."""

    other_s: Annotated[float, Number(NonNegative())] = 0.0
    """Compute per micro-batch outside the layers (embedding, output layer, loss), in
    seconds. Modelled as running between the last layer's forward and its backward."""

    head_bytes: Annotated[int, Integer(NonNegative())] = 0
    """Saved bytes of the output layer and loss (logits: ``s x b x vocab`` elements, the
    largest tensors of a GPT's last stage), per micro-batch. Modelled as resident from the
    last layer's forward end until the first layer backward starts, the span of
    ``other_s``: they are saved after the layers run and freed before the layers'
    backward."""

    head_working_bytes: Annotated[int, Integer(NonNegative())] = 0
    """What the step holds outside the layers beyond its saved tensors and beyond the
    working set its capacity already leaves out: the logits chain's temporaries and
    gradients under a device-memory cap, measured by phase in the first step (NOTE
    [Working set by phase] in ``adaptive.py``, NOTE [Working set of the head's backward]
    in ``cache/memory_cap.py``). Held over ``head_bytes``' span; not in
    the tensor cache's count (NOTE [What the cache counts] in ``holds.py``). 0:
    none, or not measured."""

    head_grad_bytes: Annotated[int, Integer(NonNegative())] = 0
    """Gradients the head's backward makes again each step (the output layer's), which the
    step freed at its start, as ``LayerProfile.grad_bytes`` is for a layer (NOTE
    [Gradients remade each step] in ``holds.py``). 0: none, or not measured."""

    def __post_init__(self) -> None:
        _settle(self)
        if self.microbatches_in_flight is None:  # after the checks: pipeline_rank is in range
            self.microbatches_in_flight = self.pipeline_size - self.pipeline_rank

    def _check(self) -> None:
        """The rules on the layer list, the I/O profile's type and the rank in the pipeline."""
        if not self.layers:
            raise _broken(self, "layers", "must hold at least one layer")
        bad = [type(layer).__name__ for layer in self.layers if not isinstance(layer, LayerProfile)]
        if bad:
            raise _fail("StageProfile", "layers", bad, "every entry must be a LayerProfile")
        if not isinstance(self.io, IOProfile):
            raise _broken(self, "io", "must be an IOProfile")
        ids = [layer.layer_id for layer in self.layers]
        dupes = sorted({repr(i) for i in ids if ids.count(i) > 1})
        if dupes:
            raise _fail("StageProfile", "layers", dupes, "layer ids must be unique; repeated: " + ", ".join(dupes))
        if self.pipeline_rank >= self.pipeline_size:
            raise _broken(self, "pipeline_rank", f"must be an integer in [0, pipeline_size={self.pipeline_size})")

    @property
    def layer_ids(self) -> List[LayerId]:
        """The layer ids in forward order."""
        return [layer.layer_id for layer in self.layers]

    def fixed(self, placement: Placement, keep_last: int = 0) -> List[Placement]:
        """The placements of a fixed mode, as the cache's policy applies it
        (:func:`~megatron_ssd.placement.default_placement`): ``placement`` for every
        transformer layer but the last ``keep_last`` (KEEP), and KEEP for the tensors
        outside the layers (NOTE [Sites outside the layers])."""
        inside = [layer_id for layer_id in self.layer_ids if layer_id not in OUTSIDE]
        return [default_placement(layer_id, inside, keep_last, placement) for layer_id in self.layer_ids]

    @property
    def saved_bytes(self) -> int:
        """Offloadable bytes of one micro-batch, all layers."""
        return sum(layer.saved_bytes for layer in self.layers)

    def with_io(self, io: IOProfile) -> "StageProfile":
        """A copy of this profile with another I/O profile."""
        return dataclasses.replace(self, io=io)

    # ------------------------------------------------------------------ JSON round trip

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready dict (the form :meth:`from_dict` reads)."""
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StageProfile":
        """Build a profile from a dict; unknown keys raise ConfigError."""
        return from_dict(cls, data)

    def to_json(self, indent: Optional[int] = 2) -> str:
        """This profile as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "StageProfile":
        """Parse JSON text written by :meth:`to_json`."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"StageProfile JSON: not valid JSON ({exc})") from None
        return cls.from_dict(data)

    def save(self, path: str) -> None:
        """Write this profile as JSON to ``path``."""
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str) -> "StageProfile":
        """Read a profile written by :meth:`save`."""
        with open(path, "r", encoding="utf-8") as fh:
            return cls.from_json(fh.read())


def uniform_stage(
    num_layers: int,
    forward_s: float,
    backward_s: float,
    saved_bytes: int,
    io: IOProfile,
    **stage_fields: Any,
) -> StageProfile:
    """A stage of ``num_layers`` identical layers named 0..n-1 (for tests and what-ifs).

    Args:
        num_layers: How many layers.
        forward_s: Forward time of each layer.
        backward_s: Backward time of each layer.
        saved_bytes: Offloadable bytes of each layer.
        io: The SSD array.
        **stage_fields: Other :class:`StageProfile` fields (``pipeline_rank``, ...).
    """
    broken = Integer(AtLeast(1)).check(num_layers)
    if broken is not None:
        raise ConfigError(f"num_layers = {num_layers!r}: {broken}")
    layers = [LayerProfile(i, forward_s, backward_s, saved_bytes) for i in range(num_layers)]
    return StageProfile(layers=layers, io=io, **stage_fields)

