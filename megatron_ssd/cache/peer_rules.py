"""The peers' placement rules, run by the cache's placement policy.

Megatron-core's fine-grained activation offloading and Transformer Engine's CPU offload
decide by a fixed rule which saved tensors go to pinned host memory. Each rule here
answers the same question for :class:`~megatron_ssd.cache.policy.PlacementPolicy`, so a
run measures the peer's decision on this cache, its host tier and its engines, with
only the policy differing from the planner's runs (``megatron-ssd rok``'s peer
placements)::

    rule = rule_for(config.peer)                        # OffloadConfig.peer
    rule.placement(layers, layer_id, group, elements)   # Placement.HOST or Placement.KEEP
    rule.read_ahead(layers, layer_id, site)             # layers ahead its read is issued

A tensor's ``group`` is the module group it was saved in (``attn_norm``,
``qkv_linear``, ``core_attn``, ``attn_proj``, ``mlp_norm``, ``mlp_fc1``, ``mlp_fc2``;
None outside them): the offload-aware layers label what each submodule saves
(NOTE [Module groups] in ``megatron/groups.py``). Each rule's decision is written once,
in ``megatron_ssd/peer_rule.py``; the pricing of the same decisions on the planner's
timeline model is ``planner/peers.py``. How faithfully each rule reproduces its peer, and
what it leaves out: docs/planner.md, "The peers' rules, measured".
"""

from __future__ import annotations

import abc
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Set, Tuple

from ..config import MEGATRON_OFFLOAD, TE_OFFLOAD, PeerConfig
from ..placement import OUTSIDE, Placement
from ..errors import ConfigError
from ..peer_rule import (FGO_MIN_TENSOR_ELEMENTS, FGO_MODULES, PEER_BY_NAME, TE_MIN_TENSOR_ELEMENTS,
                         first_layers_bound, fine_grained_choice, fine_grained_member, first_layers_placement,
                         first_layers_read_ahead)

__all__ = ["FineGrainedRule", "FirstLayersRule", "PeerRule", "RUNTIME", "rule_for"]

Group = Tuple[Hashable, str]
"""A module group: (layer id, group name)."""


class PeerRule(abc.ABC):
    """What the placement policy asks a peer's rule (NOTE [One placement policy] in
    ``policy.py``): where a new saved tensor goes, and when its read is issued."""

    name = ""

    @abc.abstractmethod
    def placement(self, layers: Sequence[Hashable], layer_id: Hashable, group: Optional[str],
                  elements: int, site: Optional[int] = None) -> Placement:
        """HOST or KEEP for a new offloadable tensor of ``elements`` elements saved in
        ``layer_id``'s ``group`` (``layers``: the registered layers in forward order)."""

    def read_ahead(self, layers: Sequence[Hashable], layer_id: Hashable, site: Optional[int]) -> Optional[int]:
        """Layers ahead that the read of ``layer_id``'s ``site`` is issued (0: when its
        own backward starts); None: the policy's default."""
        return None


# NOTE [Fine-grained offload, measured]
# Megatron-core 0.19's fine-grained activation offloading
# (pipeline_parallel/fine_grained_activation_offload.py) offloads every group in its
# warm-up iteration and records them, then chooses the groups that move
# (fine_grained_choice in ``peer_rule.py``). This rule does the same per tensor: a tensor
# of a configured group, of at least ``min_elements`` (fine_grained_member), is HOST
# while the warm-up lasts, and the groups seen are recorded in forward order; the first
# tensor of a group seen before, other than the group being saved, starts the next
# forward and ends the warm-up (Megatron ends it after the whole first iteration: with
# several micro-batches per step the later micro-batches of the first step here run the
# decided rule). From then on a tensor is HOST when its group was chosen, else KEEP. A
# moved group's reads are issued at the start of the backward of the layer holding the
# group K groups later in forward order (Megatron reloads a group when the backward of
# the group K later ends: up to one layer's backward earlier here).


