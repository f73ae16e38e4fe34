"""The planner's profile from measured steps: :class:`StepMeasurement` in, :class:`StageProfile` out.

The run-time planner builds its profile with :func:`stage_from_stats` from the steps of
its profiling phase, by kind (NOTE [Profiling steps] in ``profiling.py``).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Callable, Dict, Hashable, Iterable, List, Mapping, Optional, Sequence, Tuple

from ..placement import EMBEDDING, HEAD, MOVED, OUTSIDE, RECOMPUTE_MODULES, Placement
from ..tier import TIERS
from .measurement import ModuleMeasurement, StepMeasurement
from .profile import IOProfile, LayerId, LayerProfile, ModuleProfile, StageProfile, TierRates

__all__ = ["median_or_zero", "stage_from_stats", "with_layer_peaks", "with_probed_tiers"]

Steps = Sequence[StepMeasurement]
LayerMedians = Dict[str, Any]
"""One layer's medians over steps, per micro-batch: ``fwd``, ``bwd``, ``saved``, ``small``,
``input`` (numbers), ``sites``, ``use`` and ``save`` (per site, or None)."""


def median_or_zero(xs: Iterable[float]) -> float:
    """The median of ``xs``; 0.0 when there is nothing to summarise (no step wrote, ...)."""
    xs = list(xs)
    return statistics.median(xs) if xs else 0.0


# NOTE [Pricing recompute]
# The timeline charges a RECOMPUTE layer ``recompute_s`` more backward, by default its
# forward time. On a CPU that is short, by enough that the planner chose recompute over
# offloads that cost less. The rebuilt activations are fresh allocations
# (page faults on a CPU), and backward runs a second autograd graph. So when RECOMPUTE
# may be chosen, the profile measures it: in RECOMPUTE steps the cache clocks each
# layer's forward and its backward, which includes the re-run. Summed over the layers,
# that less their kept forward and backward is what recomputing them all costs; over
# their summed forward it is a factor, and each layer's ``recompute_s`` is the factor
# times its forward (at least 1: running a forward again costs at least that forward,
# and a smaller measured extra is load that changed between the blocks; under a loaded
# machine a gpt-ref-cpu profile priced three recomputed layers at 1.000x keep's step,
# 2026-12-07). The sum, not each layer's own difference: one step's
# differences scatter between layers of equal size, as the clocks split work at layer
# boundaries, while their sum matches the step. With no KEEP steps to compare against,
# the offload steps' compute (stalls and write waits taken out) stands in.
# Measured: docs/performance.md#run-2026-11-24-recompute-price.


def _per_mb(total: float, n: int) -> float:
    return total / n if n else 0.0


def stage_from_stats(
    keep_steps: Steps,
    offload_steps: Steps,
    pipeline_rank: int = 0,
    pipeline_size: int = 1,
    recompute_steps: Optional[Steps] = None,
    max_inflight_bytes: Optional[int] = None,
    host_steps: Optional[Steps] = None,
    host_bytes_per_s: Optional[float] = None,
) -> StageProfile:
    """Build the planner's :class:`StageProfile` from measured steps.

    Compute times come from ``keep_steps`` when there are any (no I/O interference),
    else from ``offload_steps`` with read stalls and write waits subtracted. Bandwidth and
    compute slowdown come from ``offload_steps``; each recomputable layer's
    ``recompute_s`` from ``recompute_steps`` when given (NOTE [Pricing recompute]); what
    recomputing a module inside a layer frees and costs from the steps the compute times
    come from (``LayerProfile.modules``, NOTE [Module timing] in ``cache/scopes.py``);
    ``max_inflight_bytes`` is the engine's bound on writes in flight, which a forward
    waits for (NOTE [In-flight bound] in ``planner/step_timeline.py``; None: none);
    ``host_steps`` (every layer HOST) and the host link's ``host_bytes_per_s`` give the
    host tier's rate and its compute slowdown (NOTE [Pricing host copies]).
    """
    source = keep_steps or offload_steps
    if not source:
        raise ValueError("megatron_ssd: stage_from_stats needs at least one measured step")
    measured = list(source[-1].layers)
    # NOTE [Sites outside the layers]: the embedding's tensors plan as a layer before
    # layer 0 that cannot be recomputed; the head's, used first by backward, as
    # ``head_bytes``.
    layer_ids: List[LayerId] = ([EMBEDDING] if EMBEDDING in measured else []) + [
        k for k in measured if k is not None and k not in OUTSIDE]

    def per_layer(steps: Steps, layer_id: LayerId) -> LayerMedians:
        fwd, bwd, saved, small, sites, inputs, uses, saves = [], [], [], [], [], [], [], []
        for s in steps:
            lc = s.layers.get(layer_id)
            if lc is None or not lc.microbatches:
                continue
            n = lc.microbatches
            fwd.append(_per_mb(lc.forward_s - lc.write_wait_s, n))
            bwd.append(_per_mb(max(lc.backward_s - lc.stall_s, 0.0), n))
            saved.append(_per_mb(lc.saved_bytes, n))
            small.append(_per_mb(lc.small_bytes + lc.unmovable_bytes, n))  # held whatever the placement
            sites.append([int(_per_mb(b, n)) for b in lc.site_bytes])
            inputs.append(_per_mb(lc.input_bytes, n))
            uses.append(_shares(lc.site_use_s, lc.site_uses, len(lc.site_bytes), bwd[-1]))
            saves.append(_shares(lc.site_save_s, lc.site_saves, len(lc.site_bytes), _per_mb(lc.forward_s, n)))
        site_bytes = _site_medians(sites)
        count = len(site_bytes) if site_bytes else (1 if median_or_zero(saved) else 0)
        return {"fwd": median_or_zero(fwd), "bwd": median_or_zero(bwd), "saved": median_or_zero(saved),
                "small": median_or_zero(small), "sites": site_bytes, "input": median_or_zero(inputs),
                "use": _share_medians(uses, count), "save": _share_medians(saves, count)}

    layers = []
    clean_compute = 0.0
    for layer_id in layer_ids:
        m = per_layer(source, layer_id)
        clean_compute += m["fwd"] + m["bwd"]
        layers.append(
            LayerProfile(
                layer_id=layer_id,
                forward_s=m["fwd"],
                backward_s=m["bwd"],
                saved_bytes=sum(m["sites"]) if m["sites"] else int(m["saved"]),
                kept_bytes=int(m["small"]),
                site_bytes=m["sites"],
                site_use=m["use"],
                site_save=m["save"],
                boundary_bytes=int(m["input"]),
                recomputable=layer_id != EMBEDDING,
                modules=_module_profiles(source, layer_id, len(m["sites"]) if m["sites"] else None),
            )
        )
    factor = _recompute_factor(recompute_steps or [], layers, per_layer)
    if factor is not None:
        layers = [dataclasses.replace(l, recompute_s=factor * l.forward_s) if l.recomputable else l for l in layers]
    heads = [_per_mb(s.layers[HEAD].saved_bytes + s.layers[HEAD].small_bytes + s.layers[HEAD].unmovable_bytes,
                     s.layers[HEAD].microbatches)
             for s in source if HEAD in s.layers and s.layers[HEAD].microbatches]
    head = int(statistics.median(heads)) if heads else 0
    io = dataclasses.replace(_io_profile(offload_steps, layer_ids, clean_compute if keep_steps else None),
                             max_inflight_bytes=max_inflight_bytes)
    if host_bytes_per_s is not None:
        io = dataclasses.replace(io, host_bytes_per_s=host_bytes_per_s, host_compute_slowdown=_host_slowdown(
            host_steps or [], layer_ids, clean_compute if keep_steps else None, host_bytes_per_s))
    other = median_or_zero(_outside_layers(s, layer_ids) for s in source)
    return StageProfile(layers=layers, io=io, pipeline_rank=pipeline_rank, pipeline_size=pipeline_size, other_s=other,
                        head_bytes=head)


# NOTE [Time outside the layers]
# ``other_s`` is the part of a step no layer's clock holds (the head and loss, the
# optimizer update, the schedule's own work), per micro-batch. It is each step's wall
# time less every layer's clocked forward and backward as measured, waits included, and
# the median over steps. The layers' profile times have the waits taken out (a forward's
# write wait, a backward's read stall); subtracting those cleaned times from the wall
# time instead would count every wait again, as time outside the layers. With KEEP steps
# as the source there are no waits and both ways agree; with OFFLOAD steps as the source
# (keep-everything above the capacity, NOTE [Profiling within the capacity] in
# ``adaptive.py``) the waits are most of an I/O-bound step, and keep-everything was priced
# at the offload steps' wall time, so every overlap window looked longer than it is.
# Measured: docs/performance.md#run-2026-11-29-time-outside-layers.


def _outside_layers(step: StepMeasurement, layer_ids: Sequence[LayerId]) -> float:
    """One step's time outside ``layer_ids``' clocks, per micro-batch, at least 0 (NOTE
    [Time outside the layers])."""
    clocked = 0.0
    for layer_id in layer_ids:
        lc = step.layers.get(layer_id)
        if lc is not None and lc.microbatches:
            clocked += (lc.forward_s + lc.backward_s) / lc.microbatches
    return max(0.0, step.wall_s / max(1, step.microbatches) - clocked)


def _module_profiles(steps: Steps, layer_id: LayerId, site_count: Optional[int]) -> Optional[List[ModuleProfile]]:
    """What recomputing each module inside ``layer_id`` frees and costs, per micro-batch
    (NOTE [Module timing] in ``cache/scopes.py``): its forward time and held bytes, the
    medians over ``steps``; its freed sites, where every step measured the same ones
    within the layer's ``site_count`` sites (None: the steps disagree on the layer's
    sites, so none is offered). None when no module was measured."""
    if site_count is None:
        return None
    found: Dict[str, List[ModuleMeasurement]] = {}
    for s in steps:
        lc = s.layers.get(layer_id)
        for name, mc in (lc.modules.items() if lc is not None else ()):
            if mc.microbatches:
                found.setdefault(name, []).append(mc)
    out = []
    for name in RECOMPUTE_MODULES:
        counters = found.get(name, [])
        if not counters or len(counters) != len(steps):
            continue
        sites = counters[-1].freed_sites
        if any(c.freed_sites != sites for c in counters) or any(site >= site_count for site in sites):
            continue
        out.append(ModuleProfile(name, median_or_zero(_per_mb(c.forward_s, c.microbatches) for c in counters),
                                 list(sites), int(median_or_zero(_per_mb(c.held_bytes, c.microbatches) for c in counters))))
    return out or None


def _recompute_factor(recompute_steps: Steps, layers: List[LayerProfile],
                      per_layer: Callable[[Steps, LayerId], Optional[LayerMedians]]) -> Optional[float]:
    """What RECOMPUTE costs per second of forward, from RECOMPUTE steps (NOTE [Pricing
    recompute]): over the recomputable layers, their forward plus backward in those
    steps less the same in ``layers``' profile, over their profiled forward, at least 1;
    None without such steps or forward time."""
    extra = forward = 0.0
    for layer in layers:
        if not layer.recomputable:
            continue
        r = per_layer(recompute_steps, layer.layer_id) if recompute_steps else None
        if r is None or not (r["fwd"] or r["bwd"]):
            continue
        extra += r["fwd"] + r["bwd"] - layer.forward_s - layer.backward_s
        forward += layer.forward_s
    return max(1.0, extra / forward) if forward > 0 else None


def _shares(seconds: List[float], counts: List[int], site_count: int, span_s: float) -> Optional[List[float]]:
    """One step's site points as shares of the layer's ``span_s`` per micro-batch: use
    points of its backward, save points of its forward (NOTE [Site use times], NOTE [Site
    save times] in ``planner/profile.py``); None when no site was timed. A site never
    timed in its own layer's backward (a storage a later layer saved again, whose backward
    unpacked it first) counts as needed when the layer's backward starts (0)."""
    if not any(counts) or span_s <= 0:
        return None
    timed = [min(1.0, s / k / span_s) if k else 0.0 for s, k in zip(seconds, counts)]
    return timed + [0.0] * (site_count - len(timed))


