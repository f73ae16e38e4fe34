"""How the planner chooses placements (:class:`PlannerConfig`, ``offload.planner``) and a
peer's rule run in its place for comparisons (:class:`PeerConfig`, ``offload.peer``): two
sections of the tree :mod:`.tree` reads, in a module of their own.

Each field's rules sit on its annotation (:mod:`.schema`; the settings a plan is asked for
are declared in :mod:`.plan_settings`); the docstring under it is its text in
``docs/configuration.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, List, Optional

from ..peer_rule import MEGATRON_OFFLOAD, PEER_BY_NAME, PEER_RULE_ALIASES, TE_OFFLOAD, fine_grained_modules_rule
from ..placement import FGO_MODULES, Placement
from .plan_settings import (MAX_LAYERS, AllowRecompute, CapacityBytes, MaxSlowdown, MemoryBudget, ReadAheadMode,
                            SafetyMargin, Search)
from .rules import MAX_BYTES, AtLeast, AtMost, ByteCount, InRange, NonNegative, OneOf, Positive
from .schema import _broken, _settle, warn_renamed

__all__ = ["CAPACITY_RESERVE", "FIXED_MODES", "MAX_DRIVES", "MEGATRON_OFFLOAD", "PEER_RULE_ALIASES", "PLANNER_MODES",
           "PROFILE_STEPS_MAX", "PeerConfig", "PlannerConfig", "TE_OFFLOAD"]

FIXED_MODES = tuple(p.value for p in Placement)
"""The planner modes that place every layer alike, one per :class:`Placement`."""
PLANNER_MODES = ("auto", "static") + FIXED_MODES
"""Every ``offload.planner.mode`` (and ``--ssd-offload-planner`` value)."""
CAPACITY_RESERVE = 0.15
"""The share of a GPU's memory left out of the activation capacity by default
(``offload.planner.capacity_reserve``; the what-if model leaves the same)."""
PROFILE_STEPS_MAX = 1000
"""The most steps of each kind an ``auto`` planner's profile runs (warm-up, measured,
settle, recompute)."""
MAX_DRIVES = 1 << 16
"""The most drives, and processes sharing them, the wear model takes."""


@dataclass
class PlannerConfig:
    """How layer placements (keep / offload / recompute) are chosen."""

    mode: Annotated[str, OneOf(*PLANNER_MODES)] = "auto"
    """``auto``: profile the first steps, then plan from the measured compute time and
    SSD bandwidth, and re-plan when they drift; ``static``: keep the last
    ``keep_last_layers`` layers and offload the rest, never re-plan; ``keep``,
    ``offload``, ``recompute``, ``host``: every layer placed alike (for comparisons;
    ``host`` needs ``offload.host_pool_bytes``)."""

    # The profiling schedule is a list of its steps (NOTE [Profiling steps]); a handful are
    # enough, and a count past any run's length (1e30) would not fit in a list.
    warmup_steps: Annotated[int, NonNegative(), AtMost(PROFILE_STEPS_MAX)] = 2
    """Steps run before profiling starts (allocator and page-cache warm-up), with the
    placement of the first profiling step. A process's second step still runs slower
    than its later ones (NOTE [Warm-up steps] in ``profiling.py``), so the default
    measures from the third."""

    profile_steps: Annotated[int, NonNegative(), AtMost(PROFILE_STEPS_MAX)] = 2
    """Steps measured before the first plan (``auto`` mode): the first half (rounded up)
    with every layer kept, the rest with the default placement (offload)."""

    settle_steps: Annotated[int, NonNegative(), AtMost(PROFILE_STEPS_MAX)] = 1
    """Untimed offload steps run between the kept and the offloaded profiling steps, so
    the first offloaded step measured does not inherit keep-everything's heap (NOTE
    [Profiling steps] in ``profiling.py``). The warm-up steps run with every layer kept
    when there are kept profiling steps."""

    recompute_profile_steps: Optional[Annotated[int, NonNegative(), AtMost(PROFILE_STEPS_MAX)]] = None
    """Measured steps with every layer placed RECOMPUTE (``auto`` mode), run between the
    kept and the offloaded profiling steps after ``settle_steps`` untimed ones; from them
    the profile prices RECOMPUTE per layer (``recompute_s``: one stage-wide factor, the
    layers' forward plus backward under RECOMPUTE less their kept ones over their kept
    forward, at least 1, times the layer's forward) instead of as one more forward, which falls
    short on a CPU (NOTE [Pricing recompute] in ``planner/measured_profile.py``;
    docs/performance.md#run-2026-11-24-recompute-price). None: 1 when the planner may choose RECOMPUTE to
    meet a limit (``allow_recompute`` with ``memory_budget`` or
    ``activation_capacity_bytes`` set), else 0. On a CUDA device with no limit set the
    measured capacity can still call for RECOMPUTE, priced as one forward unless this
    is set."""

    safety_margin: SafetyMargin = 0.1
    """Fraction by which measured bandwidths are derated when planning (and by which the
    measured compute slowdowns are inflated: divided by ``1 - safety_margin``)."""

    memory_budget: MemoryBudget = None
    """Peak saved-activation bytes allowed per process; None plans for zero exposed I/O.
    Sizes such as ``2GiB`` are accepted."""

    max_slowdown: MaxSlowdown = 0.05
    """With no ``memory_budget``, the most the plan's predicted step may exceed
    keep-everything's, as a fraction (0.05: 5% longer). Hidden I/O still costs compute
    time where the I/O engine shares the cores with compute (a CPU run: the measured
    ``compute_slowdown``); on a GPU that cost is near 0 and the bound does not bind.
    None: offload everything whose I/O hides, whatever it costs (NOTE [Slowdown bound]
    in ``planner/judge.py``)."""

    allow_recompute: AllowRecompute = True
    """Whether the planner may place layers RECOMPUTE to meet ``memory_budget``."""

    activation_capacity_bytes: CapacityBytes = None
    """The most saved-activation bytes the device can hold: a hard limit on every plan,
    with or without ``memory_budget`` (a plan that offloads what hides but does not fit
    is replaced by one that fits, at the smallest predicted step time). None: on a CUDA
    device measured at each plan (total memory x (1 - ``capacity_reserve``) minus what is
    allocated between steps: parameters, gradients, optimizer state); on a CPU, no limit.
    Sizes such as ``60GiB`` are accepted."""

    capacity_reserve: Annotated[float, InRange(0, 1, hi_open=True)] = CAPACITY_RESERVE
    """Fraction of a CUDA device's memory left out of the measured activation capacity,
    for temporaries, communication buffers and fragmentation; in [0, 1)."""

    replan_threshold: Annotated[float, InRange(0, 1, lo_open=True, hi_open=True)] = 0.15
    """Relative drift of measured bandwidth, or of the stage's summed forward or backward
    time, that triggers a re-plan; in (0, 1). One layer's time re-plans at three times
    this (NOTE [Compute drift by stage])."""

    _renamed_keys = {"read_ahead": "read_ahead_mode"}  # deprecated keys, read as the new (schema.renamed_keys)

    read_ahead_mode: ReadAheadMode = "auto"
    """When each offloaded layer's read is issued during backward: ``auto``, as late as
    the plan predicts it still arrives in time, chosen per layer and then per site, a
    site's read due by when backward first uses it (NOTE [Just-in-time reads]);
    ``fixed``, ``default_read_ahead`` layers ahead for every layer."""

    search: Search = "full"
    """How the plan is searched (NOTE [Search] in ``planner/search.py``): ``full``, the
    greedy start improved by a local search and a branch and bound over every layer's
    whole choice set (the model's optimum wherever the branch and bound ends:
    docs/planner.md, "How the search is checked"); ``greedy``, the greedy start alone, the
    search before this release: about half the time on deep stages, for comparisons and
    for stages where planning time matters more than the plan."""

    drive_tbw_bytes: Optional[Annotated[ByteCount, Positive()]] = None
    """Rated write endurance of one offload drive, in bytes (TBW; DWPD x capacity x
    warranty days, e.g. ``7.0e15`` for a 3.84 TB drive at 1 DWPD over 5 years). Set, the
    planner never chooses more SSD writes than let the drives last
    ``drive_lifetime_years``, and ``train`` reports their projected lifetime. None: writes
    are not bounded by wear (NOTE [Wear model])."""

    drive_lifetime_years: Annotated[float, Positive(), AtMost(100.0)] = 3.0
    """Years the drives must last at this job's write rate (used with ``drive_tbw_bytes``)."""

    drive_count: Annotated[int, NonNegative(), AtMost(MAX_DRIVES)] = 0
    """Drives behind the offload paths; 0: one per path (a RAID0 mount given as one path
    needs its drive count here)."""

    drive_sharing: Annotated[int, AtLeast(1), AtMost(MAX_DRIVES)] = 1
    """Processes writing to the same drives, each given an equal share of their endurance
    (e.g. 8 when a node's 8 GPUs share its array)."""

    drive_duty_cycle: Annotated[float, InRange(0, 1, lo_open=True)] = 1.0
    """Fraction of each day the drives are written at this rate, in (0, 1]."""

    # The names are DRIVES' in planner/drives.py (the figures live there; this layer may
    # not import it); tests/planner/test_drives.py checks the two lists are the same.
    drive: Optional[Annotated[str, OneOf("micron-7450-pro-3.84tb", "micron-7450-max-3.2tb",
                                         "solidigm-d7-p5810-800gb", "optane-p5800x-1.6tb")]] = None
    """A drive preset (docs/ssd-sizing.md#drive-presets): its datasheet endurance is the
    wear bound's ``drive_tbw_bytes`` when that is unset, as ``simulate drive=NAME`` uses
    it. None: only ``drive_tbw_bytes`` sets the endurance."""

    drive_used_fraction: Annotated[float, InRange(0, 1, hi_open=True)] = 0.0
    """Share of the drives' rated endurance already used, in [0, 1): the wear bound and
    the projected lifetime count only the rest (``drive_tbw_bytes`` x (1 - this)). NVMe
    SMART's ``percentage_used`` / 100 of the most worn drive, which ``megatron-ssd
    bench-io`` reads and prints as this setting."""

    def __post_init__(self) -> None:
        _settle(self)

    def _check(self) -> None:
        if self.mode == "auto" and self.profile_steps < 1:
            raise _broken(self, "profile_steps", "must be >= 1 when mode is auto")

    @property
    def recompute_profiling(self) -> int:
        """The measured RECOMPUTE profiling steps ``auto`` runs: ``recompute_profile_steps``,
        or when None, 1 if RECOMPUTE may be chosen to meet a set limit, else 0."""
        if self.recompute_profile_steps is not None:
            return self.recompute_profile_steps
        limited = self.memory_budget is not None or self.activation_capacity_bytes is not None
        return 1 if self.allow_recompute and limited else 0


@dataclass
class PeerConfig:
    """A peer's placement rule run on this cache and its engines, for measured comparisons
    (``megatron-ssd rok``'s peer placements; docs/planner.md, "The peers' rules,
    measured"). The rule decides which saved tensors go to the host tier; every other
    tensor is kept, so it needs ``offload.planner.mode`` ``keep`` and a host pool."""

    rule: Annotated[str, OneOf("none", *PEER_BY_NAME)] = "none"
    """``none``; ``megatron-offload``: megatron-core's fine-grained activation offloading
    (the inputs of the ``offload_modules`` of every layer to host memory, the last layer's
    groups kept, ``offload_fraction`` of the other groups offloaded); ``te-offload``:
    Transformer Engine's CPU offload (every saved tensor of the first ``num_layers``
    layers to host memory). The names before 2026-12-07, ``megatron-fine-grained`` and
    ``te-cpu-offload``, are still read, with one warning line."""

    offload_fraction: Annotated[float, InRange(0, 1)] = 1.0
    """Megatron's ``activation_offload_fraction``: the share of the eligible groups that
    are offloaded, the earliest in forward order (a count of groups, not of bytes)."""

    offload_modules: List[str] = field(
        default_factory=lambda: list(FGO_MODULES))
    """Megatron's ``offload_modules``: the module groups whose saved tensors move, of
    ``attn_norm``, ``qkv_linear``, ``core_attn``, ``attn_proj`` and ``mlp_norm``
    (``attn_proj`` needs ``core_attn``, as Megatron requires)."""

    min_tensor_elements: Optional[Annotated[int, NonNegative(), AtMost(MAX_BYTES)]] = None
    """Saved tensors with fewer elements stay (Megatron's ``min_offloaded_tensor_size``);
    None: the peer's own default, 1048576 for Megatron, 262144 for Transformer Engine."""

    num_layers: Annotated[int, Positive(), AtMost(MAX_LAYERS)] = 1
    """Transformer Engine's ``num_layers``: how many of the first layers are offloaded (at
    most the model's layers - 1, as Transformer Engine requires)."""

    def __post_init__(self) -> None:
        if isinstance(self.rule, str) and self.rule in PEER_RULE_ALIASES:  # a deprecated name, read as the new
            warn_renamed(f"offload.peer.rule={self.rule}", f"offload.peer.rule={PEER_RULE_ALIASES[self.rule]}")
            self.rule = PEER_RULE_ALIASES[self.rule]
        _settle(self)

    def _check(self) -> None:
        broken = fine_grained_modules_rule(self.offload_modules)
        if broken:
            raise _broken(self, "offload_modules", broken)
