"""The tensor cache's per-step accounting.

:class:`StepAccountingMixin` is mixed into :class:`~megatron_ssd.cache.TensorCache`,
which provides ``engine``, ``ssd``, ``host_store``, ``entries`` (the step's counters), ``clock``,
``_engine_base``, ``_step``, ``_step_started``, ``_cpu_started``, ``_check_open`` and
``drain``. The bytes moved and held come from the blob stores (NOTE [Blob stores]).
"""

from __future__ import annotations

import time

from ..io.store import StoreStep
from .stats import StepStats

__all__ = ["StepAccountingMixin"]


class StepAccountingMixin:
    """Closes each step's counters into a :class:`StepStats`."""

    def finish_step(self) -> StepStats:
        """Close the step's accounting and return its numbers; counters start again.

        Waits for writes and reads still in flight first, so each step's bytes are its own.
        """
        self._check_open()
        self.drain()
        self.clock.wait()  # the step's last kernel has run (NOTE [Device time] in device.py)
        es = self.engine.stats()
        ssd = self.ssd.take_step()
        host = self.host_store.take_step() if self.host_store is not None else StoreStep(0, 0, 0)
        with self.entries.lock:
            self.clock.resolve()
            c, base = self.entries.take_step(), self._engine_base
            wbytes, rbytes = es.bytes_written - base.bytes_written, es.bytes_read - base.bytes_read
            wbusy, rbusy = es.write_busy_s - base.write_busy_s, es.read_busy_s - base.read_busy_s
            now, cpu_now = time.perf_counter(), time.process_time()
            stats = StepStats(
                step=self._step,
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
            )
            self._engine_base = es
            self._step += 1
            self._step_started, self._cpu_started = now, cpu_now
        return stats

    @property
    def checksum(self) -> str:
        """``on`` or ``off``: whether blobs written now get a checksum."""
        return self.engine.stats().extra.get("checksum", "off" if self.config.io.checksum == "off" else "on")
