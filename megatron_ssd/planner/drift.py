"""Decide when measured steps have moved far enough from a plan's profile to re-plan.

The runtime feeds :class:`DriftDetector` one observation per training step: the
achieved write and read bandwidth and each layer's forward and backward time. It keeps
the last ``window`` observations and compares their medians with what the plan
expected; the median ignores a single slow step (a checkpoint save, a GC pause) while a
sustained change shows after ``window`` steps. When a quantity moved by more than
``threshold`` (relative), the decision says re-plan and carries the profile to plan
from::

    detector = DriftDetector()
    detector.rebase(stage, plan)
    for step in training:
        ...
        decision = detector.observe(write_bw, read_bw, forward_s, backward_s)
        if decision.replan:
            plan = make_plan(decision.profile)
            detector.rebase(decision.profile, plan)

It also counts "fell behind" events: the engine found its write queue full and kept a
tensor in memory instead of queueing it. One such event in each of ``window`` steps in a
row means the array delivers less than the plan assumed while the plan runs, so a
re-plan is due with the write bandwidth lowered by ``threshold``.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Mapping, Optional, Sequence, Union

from ..placement import OUTSIDE
from ..errors import ConfigError
from .measurement import StepMeasurement
from .plan import Plan
from .profile import LayerId, StageProfile
from ..units import MiB

__all__ = ["DriftDecision", "DriftDetector"]

Times = Union[Mapping[LayerId, float], Sequence[float]]
"""Per-layer seconds: a mapping by layer id, or a sequence in forward order."""


@dataclass
class DriftDecision:
    """What one observation concluded."""

    replan: bool
    """Whether re-planning is due."""
    reasons: List[str] = field(default_factory=list)
    """One line per quantity that moved (or the fell-behind streak)."""
    profile: Optional[StageProfile] = None
    """The profile re-planning should use: the baseline with the window's medians."""
    fell_behind: int = 0
    """Fell-behind events reported during the step just observed."""


@dataclass
class _Expected:
    """What the baseline expects a step to measure."""

    write_bw: Optional[float]
    read_bw: Optional[float]
    """None: the drives were not measured (NOTE [Unmeasured drives] in ``profile.py``)."""
    forward_s: Dict[LayerId, float]
    backward_s: Dict[LayerId, float]


def _with_unit(key: str, value: float) -> str:
    """A checked quantity with its unit: bandwidths in MiB/s, layer times in ms."""
    if key.endswith("_bw"):
        return f"{value / MiB:.1f} MiB/s"
    return f"{value * 1e3:.2f} ms"


# NOTE [Short I/O samples]
# A bandwidth measured over little busy time is a burst, not the sustained rate a plan
# depends on: a throttled disk lets a burst through at several times its limit, a drive's
# write cache absorbs one; a re-plan on such a sample writes more than the drives take
# and holds more than its budget (measured: docs/performance.md#run-2026-11-23-short-samples).
# So a step whose writes (or reads)
# kept the array busy for less than MIN_BUSY_FRACTION of its wall time gives no sample
# for that direction.
MIN_BUSY_FRACTION = 0.1


def _sustained(bandwidth: float, busy_s: float, wall_s: float) -> Optional[float]:
    """``bandwidth``, or None when it was measured over too little busy time."""
    if not wall_s:
        return bandwidth
    return bandwidth if busy_s >= MIN_BUSY_FRACTION * wall_s else None


# NOTE [Compute drift by stage]
# Compute drift is judged on the stage, not layer by layer: the forward times of all
# layers summed (and the backward times) against what the plan expects, with the
# threshold; a single layer only re-plans when it moves by LAYER_FACTOR times the
# threshold. Per-layer medians scatter where the stage's total does not: within one
# window some layers' medians move up and others down by more than the threshold, and a
# per-layer rule re-plans again and again, each time to another plan (measured:
# docs/performance.md#run-2026-11-23-layer-drift). A real change (a slower node, thermal throttling, another job on the GPU) moves the sum;
# a straggler layer (+50%) still shows by itself. The new profile takes every layer's
# measured median either way.
LAYER_FACTOR = 3.0


