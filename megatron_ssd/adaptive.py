"""The planner at run time: profile the first steps, plan, watch for drift, re-plan.

Wired to a training loop through the step callback of the offload-aware schedule::

    planner = AdaptivePlanner(cache, config.planner)
    forward_backward = get_forward_backward_func(cache=cache, on_step=planner.on_step)

The profile is built from the profiling steps' measurements by
:func:`~megatron_ssd.planner.measured_profile.stage_from_stats`.

Modes (``PlannerConfig.mode``): ``auto`` profiles and plans; ``static`` keeps the cache's
default placement (last ``keep_last_layers`` kept, the rest offloaded); ``keep``,
``offload`` and ``recompute`` place every layer alike, for comparisons.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from .cache.memory_cap import WorkingSet, capacity_under_cap
from .cache.tensor_cache import TensorCache
from .config import FIXED_MODES, PlannerConfig
from .placement import HEAD, OUTSIDE, Placement
from .planner.drift import DriftDetector
from .planner.measured_profile import stage_from_stats, with_layer_peaks, with_probed_tiers
from .planner.measurement import StepMeasurement
from .planner.plan import Plan, PlanRequest, make_plan
from .planner.profile import StageProfile
from .planner.drives import write_limit_for
from .planner.holds import rerun_working_bytes
from .io.cuda import CUDA, CudaOps
from .io.rundir import check_space_for_plan
from .profiling import Probed, measure_host_bandwidth, probe_tiers, profile_schedule
from .units import gib

__all__ = ["AdaptivePlanner", "PlanEvent"]

logger = logging.getLogger("megatron_ssd")


@dataclass
class PlanEvent:
    """One plan the run used, and why."""

    step: int
    """The step after which the plan was set."""
    reason: str
    """``profile``, ``drift: ...`` or the mode name."""
    plan: Optional[Plan] = None
    """The planner's output (None for the fixed modes)."""
    search_s: Optional[float] = None
    """Seconds the search for ``plan`` took on the training thread, between two steps, and
    so in the next step's wall time (None for the fixed modes; NOTE [Search time])."""


# NOTE [Search time]
# The search runs on the training thread, between the step that ends the profile (or
# shows drift) and the next: in the schedule's step callback, after the cache closed the
# step's numbers. The schedule starts the cache's step clock again when the callback
# returns (``StepAccountant.restart_step_clock``), so the search's time is in no step's
# ``wall_s`` or ``cpu_s``: not in the next step's, where it once was, which made the first
# planned step of a run longer by it (``rok --largest-within`` measures two planned
# steps, whose median is their mean: the planner on configs/gpt-tiny.yaml at micro-batch
# 1 measured 0.57 s a step for 0.33 s, its first planned step 0.81 s), and which a
# re-profile would have counted as time outside the layers. On a GPU the step's CUDA
# events (NOTE [Device step time]) span the callback of the step that ends the profile,
# a profiling step no summary measures; a drift re-plan's search falls in a measured
# step's events there, once per re-plan. It grows
# with the layers per stage and the tiers to choose among (docs/getting-started.md has
# measured times): the greedy start costs O(n) replays per move, each O(n) long (scored
# lazily beyond 8 layers), and the rest of the search about a second more (NOTE [Search]
# in ``planner/search.py``); with ``read_ahead_mode=auto`` the greedy start runs at each
# read-ahead of a short ladder and the rest once (NOTE [Just-in-time reads]). Where it
# matters more than the plan, ``planner.search=greedy`` keeps the greedy start alone.
# Each plan event records it (``search_s``) and the plan's line prints it: its cost is
# said there, once.

