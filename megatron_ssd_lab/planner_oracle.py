"""The placement search's oracle: every plan of a small stage, judged as the search judges.

:func:`optimum` enumerates the whole per-layer choice set (KEEP; each tier with each
prefix of the sites; RECOMPUTE; each set of modules recomputed inside the layer, with KEEP
or each tier and each prefix of the sites left) for every layer at once, and judges each
plan with :class:`~megatron_ssd.planner.search.PlacementSearch`'s own rules: the derated
replay chooses, the peak must fit at the derated and at the measured bandwidths, nothing
forwarded, the drive-wear bound, the host pool; ``max_offload`` asks for the lowest peak
whose I/O hides within the slowdown bound. It is written apart from the search's own
choice set (``megatron_ssd/planner/choices.py``) so that a choice the search forgets is
found, and it prunes only by the peak bound (NOTE [Bounds before a replay] in that module),
which the tests check against replays of every plan.

:func:`random_stage` draws the seeded stages the tests and ``benchmarks/planner_gap.py``
use: 2 to 5 layers of 1 to 3 sites, compute-to-bandwidth ratios from a CPU's (I/O, and
host copies, slow compute by up to 3x) to an H100's (I/O beside compute, drives or host link the bottleneck),
with and without the in-flight bound, a host pool, modules to recompute inside a layer, and
pipeline micro-batches in flight.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_ssd.placement import LayerChoice, Placement
from megatron_ssd.planner.module_recompute import recomputed_layer
from megatron_ssd.planner.profile import IOProfile, LayerProfile, ModuleProfile, StageProfile
from megatron_ssd.planner.search import PlacementSearch
from megatron_ssd.planner.step_timeline import Timeline, predict
from megatron_ssd.tier import TIERS

__all__ = ["Case", "Optimum", "every_choice", "optimum", "random_stage", "random_case", "cycled", "MiB"]

MiB = 1 << 20


@dataclass(frozen=True)
class Case:
    """One question to the search: a stage, and what the plan is asked for."""

    stage: StageProfile
    budget_share: Optional[float]
    """The budget as a share of keep-everything's predicted peak; None: ``max_offload``."""
    allow_recompute: bool = True
    host_share: Optional[float] = None
    """The host pool as a share of keep-everything's peak; None: no host tier."""
    safety_margin: float = 0.1
    read_ahead: int = 1
    max_slowdown: Optional[float] = None
    max_write_bytes_per_s: Optional[float] = None

    def search(self) -> PlacementSearch:
        keep = predict(self.stage, [Placement.KEEP] * len(self.stage.layers)).peak_bytes
        host = 0 if self.host_share is None else int(self.host_share * keep)
        return PlacementSearch(self.stage, self.stage.io.derated(self.safety_margin), self.read_ahead,
                               self.max_write_bytes_per_s, host, self.max_slowdown)

    def budget(self) -> Optional[int]:
        if self.budget_share is None:
            return None
        keep = predict(self.stage, [Placement.KEEP] * len(self.stage.layers)).peak_bytes
        return int(self.budget_share * keep)


@dataclass(frozen=True)
class Optimum:
    """The best plan of a case, or None when no plan is feasible."""

    choices: Optional[Tuple[LayerChoice, ...]]
    step_s: Optional[float]
    """Derated predicted step of the best plan (``memory_budget``)."""
    peak_bytes: Optional[int]
    """Derated predicted peak of the best plan (``max_offload``: the lowest hidden one)."""
    plans: int
    """Plans enumerated."""
    judged: int
    """Plans replayed (the others' peak bound exceeded the budget)."""


def every_choice(layer: LayerProfile, tiers: Sequence[Placement], recompute: bool) -> List[LayerChoice]:
    """Every choice the search may make for ``layer`` (its read-ahead unset)."""
    names = [m.name for m in layer.modules or () if m.freed_sites] if recompute else []
    out: List[LayerChoice] = []
    for r in range(len(names) + 1):
        for modules in itertools.combinations(names, r):
            left = len(recomputed_layer(layer, modules).sites)
            out.append(LayerChoice(Placement.KEEP, recompute=modules))
            out.extend(LayerChoice(tier, None if k == left else k, recompute=modules)
                       for tier in tiers for k in range(1, left + 1))
    if recompute and layer.recomputable:
        out.append(LayerChoice(Placement.RECOMPUTE))
    return out


def _held(layer: LayerProfile, derived: LayerProfile, choice: LayerChoice) -> int:
    if choice.placement is Placement.RECOMPUTE:
        return layer.boundary_bytes
    moved = derived.moved_bytes(choice.sites) if choice.moved else 0
    return derived.saved_bytes + derived.kept_bytes - moved


