"""The numbers the tensor cache reports for each training step."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Dict, Hashable, List, Optional

from ..planner.measurement import LayerMeasurement, StepMeasurement
from ..units import MiB

__all__ = ["StepStats", "Counters", "LayerCounters", "add_seconds", "time_site"]


def add_seconds(counters: Any, field: str, seconds: float) -> None:
    """A clock span's seconds added to ``counters.field``: what the cache's clock calls
    with each span it times (NOTE [Device time] in ``device.py``)."""
    setattr(counters, field, getattr(counters, field) + seconds)


def time_site(clock: Any, start: Any, seconds: List[float], counts: List[int], site: int) -> None:
    """One micro-batch's span from ``start`` to now added to ``seconds[site]`` and counted
    in ``counts[site]``, growing both lists as needed: a site's save point in its layer's
    forward (NOTE [Site save times]) or its use point in its layer's backward (NOTE [Site
    use times], both in ``planner/profile.py``). ``clock``: the cache's (NOTE [Device time]
    in ``device.py``)."""
    while len(seconds) <= site:
        seconds.append(0.0)
        counts.append(0)
    clock.since(start, partial(_add_at, seconds, site))
    counts[site] += 1


def _add_at(values: List[float], index: int, seconds: float) -> None:
    values[index] += seconds


@dataclass
class LayerCounters(LayerMeasurement):
    """Per-layer measurements of one step (summed over micro-batches): the planner's, and
    where the layer's bytes went."""

    offloaded_bytes: int = 0
    """Of ``saved_bytes``, bytes queued for writing to the SSDs (``hosted_bytes``: to the
    host pool)."""

    def add_queued(self, kind: str, nbytes: int) -> None:
        """Count ``nbytes`` queued to the blob store of ``kind`` (``ssd`` or ``host``; a
        tier registered after them is counted per step in ``StepStats.tier_bytes``, not
        per layer)."""
        if kind == "host":
            self.hosted_bytes += nbytes
        elif kind == "ssd":
            self.offloaded_bytes += nbytes


