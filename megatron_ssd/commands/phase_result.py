"""What one phase of a ``train`` job measured (:class:`PhaseResult`): its steps, losses
and independent memory, and the summary a phase's column and JSON entry are made of."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..cache import StepStats
from ..planner.measured_profile import median_or_zero as med

__all__ = ["PhaseResult"]


@dataclass
class PhaseResult:
    """Measurements of one phase (keep-everything or offload) of the job."""

    name: str
    steps: List[StepStats] = field(default_factory=list)
    losses: List[float] = field(default_factory=list)
    memory: Dict[str, Any] = field(default_factory=dict)
    """Memory measured independently of the cache (:meth:`PhaseMemory.summary`)."""
    kinds: List[str] = field(default_factory=list)
    """What each step was (NOTE [Step kinds]): ``warm-up``, ``profile`` or ``measured``."""
    device_step_s: List[float] = field(default_factory=list)
    """On a GPU, each step's CUDA-event time (NOTE [Device step time]); empty on a CPU."""
    oom: Optional[str] = None
    """The first line of the out-of-memory error that ended the phase (NOTE [Out of memory,
    recorded]); None: it ran all its steps."""
    oom_step: Optional[int] = None
    """The step (1-based) that ran out of memory."""
    paired: Optional[Dict[str, Any]] = None
    """The paired steps run after the phase's own, against keep-everything (NOTE [Paired
    steps] in ``paired.py``, ``TrainConfig.paired_steps``); None: none ran."""

    @property
    def measured_kind(self) -> str:
        """``measured``; for a short run (``--allow-short``), the kind of its last step,
        which the summary then comes from; ``oom`` for a phase that ran out of memory."""
        if self.oom is not None:
            return "oom"
        return "measured" if "measured" in self.kinds else (self.kinds[-1] if self.kinds else "measured")

    @property
    def label(self) -> str:
        """The column name: the phase, and what its numbers come from when not measured steps."""
        kind = self.measured_kind
        return self.name if kind == "measured" else f"{self.name} [{kind} step]"

    @property
    def measured_from(self) -> int:
        """Index of the first measured step; the memory peaks are taken from there on."""
        return self.kinds.index("measured") if "measured" in self.kinds else max(len(self.steps) - 1, 0)

    @property
    def measured(self) -> List[StepStats]:
        m = [s for s, k in zip(self.steps, self.kinds) if k == "measured"]
        return m or self.steps[-1:]

    def summary(self) -> Dict[str, Any]:
        """Medians over the measured steps; peaks over them. A phase that ran out of
        memory has no figures to compare: its error, its step and the losses before it."""
        if self.oom is not None:
            return {"name": self.name, "oom": self.oom, "oom_step": self.oom_step, "measured_kind": "oom",
                    "measured_steps": 0, "peak_activation_bytes": None, "independent_peak_bytes": None,
                    "median_step_s": None, "step_s": [], "device_step_s": None, "median_device_step_s": None,
                    "final_loss": None, "losses": list(self.losses), "paired": None, **self.memory}
        m = self.measured
        step_s = med([s.wall_s for s in m])
        device = [t for t, k in zip(self.device_step_s, self.kinds) if k == "measured"] or self.device_step_s[-1:]
        written = med([s.bytes_offloaded for s in m])
        return {
            "name": self.label,
            "measured_steps": len(m) if self.measured_kind == "measured" else 0,
            "measured_kind": self.measured_kind,
            "warmup_steps": self.kinds.count("warm-up"),
            "profile_steps": self.kinds.count("profile"),
            "peak_activation_bytes": max(s.peak_resident_bytes for s in m),
            "median_step_s": step_s,
            "step_s": [s.wall_s for s in m],
            # NOTE [Device step time]: CUDA events on a GPU; None on a CPU
            "device_step_s": device or None,
            "median_device_step_s": med(device) if device else None,
            "cpu_s_per_step": med([s.cpu_s for s in m]),
            "io_cpu_s_per_step": med([s.io_cpu_s for s in m]),
            "bytes_written_per_step": written,
            # what the placements sent to the drives, whether or not the drive finished it in
            # the step (written, cancelled, or completing in a later one): fixed by the plan
            "bytes_queued_per_step": med([sum(lc.offloaded_bytes for lc in s.layers.values()) for s in m]),
            "bytes_read_per_step": med([s.bytes_reloaded for s in m]),
            "bytes_forwarded_per_step": med([s.bytes_forwarded for s in m]),
            "bytes_write_cancelled_per_step": med([s.bytes_write_cancelled for s in m]),
            "write_bytes_per_s": med([s.write_bytes_per_s for s in m if s.write_bytes_per_s]),
            "read_bytes_per_s": med([s.read_bytes_per_s for s in m if s.read_bytes_per_s]),
            "stall_s_per_step": med([s.stall_s for s in m]),
            "write_wait_s_per_step": med([s.backpressure_wait_s for s in m]),
            "write_fallbacks": sum(s.write_fallbacks for s in self.steps),
            "peak_ssd_bytes": max(s.peak_ssd_bytes for s in m),
            "bytes_to_host_per_step": med([s.bytes_to_host for s in m]),
            "peak_host_bytes": max(s.peak_host_bytes for s in m),
            "tier_bytes_per_step": {name: med([s.tier_bytes.get(name, {}).get("moved", 0) for s in m])
                                    for name in sorted({n for s in m for n in s.tier_bytes})},
            "ssd_bytes_written_per_day": written / step_s * 86400 if step_s else 0.0,
            "final_loss": self.losses[-1] if self.losses else None,
            "losses": list(self.losses),
            "paired": self.paired,
            **self.memory,
        }