# NOTE [Profiling within the capacity]
# No step may hold more saved bytes than the device's activation capacity
# (``activation_capacity_bytes``, or on a CUDA device its free memory measured before the
# first step, either bounded by ``offload.device_memory_cap``: NOTE [Device memory cap]),
# the warm-up and profiling steps included: a KEEP profiling step on a
# device that cannot hold keep-everything is an out-of-memory error before any plan
# exists. So when a capacity is known, the first step runs every layer OFFLOAD under the
# cache's capacity guard (NOTE [Capacity guard] in ``cache/policy.py``), which holds it
# within the capacity whatever the drives do, and measures what each layer saves. From
# it: keep-everything would hold the step's ``peak_saved_bytes``; RECOMPUTE would hold
# each micro-batch in flight's layer inputs and embedding tensors, plus the larger of
# the head's saved tensors (with its working set, NOTE [Working set by phase]) and one
# layer's while it is recomputed (with its own, NOTE [Working set by layer]): the two
# never meet, the head's are freed before the first layer's backward. A block whose placement would not fit runs OFFLOAD
# instead (the KEEP block and the default placement's block, which keeps the last
# layers, as one: keep-everything either fits or not), and those steps are measured as
# OFFLOAD steps. Without KEEP steps the profile takes keep-everything's compute times
# from the OFFLOAD steps with their read stalls and write waits taken out (``stage_from_
# stats`` in ``planner/measured_profile.py``; the waits stay out of the time outside the
# layers too, NOTE [Time outside the layers]), so keep-everything is priced without
# being run.
# Under ``offload.device_memory_cap`` on CUDA the capacity itself is measured in that
# first step: NOTE [Working set under a cap].

# NOTE [Working set under a cap]
# An enforced cap (NOTE [Device memory cap]) counts everything the step allocates, not
# only the activations the cache holds: the logits chain (vocabulary x tokens x 4 B per
# fp32 copy, several for the loss and its gradient), attention scores, a layer's
# temporaries, and the caching allocator's reserved but unallocated blocks. A fraction of
# the cap (``capacity_reserve``) as room for them shrinks with the cap while they do not.
# Under a cap a little above the resident bytes the fraction's capacity can be smaller
# than one fp32 logits copy, and the first step then runs out of memory with every layer
# offloaded (the GPU check's job part records such a step: docs/performance.md).
# So on CUDA under a cap the first step runs with the cache's guard at
# ``FIRST_STEP_GUARD`` (0 bytes) and its peak is measured through the CUDA calls
# (``CudaOps.reset_peak_memory`` before it, ``peak_memory`` and ``memory_allocated``
# after): the working set W is the peak allocated less the resident bytes less the
# guard's limit (which bounds what the cache held of the tensors it may move; the small
# ones it always keeps stay in W, as in every step), the fragmentation F is the peak
# reserved less the peak allocated, and from then on the capacity is cap - resident - W -
# F (:class:`WorkingSet`, ``capacity_under_cap``), still at most the capacity without the
# cap. The guard at 0 is what makes W an upper bound: the cache keeps no tensor it may
# move, the forward waits for each write while anything is resident, and backward reads
# each tensor when it needs it (NOTE [Capacity guard] in ``cache/policy.py``). Any
# larger limit is unknown room (one layer's bytes are not known before the first step)
# that W would leave out. The price is a slow first step, a warm-up step by default
# (the first of ``warmup_steps``), whose times no profile uses. When even that step
# leaves no room (resident + W + F >= the cap) one warning line names the cap, the
# resident bytes and the need, and the guard stays at 0; when it runs out of memory, the
# train command records it (NOTE [Out of memory, recorded]). On a CPU nothing enforces a
# cap, but ``rok --largest-within`` holds a run to it by the allocator timeline's peak of
# live tensor bytes above the step's start (NOTE [Fits within a cap] in
# ``commands/rok_largest.py``), which counts the same working set: the logits chain, the
# temporaries. Before, the CPU planner took the cap less ``capacity_reserve`` as its
# capacity and its steps ran over the cap from micro-batch 3 of gpt-tiny at 300 MiB
# (307.5 MiB), where recompute fitted 9. So the train command measures the first step on
# a CPU as on CUDA, through :class:`~megatron_ssd.memory.TimelinePeaks` (the timeline
# opened when the planner is built, closed when the first step ends): W is its peak
# above the step's start, nothing is resident (weights are not in the count) and there
# is no fragmentation. Without a cap nothing of this runs; where the planner is built
# by another caller (Megatron-LM's ``pretrain_gpt.py``) a CPU run keeps the reserve.

