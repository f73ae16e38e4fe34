"""The stores a cache's moved placements go to, opened and closed together (NOTE [Blob
stores] in ``io/store.py``): the SSD engine's and, when the host pool is not 0, the host
tier's (NOTE [Auto host pool], NOTE [Pinning fails])."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Dict, Optional

from ..config import HostPoolChoice, NodeMemory, OffloadConfig, size_host_pool
from ..io.base import Engine
from ..io.host import open_host_pool
from ..io.store import BlobStore
from ..placement import Placement
from ..tier import tiers

__all__ = ["TierStores", "open_tier_stores"]

logger = logging.getLogger("megatron_ssd")


@dataclass
class TierStores:
    """Each moved placement's store, and the host pool's size and why."""

    ssd: BlobStore
    """The SSD engine's blobs (``Placement.OFFLOAD``)."""
    host: Optional[Engine]
    """The host-memory tier's engine (``Placement.HOST``), when the pool is not 0."""
    host_pool: HostPoolChoice
    """The pool's size and why (``offload.host_pool_bytes``, ``auto`` sized)."""
    host_store: Optional[BlobStore]
    """The host tier's blobs."""
    others: Dict[Placement, BlobStore] = field(default_factory=dict)
    """The stores of the tiers registered after the SSDs and the host pool, by placement
    (``Tier.open_store``, NOTE [Tiers] in ``tier.py``)."""

    @property
    def by_placement(self) -> Dict[Placement, BlobStore]:
        """The store each moved placement's tensors go to."""
        stores = {Placement.OFFLOAD: self.ssd}
        if self.host_store is not None:
            stores[Placement.HOST] = self.host_store
        stores.update(self.others)
        return stores

    def close(self) -> None:
        """Close every store: wait for its I/O, remove its files; every store is closed
        before the first exception one raised is raised again."""
        failed: Optional[BaseException] = None
        for store in self.by_placement.values():
            try:
                store.close()
            except BaseException as exc:  # a signal handler's exception in the wait, too
                failed = failed or exc
        if failed is not None:
            raise failed

    def remove_files_now(self) -> None:
        """Remove every store's files at once: no waiting, no locks (the signal path)."""
        for store in self.by_placement.values():
            store.remove_files_now()


def open_tier_stores(config: OffloadConfig, engine: Engine, device_type: str) -> TierStores:
    """The SSD engine's store over ``engine`` and, where ``config.host_pool_bytes`` sizes a
    pool for ``device_type``, the host tier's (its line logged)."""
    ssd = BlobStore(engine, "ssd")
    engine_bytes = sum(v for k, v in config.startup_host_bytes().items() if k != "host_pool_bytes")
    host, pool = open_host_pool(size_host_pool(config.host_pool_bytes, device_type, NodeMemory.read(), engine_bytes),
                                config.host_copy_bytes_per_s)
    stores = TierStores(ssd, host, pool, None if host is None else BlobStore(host, "host"))
    logger.info("megatron_ssd: %s", pool.line())
    for tier in tiers():
        store = tier.open_store(config, device_type) if tier.open_store is not None else None
        if store is not None:
            store.tier = tier.name
            stores.others[tier.placement] = store
            logger.info("megatron_ssd: tier %s (%s) opened", tier.name, tier.title)
    return stores
