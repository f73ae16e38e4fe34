"""What a plan is asked for: :class:`PlanRequest`, checked once when it is made.

:func:`~megatron_ssd.planner.plan.make_plan` takes one; the :class:`~megatron_ssd.planner.plan.Plan`
it returns keeps it (its JSON form writes the request's fields at the top level, as
plans always did)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Optional

from ..errors import ConfigError

__all__ = ["READ_AHEAD_MODES", "SEARCHES", "PlanRequest"]

READ_AHEAD_MODES = ("fixed", "auto")
"""``PlanRequest.read_ahead_mode``: one read-ahead for every layer, or each layer's chosen."""
SEARCHES = ("full", "greedy")
"""``PlanRequest.search``: the whole search, or its greedy start alone (NOTE [Search] in
``search.py``)."""


def _bytes_or_none(name: str, value: Any) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ConfigError(f"{name} = {value!r}: must be None or an integer number of bytes >= 0")
    return int(value)


def _number_or_none(name: str, value: Any) -> Optional[float]:
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0):
        raise ConfigError(f"{name} = {value!r}: must be None or a number >= 0")
    return value


@dataclass(frozen=True)
class PlanRequest:
    """The goal a plan is chosen for, the bounds it must keep and how its reads are
    issued. Each field is checked when the request is made; a bad one is one
    :class:`~megatron_ssd.errors.ConfigError` naming it, its value and the rule."""

    memory_budget: Optional[int] = None
    """Bytes of saved activations the stage may hold at its peak (goal ``memory_budget``);
    None: offload what hides behind compute (goal ``max_offload``)."""
    safety_margin: float = 0.1
    """Fraction in [0, 1) the bandwidths are derated by while choosing placements (the
    compute slowdowns divided by ``1 - safety_margin``: ``IOProfile.derated``)."""
    default_read_ahead: int = 1
    """Layers ahead that reads are issued by default (>= 1; each layer's own is its
    ``read_ahead``)."""
    read_ahead_mode: str = "fixed"
    """``fixed``: every read is issued ``default_read_ahead`` layers ahead; ``auto``: the
    read-issue point of each offloaded layer is chosen too, just in time (NOTE
    [Just-in-time reads] in ``just_in_time.py``)."""
    allow_recompute: bool = True
    """Whether RECOMPUTE may be used to meet a budget."""
    max_write_bytes_per_s: Optional[float] = None
    """The write rate the drives' endurance allows this process
    (:func:`~megatron_ssd.planner.wear.write_limit_bytes_per_s`, NOTE [Wear model]): no
    placement whose offloaded bytes per predicted step exceed it is chosen, under either
    goal. None: no limit."""
    capacity_bytes: Optional[int] = None
    """Saved-activation bytes the device can hold at most: a hard limit under either goal.
    Without a budget, when the hidden offload's predicted peak exceeds it, the plan meets
    it as a budget instead (goal ``capacity``); a budget above it is lowered to it. None:
    no limit."""
    host_budget_bytes: Optional[int] = None
    """Bytes of the host pool the stage may fill with HOST layers, over all its
    micro-batches in flight (NOTE [Host tier]); needs the stage's
    ``IOProfile.host_bytes_per_s``. None (0 is read as None): no HOST placement."""
    max_slowdown: Optional[float] = None
    """Under the ``max_offload`` goal, the most the predicted step may exceed
    keep-everything's, as a fraction (0.05: 5% longer; NOTE [Slowdown bound] in
    ``search.py``). None: no bound."""

    search: str = "full"
    """``full``: the greedy start, the local search and the branch and bound; ``greedy``:
    the greedy start alone (NOTE [Search] in ``search.py``)."""

    def __post_init__(self) -> None:
        checked = {
            "memory_budget": _bytes_or_none("memory_budget", self.memory_budget),
            "capacity_bytes": _bytes_or_none("capacity_bytes", self.capacity_bytes),
            "host_budget_bytes": _bytes_or_none("host_budget_bytes", self.host_budget_bytes) or None,
            "max_write_bytes_per_s": _number_or_none("max_write_bytes_per_s", self.max_write_bytes_per_s),
            "max_slowdown": _number_or_none("max_slowdown", self.max_slowdown),
        }
        margin = self.safety_margin
        if isinstance(margin, bool) or not isinstance(margin, numbers.Real) or not 0 <= margin < 1:
            raise ConfigError(f"safety_margin = {margin!r}: must be a number in [0, 1)")
        ahead = self.default_read_ahead
        if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 1:
            raise ConfigError(f"default_read_ahead = {ahead!r}: must be an integer >= 1")
        if self.search not in SEARCHES:
            raise ConfigError(f"search = {self.search!r}: must be one of {list(SEARCHES)}")
        if self.read_ahead_mode not in READ_AHEAD_MODES:
            raise ConfigError(f"read_ahead_mode = {self.read_ahead_mode!r}: must be one of {list(READ_AHEAD_MODES)}")
        if not isinstance(self.allow_recompute, bool):
            raise ConfigError(f"allow_recompute = {self.allow_recompute!r}: must be true or false")
        for name, value in checked.items():
            object.__setattr__(self, name, value)