def optimum(case: Case, tiers: Optional[Sequence[Placement]] = None) -> Optimum:
    """The exhaustive best plan of ``case`` (see the module docstring)."""
    search = case.search()
    stage = search.stage
    budget = case.budget()
    if tiers is None:
        tiers = search.tiers  # the host pool, the SSDs, then any tier registered after them
    recompute = case.allow_recompute and budget is not None  # max_offload moves bytes, it recomputes nothing
    per_layer = [every_choice(layer, tiers, recompute) for layer in stage.layers]
    derived: Dict[Tuple[int, Tuple[str, ...]], LayerProfile] = {}
    for i, layer in enumerate(stage.layers):
        for c in per_layer[i]:
            derived.setdefault((i, c.recompute), recomputed_layer(layer, c.recompute))
    from megatron_ssd.planner.choices import held_floor_weights  # the bound the tests check
    weights, fixed = held_floor_weights(stage)
    held = [[w * _held(layer, derived[(i, c.recompute)], c) for c in per_layer[i]]
            for i, (layer, w) in enumerate(zip(stage.layers, weights))]
    best_key, best = None, None
    plans = judged = 0
    for idx in itertools.product(*[range(len(p)) for p in per_layer]):
        plans += 1
        if budget is not None and fixed + sum(h[k] for h, k in zip(held, idx)) > budget:
            continue
        choices = [per_layer[i][k] for i, k in enumerate(idx)]
        layers = [derived[(i, c.recompute)] for i, c in enumerate(choices)]
        replayed = [LayerChoice(c.placement, c.sites, case.read_ahead) for c in choices]
        judged += 1
        tl = predict(stage, replayed, io=search.derated, layers=layers)
        if not _allowed(search, layers, replayed, tl):
            continue
        if budget is None:
            if not search.within_bound(tl):
                continue
            measured = predict(stage, replayed, layers=layers)
            if not search.within_bound(measured):
                continue
            key = (tl.peak_bytes, measured.peak_bytes) + _moved(tl, tiers)
        else:
            if tl.peak_bytes > budget or predict(stage, replayed, layers=layers).peak_bytes > budget:
                continue
            key = (tl.step_s,) + _moved(tl, tiers)
        if best_key is None or key < best_key:
            best_key, best = key, (tuple(choices), tl)
    if best is None:
        return Optimum(None, None, None, plans, judged)
    return Optimum(best[0], best[1].step_s, best[1].peak_bytes, plans, judged)


def _moved(tl: Timeline, tiers: Sequence[Placement]) -> Tuple[int, int]:
    """Bytes a plan writes to drive tiers (the SSDs, and any tier registered as drives),
    and all it moves: the search's tie-breaks after the step or peak."""
    return (sum(tl.moved_to(p) for p in tiers if TIERS[p].drives), sum(lt.moved_bytes for lt in tl.layers))


def _allowed(search: PlacementSearch, layers: Sequence[LayerProfile], choices: Sequence[LayerChoice],
             tl: Timeline) -> bool:
    """``PlacementSearch.allowed`` of a plan replayed on its derived layers."""
    if tl.forwarded or not search.hosts_ok(tl):
        return False
    written = sum(layer.moved_bytes(c.sites) for layer, c in zip(layers, choices)
                  if c.placement is Placement.OFFLOAD)
    return written <= search.written_limit()


# ---------------------------------------------------------------------------- random stages

def random_stage(rng: random.Random, layers: Optional[int] = None, max_sites: int = 3) -> StageProfile:
    """A seeded random stage (see the module docstring)."""
    n = layers if layers is not None else rng.randint(2, 5)
    regime = rng.random()  # 0: CPU-like (I/O slows compute), 1: GPU-like (I/O beside compute)
    slowdown = 0.0 if regime > 0.5 else rng.choice([0.05, 0.3, 1.0, 3.0])
    fwd = rng.uniform(0.5, 2.0) * 1e-2
    out: List[LayerProfile] = []
    for i in range(n):
        m = rng.randint(1, max_sites)
        sites = [rng.choice([1, 2, 4, 8, 16]) * MiB for _ in range(m)]
        f = fwd * rng.uniform(0.6, 1.4)
        modules = None
        if m >= 2 and rng.random() < 0.6:
            modules = [ModuleProfile("core_attn", f * rng.uniform(0.02, 0.4), [rng.randrange(m)])]
        out.append(LayerProfile(
            i, f, f * rng.uniform(1.5, 2.5), sum(sites), kept_bytes=rng.choice([0, MiB // 4]),
            recompute_s=f * rng.uniform(0.8, 1.2), boundary_bytes=rng.choice([MiB // 2, MiB, 2 * MiB]),
            site_bytes=sites, site_use=[round(rng.random(), 3) for _ in range(m)], modules=modules))
    total = sum(layer.saved_bytes for layer in out)
    compute = sum(layer.forward_s for layer in out)
    ratio = 10 ** rng.uniform(-1.3, 0.7)  # bytes' write time over the forward time
    write = total / (compute * ratio)
    host = write * 10 ** rng.uniform(-0.5, 1.0) if rng.random() < 0.5 else None
    io = IOProfile(write, write * rng.uniform(1.0, 2.0), compute_slowdown=slowdown, host_bytes_per_s=host,
                   host_compute_slowdown=0.0 if host is None or regime > 0.5 else rng.choice([0.0, 0.3, 1.0]),
                   max_inflight_bytes=rng.choice([None, 8 * MiB, 32 * MiB]),
                   shared_host_link=regime > 0.5 and rng.random() < 0.5)
    return StageProfile(layers=out, io=io, microbatches_in_flight=rng.choice([1, 1, 2]),
                        other_s=fwd * rng.uniform(0.0, 0.5), head_bytes=rng.choice([0, MiB, 4 * MiB]))


def random_case(rng: random.Random, layers: Optional[int] = None, max_sites: int = 3) -> Case:
    """A seeded random stage and question: a budget of 0.3 to 0.8 of keep's peak (or
    ``max_offload`` one time in five), with or without recompute and a host pool."""
    stage = random_stage(rng, layers, max_sites)
    host_share = rng.choice([0.1, 0.25, 0.5]) if stage.io.host_bytes_per_s is not None else None
    if rng.random() < 0.2:
        return Case(stage, None, False, host_share, max_slowdown=rng.choice([None, 0.05, 0.3]))
    return Case(stage, round(rng.uniform(0.3, 0.8), 2), rng.random() < 0.7, host_share)


def cycled(stage: StageProfile, layers: int) -> StageProfile:
    """``stage`` cut or cycled to ``layers`` layers, renumbered (the stored real profiles
    made small enough to enumerate)."""
    out = [dataclasses.replace(stage.layers[i % len(stage.layers)], layer_id=i) for i in range(layers)]
    return dataclasses.replace(stage, layers=out)