@dataclass
class Counters:
    """Mutable counters the cache accumulates during a step (guarded by its lock)."""

    bytes_deduplicated: int = 0
    bytes_forwarded: int = 0
    bytes_kept: int = 0
    tensors_packed: int = 0
    tensors_skipped: int = 0
    write_fallbacks: int = 0
    bytes_fallen_back: int = 0
    backpressure_keeps: int = 0
    late_reads: int = 0
    stall_s: float = 0.0
    peak_resident_bytes: int = 0
    bytes_returned: int = 0
    heap_trim_s: float = 0.0
    bytes_write_cancelled: int = 0
    bytes_discarded: int = 0
    prefetch_deferred: int = 0
    peak_live_bytes: int = 0
    capacity_waits: int = 0
    peak_open_records: int = 0
    microbatches: int = 0
    layers: Dict[Optional[Hashable], LayerCounters] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class StepStats(StepMeasurement):
    """What the cache did during one step (between two ``finish_step()`` calls): the
    planner's :class:`~megatron_ssd.planner.measurement.StepMeasurement` (its ``layers``
    are :class:`LayerCounters`) and the cache's own report."""

    step: int
    """Index of the step, from 0."""
    cpu_s: float
    """CPU time the whole process used during the step (every thread, user and system)."""
    io_cpu_s: float
    """Part of ``cpu_s`` used by the I/O engine's worker threads (staging copies,
    checksums, syscalls, completion callbacks)."""
    bytes_offloaded: int
    """Bytes written to the SSD array (completed writes, payload only)."""
    bytes_reloaded: int
    """Bytes read back from the SSD array."""
    bytes_deduplicated: int
    """Bytes of saved tensors whose storage was already in the cache (not stored again)."""
    bytes_forwarded: int
    """Bytes of offloaded tensors served from memory because they were still resident
    (write still in flight or not yet dropped), so no read was needed."""
    bytes_kept: int
    """Bytes of saved tensors held in memory by placement (KEEP layers, small tensors,
    tensors outside any layer)."""
    tensors_packed: int
    """Saved tensors seen by the pack hook."""
    tensors_skipped: int
    """Saved tensors left untouched: parameters, other devices, meta tensors."""
    write_fallbacks: int
    """Writes that failed (ENOSPC, EIO, ...); those tensors stayed in memory."""
    bytes_fallen_back: int
    """Bytes of the failed writes kept in memory instead."""
    late_reads: int
    """Offloaded tensors needed before any prefetch asked for them (read on demand)."""
    stall_s: float
    """Time backward spent waiting in unpack for reads (exposed read time)."""
    backpressure_wait_s: float
    """Time forward spent waiting for room in the write queue (exposed write time)."""
    peak_resident_bytes: int
    """Peak bytes of saved activations held in compute-device memory by the cache."""
    peak_ssd_bytes: int
    """Peak bytes this cache had on the SSD array during the step (padding included):
    the footprint to provision."""
    ssd_bytes: int
    """Bytes allocated on the SSD array at the end of the step."""
    bytes_to_host: int = 0
    """Bytes copied into the host pool (``host`` placement; completed copies)."""
    bytes_from_host: int = 0
    """Bytes copied back from the host pool."""
    peak_host_bytes: int = 0
    """Peak bytes this cache held in the host pool during the step."""
    bytes_returned: int = 0
    """Bytes of offloaded CPU activations whose pages were given back to the kernel when
    their write completed (NOTE [Returning freed pages])."""
    heap_trim_s: float = 0.0
    """Time spent returning glibc's free pages at the end of micro-batch forwards."""
    bytes_write_cancelled: int = 0
    """Bytes of offloaded tensors whose write was cancelled before it completed, because
    backward used them from memory or autograd released them first (NOTE [Cancelled
    writes] in ``io/recovery.py``); not in ``bytes_offloaded``."""
    bytes_discarded: int = 0
    """Bytes of saved tensors whose owner freed and refilled the storage itself (Megatron's
    output discarding), served by reference instead of moved (NOTE [Discarded storages]
    in ``cache/entries.py``)."""
    prefetch_deferred: int = 0
    """Prefetches put off because their read buffer could not be allocated (out of device
    memory); the tensors were read when backward needed them instead (NOTE [Prefetch
    under memory pressure] in ``cache/backward.py``)."""
    capacity_waits: int = 0
    """Times the forward waited for writes to bring the resident bytes back under the
    activation capacity (NOTE [Capacity guard] in ``cache/policy.py``)."""
    tier_bytes: Dict[str, Dict[str, int]] = field(default_factory=dict)
    """Per tier registered after the SSDs and the host pool (NOTE [Tiers] in ``tier.py``),
    by name: ``moved`` (bytes put there), ``returned`` (bytes got back) and ``peak``
    (most bytes held at once) in the step; empty without such a tier."""

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready dict (layer ids become strings)."""
        out = dataclasses.asdict(self)
        out["layers"] = {str(k): dataclasses.asdict(v) for k, v in self.layers.items()}
        return out

    def summary(self) -> str:
        """One line for logs."""
        return (
            f"step {self.step}: offloaded {self.bytes_offloaded / MiB:.1f} MiB "
            f"(write {self.write_bytes_per_s / MiB:.0f} MiB/s), reloaded {self.bytes_reloaded / MiB:.1f} MiB "
            f"(read {self.read_bytes_per_s / MiB:.0f} MiB/s), forwarded {self.bytes_forwarded / MiB:.1f} MiB, "
            f"writes cancelled {self.bytes_write_cancelled / MiB:.1f} MiB, "
            f"dedup {self.bytes_deduplicated / MiB:.1f} MiB, peak resident {self.peak_resident_bytes / MiB:.1f} MiB, "
            f"stall {self.stall_s * 1e3:.0f} ms"
        ) + "".join(f", {name} {t['moved'] / MiB:.1f} MiB" for name, t in self.tier_bytes.items())