class DriftDetector:
    """Compare measured steps with the profile (and plan) in use.

    Args:
        threshold: Relative change of a window median, against the expected value,
            that makes re-planning due (0.15: 15%): of a bandwidth, or of the stage's
            summed forward or backward time; one layer's time needs ``LAYER_FACTOR``
            times as much (NOTE [Compute drift by stage]).
        window: Steps whose median is compared; also the fell-behind streak length.
    """

    def __init__(self, threshold: float = 0.15, window: int = 3) -> None:
        if not (isinstance(threshold, (int, float)) and not isinstance(threshold, bool) and 0 < threshold < 1):
            raise ConfigError(f"DriftDetector.threshold = {threshold!r}: must be a number in (0, 1)")
        if not (isinstance(window, int) and not isinstance(window, bool) and window >= 1):
            raise ConfigError(f"DriftDetector.window = {window!r}: must be an integer >= 1")
        self.threshold = float(threshold)
        self.window = window
        self.baseline: Optional[StageProfile] = None
        self._expected: Optional[_Expected] = None
        self._history: Dict[str, Deque[float]] = {}
        self._streak: Deque[int] = deque(maxlen=window)
        self._pending_fell_behind = 0
        self.fell_behind_total = 0
        """Fell-behind events reported since construction."""
        self.steps_observed = 0
        """Observations since the last :meth:`rebase`."""

    # ------------------------------------------------------------------ inputs

    def rebase(self, profile: StageProfile, plan: Optional[Plan] = None) -> None:
        """Start comparing against ``profile`` (and the step ``plan`` predicts).

        With a plan, the expected layer times are its predicted wall times, which include
        the slowdown from concurrent I/O and the recompute of RECOMPUTE layers; measured
        times then compare like with like. Without one, the profile's compute times are
        expected (right for a keep-everything run). History is cleared.
        """
        if plan is not None and len(plan.layers) != len(profile.layers):
            raise ConfigError(
                f"plan: has {len(plan.layers)} layers, profile has {len(profile.layers)}; must describe the same stage"
            )
        forward = {layer.layer_id: layer.forward_s for layer in profile.layers}
        backward = {layer.layer_id: layer.backward_s for layer in profile.layers}
        if plan is not None:
            forward = {lp.layer_id: lp.forward_s for lp in plan.layers}
            backward = {lp.layer_id: lp.backward_s for lp in plan.layers}
        self.baseline = profile
        self._expected = _Expected(profile.io.write_bytes_per_s, profile.io.read_bytes_per_s, forward, backward)
        self._history = {}
        self._streak.clear()
        self.steps_observed = 0

    def report_fell_behind(self, layer_id: Optional[LayerId] = None, nbytes: int = 0) -> None:
        """Count one event of the current step: a tensor kept because the write queue was full."""
        self._pending_fell_behind += 1
        self.fell_behind_total += 1

    def observe(
        self,
        write_bw: Optional[float] = None,
        read_bw: Optional[float] = None,
        forward_s: Optional[Times] = None,
        backward_s: Optional[Times] = None,
    ) -> DriftDecision:
        """Add one step's measurements and decide.

        Args:
            write_bw: Achieved write bandwidth (bytes written / time a write was in
                flight); ``None`` or 0 when the step wrote nothing.
            read_bw: Achieved read bandwidth, likewise.
            forward_s: Per-layer forward wall time of one micro-batch.
            backward_s: Per-layer backward wall time of one micro-batch, without time
                spent waiting for reads.

        Returns:
            The :class:`DriftDecision`; ``replan`` is False until ``window`` steps
            were seen.

        Raises:
            ConfigError: No baseline yet (call :meth:`rebase`) or a layer id is unknown.
        """
        if self.baseline is None or self._expected is None:
            raise ConfigError("DriftDetector.baseline = None: call rebase(profile, plan) before observe()")
        fell = self._pending_fell_behind
        self._pending_fell_behind = 0
        self._streak.append(fell)
        self.steps_observed += 1
        if write_bw:
            self._push("write_bw", write_bw)
        if read_bw:
            self._push("read_bw", read_bw)
        for kind, times in (("forward", forward_s), ("backward", backward_s)):
            for layer_id, seconds in self._by_id(kind, times).items():
                self._push(f"{kind}:{layer_id!r}", seconds)
        return self._decide(fell)

    def observe_step_stats(self, stats: StepMeasurement) -> DriftDecision:
        """Observe the tensor cache's measurement of one step.

        Reads ``write_bytes_per_s``, ``read_bytes_per_s``, ``backpressure_keeps`` and
        ``layers[id].forward_s / backward_s / microbatches`` (times summed over
        micro-batches, divided here, less ``write_wait_s`` / ``stall_s``; the
        ``embedding`` and ``head`` keys, tensors saved outside the layers, are skipped). Counts ``backpressure_keeps`` as fell-behind events.
        A direction busy for less than ``MIN_BUSY_FRACTION`` of the step (``write_busy_s``
        / ``read_busy_s`` against ``wall_s``) gives no bandwidth sample (NOTE [Short I/O
        samples]).
        """
        for _ in range(stats.backpressure_keeps):
            self.report_fell_behind()
        forward: Dict[LayerId, float] = {}
        backward: Dict[LayerId, float] = {}
        for layer_id, counters in stats.layers.items():
            if layer_id is None or layer_id in OUTSIDE:  # saved outside the layers: no compute time measured
                continue
            count = max(counters.microbatches, 1)
            # Compute only: time spent waiting for I/O is exposed I/O, not compute drift.
            forward[layer_id] = max(counters.forward_s - counters.write_wait_s, 0.0) / count
            backward[layer_id] = max(counters.backward_s - counters.stall_s, 0.0) / count
        write = _sustained(stats.write_bytes_per_s, stats.write_busy_s, stats.wall_s)
        read = _sustained(stats.read_bytes_per_s, stats.read_busy_s, stats.wall_s)
        return self.observe(write, read, forward or None, backward or None)

    # ------------------------------------------------------------------ internals

    def _push(self, key: str, value: float) -> None:
        self._history.setdefault(key, deque(maxlen=self.window)).append(float(value))

    def _by_id(self, kind: str, times: Optional[Times]) -> Dict[LayerId, float]:
        if times is None:
            return {}
        ids = self.baseline.layer_ids
        if isinstance(times, Mapping):
            unknown = [k for k in times if k not in ids]
            if unknown:
                raise ConfigError(f"{kind}_s: unknown layer ids {unknown}; the profile has {ids}")
            return dict(times)
        if len(times) != len(ids):
            raise ConfigError(f"{kind}_s: {len(times)} values for {len(ids)} layers; need one per layer")
        return dict(zip(ids, times))

    def _median(self, key: str) -> Optional[float]:
        values = self._history.get(key)
        if values is None or len(values) < self.window:
            return None
        return statistics.median(values)

    def _decide(self, fell: int) -> DriftDecision:
        exp = self._expected
        reasons: List[str] = []
        ratios: Dict[str, float] = {}
        medians: Dict[str, float] = {}
        checks = [("write_bw", exp.write_bw, self.threshold), ("read_bw", exp.read_bw, self.threshold)]
        layer_threshold = LAYER_FACTOR * self.threshold  # NOTE [Compute drift by stage]
        checks += [(f"forward:{k!r}", v, layer_threshold) for k, v in exp.forward_s.items()]
        checks += [(f"backward:{k!r}", v, layer_threshold) for k, v in exp.backward_s.items()]
        for key, expected, threshold in checks:
            median = self._median(key)
            if median is None or expected is None or expected <= 0:
                continue
            ratio = median / expected
            ratios[key], medians[key] = ratio, median
            if abs(ratio - 1.0) > threshold:
                reasons.append(f"{key}: median {_with_unit(key, median)} vs expected {_with_unit(key, expected)} "
                               f"({ratio - 1.0:+.1%})")
        for kind, expected_by_layer in (("forward", exp.forward_s), ("backward", exp.backward_s)):
            pairs = [(medians.get(f"{kind}:{k!r}"), v) for k, v in expected_by_layer.items() if v > 0]
            if not pairs or any(m is None for m, _ in pairs):
                continue
            measured, expected = sum(m for m, _ in pairs), sum(v for _, v in pairs)
            ratio = measured / expected
            if abs(ratio - 1.0) > self.threshold:
                reasons.append(f"{kind} of the stage: median {measured * 1e3:.2f} ms vs expected "
                               f"{expected * 1e3:.2f} ms ({ratio - 1.0:+.1%})")
        streak = len(self._streak) == self.window and all(self._streak)
        if streak:
            reasons.append(
                f"fell behind: the write queue was full in each of the last {self.window} steps "
                f"({sum(self._streak)} tensors kept)"
            )
        if not reasons:
            return DriftDecision(False, [], None, fell)
        return DriftDecision(True, reasons, self._updated_profile(ratios, streak), fell)

    def _updated_profile(self, ratios: Dict[str, float], fell_behind: bool) -> StageProfile:
        """The baseline with measured medians applied (ratios of measured to expected)."""
        base = self.baseline
        io = base.io
        if io.drives_measured:  # else nothing to scale (NOTE [Unmeasured drives] in profile.py)
            write = io.write_bytes_per_s * ratios.get("write_bw", 1.0)
            if fell_behind:
                write = min(write, io.write_bytes_per_s * (1.0 - self.threshold))
            io = dataclasses.replace(io, write_bytes_per_s=write,
                                     read_bytes_per_s=io.read_bytes_per_s * ratios.get("read_bw", 1.0))
        layers = []
        for layer in base.layers:
            f = ratios.get(f"forward:{layer.layer_id!r}", 1.0)
            b = ratios.get(f"backward:{layer.layer_id!r}", 1.0)
            recompute = None if layer.recompute_s is None else layer.recompute_s * b
            modules = None if layer.modules is None else [  # a module recomputed runs its forward again
                dataclasses.replace(m, forward_s=m.forward_s * f) for m in layer.modules]
            layers.append(
                dataclasses.replace(
                    layer, forward_s=layer.forward_s * f, backward_s=layer.backward_s * b, recompute_s=recompute,
                    modules=modules,
                )
            )
        return dataclasses.replace(base, layers=layers, io=io)
