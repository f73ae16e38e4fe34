"""The tensor cache's per-step accounting.

:class:`StepAccountant` closes each step's counters into a :class:`StepStats`. It is built
with what it reads: the config, the entry table (the step's counters, the clock, the
lock), the placement policy, the SSD engine and the blob stores (the bytes moved and held
come from the stores, NOTE [Blob stores]), and the device binding.
:class:`~megatron_ssd.cache.TensorCache` composes one.
"""

from __future__ import annotations

import logging
import time
from typing import Hashable, List, Mapping, Optional

import torch

from ..config import OffloadConfig
from ..io.base import Engine
from ..io.store import BlobStore, StoreStep
from ..placement import OUTSIDE, Placement
from .device import DeviceBinding
from .entries import EntryTable
from .policy import PlacementPolicy
from .stats import StepStats

__all__ = ["StepAccountant"]

logger = logging.getLogger("megatron_ssd")


class StepAccountant:
    """Closes each step's counters into a :class:`StepStats`.

    Args:
        config: the cache's config (named in the nothing-moved warning).
        entries: the entry table whose step counters are taken.
        policy: the placements (which layers are placed to move).
        engine: the SSD engine (its cumulative stats; each step reports the difference).
        ssd: the SSD engine's blob store.
        host_store: the host tier's blob store, if any.
        binding: the device the cache serves.
        others: the stores of the other tiers, by placement (NOTE [Tiers] in ``tier.py``).
    """

    def __init__(self, config: OffloadConfig, entries: EntryTable, policy: PlacementPolicy, engine: Engine,
                 ssd: BlobStore, host_store: Optional[BlobStore], binding: DeviceBinding,
                 others: Optional[Mapping[Placement, BlobStore]] = None) -> None:
        self.others = dict(others or {})
        self.config = config
        self.entries = entries
        self.policy = policy
        self.engine = engine
        self.ssd = ssd
        self.host_store = host_store
        self.binding = binding
        self.step = 0
        """The number of the step being counted (0 first)."""
        self.foreign_device: Optional[torch.device] = None
        """The last device of a saved tensor left alone because the cache serves another."""
        self._engine_base = engine.stats()
        self._step_started = time.perf_counter()
        self._cpu_started = time.process_time()
        self._said_nothing_moved = False

    def finish_step(self) -> StepStats:
        """Close the step's accounting and return its numbers; counters start again.

        Call it once the step's writes and reads have completed (the cache drains first),
        so each step's bytes are its own.
        """
        clock = self.entries.clock
        clock.wait()  # the step's last kernel has run (NOTE [Device time] in device.py)
        es = self.engine.stats()
        ssd = self.ssd.take_step()
        host = self.host_store.take_step() if self.host_store is not None else StoreStep(0, 0, 0)
        others = {p.value: store.take_step() for p, store in self.others.items()}
        with self.entries.lock:
            clock.resolve()
            c, base = self.entries.take_step(), self._engine_base
            wbytes, rbytes = es.bytes_written - base.bytes_written, es.bytes_read - base.bytes_read
            wbusy, rbusy = es.write_busy_s - base.write_busy_s, es.read_busy_s - base.read_busy_s
            now, cpu_now = time.perf_counter(), time.process_time()
            stats = StepStats(
                step=self.step,
                wall_s=now - self._step_started,
                microbatches=c.microbatches,
                cpu_s=cpu_now - self._cpu_started,
                io_cpu_s=es.cpu_s - base.cpu_s,
                bytes_offloaded=ssd.put_bytes,
                bytes_reloaded=ssd.got_bytes,
                bytes_deduplicated=c.bytes_deduplicated,
                bytes_forwarded=c.bytes_forwarded,
                bytes_kept=c.bytes_kept,
                tensors_packed=c.tensors_packed,
                tensors_skipped=c.tensors_skipped,
                write_fallbacks=c.write_fallbacks,
                bytes_fallen_back=c.bytes_fallen_back,
                backpressure_keeps=c.backpressure_keeps,
                late_reads=c.late_reads,
                write_bytes_per_s=wbytes / wbusy if wbusy > 0 else 0.0,
                read_bytes_per_s=rbytes / rbusy if rbusy > 0 else 0.0,
                write_busy_s=wbusy,
                read_busy_s=rbusy,
                stall_s=c.stall_s,
                backpressure_wait_s=es.backpressure_wait_s - base.backpressure_wait_s,
                peak_resident_bytes=c.peak_resident_bytes,
                peak_ssd_bytes=ssd.peak_bytes,
                ssd_bytes=es.disk_bytes,
                layers=c.layers,
                bytes_to_host=host.put_bytes,
                bytes_from_host=host.got_bytes,
                peak_host_bytes=host.peak_bytes,
                bytes_returned=c.bytes_returned,
                heap_trim_s=c.heap_trim_s,
                bytes_write_cancelled=c.bytes_write_cancelled,
                bytes_discarded=c.bytes_discarded,
                prefetch_deferred=c.prefetch_deferred,
                peak_saved_bytes=c.peak_live_bytes,
                capacity_waits=c.capacity_waits,
                peak_open_microbatches=c.peak_open_records,
                tier_bytes={name: {"moved": o.put_bytes, "returned": o.got_bytes, "peak": o.peak_bytes}
                            for name, o in others.items()},
            )
            self._engine_base = es
            self.step += 1
            self._step_started, self._cpu_started = now, cpu_now
        self._say_if_nothing_moved(stats)
        return stats

    def restart_step_clock(self) -> None:
        """Start the next step's wall and CPU clocks from now (NOTE [Search time] in
        ``adaptive.py``: the schedule calls it once its step callback returns, so the time
        spent there, the planner's search among it, is in no step's ``wall_s`` or
        ``cpu_s``)."""
        with self.entries.lock:
            self._step_started, self._cpu_started = time.perf_counter(), time.process_time()

    def _moving_layers(self) -> List[Hashable]:
        """The layers (and outside sites) whose placement moves at least one site now."""
        policy = self.policy
        return [layer for layer in [*policy.layers, *OUTSIDE] if policy.moves(layer)]

    def _say_if_nothing_moved(self, stats: StepStats) -> None:
        """Warn, once per cache, about a step that saved tensors and moved none of them
        although layers are placed to move (NOTE [A device that exists] in ``device.py``)."""
        if self._said_nothing_moved or not stats.tensors_packed or stats.backpressure_keeps:
            return
        if any(lc.offloaded_bytes or lc.hosted_bytes for lc in stats.layers.values()):
            return
        moving = self._moving_layers()
        if not moving:
            return
        self._said_nothing_moved = True
        reasons = []
        if self.foreign_device is not None:
            reasons.append(f"tensors saved on {self.foreign_device} were left to autograd: this cache serves "
                           f"{self.binding.device} (OffloadConfig.device = {self.config.device!r})")
        small = sum(stats.layers[layer].small_bytes for layer in moving if layer in stats.layers)
        if small:
            reasons.append(f"{small} bytes saved in those layers were each under min_tensor_bytes = "
                           f"{self.config.min_tensor_bytes}")
        if not any(layer in stats.layers for layer in moving):
            reasons.append("no tensor was saved inside those layers (are the registered modules the ones that run, "
                           "and offload-aware?)")
        logger.warning(
            "megatron_ssd: step %d moved nothing off the device although %d layer(s) are placed to move (%s): %s; "
            "no memory is saved (said once)", stats.step, len(moving),
            ", ".join(repr(layer) for layer in moving[:8]) + (", ..." if len(moving) > 8 else ""),
            "; ".join(reasons) or "every tensor they saved was kept",
        )
