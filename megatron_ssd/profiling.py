"""What an ``auto`` planner runs before its first plan: the profiling schedule (NOTE
[Profiling steps]) and, on a CUDA device, the probe of the host tier's link.

:class:`~megatron_ssd.adaptive.AdaptivePlanner` runs the schedule;
``megatron-ssd plan``, the step lines and ``rok``'s probes count it
(:func:`profile_counts`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from .config import PlannerConfig
from .errors import ConfigError
from .placement import Placement
from .tier import TIERS

__all__ = ["Probed", "ProfileCounts", "ProfileStep", "measure_host_bandwidth", "probe_tiers", "profile_counts", "profile_schedule",
           "PROBE_BYTES"]

# NOTE [Profiling steps]
# ``auto`` measures two kinds of steps after warm-up: KEEP steps give each layer's compute
# time with no I/O running and its saved bytes; OFFLOAD steps (the default placement) give
# the bandwidth the engine achieves while the model computes, and how much the I/O slows
# compute down (on a CPU both share the cores; on a GPU the factor comes out near 0).
# The kinds run in two blocks, KEEP first (``profile_steps = 2`` measures one of each;
# an odd count gives KEEP the extra step), and every measured step follows a step of its
# own kind: the warm-up steps run the first block's placement, and ``settle_steps``
# untimed OFFLOAD steps run between the blocks. A step right after a switch inherits the
# other kind's heap: a KEEP step right after an OFFLOAD step runs slower than after a
# KEEP step, and an OFFLOAD step after a KEEP step skips the page faults its own steady
# state pays, so alternating the kinds hides most of what offloading costs
# (docs/planner.md). Measured: docs/performance.md#run-2026-11-24-switch-heap.
# NOTE [Warm-up steps]: a process's first steps run slower than its later ones (its
# allocator and the kernel still map fresh pages), and the second one still does: over 48
# keep-everything rounds of `rok` stored in benchmarks/results, step 1 took a median 1.021x
# the round's later steps (quartiles 0.976-1.085) and step 2 0.995x (0.955-1.037). A KEEP
# step measured at step 1 makes keep-everything slow, so every plan's ratio to it reads low,
# and the host copies' price (measured against it) low too: on configs/gpt-deep-cpu.yaml
# the default planner predicted 1.042x keep from such a profile and measured 1.086x and
# 1.097x paired, over its 1.05x bound; with two warm-up steps it predicted 1.042x and
# measured 1.032x (docs/performance.md#run-2026-12-07-warm-up). So ``warmup_steps``
# defaults to 2.
# A KEEP step holds every activation, which a user of this plugin often cannot hold: see
# NOTE [Profiling within the capacity] in ``adaptive.py``.
# When RECOMPUTE may be chosen (``recompute_profile_steps``), a RECOMPUTE block runs
# between the two, after its own settle steps (NOTE [Pricing recompute] in
# ``planner/measured_profile.py``). Where the plan may use a host pool (``host_budget``),
# a HOST block as long as the OFFLOAD one runs last, after its settle steps: its copies'
# cost to compute is measured as the drives' I/O is (NOTE [Pricing host copies] there).


@dataclass(frozen=True)
class ProfileStep:
    """One step of the profiling phase (NOTE [Profiling steps])."""

    placement: Optional[Placement]
    """KEEP, RECOMPUTE or HOST for every layer, or None for the cache's default placement
    (offload)."""
    measured: bool
    """Whether the profile uses the step; warm-up and settle steps are not."""


def profile_schedule(config: PlannerConfig, host: bool = False) -> List[ProfileStep]:
    """The steps an ``auto`` planner runs before its first plan, in order (NOTE
    [Profiling steps]); empty for the other modes. ``host``: the plan may use a host pool,
    so a HOST block follows, as long as the OFFLOAD one (NOTE [Pricing host copies] in
    ``planner/measured_profile.py``)."""
    if config.mode != "auto":
        return []
    keep = (config.profile_steps + 1) // 2 if config.profile_steps >= 2 else 0
    blocks = [(Placement.KEEP, keep), (Placement.RECOMPUTE, config.recompute_profiling),
              (None, config.profile_steps - keep),
              (Placement.HOST, (config.profile_steps - keep) if host and keep else 0)]
    blocks = [(placement, n) for placement, n in blocks if n]
    schedule = [ProfileStep(blocks[0][0], False)] * config.warmup_steps
    for i, (placement, n) in enumerate(blocks):
        if i:
            schedule += [ProfileStep(placement, False)] * config.settle_steps
        schedule += [ProfileStep(placement, True)] * n
    return schedule


@dataclass(frozen=True)
class ProfileCounts:
    """How many steps of each kind :func:`profile_schedule` runs."""

    warmup: int
    """Warm-up steps (not used)."""
    measured: int
    """Steps the profile measures."""
    settle: int
    """Settle steps before each kind's measured block but the first (not used)."""

    @property
    def total(self) -> int:
        """Every step of the profile; a run needs one more to run its plan."""
        return self.warmup + self.measured + self.settle


