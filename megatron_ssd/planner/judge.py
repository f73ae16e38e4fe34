"""The rules a plan keeps, and the replays that judge it.

:class:`Judge` holds what every search of a stage is held to (the derated and measured
bandwidths, the read-ahead, the drive-wear bound, the host pool, the slowdown bound) and
judges a placement with the timeline model
(:func:`~megatron_ssd.planner.step_timeline.predict`): with the bandwidths derated by the
safety margin to choose, and with the measured ones to check. The searches
(:mod:`~megatron_ssd.planner.search`, :mod:`~megatron_ssd.planner.greedy`,
:mod:`~megatron_ssd.planner.local_search`) share it, so they keep one set of rules.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from ..placement import LayerChoice, Placement
from ..tier import TIERS, added
from .module_recompute import recomputed_layer, with_recompute
from .profile import IOProfile, LayerProfile, StageProfile
from .step_timeline import Timeline, predict

__all__ = ["Choices", "Judge", "replaced", "replay"]

Choices = List[LayerChoice]
"""What a search works on and chooses: one choice per layer in forward order."""


def replay(stage: StageProfile, choices: Sequence[LayerChoice], read_ahead: Optional[int] = None,
           io: Optional[IOProfile] = None) -> Timeline:
    """:func:`~megatron_ssd.planner.step_timeline.predict` of ``choices`` (their
    placements, site counts and modules recomputed inside a layer, NOTE [Recompute inside
    a layer] in ``module_recompute.py``) at ``read_ahead``; None: each choice's own."""
    return predict(with_recompute(stage, choices), _at_read_ahead(choices, read_ahead), io=io)


def _at_read_ahead(choices: Sequence[LayerChoice], read_ahead: Optional[int]) -> Sequence[LayerChoice]:
    """``choices`` each at ``read_ahead``; None: each choice's own."""
    if read_ahead is None:
        return choices
    return [dataclasses.replace(c, read_ahead=read_ahead) for c in choices]


def replaced(values: List, i: int, value) -> List:
    """A copy of ``values`` with entry ``i`` replaced."""
    return values[:i] + [value] + values[i + 1 :]