def _share_medians(per_step: List[Optional[List[float]]], site_count: int) -> Optional[List[float]]:
    """Per site, the median over steps of its use (or save) point; None (every site at
    0) unless every step timed all ``site_count`` sites."""
    if not per_step or site_count == 0 or any(u is None or len(u) != site_count for u in per_step):
        return None
    return [round(statistics.median(column), 6) for column in zip(*per_step)]  # type: ignore[arg-type]


def _site_medians(per_step: List[List[int]]) -> Optional[List[int]]:
    """Per site, the median over steps of its bytes per micro-batch (NOTE [Sites]: a site
    another layer saved first has none here); None when the steps disagree on the site
    count or no site has bytes, so the layer is planned whole."""
    if not per_step or any(len(sites) != len(per_step[0]) for sites in per_step) or not per_step[0]:
        return None
    medians = [int(statistics.median(column)) for column in zip(*per_step)]
    return medians if any(b > 0 for b in medians) else None


def _io_profile(offload_steps: Steps, layer_ids: List[LayerId], clean_compute: Optional[float]) -> IOProfile:
    """The drives' bandwidths and the compute slowdown from the OFFLOAD steps: medians
    over the steps that moved bytes (reads as writes where nothing was read back); both
    bandwidths None where no step wrote a byte (NOTE [Unmeasured drives] in
    ``planner/profile.py``)."""
    writes = [s.write_bytes_per_s for s in offload_steps if s.write_bytes_per_s > 0]
    reads = [s.read_bytes_per_s for s in offload_steps if s.read_bytes_per_s > 0]
    write_bw = statistics.median(writes) if writes else None
    read_bw = (statistics.median(reads) if reads else write_bw) if write_bw is not None else None
    slowdown = 0.0
    if clean_compute and offload_steps:
        slowdown = statistics.median(_slowdown_in_flight(s, layer_ids, clean_compute) for s in offload_steps)
    return IOProfile(write_bytes_per_s=write_bw, read_bytes_per_s=read_bw, compute_slowdown=slowdown)


