"""Storage tiers: the places saved tensors go between forward and backward, as values.

A :class:`Tier` names its placement and says how its transfers queue (its link, whether
it is a drive array with an in-flight bound, whether its bytes cross the host link too).
Its rates are measured per run and live in the stage's ``IOProfile``, keyed by the tier's
name (``IOProfile.rates``). The planner searches over :func:`tiers` in their order, and
the timeline queues each tier's transfers by its :class:`Tier`, so a tier registered
with :func:`register` is priced and chosen by cost like the built-in two::

    slow = register(Tier("slow-ssd", "the slower drive group", link="slow-ssd", drives=True))
    stage.io.tiers["slow-ssd"] = TierRates(write_bytes_per_s=2e8, read_bytes_per_s=3e8)

Pure: no torch, no I/O.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from .errors import ConfigError
from .placement import MOVED, Placement

__all__ = ["Tier", "TIERS", "register", "unregister", "load_tier_modules", "tiers", "added", "DRIVES_LINK",
           "HOST_LINK"]

DRIVES_LINK = "drives"
"""The SSD array's queue."""
HOST_LINK = "host"
"""The host link: the host tier's copies, and on a GPU the SSDs' bytes too (NOTE [Shared
link] in ``planner/step_timeline.py``)."""


# NOTE [Tiers]
# A tier is one value: its name (its placement's, and its key in the profile's rates,
# the plan's JSON and the reports), its title, the link its transfers take and what kind
# of queue that is. Tiers naming one link share it: one transfer at a time, the compute
# slowdown of the busiest. A drive array (``drives``) queues its requests first come,
# first served and holds its writes under the engine's in-flight bound; any other tier
# is a copy link, each transfer taking the earliest idle span
# long enough (NOTE [Host tier] in ``planner/step_timeline.py``). A tier that
# ``crosses_host_link`` also occupies the host link for its bytes where the profile says
# the links are shared (``IOProfile.shared_host_link``: the SSDs' bytes cross a GPU's PCIe
# link to the host). Drive wear is the SSDs' own (``planner.drive_tbw_bytes``).
# The order of :data:`TIERS` is the search's preference on equal cost (NOTE [Tier
# preference] in ``planner/greedy.py``): the host pool, the SSDs, then tiers in the order
# registered.


@dataclass(frozen=True)
class Tier:
    """A storage tier (NOTE [Tiers])."""

    name: str
    """Its placement's name (``offload``, ``host``): the plan's JSON, the config's planner
    modes and the reports write it; lowercase letters, digits, ``-`` and ``_``."""
    title: str
    """What the tables call it (``the SSDs``)."""
    link: str
    """The link its transfers queue on; tiers naming one link share it."""
    drives: bool = False
    """A drive array: its requests queue first come, first served under its engine's
    in-flight bound (``TierRates.max_inflight_bytes``), and a plan's tie of step times
    goes to the plan writing fewer bytes to drive tiers."""
    crosses_host_link: bool = False
    """Its bytes also cross the host link where ``IOProfile.shared_host_link`` is true
    (the SSDs' bytes on a GPU: NOTE [Shared link] in ``planner/step_timeline.py``)."""
    open_store: Optional[Callable[[Any, str], Any]] = field(default=None, compare=False, repr=False)
    """A tier registered after the built-in two: ``open_store(config, device_type)``, the
    cache's ``OffloadConfig`` and its device's type, gives the ``io.store.BlobStore`` its
    blobs go to, or None where the tier is not there; the cache opens and closes it with
    its others (``cache/tier_stores.py``). None: the built-in tiers, opened by the cache
    itself."""
    budget: Optional[Callable[[Any], Optional[int]]] = field(default=None, compare=False, repr=False)
    """A tier registered after the built-in two: ``budget(store)``, given the store
    ``open_store`` opened, is the most bytes the tier may hold for a stage's micro-batches
    in flight (a pool's size, a drive group's free space), read once when its rates are
    probed (NOTE [Probed tiers] in ``profiling.py``) and kept by the search as the host
    pool's budget is; None, or a budget of None: no bound. The host pool's budget is
    ``offload.host_pool_bytes``."""
    placement: Placement = field(init=False, compare=False, repr=False)
    """Its placement (made from ``name``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "placement", Placement.define(self.name, named=False))  # named when registered


TIERS: Dict[Placement, Tier] = {}
"""Every tier by placement, in the search's order of preference (NOTE [Tiers])."""


def register(tier: Tier) -> Tier:
    """Add ``tier`` after the ones there (its placement moves tensors from now on); the
    same tier again is a no-op.

    Raises:
        ValueError: another tier has its name, or it names a built-in placement that
            does not move tensors (``keep``, ``recompute``).
    """
    known = TIERS.get(tier.placement)
    if known is not None:
        if known != tier:
            raise ValueError(f"tier {tier.name!r}: another tier has that name ({known.title})")
        return known
    if tier.placement in (Placement.KEEP, Placement.RECOMPUTE):
        raise ValueError(f"tier {tier.name!r}: the name of a placement that keeps its tensors")
    Placement.adopt(tier.placement)
    TIERS[tier.placement] = tier
    MOVED.add(tier.placement)
    return tier


def unregister(tier: Tier) -> None:
    """Remove a tier :func:`register` added, and its placement (a test's tier); the
    SSDs and the host pool stay."""
    if tier.placement in (Placement.OFFLOAD, Placement.HOST) or TIERS.get(tier.placement) != tier:
        return
    del TIERS[tier.placement]
    MOVED.discard(tier.placement)
    Placement.forget(tier.name)


def load_tier_modules(names: List[str]) -> None:
    """Import each module of ``offload.tier_modules``, which registers its tiers.

    Raises:
        ConfigError: a module could not be imported, naming it and why.
    """
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # an import error, or the module's own: both are the setting's fault
            raise ConfigError(f"offload.tier_modules: {name!r} could not be imported "
                              f"({type(exc).__name__}: {exc})") from None


def tiers() -> List[Tier]:
    """Every tier, in the order of :data:`TIERS`."""
    return list(TIERS.values())


def added() -> List[Placement]:
    """The placements of the tiers registered after the host pool and the SSDs, in the
    order registered."""
    return [p for p in TIERS if p is not Placement.HOST and p is not Placement.OFFLOAD]


register(Tier("host", "the host pool", link=HOST_LINK))
register(Tier("offload", "the SSDs", link=DRIVES_LINK, drives=True, crosses_host_link=True))
