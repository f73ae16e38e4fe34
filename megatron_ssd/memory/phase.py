"""The independent memory measures of one training phase, step by step.

The tensor cache counts the activation bytes it holds (``peak_activation_bytes``). This
module measures what the process and the allocators actually hold, so a saving the cache
reports can be checked::

    memory = PhaseMemory(device="cpu")
    memory.start()                 # right before the phase's first forward
    for step in range(steps):
        memory.step_begin()
        run_step(step)
        memory.step_end()
    memory.summary(measured_from)  # peaks over the measured steps, above the start level

What is measured (all above the level at :meth:`PhaseMemory.start`):

* ``peak_rss_above_base_bytes``: the process's resident memory (NOTE [Resettable RSS
  peak]), every page whoever holds it: freed memory the heap keeps counts too;
* ``cuda_peak_allocated_above_base_bytes`` / ``cuda_peak_reserved_above_base_bytes``:
  ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` (GPU runs only);
* ``cuda_step_start_above_base_bytes``: ``torch.cuda.memory_allocated`` when a measured
  step starts (the most over those steps): what stays allocated from one step to the next
  (gradients, optimizer state, and anything a placement holds between steps), and
  ``cuda_live_blocks_after``: the sizes of the allocator's live blocks when the summary is
  taken, after the phase's steps, largest totals first, to tell what such memory is (GPU
  runs only; read outside the steps, so it costs them no time);
* ``allocator_peak_bytes`` (set by the caller from one profiled step,
  :class:`~megatron_ssd.memory.allocator_timeline.AllocatorTimeline`).

``independent_peak_bytes`` is the headline one: CUDA allocated bytes on a GPU, RSS on a CPU.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List, Optional

from .rss import RSSPeak, current_rss_bytes

__all__ = ["LIVE_BLOCK_SIZES", "PhaseMemory", "live_block_sizes"]

LIVE_BLOCK_SIZES = 12
"""How many block sizes :func:`live_block_sizes` reports."""


def live_block_sizes(snapshot: List[Dict[str, Any]], top: int = LIVE_BLOCK_SIZES) -> List[Dict[str, int]]:
    """``{"bytes", "count"}`` per block size of the live (``active_allocated``) blocks in a
    ``torch.cuda.memory_snapshot()``, the ``top`` largest totals first."""
    counts = Counter(block["size"] for segment in snapshot for block in segment.get("blocks", ())
                     if block.get("state") == "active_allocated")
    ranked = sorted(counts.items(), key=lambda kv: (-kv[0] * kv[1], -kv[0]))
    return [{"bytes": size, "count": n} for size, n in ranked[:top]]


class PhaseMemory:
    """Per-step peaks of RSS (and of CUDA memory on a GPU) above the phase's start level.

    Args:
        device: ``"cpu"`` or ``"cuda"``; CUDA statistics are read only for ``"cuda"``.
    """

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self._rss = RSSPeak()
        self.rss_base_bytes = 0
        self.cuda_base_allocated = 0
        self.cuda_base_reserved = 0
        self.steps: List[Dict[str, int]] = []
        """Per step: ``rss_peak_bytes`` (absolute), ``rss_end_bytes``, and on CUDA
        ``cuda_peak_allocated_bytes`` / ``cuda_peak_reserved_bytes`` (absolute)."""
        self.allocator_peak_bytes: Optional[int] = None
        self.allocator_device_peak_bytes: Optional[int] = None
        self._cuda_start_allocated = 0

    @property
    def rss_method(self) -> str:
        """``vmhwm`` or ``sampled`` (NOTE [Resettable RSS peak])."""
        return self._rss.method

    def start(self) -> None:
        """Take the base levels; call right before the phase's first forward."""
        self.rss_base_bytes = self._rss.mark_base()
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
            self.cuda_base_allocated = torch.cuda.memory_allocated()
            self.cuda_base_reserved = torch.cuda.memory_reserved()

    def step_begin(self) -> None:
        """Restart the peaks for the next step."""
        self._rss.reset()
        if self.device == "cuda":
            import torch

            torch.cuda.reset_peak_memory_stats()
            self._cuda_start_allocated = torch.cuda.memory_allocated()

    def step_end(self) -> Dict[str, int]:
        """Record the step's peaks; returns them."""
        rec = {"rss_peak_bytes": self._rss.peak_bytes(), "rss_end_bytes": current_rss_bytes()}
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
            rec["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
            rec["cuda_peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
            rec["cuda_start_allocated_bytes"] = self._cuda_start_allocated
        self.steps.append(rec)
        return rec

    def summary(self, measured_from: int = 0) -> Dict[str, Any]:
        """Peaks over steps ``measured_from..`` above the base levels (bytes)."""
        m = self.steps[measured_from:] or self.steps[-1:]
        out: Dict[str, Any] = {
            "rss_base_bytes": self.rss_base_bytes,
            "rss_method": self.rss_method,
            "peak_rss_above_base_bytes": max((max(0, s["rss_peak_bytes"] - self.rss_base_bytes) for s in m),
                                             default=0),
            "rss_peak_per_step_bytes": [s["rss_peak_bytes"] for s in self.steps],
            "rss_end_bytes": self.steps[-1]["rss_end_bytes"] if self.steps else current_rss_bytes(),
            "allocator_peak_bytes": self.allocator_peak_bytes,
            "cuda_peak_allocated_above_base_bytes": None,
            "cuda_peak_reserved_above_base_bytes": None,
            "cuda_step_start_above_base_bytes": None,
            "cuda_live_blocks_after": None,
        }
        if self.device == "cuda" and m:
            out["cuda_peak_allocated_above_base_bytes"] = max(
                0, max(s["cuda_peak_allocated_bytes"] for s in m) - self.cuda_base_allocated)
            out["cuda_peak_reserved_above_base_bytes"] = max(
                0, max(s["cuda_peak_reserved_bytes"] for s in m) - self.cuda_base_reserved)
            out["allocator_device_peak_bytes"] = self.allocator_device_peak_bytes
            out["cuda_step_start_above_base_bytes"] = max(
                s["cuda_start_allocated_bytes"] for s in m) - self.cuda_base_allocated
            import torch

            out["cuda_live_blocks_after"] = live_block_sizes(torch.cuda.memory_snapshot())
            out["cuda_peak_allocated_bytes"] = max(s["cuda_peak_allocated_bytes"] for s in self.steps)
            out["cuda_base_allocated_bytes"] = self.cuda_base_allocated  # the level the peaks are above
            out["independent_peak_bytes"] = out["cuda_peak_allocated_above_base_bytes"]
            out["independent_peak_source"] = "cuda_max_memory_allocated"
        else:
            out["independent_peak_bytes"] = out["peak_rss_above_base_bytes"]
            out["independent_peak_source"] = f"rss ({self.rss_method})"
        return out

    def close(self) -> None:
        """Stop the RSS sampler thread, if one runs."""
        self._rss.close()