class FineGrainedRule(PeerRule):
    """Megatron-core's ``--fine-grained-activation-offloading`` (NOTE [Fine-grained
    offload, measured]).

    Args:
        modules: ``offload_modules``, of :data:`~megatron_ssd.peer_rule.FGO_MODULES`.
        fraction: ``activation_offload_fraction``, in [0, 1].
        min_elements: ``min_offloaded_tensor_size``.
    """

    name = MEGATRON_OFFLOAD

    def __init__(self, modules: Sequence[str] = FGO_MODULES, fraction: float = 1.0,
                 min_elements: int = FGO_MIN_TENSOR_ELEMENTS) -> None:
        self.modules = tuple(modules)
        self.fraction = fraction
        self.min_elements = min_elements
        self.groups: List[Group] = []
        """The eligible groups of the warm-up forward, in forward order."""
        self._seen: Set[Group] = set()
        self.offloaded: Optional[Set[Group]] = None
        """The groups chosen to move (None: still warming up)."""
        self.group_read_ahead: Dict[Group, int] = {}
        """Per moved group, layers ahead its read is issued."""
        self._site_group: Dict[Tuple[Hashable, int], Group] = {}

    def placement(self, layers: Sequence[Hashable], layer_id: Hashable, group: Optional[str],
                  elements: int, site: Optional[int] = None) -> Placement:
        if layer_id in OUTSIDE or not fine_grained_member(group, elements, self.modules, self.min_elements):
            return Placement.KEEP
        key = (layer_id, group)
        if site is not None:
            self._site_group[(layer_id, site)] = key
        if self.offloaded is None:
            if key not in self._seen:
                self._seen.add(key)
                self.groups.append(key)
                return Placement.HOST  # the warm-up offloads every group
            if key == self.groups[-1]:
                return Placement.HOST  # another tensor of the group being saved
            self.decide()
        return Placement.HOST if key in self.offloaded else Placement.KEEP  # type: ignore[operator]

    def decide(self) -> None:
        """End the warm-up: choose the groups that move and each one's read-ahead
        (:func:`~megatron_ssd.peer_rule.fine_grained_choice`)."""
        chosen = fine_grained_choice([(layer, name, True) for layer, name in self.groups], self.fraction)
        self.offloaded = {self.groups[g] for g in chosen}
        self.group_read_ahead = {self.groups[g]: ahead for g, ahead in chosen.items()}

    def read_ahead(self, layers: Sequence[Hashable], layer_id: Hashable, site: Optional[int]) -> Optional[int]:
        if not self.group_read_ahead:
            return None
        if site is not None and (layer_id, site) in self._site_group:
            found = self.group_read_ahead.get(self._site_group[(layer_id, site)])
            if found is not None:
                return found
        aheads = [d for (layer, _), d in self.group_read_ahead.items() if layer == layer_id]
        return min(aheads) if aheads else None


class FirstLayersRule(PeerRule):
    """Transformer Engine's ``get_cpu_offload_context(num_layers=N, model_layers=L)``:
    every saved tensor of at least ``min_elements`` elements of the first N layers goes
    to host memory as it is saved, and layer i's reads are issued when the backward of
    layer L - 1 - N + i starts (L - N - 1 layers ahead; ``DefaultOffloadSynchronizer``).

    Args:
        num_layers: N, at most the model's layers - 1.
        min_elements: Transformer Engine skips smaller tensors.
    """

    name = TE_OFFLOAD

    def __init__(self, num_layers: int, min_elements: int = TE_MIN_TENSOR_ELEMENTS) -> None:
        self.num_layers = num_layers
        self.min_elements = min_elements

    def _check(self, layers: Sequence[Hashable]) -> None:
        most = first_layers_bound(len(layers))
        if self.num_layers > most:
            raise ConfigError(f"PeerConfig.num_layers = {self.num_layers}: must be <= {most} (the model's "
                              f"{len(layers)} layers - 1: Transformer Engine offloads at most all layers but the last)")

    def placement(self, layers: Sequence[Hashable], layer_id: Hashable, group: Optional[str],
                  elements: int, site: Optional[int] = None) -> Placement:
        index = None if layer_id in OUTSIDE or layer_id not in layers else list(layers).index(layer_id)
        placement = first_layers_placement(index, elements, self.num_layers, self.min_elements)
        if placement is Placement.HOST:
            self._check(layers)
        return placement

    def read_ahead(self, layers: Sequence[Hashable], layer_id: Hashable, site: Optional[int]) -> Optional[int]:
        if layer_id not in layers[:self.num_layers]:
            return None
        return first_layers_read_ahead(len(layers), self.num_layers)


RUNTIME: Dict[str, Callable[[PeerConfig, int], PeerRule]] = {
    MEGATRON_OFFLOAD: lambda peer, minimum: FineGrainedRule(peer.offload_modules, peer.offload_fraction, minimum),
    TE_OFFLOAD: lambda peer, minimum: FirstLayersRule(peer.num_layers, minimum),
}
"""Per peer's name (``peer_rule.PEERS``), its runtime rule from the config's settings and
the smallest tensor it moves."""


def rule_for(peer: Optional[PeerConfig]) -> Optional[PeerRule]:
    """The rule ``peer`` names, at its settings; None for ``rule: none`` (or no ``peer``)."""
    if peer is None or peer.rule not in RUNTIME:
        return None
    minimum = peer.min_tensor_elements
    return RUNTIME[peer.rule](peer, PEER_BY_NAME[peer.rule].min_tensor_elements if minimum is None else minimum)
