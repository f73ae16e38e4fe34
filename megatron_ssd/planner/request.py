"""What a plan is asked for: :class:`PlanRequest`, checked once when it is made.

:func:`~megatron_ssd.planner.plan.make_plan` takes one; the :class:`~megatron_ssd.planner.plan.Plan`
it returns keeps it (its JSON form writes the request's fields at the top level, as
plans always did)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Optional

from ..config import Bytes, Integer, NonNegative, Number, validate
from ..config.plan_settings import (READ_AHEAD_MODES, SEARCHES, AllowRecompute, CapacityBytes, MaxSlowdown,
                                    MemoryBudget, ReadAhead, ReadAheadMode, SafetyMargin, Search)

__all__ = ["READ_AHEAD_MODES", "SEARCHES", "PlanRequest"]


@dataclass(frozen=True)
class PlanRequest:
    """The goal a plan is chosen for, the bounds it must keep and how its reads are
    issued. Each field is checked when the request is made, by the rules the config and
    ``simulate`` check the same setting by (``config/plan_settings.py``); a bad one is one
    :class:`~megatron_ssd.errors.ConfigError` naming it, its value and the rule."""

    memory_budget: MemoryBudget = None
    """Bytes of saved activations the stage may hold at its peak (goal ``memory_budget``);
    None: offload what hides behind compute (goal ``max_offload``)."""
    safety_margin: SafetyMargin = 0.1
    """Fraction in [0, 1) the bandwidths are derated by while choosing placements (the
    compute slowdowns divided by ``1 - safety_margin``: ``IOProfile.derated``)."""
    default_read_ahead: ReadAhead = 1
    """Layers ahead that reads are issued by default (>= 1; each layer's own is its
    ``read_ahead``)."""
    read_ahead_mode: ReadAheadMode = "fixed"
    """``fixed``: every read is issued ``default_read_ahead`` layers ahead; ``auto``: the
    read-issue point of each offloaded layer is chosen too, just in time (NOTE
    [Just-in-time reads] in ``just_in_time.py``)."""
    allow_recompute: AllowRecompute = True
    """Whether RECOMPUTE may be used to meet a budget."""
    max_write_bytes_per_s: Optional[Annotated[float, Number(NonNegative())]] = None
    """The write rate the drives' endurance allows this process
    (:func:`~megatron_ssd.planner.wear.write_limit_bytes_per_s`, NOTE [Wear model]): no
    placement whose offloaded bytes per predicted step exceed it is chosen, under either
    goal. None: no limit."""
    capacity_bytes: CapacityBytes = None
    """Saved-activation bytes the device can hold at most: a hard limit under either goal.
    Without a budget, when the hidden offload's predicted peak exceeds it, the plan meets
    it as a budget instead (goal ``capacity``); a budget above it is lowered to it. None:
    no limit."""
    host_budget_bytes: Optional[Annotated[int, Bytes, Integer(NonNegative())]] = None
    """Bytes of the host pool the stage may fill with HOST layers, over all its
    micro-batches in flight (NOTE [Host tier]); needs the stage's
    ``IOProfile.host_bytes_per_s``. None (0 is read as None): no HOST placement."""
    max_slowdown: MaxSlowdown = None
    """Under the ``max_offload`` goal, the most the predicted step may exceed
    keep-everything's, as a fraction (0.05: 5% longer; NOTE [Slowdown bound] in
    ``search.py``). None: no bound."""

    search: Search = "full"
    """``full``: the greedy start, the local search and the branch and bound; ``greedy``:
    the greedy start alone (NOTE [Search] in ``search.py``)."""

    def __post_init__(self) -> None:
        validate(self)  # each field's rules, on its annotation (config/plan_settings.py)
        if self.host_budget_bytes == 0:
            object.__setattr__(self, "host_budget_bytes", None)