def _slowdown_in_flight(stats: StepMeasurement, layer_ids: List[LayerId], clean_compute: float,
                        in_flight: Optional[float] = None) -> float:
    """One OFFLOAD step's ``compute_slowdown``: the factor by which compute ran slower
    while I/O was in flight (NOTE [Compute slowdown] in ``planner/step_timeline.py``);
    ``in_flight``: that time per micro-batch, where not the drives' busy time (a HOST
    step's copies, NOTE [Pricing host copies]).

    NOTE [Slowdown while in flight]: the layers' compute per micro-batch took ``busy``
    against ``clean_compute`` in KEEP steps; the timeline model charges the extra only
    to compute that overlaps I/O, so it is spread over that time, not over the whole
    step. With ``w`` the in-flight time per micro-batch (writes' plus reads' busy time,
    at most ``busy``), compute that took ``w`` would have taken ``w - extra`` alone, so
    ``slowdown = extra / (w - extra)``. Spread over the whole step instead, the factor
    comes out a fraction of what the replay needs, and the plan sees that fraction of
    the cost. Where ``w`` is too short to hold the extra, the denominator is held at a
    tenth of ``w``. Measured: docs/performance.md#run-2026-11-24-slowdown. The factor
    moves faster than the extra it is made from, but the replay of compute beside ``w``
    seconds of I/O charges ``w * s / (1 + s)``, the extra itself (up to 0.9 ``w``), so
    a prediction moves with the measured extra; between fresh profiles on an idle
    machine: docs/performance.md#run-2026-12-07-host-price-spread.
    """
    busy = 0.0
    for layer_id in layer_ids:
        lc = stats.layers.get(layer_id)
        if lc is not None and lc.microbatches:
            busy += (lc.forward_s - lc.write_wait_s + max(lc.backward_s - lc.stall_s, 0.0)) / lc.microbatches
    extra = busy - clean_compute
    if extra <= 0:
        return 0.0
    if in_flight is None:
        in_flight = (stats.write_busy_s + stats.read_busy_s) / max(1, stats.microbatches)
    in_flight = min(in_flight, busy)
    if in_flight <= 0:
        return extra / clean_compute
    return extra / max(in_flight - extra, 0.1 * in_flight)



