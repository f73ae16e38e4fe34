"""Where a saved tensor goes: the cache's one placement policy.

:class:`PlacementPolicy` holds the plan the cache runs (a
:class:`~megatron_ssd.placement.LayerChoice` per layer: placement, sites moved,
read-ahead; and the default placement of the layers it does not name) and the rules for
what the plan does not name, and it answers the questions the cache asks:

- :meth:`PlacementPolicy.site_of`: whether a new saved tensor may move at all (its size,
  whether it is unmovable) and, if so, its site;
- :meth:`PlacementPolicy.layer`: the placement of a layer (``OffloadTransformerLayer``
  asks it whether to recompute; the cache asks it when a later layer saves a tensor
  again);
- :meth:`PlacementPolicy.tensor`: the placement of one new saved tensor, from its layer,
  its site (NOTE [Sites] in ``planner/profile.py``), its size and the module group it
  was saved in.

A peer's rule (``OffloadConfig.peer``: Megatron's fine-grained offloading, Transformer
Engine's CPU offload; ``peer_rules.py``) is consulted here too, for the tensors the plan
keeps: it moves what the peer would move to the host tier and reads it back when the peer
would, so a run measures the peer's decision on this cache and its engines.

NOTE [One placement policy]: a placement is decided here and nowhere else: whether a
tensor may move (:meth:`PlacementPolicy.site_of`), where it goes and when it is read
back. (Parameters, leaves that need a gradient and tensors on another device never
reach the cache's table: autograd keeps them, ``TensorCache._skippable``.) Two outcomes
change an entry's placement later, and both are events, not decisions: a write the
engine refuses (backpressure) or fails keeps the tensor where it is, and a tensor that a
KEEP layer saves again is pinned in memory after its write (``entries.py``).

NOTE [Capacity guard]: with ``resident_limit`` set (the device's activation capacity,
set by the planner), no step may hold more saved bytes than that, whatever the plan
predicted or the profile placement is. A new offloadable tensor that its layer would
keep, but that would take the resident bytes over the limit, is offloaded instead; and
after queuing a write the forward waits while the resident bytes exceed the limit and
writes are in flight (``EntryTable.write``), so bytes waiting to be written count
against the limit too. In backward a prefetch that would take the resident bytes over
the limit is deferred until backward needs the tensor (NOTE [Prefetch under memory
pressure] in ``backward.py``). Only bytes the cache cannot move (small and unmovable
tensors, the tensors backward is using) can take it over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Dict, Hashable, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch

from ..config import OffloadConfig
from ..placement import MOVED, OUTSIDE, LayerChoice, Placement, default_placement, placement_named
from ..errors import ConfigError
from .peer_rules import PeerRule, rule_for

__all__ = ["PlacementPolicy", "PlanState"]


@dataclass(frozen=True)
class PlanState:
    """One plan, swapped whole by :meth:`PlacementPolicy.set_plan` (readers on other
    threads see the old plan or the new one, never a mix)."""

    choices: Mapping[Hashable, LayerChoice] = field(default_factory=lambda: MappingProxyType({}))
    """The plan's choice per layer id (placement, sites moved, read-ahead); read-only."""
    default: Optional[Placement] = None
    """Placement of the layers the plan does not name; None: the ``keep_last_layers``
    rule (:func:`~megatron_ssd.placement.default_placement`)."""


