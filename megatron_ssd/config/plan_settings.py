"""The planner's settings, each declared once.

A planner setting reaches :func:`~megatron_ssd.planner.plan.make_plan` from three places:
the config (``offload.planner.*`` and ``offload.default_read_ahead``), ``simulate``'s keys
(:class:`~megatron_ssd.planner.simulation_spec.SimulationSpec`) and the API's
:class:`~megatron_ssd.planner.request.PlanRequest`. Each annotates its field with the alias
here, so the three take the same values and refuse the others with the same one-line
rule (``Class.field = value: rule``). Their defaults stay their own: the config's are a
training run's, the API's those of a plan asked for by hand.
"""

from __future__ import annotations

from typing import Annotated, Optional

from .rules import AtLeast, AtMost, Boolean, Bytes, InRange, Integer, NonNegative, Number, OneOf, Positive

__all__ = ["MAX_LAYERS", "READ_AHEAD_MODES", "SEARCHES", "AllowRecompute", "CapacityBytes", "MaxSlowdown",
           "MemoryBudget", "ReadAhead", "ReadAheadMode", "SafetyMargin", "Search"]

MAX_LAYERS = 10_000
"""The most layers a count of layers kept, read ahead or offloaded by a peer takes (NOTE
[Bounded numbers] in ``rules.py``; the model's own size is bounded by the machine, NOTE
[Bounds from the machine] in ``tree.py``)."""

READ_AHEAD_MODES = ("auto", "fixed")
"""How reads are issued: each offloaded layer's just in time, chosen by the planner (NOTE
[Just-in-time reads] in ``planner/just_in_time.py``), or ``default_read_ahead`` layers
ahead for every layer."""

SEARCHES = ("full", "greedy")
"""The whole search, or its greedy start alone (NOTE [Search] in ``planner/search.py``)."""

MemoryBudget = Optional[Annotated[int, Bytes, Integer(Positive())]]
"""Peak saved-activation bytes a stage may hold (goal ``memory_budget``); sizes such as
``2GiB`` are accepted; None: offload what hides behind compute (goal ``max_offload``)."""

CapacityBytes = Optional[Annotated[int, Bytes, Integer(Positive())]]
"""Saved-activation bytes the device holds at most, a hard limit under either goal; None:
no limit."""

SafetyMargin = Annotated[float, Number(InRange(0, 1, hi_open=True))]
"""Fraction the measured bandwidths are derated by while planning, and the measured
compute slowdowns inflated by (divided by ``1 - margin``), in [0, 1)."""

ReadAhead = Annotated[int, Integer(AtLeast(1)), AtMost(MAX_LAYERS)]
"""Layers ahead of the running backward layer that a moved layer's read is issued, where
the plan sets none of its own (a plan's per-site read-aheads may be 0: NOTE [Write and
read issue points] in ``planner/step_timeline.py``)."""

ReadAheadMode = Annotated[str, OneOf(*READ_AHEAD_MODES)]
"""One of :data:`READ_AHEAD_MODES`."""

Search = Annotated[str, OneOf(*SEARCHES)]
"""One of :data:`SEARCHES`."""

MaxSlowdown = Optional[Annotated[float, Number(NonNegative()), AtMost(1000.0)]]
"""Without a budget, the most the predicted step may exceed keep-everything's, as a
fraction (0.05: 5% longer); None: no bound."""

AllowRecompute = Annotated[bool, Boolean()]
"""Whether RECOMPUTE (of a whole layer or of modules inside it) may meet a limit."""