# NOTE [Working set by phase]
# One number for the working set sums two peaks that do not meet. The logits chain (the
# output layer's logits, the loss's fp32 copies and their gradient) lives outside the
# layers, between the last layer's forward and its backward; the layers' temporaries
# live inside them. A plan's activations peak where its placements put them: keep-
# everything at the head, with every layer's saved tensors resident, but a plan that
# recomputes or moves layers in backward, where one layer is rebuilt or read back while
# the logits are gone. Subtracting the whole step's working set from the cap charged a
# recomputing plan for the logits it never holds beside a rebuilt layer: on gpt-tiny at
# 300 MiB and micro-batch 9 the first step's working set was 80.4 MiB inside the layers
# and 100.7 MiB outside them, and one number charged 100.7 MiB at every instant. So on a
# CPU the first step under a cap is measured by phase. The cache tells its memory
# observer (``TensorCache.observe_memory``, here the
# :class:`~megatron_ssd.memory.TimelinePeaks`) each tensor a layer saves and
# each entry into a layer (its forward, or its backward starting) and out of one (a
# forward scope closing). The timeline takes the working set as the live bytes less the
# activations among them, with one peak inside the layers and one outside them
# (``working_peaks``). The activations are the read-back buffers and the layers' saved
# tensors, from when each is packed to when its storage dies, not only while the cache
# holds it: in this step every layer is offloaded, and a tensor written out and let go
# by the cache still lives while the layer's code holds it, where the timeline counts a
# layer's saved bytes from its forward's end. The head's saved tensors are not told: the
# loss saves its softmax after the logits chain peaks, so at that peak the tensor it
# will save is still a temporary, and the outside peak is the head's whole need.
# The capacity is the cap less the inside peak (``WorkingSet.working_bytes``; 0 where the
# layers are measured one by one, NOTE [Working set by layer]); what the outside peak
# adds beyond it (``WorkingSet.head_bytes``), less the head's saved tensors
# (``StageProfile.head_bytes``, which the timeline already holds there), goes into the
# profile as ``StageProfile.head_working_bytes``, held over the head's span, so a plan's
# predicted peak there meets the same capacity. The profile's KEEP block fits only with
# it added too (keep-everything's peak is at the head), and RECOMPUTE's with the larger
# of one layer's bytes and it. The outside phase also covers the embedding and the gaps
# between layers, so its peak bounds the head's from above; what runs after the first
# layer's backward starts (the rest of backward, the optimizer step, which on the first
# step allocates its state) is inside, so the inside peak can be the larger (gpt-tiny at
# micro-batch 3, one micro-batch: 42.3 MiB inside, 24.8 MiB outside), and the capacity
# then leaves room for it at every instant, as one number did. On CUDA the peak counter is
# one per device (``max_memory_allocated``), which the train command also reads per
# step, so the working set stays one number there (``CudaOps.working_peaks`` is None)
# and the capacity is the cap less all of it, as before.

# NOTE [Working set by layer]
# One peak for the whole inside of the layers still charged every instant with the
# largest transient of any layer, on top of every byte the plan holds. That transient is
# a layer's own: on configs/gpt-ref-cpu.yaml at micro-batch 8 the inside peak (192.0 MiB)
# was three attention-score tensors of 64 MiB (``baddbmm``, ``masked_fill``, ``_softmax``)
# alive at once in one layer's forward, before that layer had saved most of its tensors,
# and the softmax's output becomes one of them. Added to the layer's whole saved bytes it
# counted those bytes twice, and full recompute, measured at 633.5 MiB at micro-batch 16,
# was priced over the 700 MiB cap, so the planner called the cap unreachable from
# micro-batch 13 (benchmarks/results/rok-largest-gpt-ref-cpu.json). So on a CPU the first
# step under a cap is measured per layer too: the cache names the layer whose forward or
# backward starts (``phase``) and the layer that saved each tensor (``saved``), and the
# timeline takes per layer (``layer_peaks``):
# - its forward's peak: live bytes less the other layers' saved tensors, that is what it
#   has saved so far and its temporaries (``LayerProfile.forward_peak_bytes``; 232.3 MiB
#   at micro-batch 8, its saved tensors 192.2 MiB);
# - its backward's working set: live bytes less every saved tensor and read-back buffer,
#   less the read-back buffers freed since its backward began, so what it needs beyond
#   its saved tensors where each dies when used (``backward_working_bytes``; 72.0 MiB).
# The plan's timeline holds the first over the layer's forward and the second over its
# backward, uncounted as the head's working set is. A layer that runs a forward again
# in backward (RECOMPUTE, or modules recomputed inside it) holds there at least its
# forward's peak and two gradients of its input's size (the one coming in and the
# residual's) beyond its saved bytes (``holds.backward_working_bytes``). Full
# recompute's layer backward was measured at 264.3 MiB at micro-batch 8 (its input
# included); it is priced at 272.2 MiB. The capacity then leaves no room for a working
# set inside the layers (``WorkingSet.working_bytes`` is 0). What runs after the first
# layer's backward starts (the embedding's backward, the optimizer step) counts as that
# layer's backward. What the first step makes for the steps after it (gradients,
# optimizer state) is no working set (NOTE [Survivors] in ``memory/allocator_timeline.py``):
# later steps find it allocated at their start.

