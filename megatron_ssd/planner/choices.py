"""Every choice the search may make for one layer, and what each is known to cost before
any replay.

A layer's choice set (:func:`layer_options`) is the product of three decisions (NOTE
[Choice set]): which modules to recompute inside the layer, where its saved tensors live
(kept, recomputed whole, or moved to a tier) and, for a moved layer, how many of its sites
move (a prefix, NOTE [Sites] in ``profile.py``). Each :class:`Option` carries two numbers
the search prunes with before it replays anything (NOTE [Bounds before a replay]): the
bytes the layer holds between its forward and its backward once its writes have drained,
and its compute with no I/O.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..placement import LayerChoice, Placement
from ..tier import HOST_LINK, TIERS, added
from .module_recompute import recomputed_layer
from .profile import LayerProfile, StageProfile

__all__ = ["Floors", "Option", "layer_options", "held_floor_weights"]


# NOTE [Choice set]
# For one layer the search chooses among:
# - KEEP;
# - for each tier it may use (``tiers``: OFFLOAD for the drives, HOST for the host pool),
#   that tier with each prefix of the layer's sites, 1 to all of them;
# - RECOMPUTE, where recompute is allowed and the layer is recomputable;
# - for each non-empty set of the layer's modules that free a site (NOTE [Recompute inside
#   a layer] in ``module_recompute.py``), where recompute is allowed: those modules
#   recomputed, with KEEP, or with each tier and each prefix of the sites left.
# It is the set the greedy search before it could reach one move at a time, made explicit,
# and the set the exhaustive oracle of the tests enumerates (``megatron_ssd_lab/planner_oracle.py``).
# Nothing in it is dropped as dominated: the peak is not monotone in the sites moved (the
# last sites' writes may end after the peak), so no prefix is known to be useless before a
# replay.


@dataclass(frozen=True)
class Option:
    """One choice for one layer and the costs known without a replay."""

    choice: LayerChoice
    """The choice (its read-ahead unset: the search's)."""
    layer: LayerProfile
    """The layer as the choice sees it: with its recomputed modules' sites gone
    (:func:`~megatron_ssd.planner.module_recompute.recomputed_layer`), else the measured one."""
    held: int
    """Bytes the layer holds between its forward and its backward once its writes have
    completed: saved + kept (KEEP), the input (RECOMPUTE), the bytes it does not move
    (OFFLOAD, HOST)."""
    compute_s: float
    """Its forward and backward with no I/O: the backward lengthened by the modules it
    recomputes, or by its whole forward under RECOMPUTE."""
    moved: int
    """Bytes it moves to its tier and back per micro-batch (0 unless OFFLOAD or HOST)."""

    @property
    def placement(self) -> Placement:
        return self.choice.placement


def _option(layer: LayerProfile, derived: LayerProfile, choice: LayerChoice) -> Option:
    placement = choice.placement
    if placement is Placement.RECOMPUTE:
        return Option(choice, derived, layer.boundary_bytes,
                      layer.forward_s + layer.backward_s + layer.recompute_time, 0)
    moved = derived.moved_bytes(choice.sites) if choice.moved else 0
    return Option(choice, derived, derived.saved_bytes + derived.kept_bytes - moved,
                  derived.forward_s + derived.backward_s, moved)


def _module_sets(layer: LayerProfile) -> List[Tuple[str, ...]]:
    """Each non-empty set of the layer's modules that free a site, in profile order."""
    names = [m.name for m in layer.modules or () if m.freed_sites]
    return [combo for r in range(1, len(names) + 1) for combo in itertools.combinations(names, r)]


def layer_options(layer: LayerProfile, tiers: Sequence[Placement], recompute: bool) -> List[Option]:
    """The layer's choice set (NOTE [Choice set]), KEEP first.

    Args:
        layer: The measured layer.
        tiers: The moved placements the search may use (OFFLOAD, HOST), in preference order.
        recompute: Whether RECOMPUTE and recompute inside the layer may be chosen.
    """
    out: List[Option] = []
    sets: List[Tuple[str, ...]] = [()] + (_module_sets(layer) if recompute else [])
    for modules in sets:
        derived = recomputed_layer(layer, modules)
        m = len(derived.sites)
        out.append(_option(layer, derived, LayerChoice(Placement.KEEP, recompute=modules)))
        for tier in tiers:
            for k in range(1, m + 1):
                out.append(_option(layer, derived, LayerChoice(tier, None if k == m else k, recompute=modules)))
        if not modules and recompute and layer.recomputable:
            out.append(_option(layer, layer, LayerChoice(Placement.RECOMPUTE)))
    return out


# NOTE [Bounds before a replay]
# Two numbers bound a plan from below without replaying it:
# - its step is at least its compute: every layer's forward and backward, the recomputed
#   forwards, and the time outside the layers (the replay adds stalls, write waits and
#   slowdown, never less than nothing);
# - its peak is at least what is resident just before the head's tensors are released,
#   when ``other_s`` > 0 (every layer's forward has ended, no backward has begun, no read
#   is issued): the head's bytes plus each layer's ``Option.held`` (its writes done or
#   not) for the replayed micro-batch, and the same held bytes for each of the m - 1
#   parked ones (NOTE [Pipeline micro-batches] in ``step_timeline.py``). Without time
#   outside the layers the instant is just before the first backward, and a layer counts
#   only where forward compute or the pipeline's gap follows its own forward (else its
#   span can be empty at that instant).
# The search skips a trial whose bounds cannot beat what it holds, and the oracle of the
# tests skips a plan whose peak bound exceeds the budget; a test checks both bounds
# against replays of every plan of small stages.


def held_floor_weights(stage: StageProfile) -> Tuple[List[int], int]:
    """Per layer, how many times its held bytes count in the peak bound (0 or m, NOTE
    [Bounds before a replay]), and the bytes the bound adds whatever the plan (the head's,
    less every gradient the step frees at its start: NOTE [Gradients remade each step] in
    ``holds.py``, at most that credit outstanding at the bound's instant)."""
    m = stage.microbatches_in_flight or 1
    credit = stage.head_grad_bytes + sum(layer.grad_bytes for layer in stage.layers)
    if stage.other_s > 0:
        return [m] * len(stage.layers), stage.head_bytes - credit
    gap = m > 1 and (sum(layer.forward_s + layer.backward_s for layer in stage.layers) > 0)
    after = 0.0
    weights: List[int] = []
    for layer in reversed(stage.layers):
        weights.append(m if (after > 0 or gap) else (m - 1))
        after += layer.forward_s
    return weights[::-1], -credit


# NOTE [Drain and read floors]
# Two more bounds hold for every plan, from the bytes each channel carries (the drives'
# queue: OFFLOAD; the host link: HOST, and on a shared link OFFLOAD too, NOTE [Shared
# link] in ``step_timeline.py``):
# - drain: at the peak bound's instant t_b (NOTE [Bounds before a replay]), a channel
#   has written at most its write rate times the time since the forward of the first
#   layer it carries began, so the bytes beyond that are still resident. That time is at
#   most the forward compute from that layer on, plus ``other_s``, plus d = t_b less the
#   compute before t_b (what write waits and slowdown add to the forward; all of it is
#   in the step). So peak >= floor + out(d), out falling in d, and step >= compute + d:
#   the smallest d with floor + out(d) <= budget is a step the plan pays at least.
#   Where t_b is the first backward's start (no time outside the layers) and micro-
#   batches wait in a pipeline's gap, the gap lends writes more time: no drain bound;
# - read: every byte a channel carries is read back after the first backward begins
#   (t_b at the earliest) and before the step ends, one transfer at a time, so the step
#   is at least the forward compute, ``other_s`` and d, plus the channel's read time.
# Both use the derated rates, which the search's key and fit are judged at.


class Floors:
    """The bounds of NOTE [Bounds before a replay] and NOTE [Drain and read floors] for
    one stage at one set of rates.

    Args:
        stage: The measured stage.
        io: The rates the key is judged at (the derated ones).

    ``slots`` are the tiers the rates price, the SSDs first, then the host pool, then the
    tiers registered after them (NOTE [Tiers] in ``megatron_ssd/tier.py``): :meth:`bound`
    takes one byte count and one first layer per slot.
    """

    def __init__(self, stage: StageProfile, io) -> None:
        self.weights, self.fixed = held_floor_weights(stage)
        self.other_s = stage.other_s
        forwards = [layer.forward_s for layer in stage.layers]
        self.forward_s = sum(forwards)
        self.forward_from = [sum(forwards[i:]) for i in range(len(forwards))]
        """Per layer, the forward compute from it on."""
        m = stage.microbatches_in_flight or 1
        self.drain = stage.other_s > 0 or m == 1
        self.slots: List[Placement] = [p for p in (Placement.OFFLOAD, Placement.HOST, *added()) if io.rates(p) is not None]
        """The tiers priced, in the order :meth:`bound` takes their bytes."""
        links: Dict[str, List[int]] = {}
        for slot, p in enumerate(self.slots):
            links.setdefault(TIERS[p].link, []).append(slot)
        rates = [io.rates(p) for p in self.slots]
        per_link = [(slots, max(rates[x].write_bytes_per_s for x in slots), max(rates[x].read_bytes_per_s for x in slots))
                    for slots in links.values()]  # a link's write and read rates: the fastest of its tiers'
        self._one = [(slots[0], write, read) for slots, write, read in per_link if len(slots) == 1]
        self._many = [link for link in per_link if len(link[0]) > 1]
        h = io.host_bytes_per_s
        crossing = [x for x, p in enumerate(self.slots) if TIERS[p].crosses_host_link and TIERS[p].link != HOST_LINK]
        host = [x for x, p in enumerate(self.slots) if TIERS[p].link == HOST_LINK]
        self.crossing = (crossing, host, h) if h is not None and io.shared_host_link and crossing else None
        """The slots whose bytes cross the host link, the host link's own, and its rate
        (NOTE [Shared link] in ``step_timeline.py``); None: no shared link."""

    def _out(self, d: float, loads: Sequence[Tuple[float, float, float]]) -> float:
        return sum(max(0.0, x - rate * (window + d)) for x, rate, window in loads)

    def bound(self, held: int, compute_s: float, moved: Sequence[int], first: Sequence[int],
              budget: Optional[int]) -> Tuple[int, int, float]:
        """The peak bound without the drain (valid for every d), the peak bound at d = 0,
        and the step bound (at the smallest d that meets
        ``budget``; inf where none does), for a plan holding ``held`` (weighted), of
        compute ``compute_s`` (``other_s`` included), moving ``moved[x]`` bytes to the tier
        of slot ``x``, the first such layer ``first[x]`` (-1: none)."""
        peak = self.fixed + held
        loads: List[Tuple[float, float, float]] = []
        reads = 0.0
        for x, write, read in self._one:  # a link of one tier (the per-node path of the branch and bound)
            carried = moved[x]
            if carried:
                loads.append((carried, write, self.forward_from[first[x]] + self.other_s))
                reads = max(reads, carried / read)
        for slots, write, read in self._many:
            carried, start = _carried(slots, moved, first)
            if carried:
                loads.append((carried, write, self.forward_from[start] + self.other_s))
                reads = max(reads, carried / read)
        shared_load: List[Tuple[float, float, float]] = []
        if self.crossing is not None:
            crossing, host, rate = self.crossing
            if _carried(crossing, moved, first)[0]:
                carried, start = _carried(crossing + host, moved, first)
                reads = max(reads, carried / rate)
                shared_load = [(carried, rate, self.forward_from[start] + self.other_s)]
        step = max(compute_s, self.forward_s + self.other_s + reads)
        if not self.drain or not loads:
            return peak, peak, (step if budget is None or peak <= budget else float("inf"))

        def out(d: float) -> float:
            return max(self._out(d, loads), self._out(d, shared_load))

        at_zero = peak + int(out(0.0))
        if budget is None or at_zero <= budget:
            return peak, at_zero, step
        if peak > budget:
            return peak, at_zero, float("inf")
        lo, hi = 0.0, max(x / rate for x, rate, _ in loads + shared_load)  # out(hi) == 0
        for _ in range(50):
            mid = (lo + hi) / 2
            if peak + out(mid) <= budget:
                hi = mid
            else:
                lo = mid
        return peak, at_zero, step + lo


def _carried(slots: Sequence[int], moved: Sequence[int], first: Sequence[int]) -> Tuple[int, int]:
    """The bytes the tiers of ``slots`` move and the first layer moving any (-1: none)."""
    carried, start = 0, -1
    for x in slots:
        if moved[x]:
            carried += moved[x]
            start = first[x] if start < 0 else min(start, first[x])
    return carried, start