# NOTE [Pricing host copies]
# On a GPU the host tier's copies run on copy engines beside compute; on a CPU they are
# memory copies into fresh pages (a page fault per 4 KiB, then the copy), made by the host
# engine's threads on the cores compute runs on: measured here, 288 MiB copied each way
# cost 0.45-0.55 s of CPU, and a gpt-tiny step hosting every layer at 1 GiB/s took 2.01 s
# against keep's 1.19 s with no stall and no write wait. A planner that priced the copies
# at nothing hosted as much as the pool took and broke its own bound (1.44x keep where it
# predicted 1.00x). So the profile measures them as it measures the drives' I/O: where
# the plan may use a host pool, HOST steps (every layer hosted) run after the OFFLOAD
# block, and ``host_compute_slowdown`` is their compute against the KEEP steps', spread
# over the time the link carried their copies (each hosted byte out and back at
# ``host_bytes_per_s``, NOTE [Slowdown while in flight]). The timeline then slows compute
# by it while a host copy is in flight (NOTE [Compute slowdown] in ``step_timeline.py``).
# Without HOST steps (profiles measured before, or a host tier sized after the profile)
# it is 0, as before.


def _host_slowdown(host_steps: Steps, layer_ids: List[LayerId], clean_compute: Optional[float],
                   host_bytes_per_s: float) -> float:
    """``IOProfile.host_compute_slowdown`` from HOST steps (NOTE [Pricing host copies]): the
    median over the steps that hosted bytes; 0 without KEEP steps' compute or such steps."""
    if not clean_compute:
        return 0.0
    found = []
    for s in host_steps:
        hosted = sum(lc.hosted_bytes for k, lc in s.layers.items() if k in layer_ids)
        if hosted > 0:
            found.append(_slowdown_in_flight(s, layer_ids, clean_compute,
                                             2 * hosted / max(1, s.microbatches) / host_bytes_per_s))
    return statistics.median(found) if found else 0.0