FIRST_STEP_GUARD = 0
"""The cache's capacity guard in the first step under a cap (NOTE [Working set under a
cap])."""


class AdaptivePlanner:
    """Chooses and updates the cache's per-layer placement from what each step measured.

    Args:
        cache: the :class:`~megatron_ssd.cache.TensorCache` whose plan is set.
        config: planner settings.
        default_read_ahead: layers read ahead during backward (the cache's ``default_read_ahead``).
        pipeline_rank, pipeline_size: this process's pipeline stage.
        cuda: the CUDA calls that measure device memory (tests pass a fake).
        cpu_peaks: on a CPU, what measures the first step's working set under
            ``offload.device_memory_cap`` (:class:`~megatron_ssd.memory.TimelinePeaks`, which
            the train command passes: it brackets the step with a dispatch mode, so only a
            caller that runs the first step right after building the planner may); None:
            not measured on a CPU (NOTE [Working set under a cap]).
    """

    def __init__(
        self,
        cache: TensorCache,
        config: PlannerConfig,
        default_read_ahead: Optional[int] = None,
        pipeline_rank: int = 0,
        pipeline_size: int = 1,
        cuda: Optional[CudaOps] = None,
        cpu_peaks: Optional[Any] = None,
    ) -> None:
        self.cache = cache
        self.cuda = cuda if cuda is not None else CUDA
        self.peaks = self.cuda if cache.device.type == "cuda" else cpu_peaks
        """What measures the first step's working set under a cap: the CUDA calls on a
        GPU, ``cpu_peaks`` on a CPU (NOTE [Working set under a cap])."""
        self.config = config
        self.default_read_ahead = default_read_ahead or cache.config.default_read_ahead
        self.pipeline_rank = pipeline_rank
        self.pipeline_size = pipeline_size
        self.events: List[PlanEvent] = []
        self.plan: Optional[Plan] = None
        self.profile: Optional[StageProfile] = None
        self.replans = 0
        self.fell_behind = 0
        self._keep_steps: List[StepMeasurement] = []
        self._recompute_steps: List[StepMeasurement] = []
        self._offload_steps: List[StepMeasurement] = []
        self._host_steps: List[StepMeasurement] = []
        self._drift = DriftDetector(threshold=config.replan_threshold)
        self._steps_seen = 0
        self._microbatches = 1
        self._host_bw: Optional[float] = None
        self._probed: Dict[str, Probed] = {}  # NOTE [Probed tiers] in profiling.py
        self.profiles_host = self.host_budget() is not None
        """Whether the profile measures HOST steps too (the plan may use a host pool)."""
        self._schedule = profile_schedule(config, host=self.profiles_host)
        if config.mode in FIXED_MODES:
            self._fixed = Placement(config.mode)
        else:
            self._fixed = None
        self.capacity_at_start: Optional[int] = None
        """The activation capacity measured before the first step, under a cap on CUDA
        after it (None: none applies); the cache's guard holds every step within it (NOTE
        [Profiling within the capacity], NOTE [Working set under a cap])."""
        self.working_set: Optional[WorkingSet] = None
        """What the first step needed beyond its activations, under a cap (NOTE [Working
        set under a cap]); None: not measured."""
        self._measure_first = (self._fixed is None and self.peaks is not None
                               and cache.config.device_memory_cap is not None)
        self.fits: Dict[str, bool] = {}
        """Whether keep-everything and RECOMPUTE fit the capacity, decided after the first
        step (empty: no capacity, or not decided yet)."""
        self.fit_bytes: Dict[str, int] = {}
        """What that decision compared: each placement's estimated peak and the capacity."""
        self.placed: List[str] = []
        """The placement each profiling step ran (``keep``, ``recompute``, ``offload``,
        ``default``)."""
        if self._fixed is None:
            self.capacity_at_start = self.activation_capacity()
            self.cache.policy.resident_limit = self.capacity_at_start
        self._resident_at_start = 0
        if self._measure_first:  # NOTE [Working set under a cap]
            self.cache.policy.resident_limit = FIRST_STEP_GUARD
            if cache.device.type != "cuda":  # NOTE [Working set by phase]
                self.cache.observe_memory(self.peaks)
            self._resident_at_start = self.peaks.memory_allocated(self.cache.binding.resolved())
            self.peaks.reset_peak_memory(self.cache.binding.resolved())
        self.before_step()

    def before_step(self) -> None:
        """Set the placement for the coming step (called by the constructor and on_step)."""
        if self._fixed is not None:
            self._place_all(self._fixed)
        elif self._steps_seen < len(self._schedule):
            placement = self._profile_placement(self._steps_seen)
            self.placed.append(placement.value if placement is not None else "default")
            self._place_all(placement)

    def _profile_placement(self, step: int) -> Optional[Placement]:
        """What profiling step ``step`` runs: the schedule's placement, or OFFLOAD where a
        capacity rules it out (NOTE [Profiling within the capacity])."""
        planned = self._schedule[step].placement
        if self.capacity_at_start is None:
            return planned
        if step == 0:
            return Placement.OFFLOAD
        if planned is Placement.RECOMPUTE:
            return planned if self.fits.get("recompute", False) else Placement.OFFLOAD
        return planned if self.fits.get("keep", False) else Placement.OFFLOAD

    def _decide_fits(self, stats: StepMeasurement) -> None:
        """From the first step (every layer OFFLOAD): which placements the capacity holds
        (NOTE [Profiling within the capacity])."""
        capacity = self.capacity_at_start
        keep = stats.peak_saved_bytes
        in_flight = max(1, stats.peak_open_microbatches)
        held = largest = beyond = 0
        head_saved = 0
        per_layer = (self.working_set.by_layer if self.working_set is not None else None) or {}
        for layer_id, lc in stats.layers.items():
            if not lc.microbatches:
                continue
            per_mb = (lc.saved_bytes + lc.small_bytes + lc.unmovable_bytes) // lc.microbatches
            if layer_id == HEAD:  # held from the head's forward to its backward, no layer's beside it
                head_saved = per_mb
                continue
            if layer_id in OUTSIDE or layer_id is None:
                held += per_mb
                continue
            held += lc.input_bytes // lc.microbatches
            largest = max(largest, per_mb)
            if layer_id in per_layer:  # NOTE [Working set by layer]
                forward, backward = per_layer[layer_id]
                beyond = max(beyond, forward - per_mb, backward)
                rerun = rerun_working_bytes(forward, lc.input_bytes // lc.microbatches, per_mb)
                largest = max(largest, per_mb + max(backward, rerun))
        head = self._head_working_bytes(head_saved)  # NOTE [Working set by phase]
        keep += max(head, beyond)
        recompute = held * in_flight + max(largest, head_saved + head)
        self.fits = {"keep": keep <= capacity, "recompute": recompute <= capacity}
        self.fit_bytes = {"keep": keep, "recompute": recompute, "capacity": capacity}
        if not self.fits["keep"]:
            logger.warning(
                "megatron_ssd: keep-everything would hold %.1f MiB of activations, over the %.1f MiB capacity: "
                "the profile runs offloaded instead of keeping every layer%s",
                keep / 2**20, capacity / 2**20,
                "" if self.fits["recompute"] else f", and RECOMPUTE (about {recompute / 2**20:.1f} MiB) does not fit either")

    def _head_working_bytes(self, head_saved: int) -> int:
        """What the step needs outside the layers beyond the working set inside them and
        beyond the head's ``head_saved`` bytes of saved tensors (NOTE [Working set by
        phase]), and at least what the head's backward needs beyond them (NOTE [Working
        set of the head's backward] in ``cache/memory_cap.py``); 0 where not measured by
        phase."""
        if self.working_set is None:
            return 0
        return max(self.working_set.head_bytes - head_saved, self.working_set.head_backward_bytes, 0)

    def _measure_working_set(self) -> None:
        """After the first step under a cap: its working set, and from it the capacity and
        the guard for every later step (NOTE [Working set under a cap])."""
        device = self.cache.binding.resolved()
        if self.cache.device.type != "cuda":
            self.cache.observe_memory(None)  # NOTE [Working set by phase]
        peak_allocated, peak_reserved = self.peaks.peak_memory(device)
        by_layer = getattr(self.peaks, "layer_peaks", None)  # NOTE [Working set by layer]
        self.working_set = WorkingSet(self.peaks.memory_allocated(device), FIRST_STEP_GUARD, peak_allocated,
                                      peak_reserved, self.peaks.working_peaks(device),
                                      by_layer(device) if by_layer is not None else None)
        cap = self.cache.config.device_memory_cap
        short = self.working_set.shortfall(cap)
        if short is not None:
            logger.warning(short)
        self.capacity_at_start = self.activation_capacity()
        self.cache.policy.resident_limit = self.capacity_at_start
        logger.info("megatron_ssd: the first step under offload.device_memory_cap = %s needed a working set of %s "
                    "(%s more outside the layers) and %s of fragmentation beyond %s allocated between steps%s: "
                    "activation capacity %s", gib(cap), gib(self.working_set.working_bytes),
                    gib(self.working_set.head_bytes), gib(self.working_set.fragmentation_bytes),
                    gib(self.working_set.resident), self._survivors_clause(), gib(self.capacity_at_start))

    def _survivors_clause(self) -> str:
        """On a CPU, what the first step made for the steps after it (NOTE [Survivors] in
        ``memory/allocator_timeline.py``), which its working set leaves out."""
        kept = getattr(self.peaks, "surviving_bytes", 0)
        return f" (and {gib(kept)} it made for later steps: optimizer state, gradients)" if kept else ""

    def out_of_memory_line(self) -> Optional[str]:
        """When the first step under a cap on CUDA, run with the guard at
        ``FIRST_STEP_GUARD``, ran out of memory: one line naming the cap, the bytes
        allocated before it and what it had reserved when it failed, less than it needs
        (NOTE [Working set under a cap]); else None. The train command adds it to its
        record (NOTE [Out of memory, recorded])."""
        if not self._measure_first or self._steps_seen:
            return None
        cap = self.cache.config.device_memory_cap
        _, reserved = self.peaks.peak_memory(self.cache.binding.resolved())
        return (f"megatron_ssd: offload.device_memory_cap = {cap} ({gib(cap)}) does not hold the first step with "
                f"the cache holding at most {FIRST_STEP_GUARD} bytes of activations: {self._resident_at_start} bytes "
                f"({gib(self._resident_at_start)}) allocated before it, and it had reserved {reserved} "
                f"({gib(reserved)}) when it needed more")

    def _place_all(self, placement: Optional[Placement]) -> None:
        """Place every layer alike; None restores the cache's ``keep_last_layers`` rule."""
        self.cache.set_plan({}, placement)

    def on_step(self, stats: StepMeasurement) -> None:
        """Take one step's measurement (the cache's ``StepStats``); plan or re-plan when due."""
        step = self._steps_seen
        self._steps_seen += 1
        self.fell_behind += stats.backpressure_keeps
        self._microbatches = max(self._microbatches, stats.microbatches)
        if self._fixed is not None:  # placed once, by the constructor
            if not self.events:
                self.events.append(PlanEvent(step, self.config.mode))
            return
        if step == 0 and self._measure_first:
            self._measure_working_set()
        if step < len(self._schedule):  # NOTE [Profiling steps]
            planned = self._schedule[step]
            if step == 0 and self.capacity_at_start is not None:
                self._decide_fits(stats)
            if planned.measured:
                measured = {"keep": self._keep_steps, "recompute": self._recompute_steps, "host": self._host_steps}
                measured.get(self.placed[step], self._offload_steps).append(stats)
            if step == len(self._schedule) - 1:
                self._make_plan(step, "profile")  # its plan has no default: the keep_last_layers rule
                return
            self.before_step()
            return
        if self.plan is None:
            return
        decision = self._drift.observe_step_stats(stats)
        if decision.replan and decision.profile is not None:
            self.replans += 1
            self.profile = decision.profile
            self._make_plan(step, "drift: " + "; ".join(decision.reasons), profile=decision.profile)

    def _make_plan(self, step: int, reason: str, profile: Optional[StageProfile] = None) -> None:
        host_budget = self.host_budget()
        if profile is None:
            profile = stage_from_stats(self._keep_steps, self._offload_steps, self.pipeline_rank, self.pipeline_size,
                                       self._recompute_steps, self.cache.config.io.forward_write_bound,
                                       self._host_steps, self.host_bandwidth() if host_budget else None)
        head_working = self._head_working_bytes(profile.head_bytes)  # NOTE [Working set by phase]
        if head_working:
            profile = dataclasses.replace(profile, head_working_bytes=head_working)
        remade = getattr(self.peaks, "remade", None)  # NOTE [Gradients remade each step] in planner/holds.py
        profile = with_layer_peaks(profile, self.working_set and self.working_set.by_layer,  # NOTE [Working set by layer]
                                   remade and remade(self.cache.binding.resolved()), self._one_microbatch())
        if host_budget:  # NOTE [Shared link]: a GPU's SSD bytes cross it
            profile = profile.with_io(dataclasses.replace(
                profile.io, host_bytes_per_s=profile.io.host_bytes_per_s or self.host_bandwidth(),
                shared_host_link=self.cache.device.type == "cuda"))
        if self.cache.tiers.others:  # NOTE [Probed tiers] in profiling.py
            profile = with_probed_tiers(profile, probe_tiers(self.cache.tiers.others, self._probed))
        self.profile = profile
        started = time.perf_counter()
        plan = make_plan(profile, PlanRequest(  # PlanInfeasibleError propagates: the budget cannot be met
            memory_budget=self.config.memory_budget,
            safety_margin=self.config.safety_margin,
            default_read_ahead=self.default_read_ahead,
            allow_recompute=self.config.allow_recompute,
            max_write_bytes_per_s=write_limit_for(self.config, len(self.cache.config.paths)),
            capacity_bytes=self.activation_capacity(),
            read_ahead_mode=self.config.read_ahead_mode,
            host_budget_bytes=host_budget,
            max_slowdown=self.config.max_slowdown,
            search=self.config.search,
        ))
        search_s = time.perf_counter() - started
        self._check_space(plan)
        if self.capacity_at_start is not None:  # NOTE [Capacity guard]: the capacity measured now
            self.cache.policy.resident_limit = self.activation_capacity()
        self.plan = plan
        self.cache.set_plan(plan.choices())
        self._drift.rebase(profile, plan)
        self.events.append(PlanEvent(step, reason, plan, search_s))
        logger.info("megatron_ssd: plan after step %d (%s; searched %.2f s):\n%s", step, reason, search_s, plan.table())

    def _one_microbatch(self) -> bool:
        """Whether the profile's steps ran one micro-batch each."""
        steps = self._offload_steps or self._keep_steps
        return bool(steps) and steps[-1].microbatches == 1

    def activation_capacity(self) -> Optional[int]:
        """The hard limit on the plan's predicted peak: ``activation_capacity_bytes`` when
        set; on a CUDA device, its total memory less ``capacity_reserve`` and less what is
        allocated now, between steps (parameters, gradients, optimizer state: activations
        are freed by then); on a CPU, None. With ``offload.device_memory_cap`` set, at most
        the cap less the same allocated bytes and less, once the first step measured it,
        that step's working set and fragmentation (NOTE [Working set under a cap]), before
        it and on a CPU the same reserve (NOTE [Device memory cap])."""
        limits = []
        if self.config.activation_capacity_bytes is not None:
            limits.append(self.config.activation_capacity_bytes)
        cap = self.cache.config.device_memory_cap
        resident = 0
        if self.cache.device.type == "cuda" and (cap is not None or not limits):
            device = self.cache.binding.resolved()
            resident = self.cuda.memory_allocated(device)
            if not limits:
                total = self.cuda.total_memory(device)
                limits.append(max(int(total * (1.0 - self.config.capacity_reserve)) - resident, 0))
        if cap is not None:
            measured = self.working_set.room if self.working_set is not None else None
            limits.append(capacity_under_cap(cap, self.config.capacity_reserve, resident, measured))
        return min(limits) if limits else None

    # NOTE [Paced host tier]
    # On a CPU the host tier's blobs are in the same memory as the compute device's, so by
    # the process's RSS hosting saves nothing, and without more the planner gives the pool
    # no budget. With its copies paced (``offload.host_copy_bytes_per_s``, ``rok
    # --host-throttle``, NOTE [Host copy rate] in ``io/pacing.py``) the tier stands in
    # for a GPU's: its blobs are not the compute device's live tensors (NOTE [Host blobs
    # are not device memory] in ``io/host.py``), the measure the ``rok`` comparison uses,
    # and a copy takes as long as at the paced rate. The planner then plans it as on a
    # GPU: its budget is the pool, its bandwidth the pace, and its link is its own
    # (``IOProfile.shared_host_link`` false: the drives are written from memory in place,
    # not over the paced link), so the planner and the host-tier peers (Megatron's
    # fine-grained offloading, Transformer Engine's CPU offload) use the same tier.

    def host_budget(self) -> Optional[int]:
        """Bytes of the cache's host pool the plan may use (NOTE [Host tier]): the pool's
        size on a CUDA device (``auto`` already sized by the cache: NOTE [Auto host pool]),
        and on a CPU where its copies are paced (NOTE [Paced host tier]); None on a CPU
        otherwise, where the host tier saves nothing (the compute device's memory is host
        memory), without a pool, and on CUDA with a pool left unpinned because pinning
        failed, whose pageable copies block the forward pass (NOTE [Pinning fails])."""
        if self.cache.host is None:
            return None
        if self.cache.device.type != "cuda":
            return self.cache.host.capacity_bytes if self.cache.config.host_copy_bytes_per_s is not None else None
        if not self.cache.host.pinned:
            return None
        return self.cache.host.capacity_bytes

    def host_bandwidth(self) -> float:
        """The copy bandwidth between the device and the host pool: on CUDA that of pinned
        memory, measured once (:func:`measure_host_bandwidth`), or the pace of
        ``offload.host_copy_bytes_per_s`` where that is lower; on a CPU the pace (NOTE
        [Paced host tier])."""
        pace = self.cache.config.host_copy_bytes_per_s
        if self.cache.device.type != "cuda":
            return float(pace)
        if self._host_bw is None:
            self._host_bw = measure_host_bandwidth(self.cache.binding.resolved())
        return self._host_bw if pace is None else min(self._host_bw, float(pace))

    def _check_space(self, plan: Plan) -> None:
        """Refuse a plan whose SSD footprint does not fit the offload paths' free space.

        Footprint: the plan's offloaded bytes per micro-batch times the micro-batches a
        step can hold on disk at once (all of them, under gradient accumulation with
        1F1B the stage's in-flight count), plus the 4 KiB padding of each blob.
        """
        in_flight = max(plan.microbatches_in_flight, self._microbatches)
        planned = int(plan.offloaded_bytes * in_flight * 1.01)
        if planned > 0:
            check_space_for_plan(list(self.cache.config.paths), planned)

    def summary(self) -> Dict[str, Any]:
        """What the planner did, JSON-ready."""
        return {
            "mode": self.config.mode,
            "profile": self.profile.to_dict() if self.profile is not None else None,
            "capacity_at_start_bytes": self.capacity_at_start,
            "profile_placements": list(self.placed),
            "fits": dict(self.fits),
            "fit_bytes": dict(self.fit_bytes),
            "working_set": None if self.working_set is None else {
                **dataclasses.asdict(self.working_set), "working_bytes": self.working_set.working_bytes,
                "head_bytes": self.working_set.head_bytes,
                "fragmentation_bytes": self.working_set.fragmentation_bytes},
            "replans": self.replans,
            "fell_behind": self.fell_behind,
            "events": [
                {"step": e.step, "reason": e.reason, "plan": e.plan.to_dict() if e.plan else None,
                 "search_s": e.search_s} for e in self.events
            ],
        }