class PlacementPolicy:
    """The plan the cache runs and the rules for everything it does not name.

    Args:
        config: ``keep_last_layers``, ``default_read_ahead`` and ``min_tensor_bytes``.
        host_available: whether a host pool exists (``Placement.HOST`` needs one).
        others: the other tiers with a store (NOTE [Tiers] in ``tier.py``).
    """

    def __init__(self, config: OffloadConfig, host_available: bool, others: Sequence[Placement] = ()) -> None:
        self.config = config
        self.host_available = host_available
        self.others = frozenset(others)
        """The tiers registered after the SSDs and the host pool that have a store here."""
        self.state = PlanState()
        self.layers: List[Hashable] = []
        """Registered layer ids in forward order (for the ``keep_last_layers`` rule)."""
        self.resident_limit: Optional[int] = None
        """Most saved bytes the cache may hold in memory (NOTE [Capacity guard]); None: no limit."""
        self.rule: Optional[PeerRule] = rule_for(getattr(config, "peer", None))
        """The peer's rule for the tensors the plan keeps (``OffloadConfig.peer``); None: none."""
        self.rule_active = True
        """Whether :attr:`rule` applies now (a paired keep step turns it off)."""
        self.parameters: Set[int] = set()
        """Storages of the registered parameters (``TensorCache.register_parameters``)."""

    @property
    def default(self) -> Optional[Placement]:
        """Placement of the layers the plan does not name; None: the ``keep_last_layers`` rule."""
        return self.state.default

    def set_plan(self, plan: Mapping[Hashable, Union[LayerChoice, Placement, str]],
                 default: Optional[Union[Placement, str]] = None) -> None:
        """Validate and swap in a plan (see ``TensorCache.set_plan``).

        Raises:
            ConfigError: an unknown placement, ``recompute`` for the tensors outside the
                layers, ``host`` without a host pool, a read-ahead below 1 (below 0 in a
                per-site list) or a negative site count, naming the layer and the value.
        """
        choices: Dict[Hashable, LayerChoice] = {}
        for layer_id, value in plan.items():
            choice = choices[layer_id] = LayerChoice.of(layer_id, value)
            if choice.placement is Placement.RECOMPUTE and layer_id in OUTSIDE:
                raise ConfigError(
                    f"plan[{layer_id!r}] = 'recompute': the tensors saved outside the layers cannot be recomputed "
                    "(docs/tensor-cache.md#sites-outside-the-layers); use keep, offload or host"
                )
            if choice.placement is Placement.HOST and not self.host_available:
                setting = self.config.host_pool_bytes
                raise ConfigError(
                    f"plan[{layer_id!r}] = 'host': OffloadConfig.host_pool_bytes = {setting!r}"
                    f"{', which gave no pool here' if setting == 'auto' else ''}; the host placement needs a "
                    "host pool (e.g. offload.host_pool_bytes=8GiB)"
                )
            if not self._open(choice.placement):
                raise ConfigError(f"plan[{layer_id!r}] = {choice.placement.value!r}: that tier has no store in this "
                                  "cache (its Tier.open_store gave none)")
        if default is not None:
            default = placement_named("set_plan(default=...)", default)
        self.state = PlanState(MappingProxyType(choices), default)

    def _open(self, placement: Placement) -> bool:
        """Whether a moved ``placement`` has a store here: the SSDs always, the host pool
        where there is one, another tier where its ``open_store`` gave one (True for a
        placement that moves nothing)."""
        if placement is Placement.HOST:
            return self.host_available
        return placement is Placement.OFFLOAD or placement not in MOVED or placement in self.others

    def left_to_autograd(self, t: torch.Tensor) -> bool:
        """Whether the cache leaves a saved tensor to autograd, uncounted: parameters (and
        views of them), leaves that need a gradient, meta tensors."""
        if t.is_meta:
            return True
        if t.is_leaf and t.requires_grad:
            return True
        base = t._base
        if base is not None and base.is_leaf and base.requires_grad:
            return True
        try:
            return t.untyped_storage()._cdata in self.parameters
        except (RuntimeError, NotImplementedError):  # a wrapper subclass without a storage
            return False

    def site_of(self, nbytes: int, unmovable: bool, taken: int) -> Optional[int]:
        """The site of a new saved tensor of ``nbytes`` (NOTE [Sites] in
        ``planner/profile.py``): ``taken``, the count of sites its layer has saved so far
        this micro-batch, when the tensor may move (at least ``min_tensor_bytes`` and not
        ``unmovable``, NOTE [Unmovable saved tensors] in ``identity.py``); else None: it
        never moves."""
        return taken if nbytes >= self.config.min_tensor_bytes and not unmovable else None

    def layer(self, layer_id: Hashable) -> Placement:
        """The plan's placement of ``layer_id``, else the default
        (:func:`~megatron_ssd.placement.default_placement`: the last ``keep_last_layers``
        registered layers KEEP, the others OFFLOAD, or the plan's default for all of
        them); tensors saved outside the layers (``embedding``, ``head``, NOTE [Sites
        outside the layers]) KEEP unless the plan names them."""
        return self._lookup(layer_id)[0]

    def _lookup(self, layer_id: Hashable) -> Tuple[Placement, Optional[LayerChoice]]:
        """The placement of ``layer_id`` and the plan's choice for it (None: the plan does
        not name it), both read from one plan (NOTE [One placement policy])."""
        state = self.state
        choice = state.choices.get(layer_id)
        if choice is not None:
            return choice.placement, choice
        if state.default is not None:
            return default_placement(layer_id, self.layers, 0, state.default), None
        return default_placement(layer_id, self.layers, self.config.keep_last_layers), None

    def moves(self, layer_id: Hashable) -> bool:
        """Whether the plan moves at least one site of ``layer_id`` (OFFLOAD, or HOST with
        a host pool, and not limited to 0 sites)."""
        placement, choice = self._lookup(layer_id)
        if placement not in MOVED or not self._open(placement):
            return False
        return choice is None or choice.sites != 0

    def tensor(self, layer_id: Hashable, site: Optional[int], resident_after: int = 0,
               group: Optional[str] = None, elements: int = 0) -> Placement:
        """Where a new saved tensor of ``layer_id`` goes: its layer's placement when that
        moves it, the tensor has a site (:meth:`site_of`: it may move; a tensor without
        one, small or unmovable, always stays), the site is within the plan's count for the layer, and
        for HOST a pool exists; else the peer's rule, when one is set, for an
        offloadable tensor of ``elements`` elements saved in module ``group``; else
        KEEP, unless keeping it would take the resident bytes (``resident_after``, with
        it) over ``resident_limit``: then OFFLOAD (NOTE [Capacity guard])."""
        placement = self._planned(layer_id, site)
        if placement is Placement.KEEP and site is not None and self.rule is not None and self.rule_active:
            placement = self.rule.placement(self.layers, layer_id, group, elements, site)
        if (placement is Placement.KEEP and site is not None and self.resident_limit is not None
                and resident_after > self.resident_limit):
            return Placement.OFFLOAD
        return placement

    def _planned(self, layer_id: Hashable, site: Optional[int]) -> Placement:
        placement, choice = self._lookup(layer_id)
        if placement not in MOVED or site is None:
            return Placement.KEEP
        if choice is not None and choice.sites is not None and site >= choice.sites:
            return Placement.KEEP
        return placement if self._open(placement) else Placement.KEEP  # a default placement of host, no pool: KEEP

    def read_ahead(self, layer_id: Hashable, site: Optional[int] = None) -> int:
        """Layers ahead that the read of ``layer_id``'s ``site`` is issued (NOTE [Write
        and read issue points]): the plan's, else the peer rule's, else
        ``default_read_ahead``; with no site (a tensor under ``min_tensor_bytes``, or
        one a later layer saved again), or a site past a per-site list, the layer's
        earliest."""
        choice = self.state.choices.get(layer_id)
        ahead = choice.read_ahead if choice is not None else None
        if ahead is None and self.rule is not None:
            ahead = self.rule.read_ahead(self.layers, layer_id, site)
        if ahead is None:
            ahead = self.config.default_read_ahead
        if isinstance(ahead, int):
            return ahead
        return ahead[site] if site is not None and site < len(ahead) else max(ahead)