def with_layer_peaks(profile: StageProfile, by_layer: Optional[Mapping[Hashable, Tuple[int, int]]],
                     remade: Optional[Mapping[Hashable, int]] = None, one_microbatch: bool = False) -> StageProfile:
    """``profile`` with each layer's forward peak and backward working set measured by
    layer in the first step under a cap (NOTE [Working set by layer] in ``adaptive.py``),
    and, for a step of ``one_microbatch``, the gradients each backward makes again that a
    later step freed (``remade``, NOTE [Gradients remade each step] in ``holds.py``);
    unchanged where not measured."""
    if not by_layer:
        return profile
    grads = dict(remade or {}) if one_microbatch else {}
    layers = [dataclasses.replace(layer, forward_peak_bytes=by_layer[layer.layer_id][0],
                                  backward_working_bytes=by_layer[layer.layer_id][1],
                                  grad_bytes=grads.get(layer.layer_id, 0))
              if layer.layer_id in by_layer else layer for layer in profile.layers]
    return dataclasses.replace(profile, layers=layers, head_grad_bytes=grads.get(HEAD, 0))


def with_probed_tiers(profile: StageProfile, probed: Mapping[str, Tuple[float, float, Optional[int]]]) -> StageProfile:
    """``profile`` with the rates of the tiers registered after the SSDs and the host
    pool, probed by their engines (NOTE [Probed tiers] in ``profiling.py``): per tier
    name, (write, read) bytes per second and its byte budget (None: no bound). A drive
    tier's transfers are priced at the SSDs' measured compute slowdown and in-flight bound
    (its engine does the same work per byte on the same cores, made from the same ``io``
    settings), any other's at none."""
    io = profile.io
    tiers = {name: TierRates(w, r, *((io.compute_slowdown, io.max_inflight_bytes) if TIERS[Placement(name)].drives
                                     else (0.0, None)), budget_bytes=budget)
             for name, (w, r, budget) in probed.items() if name in MOVED}
    return profile.with_io(dataclasses.replace(io, tiers={**io.tiers, **tiers}))
