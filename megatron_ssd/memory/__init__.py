"""Memory measured independently of the tensor cache: process RSS, allocator events, CUDA.

See :mod:`.rss` (NOTE [Resettable RSS peak]), :mod:`.allocator_timeline` (NOTE [Allocator
timeline]) and :mod:`.phase`.
"""

from .phase import PhaseMemory
from .rss import RSSPeak, current_rss_bytes, hwm_bytes, reset_hwm
from .allocator_timeline import AllocatorTimeline, TimelinePeaks, peak_of_events

__all__ = ["AllocatorTimeline", "PhaseMemory", "TimelinePeaks", "RSSPeak", "current_rss_bytes", "hwm_bytes",
           "peak_of_events", "reset_hwm"]