def profile_counts(config: PlannerConfig, host: bool = False) -> ProfileCounts:
    """The step counts of ``profile_schedule(config, host)`` by kind."""
    schedule = profile_schedule(config, host)
    measured = sum(step.measured for step in schedule)
    warmup = config.warmup_steps if schedule else 0
    return ProfileCounts(warmup, measured, len(schedule) - warmup - measured)


def measure_host_bandwidth(device: torch.device, nbytes: int = 256 << 20, repeats: int = 3) -> float:
    """Bytes per second of a copy between ``device`` and pinned host memory: the slower
    direction's best of ``repeats`` copies of ``nbytes`` (the host tier's link, NOTE
    [Host tier]). CUDA only.

    Raises:
        ConfigError: ``device`` is not a CUDA device.
    """
    if device.type != "cuda":
        raise ConfigError(f"measure_host_bandwidth: device = {device}: the host tier is measured on a CUDA device")
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    best = {"d2h": float("inf"), "h2d": float("inf")}
    for _ in range(repeats):
        for name, (dst, origin) in (("d2h", (host, src)), ("h2d", (src, host))):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(origin, non_blocking=True)
            end.record()
            end.synchronize()
            best[name] = min(best[name], start.elapsed_time(end) / 1e3)
    return nbytes / max(best.values())


# NOTE [Probed tiers]
# A tier registered after the SSDs and the host pool (NOTE [Tiers] in ``tier.py``) is
# measured once, before the cache's first plan, by a probe through its own store's
# engine: ``PROBE_BYTES`` written and read back into a buffer of the engine's, the best
# of two of each, the bytes compared. Its rates are what its engine achieves alone; the
# compute slowdown its transfers cause is not probed (``planner/measured_profile.py``,
# ``with_probed_tiers``, prices a drive tier's at the SSDs' measured one). Its byte
# budget, where the tier has one (``Tier.budget``), is read from its store then too.

PROBE_BYTES = 16 << 20
"""Bytes each probe of a tier writes and reads back."""

Probed = Tuple[float, float, Optional[int]]
"""A probed tier's write and read bytes per second and its byte budget (None: no bound)."""


def probe_tiers(stores: Mapping[Any, Any], probed: Dict[str, Probed]) -> Dict[str, Probed]:
    """``probed`` with each store's tier not in it yet probed (NOTE [Probed tiers]): per
    tier name, its (write, read) bytes per second and its byte budget (``Tier.budget``;
    None: no bound).

    Raises:
        ConfigError: a probe's bytes did not come back as written.
    """
    for placement, store in stores.items():
        name = placement.value
        if name in probed:
            continue
        engine, data = store.engine, torch.randint(0, 256, (PROBE_BYTES,), dtype=torch.uint8)
        best = [float("inf"), float("inf")]
        for _ in range(2):
            started = time.perf_counter()
            handle = engine.write(data, block=True).get()
            best[0] = min(best[0], time.perf_counter() - started)
            dst = engine.alloc(PROBE_BYTES, torch.device("cpu"), handle)
            started = time.perf_counter()
            engine.read(handle, dst).get()
            best[1] = min(best[1], time.perf_counter() - started)
            engine.free(handle)
            if not torch.equal(dst[:PROBE_BYTES], data):
                raise ConfigError(f"tier {name}: its probe read back other bytes than it wrote")
        budget = TIERS[placement].budget
        probed[name] = (PROBE_BYTES / max(best[0], 1e-9), PROBE_BYTES / max(best[1], 1e-9),
                        None if budget is None else budget(store))
    return probed
