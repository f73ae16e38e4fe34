"""Recompute inside a layer: the modules a plan recomputes in one layer's backward.

A :class:`~megatron_ssd.placement.LayerChoice` may name modules of its layer to recompute
(``recompute``, of :data:`~megatron_ssd.placement.RECOMPUTE_MODULES`), with KEEP, OFFLOAD
or HOST for the layer's other sites. Here that choice is priced: :func:`recomputed_layer`
is the layer as the plan sees it then (fewer sites, a longer backward, the freed bytes
rebuilt during that backward), :func:`with_recompute` a stage of such layers, which the
timeline model replays like any other; and :class:`ModuleMoves` gives the placement
search its moves "recompute module M in layer i", priced like the others.

# NOTE [Recompute inside a layer]
Megatron's selective recompute (``recompute_granularity="selective"``) runs some modules of
every layer under a checkpoint: their forward saves nothing but their inputs, and backward
runs them again. For ``core_attn`` those are the attention's scores, softmax and dropout
tensors, of ``s^2`` elements per head: on a long sequence the largest share of a layer's
activations, for a small share of its compute. Here the same switch is a per-layer
choice the planner makes with the rest of the layer's placement, so every point of a peer
that recomputes selectively is inside the planner's space:

- The profile measures, per layer and module, in the steps that keep every layer (NOTE
  [Module timing] in ``cache/scopes.py``): the module's forward time, the sites it
  saved, and which of them are its inputs (the checkpoint saves those instead). Sites are
  numbered in save order and a module runs in one piece, so its sites are a contiguous
  range; recomputing it frees the range less its inputs (``ModuleProfile.freed_sites``).
  Nothing is estimated: bytes are the cache's sites, time the cache's clock.
- The plan sees the layer with those sites gone (:func:`recomputed_layer`): its other
  sites keep their order and are renumbered, so a choice's ``sites`` counts among them,
  as the cache numbers them at run time (the module saves nothing then); its backward is
  longer by the modules' forward times (times the layer's rerun factor, NOTE [Pricing a
  module's rerun]); and the freed bytes are held again while its
  backward runs (``LayerProfile.rebuilt_bytes``, NOTE [Memory accounting] in
  ``holds.py``), as a recomputed layer's are.
- The search (:class:`ModuleMoves`) offers "recompute M in layer i" beside the tier
  moves, scored the same way, peak removed per second of step time added, and combined
  with the layer's OFFLOAD or HOST of the sites left (their prefix is carried over). A
  module recompute costs its forward every step, so it is chosen only where moving the
  same bytes would expose more time; after the budget fits, each one that is not needed
  is undone where the step is no slower. Full recompute of the layer supersedes it: a
  layer that recomputes a module is not offered RECOMPUTE, and a RECOMPUTE layer no
  module.
- The runtime switches megatron-core's own attributes of that layer
  (``megatron/module_recompute.py``), so the recomputation is megatron-core's code.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence

from ..errors import ConfigError
from ..placement import MOVED, LayerChoice, Placement
from .profile import LayerProfile, ModuleProfile, StageProfile

__all__ = ["MODULE_MOVE", "ModuleMoves", "recomputed_layer", "rerun_factor", "with_recompute"]

MODULE_MOVE = "recompute:"
"""Prefix of a search move that recomputes one module inside a layer (``recompute:core_attn``)."""


def _kept_sites(layer: LayerProfile, modules: Sequence[str]) -> List[int]:
    """The layer's sites (indices) left when ``modules`` are recomputed inside it.

    Raises:
        ConfigError: a module the profile did not measure in the layer.
    """
    known: Dict[str, ModuleProfile] = {m.name: m for m in layer.modules or ()}
    missing = [m for m in modules if m not in known]
    if missing:
        raise ConfigError(f"recompute[{layer.layer_id!r}] = {list(modules)!r}: the profile measured no "
                          f"{missing[0]!r} in this layer (LayerProfile.modules: {sorted(known)})")
    freed = {s for m in modules for s in known[m].freed_sites}
    return [s for s in range(len(layer.sites)) if s not in freed]


# NOTE [Pricing a module's rerun]
# A module recomputed inside a layer runs its forward again in the layer's backward, on
# fresh allocations (page faults on a CPU) under a second autograd graph: what makes a
# whole layer's rerun cost more than its forward (NOTE [Pricing recompute] in
# ``measured_profile.py``) makes a module's cost more than its clocked forward too.
# Priced at its forward alone, selective recompute of core attention in every layer of
# configs/gpt-deep-cpu.yaml was predicted at 1.133x keep and measured at 1.170x (fresh
# processes), and six of the seven plans of configs/gpt-ref-cpu.yaml that recomputed core
# attention measured 2-9% slower than predicted (docs/performance.md, "The reference
# workload on an idle machine"; with the factor the largest of those errors fell from 8.6%
# to 6.4%). So the module's forward is scaled by the layer's measured rerun factor,
# its ``recompute_s`` over its forward (at least 1; 1 where the profile measured no
# RECOMPUTE steps): on a gpt-deep profile 1.11-1.51 (two layers below 1), which
# predicts the selective point at 1.161x.


def rerun_factor(layer: LayerProfile) -> float:
    """What running ``layer``'s forward again in its backward costs per second of that
    forward (NOTE [Pricing a module's rerun]): its ``recompute_s`` over its
    ``forward_s``, at least 1; 1 without a measured ``recompute_s``."""
    if layer.recompute_s is None or layer.forward_s <= 0:
        return 1.0
    return max(1.0, layer.recompute_s / layer.forward_s)


def recomputed_layer(layer: LayerProfile, modules: Sequence[str]) -> LayerProfile:
    """``layer`` as a plan that recomputes ``modules`` inside it sees it (NOTE [Recompute
    inside a layer]): the sites the modules free are gone and the others renumbered in
    order, the modules' forward (times :func:`rerun_factor`) is added to the backward
    and their freed bytes are rebuilt during it, and the modules left may still be
    recomputed (their sites renumbered). It may not be recomputed whole. ``layer``
    itself when ``modules`` is empty.

    Raises:
        ConfigError: a module the profile did not measure in the layer.
    """
    if not modules:
        return layer
    kept = _kept_sites(layer, modules)
    renumbered = {old: new for new, old in enumerate(kept)}
    sites = layer.sites
    chosen = [m for m in layer.modules or () if m.name in modules]
    rest = [dataclasses.replace(m, freed_sites=[renumbered[s] for s in m.freed_sites if s in renumbered])
            for m in layer.modules or () if m.name not in modules]
    site_bytes = [sites[s] for s in kept]
    return layer.with_sites(
        kept,
        saved_bytes=sum(site_bytes),
        kept_bytes=layer.kept_bytes + sum(m.held_bytes for m in chosen),
        backward_s=layer.backward_s + rerun_factor(layer) * sum(m.forward_s for m in chosen),
        rebuilt_bytes=layer.rebuilt_bytes + sum(sites) - sum(site_bytes),
        modules=rest,
        recomputable=False,
    )


def with_recompute(stage: StageProfile, choices: Sequence[LayerChoice]) -> StageProfile:
    """``stage`` with each layer as its choice's ``recompute`` derives it
    (:func:`recomputed_layer`); ``stage`` itself when no choice recomputes a module."""
    if not any(c.recompute for c in choices):
        return stage
    if len(choices) != len(stage.layers):
        raise ConfigError(f"choices: {len(choices)} given for {len(stage.layers)} layers; need one per layer")
    return dataclasses.replace(stage, layers=[recomputed_layer(layer, c.recompute)
                                              for layer, c in zip(stage.layers, choices)])


def _prefix_after(layer: LayerProfile, modules: Sequence[str], sites: Optional[int], more: Sequence[str]) -> Optional[int]:
    """The site count of a prefix in ``layer`` recomputing ``modules`` carried over to
    ``layer`` recomputing ``more``: the count that moves the same sites, less those the
    new set frees, plus those it no longer frees inside the prefix. None stays None."""
    if sites is None:
        return None
    before, after = _kept_sites(layer, modules), _kept_sites(layer, more)
    moved = set(before[:sites])
    if not moved:
        return 0
    last = max(moved)
    return len([s for s in after if s <= last])


class ModuleMoves:
    """The placement search's moves that recompute a module inside a layer (NOTE
    [Recompute inside a layer]), for :class:`~megatron_ssd.planner.greedy.Greedy`.

    The search's choices carry their modules (``LayerChoice.recompute``) and the stage is
    always the measured one: each layer is judged as its choice derives it
    (``Judge.layer_at``), so a move is a value and judging it changes nothing. A module
    move's target is the layer's choice recomputing one module more, its moved prefix
    carried over (KEEP when no moved site is left); the tier moves keep the layer's
    modules.
    """

    stage: StageProfile
    n: int
    layer_at: Callable[[int, LayerChoice], LayerProfile]
    """``Judge.layer_at``: layer i as a choice derives it."""

    def _module_moves(self, i: int, now: LayerChoice, allowed: bool) -> List[str]:
        """``recompute:<module>`` for each module of layer ``i`` left to recompute that
        frees a site, when recompute is ``allowed`` and the layer is not RECOMPUTE."""
        if not allowed or now.placement is Placement.RECOMPUTE:
            return []
        return [MODULE_MOVE + m.name for m in self.layer_at(i, now).modules or () if m.freed_sites]

    def _resolve_module(self, choices: Sequence[LayerChoice], i: int, move: str) -> LayerChoice:
        """The target of a module move: layer ``i``'s choice recomputing that module too,
        its moved prefix carried over; KEEP when no moved site is left."""
        now, layer = choices[i], self.stage.layers[i]
        more = now.recompute + (move[len(MODULE_MOVE):],)
        kept = _kept_sites(layer, more)
        if now.placement not in MOVED:
            return LayerChoice(now.placement, None, now.read_ahead, more)
        sites = _prefix_after(layer, now.recompute, now.sites, more)
        if not kept or sites == 0:
            return LayerChoice(Placement.KEEP, None, now.read_ahead, more)
        return LayerChoice(now.placement, None if sites == len(kept) else sites, now.read_ahead, more)

    def _modules_finish(self, choices: List[LayerChoice], fits, eps: float) -> List[LayerChoice]:
        """Undo each module recompute the limit does not need where the step is no
        slower, last layer first.

        Args:
            choices: The search's choices.
            fits: ``fits(choices, timeline)``: the trial still meets the limit and the
                search's other bounds.
            eps: Step-time slack.
        """
        step = self.judge(choices).step_s  # type: ignore[attr-defined]
        for i in range(self.n - 1, -1, -1):
            layer = self.stage.layers[i]
            for name in choices[i].recompute:
                now = choices[i]
                fewer = tuple(m for m in now.recompute if m != name)
                carried = _prefix_after(layer, now.recompute, now.sites if now.placement in MOVED else None, fewer)
                undone = dataclasses.replace(now, sites=None if carried == len(_kept_sites(layer, fewer)) else carried,
                                             recompute=fewer)
                trial = choices[:i] + [undone] + choices[i + 1:]
                tl = self.judge(trial)  # type: ignore[attr-defined]
                if tl.step_s <= step + eps and fits(trial, tl):
                    choices, step = trial, tl.step_s
        return choices
