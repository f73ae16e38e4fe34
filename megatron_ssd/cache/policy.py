"""Where a saved tensor goes: the cache's one placement policy.

:class:`PlacementPolicy` holds the plan the cache runs (a placement per layer, a
read-ahead per layer, a site count per layer) and the rules for what the plan does not
name, and it answers the two questions the cache asks:

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

NOTE [One placement policy]: a placement is decided here and nowhere else. Two outcomes
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
pressure] in ``entries.py``). Only bytes the cache cannot move (small and unmovable
tensors, the tensors backward is using) can take it over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Mapping, Optional, Sequence, Tuple, Union

from ..config import OffloadConfig, is_int
from ..placement import MOVED, OUTSIDE, Placement
from ..errors import ConfigError
from .peer_rules import PeerRule, rule_for

__all__ = ["PlacementPolicy", "PlanState"]


@dataclass(frozen=True)
class PlanState:
    """One plan, swapped whole by :meth:`PlacementPolicy.set_plan` (readers on other
    threads see the old plan or the new one, never a mix)."""

    placements: Dict[Hashable, Placement] = field(default_factory=dict)
    """Placement per layer id; layers not named take the default."""
    read_ahead: Dict[Hashable, Union[int, Tuple[int, ...]]] = field(default_factory=dict)
    """Read-issue point per layer (NOTE [Write and read issue points]): layers ahead, or
    one per site in save order; others use ``prefetch_layers``."""
    sites: Dict[Hashable, int] = field(default_factory=dict)
    """Per OFFLOAD / HOST layer, how many of its sites (a prefix) move; others: all."""


class PlacementPolicy:
    """The plan the cache runs and the rules for everything it does not name.

    Args:
        config: ``keep_last_layers`` and ``prefetch_layers``.
        host_available: whether a host pool exists (``Placement.HOST`` needs one).
    """

    def __init__(self, config: OffloadConfig, host_available: bool) -> None:
        self.config = config
        self.host_available = host_available
        self.state = PlanState()
        self.layers: List[Hashable] = []
        """Registered layer ids in forward order (for the ``keep_last_layers`` rule)."""
        self.default: Optional[Placement] = None
        """Placement of layers the plan does not name; None: the ``keep_last_layers`` rule."""
        self.resident_limit: Optional[int] = None
        """Most saved bytes the cache may hold in memory (NOTE [Capacity guard]); None: no limit."""
        self.rule: Optional[PeerRule] = rule_for(getattr(config, "peer", None))
        """The peer's rule for the tensors the plan keeps (``OffloadConfig.peer``); None: none."""
        self.rule_active = True
        """Whether :attr:`rule` applies now (a paired keep step turns it off)."""

    def set_plan(self, placements: Mapping[Hashable, Union[Placement, str]],
                 read_ahead: Optional[Mapping[Hashable, Union[int, Sequence[int]]]] = None,
                 sites: Optional[Mapping[Hashable, int]] = None) -> None:
        """Validate and swap in a plan (see ``TensorCache.set_plan``).

        Raises:
            ConfigError: an unknown placement, ``host`` without a host pool, a read-ahead
                below 1 (below 0 in a per-site list) or a negative site count, naming the
                layer and the value.
        """
        ahead: Dict[Hashable, Union[int, Tuple[int, ...]]] = {}
        for layer_id, depth in (read_ahead or {}).items():
            if is_int(depth, 1):
                ahead[layer_id] = depth  # type: ignore[assignment]
            elif isinstance(depth, (list, tuple)) and depth and all(is_int(d, 0) for d in depth):
                ahead[layer_id] = tuple(depth)
            else:
                raise ConfigError(f"read_ahead[{layer_id!r}] = {depth!r}: must be an integer >= 1 or a non-empty list "
                                  "of integers >= 0, one per site")
        limits: Dict[Hashable, int] = {}
        for layer_id, count in (sites or {}).items():
            if not is_int(count, 0):
                raise ConfigError(f"sites[{layer_id!r}] = {count!r}: must be an integer >= 0 (sites to move)")
            limits[layer_id] = count
        plan: Dict[Hashable, Placement] = {}
        for layer_id, placement in placements.items():
            try:
                plan[layer_id] = Placement(placement)
            except ValueError:
                raise ConfigError(
                    f"plan[{layer_id!r}] = {placement!r}: must be one of {[p.value for p in Placement]}"
                ) from None
            if plan[layer_id] is Placement.RECOMPUTE and layer_id in OUTSIDE:
                raise ConfigError(
                    f"plan[{layer_id!r}] = 'recompute': the tensors saved outside the layers cannot be recomputed "
                    "(docs/tensor-cache.md#sites-outside-the-layers); use keep, offload or host"
                )
            if plan[layer_id] is Placement.HOST and not self.host_available:
                raise ConfigError(
                    f"plan[{layer_id!r}] = 'host': OffloadConfig.host_pool_bytes = 0; the host placement needs a "
                    "host pool (e.g. offload.host_pool_bytes=8GiB)"
                )
        self.state = PlanState(plan, ahead, limits)

    def layer(self, layer_id: Hashable) -> Placement:
        """The plan's placement of ``layer_id``, else the default (the last
        ``keep_last_layers`` registered layers KEEP, the others OFFLOAD); tensors saved
        outside the layers (``embedding``, ``head``, NOTE [Sites outside the layers]) KEEP
        unless the plan names them."""
        plan = self.state.placements
        if layer_id in plan:
            return plan[layer_id]
        if layer_id is None or layer_id in OUTSIDE:
            return Placement.KEEP
        if self.default is not None:
            return self.default
        keep = self.config.keep_last_layers
        if keep and layer_id in self.layers[len(self.layers) - keep:]:
            return Placement.KEEP
        return Placement.OFFLOAD

    def tensor(self, layer_id: Hashable, site: Optional[int], resident_after: int = 0,
               group: Optional[str] = None, elements: int = 0) -> Placement:
        """Where a new saved tensor of ``layer_id`` goes: its layer's placement when that
        moves it, the tensor has a site (it is offloadable: at least
        ``min_tensor_bytes``), the site is within the plan's count for the layer, and
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
        placement = self.layer(layer_id)
        if placement not in MOVED or site is None:
            return Placement.KEEP
        if site >= self.state.sites.get(layer_id, site + 1):
            return Placement.KEEP
        if placement is Placement.HOST and not self.host_available:  # a default placement of host, no pool
            return Placement.KEEP
        return placement

    def read_ahead(self, layer_id: Hashable, site: Optional[int] = None) -> int:
        """Layers ahead that the read of ``layer_id``'s ``site`` is issued (NOTE [Write
        and read issue points]): the plan's, else the peer rule's, else
        ``prefetch_layers``; with no site (a tensor under ``min_tensor_bytes``, or
        one a later layer saved again), or a site past a per-site list, the layer's
        earliest."""
        depth = self.state.read_ahead.get(layer_id)
        if depth is None and self.rule is not None:
            depth = self.rule.read_ahead(self.layers, layer_id, site)
        if depth is None:
            depth = self.config.prefetch_layers
        if isinstance(depth, int):
            return depth
        return depth[site] if site is not None and site < len(depth) else max(depth)