class Judge:
    """The rules of one stage's search and its replays (see the module docstring)."""

    def __init__(
        self, stage: StageProfile, derated: IOProfile, read_ahead: int, max_write_bytes_per_s: Optional[float] = None,
        host_budget_bytes: int = 0, max_slowdown: Optional[float] = None,
    ) -> None:
        self.stage = stage
        self.derated = derated
        self.read_ahead = read_ahead
        self.max_write_bytes_per_s = max_write_bytes_per_s
        self.max_slowdown = max_slowdown
        """How much longer than keep-everything's the predicted step may be under
        :meth:`max_offload` (NOTE [Slowdown bound]); None: no bound."""
        self.host_budget_bytes = host_budget_bytes if stage.io.host_bytes_per_s is not None else 0
        """Bytes the host pool may hold for this stage (0: no HOST placement)."""
        self.tier_budgets: Dict[Placement, int] = {Placement.HOST: self.host_budget_bytes}
        """Per tier with a byte bound, the bytes it may hold for the stage's micro-batches
        in flight: the host pool's, and each other tier's ``TierRates.budget_bytes``."""
        for name, rates in stage.io.tiers.items():
            if name in TIERS and rates.budget_bytes is not None:
                self.tier_budgets[Placement(name)] = rates.budget_bytes
        self.extra_tiers = [p for p in added() if stage.io.rates(p) is not None and self.tier_budgets.get(p) != 0]
        """The tiers registered after the host pool and the SSDs that the profile has rates
        for (and a budget above 0, where one is set)."""
        self.tiers = ([Placement.HOST] if self.host_budget_bytes else []) + (
            [Placement.OFFLOAD] if stage.io.drives_measured else []) + self.extra_tiers
        """The tiers a plan may use, in the search's order (NOTE [Tiers] in
        ``megatron_ssd/tier.py``): the host pool with a budget, the SSDs once measured,
        then :attr:`extra_tiers`."""
        self.drives = stage.io.drives_measured
        """Whether OFFLOAD may be chosen: only with the drives' bandwidths measured (NOTE
        [Unmeasured drives] in ``profile.py``)."""
        self.n = len(stage.layers)
        self.replays = 0
        """Replays :meth:`judge` and :meth:`check` made (a placement judged again is not
        replayed again: NOTE [Replays remembered])."""
        self._judged: Dict[Tuple[LayerChoice, ...], Timeline] = {}
        self._checked: Dict[Tuple[LayerChoice, ...], Timeline] = {}
        self._derived: Dict[Tuple[int, Tuple[str, ...]], LayerProfile] = {}
        self.smallest_peak: Optional[int] = None
        # See wears_ok and within_bound: no placement's step is shorter than keeping everything.
        self._shortest_step_s = predict(stage, [Placement.KEEP] * self.n).step_s

    def wears_ok(self, choices: Sequence[LayerChoice]) -> bool:
        """The offloaded bytes per micro-batch stay within ``max_write_bytes_per_s``
        (NOTE [Wear model]) over keep-everything's step time at the measured bandwidths:
        offload and recompute only lengthen a step, so the bound holds for the plan's
        own step time whatever bandwidth judged it. Always true without a limit."""
        if self.max_write_bytes_per_s is None:
            return True
        written = sum(self.layer_at(i, c).moved_bytes(c.sites) for i, c in enumerate(choices)
                      if c.placement is Placement.OFFLOAD)
        return written <= self.written_limit()

    def written_limit(self) -> float:
        """The most bytes a plan may write to the drives per micro-batch
        (:meth:`wears_ok`); inf without a limit."""
        if self.max_write_bytes_per_s is None:
            return float("inf")
        return self.max_write_bytes_per_s * self._shortest_step_s * (1 + 1e-9)

    def hosts_ok(self, tl: Timeline) -> bool:
        """The host pool, and every other tier with a byte bound, holds what ``tl`` moves
        to it for every micro-batch in flight (NOTE [Host tier])."""
        m = self.stage.microbatches_in_flight or 1
        return all(tl.moved_to(p) * m <= budget for p, budget in self.tier_budgets.items())

    def allowed(self, choices: Sequence[LayerChoice], tl: Timeline) -> bool:
        """Within the drive-wear limit and the host pool, and nothing forwarded."""
        return not tl.forwarded and self.wears_ok(choices) and self.hosts_ok(tl)

    # NOTE [Replays remembered]
    # The greedy start judges the same placement again and again (each round re-scores
    # every layer's move from a plan that changed in one layer): on a 16-layer stage 6,171
    # judgements were 2,117 placements. A replay is a pure function of the choices (the
    # stage, bandwidths and read-ahead are fixed per Judge; a choice's ``recompute``
    # derives its layer, NOTE [Recompute inside a layer]), and no caller changes a
    # Timeline, so each is replayed once and its Timeline handed out again. Each derived
    # layer is made once too (:meth:`layer_at`). Up to ``_REMEMBERED`` per kind; past
    # that the memory starts over (a 128-layer Timeline is tens of KB). ``replays`` counts
    # the replays made, which the search's work budget reads.

    _REMEMBERED = 4096

    def layer_at(self, i: int, choice: LayerChoice) -> LayerProfile:
        """Layer ``i`` as ``choice`` sees it: the measured layer with the modules its
        ``recompute`` names recomputed inside it (:func:`recomputed_layer`), made once."""
        if not choice.recompute:
            return self.stage.layers[i]
        key = (i, choice.recompute)
        layer = self._derived.get(key)
        if layer is None:
            layer = self._derived[key] = recomputed_layer(self.stage.layers[i], choice.recompute)
        return layer

    def _remembered(self, memory: Dict[Tuple[LayerChoice, ...], Timeline], choices: Sequence[LayerChoice],
                    io: Optional[IOProfile]) -> Tuple[Timeline, bool]:
        key = tuple(choices)
        tl = memory.get(key)
        if tl is not None:
            return tl, False
        if len(memory) >= self._REMEMBERED:
            self._judged.clear()
            self._checked.clear()
        self.replays += 1
        layers = [self.layer_at(i, c) for i, c in enumerate(choices)]
        tl = memory[key] = predict(self.stage, _at_read_ahead(choices, self.read_ahead), io=io, layers=layers)
        return tl, True

    def judge(self, choices: Sequence[LayerChoice]) -> Timeline:
        """Replay with derated bandwidths (once per placement: NOTE [Replays remembered]);
        remembers the smallest peak seen."""
        tl, new = self._remembered(self._judged, choices, self.derated)
        if new and self.allowed(choices, tl) and (
            self.smallest_peak is None or tl.peak_bytes < self.smallest_peak
        ):
            self.smallest_peak = tl.peak_bytes
        return tl

    def check(self, choices: Sequence[LayerChoice]) -> Timeline:
        """Replay with the measured bandwidths (once per placement)."""
        return self._remembered(self._checked, choices, None)[0]

    @staticmethod
    def hidden(tl: Timeline) -> bool:
        """No stall (beyond float noise): backward waits for no read and no forward waits
        for the in-flight bound (NOTE [In-flight bound] in ``step_timeline.py``); and no
        forwarded layer."""
        return not tl.forwarded and tl.exposed_s + tl.write_wait_s <= 1e-9 * tl.compute_s + 1e-12

    # NOTE [Slowdown bound]
    # "Hidden" I/O never stalls backward, but on a machine where the I/O engine shares
    # the cores with compute (a CPU run) it still slows compute while it is in flight
    # (``IOProfile.compute_slowdown``), by tens of percent on two cores without a single
    # stall (measured: docs/performance.md#run-2026-11-24-slowdown). So the hidden
    # offload is also held to a predicted step at most ``1 + max_slowdown`` times
    # keep-everything's, at the derated and at the measured bandwidths. On a GPU the
    # measured slowdown is near
    # 0 and the bound never binds. It applies to the ``max_offload`` goal only: a
    # memory budget or the device's capacity is met whatever it costs.

    def within_bound(self, tl: Timeline) -> bool:
        """Hidden (:meth:`hidden`) and, with ``max_slowdown``, a predicted step within it
        of keep-everything's (NOTE [Slowdown bound])."""
        if not self.hidden(tl):
            return False
        return self.max_slowdown is None or tl.step_s <= self._shortest_step_s * (1 + self.max_slowdown) + 1e-12

    def fits(self, choices: Sequence[LayerChoice], tl: Timeline, budget: int) -> bool:
        """Peak within budget at derated (``tl``) and at measured bandwidths."""
        return tl.peak_bytes <= budget and self.check(choices).peak_bytes <= budget
