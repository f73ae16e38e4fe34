"""The placement search behind :func:`~megatron_ssd.planner.plan.make_plan`.

:class:`PlacementSearch` holds the rules a plan must keep and judges placements with the
timeline model (:func:`~megatron_ssd.planner.step_timeline.predict`): with the bandwidths
derated by the safety margin to choose, and with the measured ones to check. It searches
each layer's whole choice set (NOTE [Choice set] in ``choices.py``: KEEP, each tier with
each prefix of the sites, RECOMPUTE, modules recomputed inside the layer with KEEP or a
tier) for one of two goals:

- :meth:`PlacementSearch.meet_budget`: the shortest predicted step whose peak fits the
  budget, then the fewest bytes written to the drives, then the fewest moved;
- :meth:`PlacementSearch.max_offload`: the lowest predicted peak whose copies and I/O the
  model hides completely, within ``max_slowdown`` (NOTE [Slowdown bound]), then the fewest
  bytes written, then the fewest moved.

How (NOTE [Search]): a local search over single-layer changes and two-layer exchanges from
several starting plans (:mod:`~megatron_ssd.planner.local_search`), then a branch and bound
over every plan from the best it found, pruned by bounds that need no replay (NOTE [Bounds
before a replay] in ``choices.py``), within a replay budget. Where the branch and bound
ends within its budget the plan is the model's optimum and the search says so
(``PlacementSearch.proven``).

What it guarantees, as measured (``benchmarks/planner_gap.py``, docs/planner.md, "How the
search is checked"): see docs/planner.md; the tests check it against the exhaustive oracle
of ``megatron_ssd_lab/planner_oracle.py``.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator, Optional

from ..errors import MegatronSSDError
from ..placement import LayerChoice, Placement
from .choices import layer_options
from .greedy import Greedy
from .judge import Choices, Judge, replaced, replay
from .local_search import LocalSearch, Trial
from .profile import StageProfile
from .step_timeline import predict
from ..units import GiB

__all__ = ["Choices", "PlanInfeasibleError", "PlacementSearch", "replaced", "replay", "GOAL_MAX_OFFLOAD",
           "GOAL_MEMORY_BUDGET", "GOAL_CAPACITY", "SEARCH_WORK"]

GOAL_MAX_OFFLOAD = "max_offload"
"""Goal without a budget: offload every byte whose I/O hides behind compute."""
GOAL_MEMORY_BUDGET = "memory_budget"
"""Goal with a budget: peak <= budget at the smallest predicted step time."""
GOAL_CAPACITY = "capacity"
"""Goal without a budget whose hidden offload does not fit the device: peak <= the
device's activation capacity at the smallest predicted step time."""

SEARCH_WORK = 100_000
"""The work the descent and the branch and bound may spend per search, in layers and sites
walked by their replays (a replay walks each layer and site once), a branch and bound node
counted as 2: about 3.5 s on one core here at 8 layers of 9 sites, three quarters of it in
the nodes' bounds, about 1 s at 32 (NOTE [Search], docs/planner.md)."""

_KEEP = LayerChoice(Placement.KEEP)


# NOTE [Collector paused]
# A search allocates a Timeline per replay, thousands of them, and the Judge remembers up
# to 4,096 (NOTE [Replays remembered] in ``judge.py``): Python's cyclic collector then
# runs often and walks them all each time, though a replay makes no reference cycle
# (refcounting frees what a search drops; after a 32-layer search the collector found 86
# objects in cycles, the branch and bound's recursive closures). On the H200 check's
# layer it was a quarter of each replay at 128 layers (2.65 ms without it, 3.46 ms with
# it), and pausing it took the search from 0.97 to 0.62 s at 32 layers and from 8.30 to
# 5.99 s at 128 (the same plans): the collector is paused for the search and restored as
# it was after it, exceptions included. What the search object holds is freed by the
# first collection after it, as before.


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off within, as it was after (NOTE [Collector
    paused])."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class PlanInfeasibleError(MegatronSSDError):
    """No placement brings the predicted peak under the memory budget.

    Attributes:
        memory_budget: The budget asked for, in bytes.
        smallest_peak: The smallest predicted peak any placement reached, in bytes.
    """

    def __init__(
        self, memory_budget: int, smallest_peak: int, stage: StageProfile, keep_peak: int,
        max_write_bytes_per_s: Optional[float] = None, limit_name: str = "memory_budget", drives: bool = True,
    ) -> None:
        self.memory_budget = memory_budget
        self.smallest_peak = smallest_peak
        wear = (
            f" within the drive-wear write limit of {max_write_bytes_per_s / 1e6:.1f} MB/s"
            if max_write_bytes_per_s is not None else ""
        )
        if not drives:  # NOTE [Unmeasured drives] in profile.py
            wear += (" without the drives (their bandwidth was not measured: no profiling step moved a byte to "
                     "them; lower offload.keep_last_layers below the layer count)")
        super().__init__(
            f"{limit_name} = {memory_budget} bytes ({memory_budget / GiB:.2f} GiB) cannot be met{wear} on "
            f"pipeline stage {stage.pipeline_rank} of {stage.pipeline_size} "
            f"({stage.microbatches_in_flight} micro-batches in flight): the smallest reachable predicted "
            f"peak is {smallest_peak} bytes ({smallest_peak / GiB:.2f} GiB; keeping everything needs "
            f"{keep_peak / GiB:.2f} GiB). Raise the budget, allow recompute, or lower the micro-batch size."
        )


class PlacementSearch(Judge):
    """The search for a plan under one stage's rules (see the module docstring)."""

    def __init__(self, *args, greedy_only: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.greedy_only = greedy_only
        """Return the greedy start's plan, searching no further (``PlanRequest.search =
        "greedy"``)."""
        self.proven: Optional[bool] = None
        """After a search: whether its branch and bound ended within its budget, so its plan
        is the model's optimum (and an infeasible budget is infeasible by proof)."""
        self.replays = 0  # after a search: every replay it made, the greedy start's included

    # NOTE [Search]
    # Both goals run one search (docs/planner.md, "Goals"):
    # 1. the greedy start (``greedy.py``): under a budget, single-layer moves by peak removed
    #    per second added and a clean-up, with ties to the host tier and with ties to the
    #    SSDs, the better plan kept (one order alone, with the descent's exchanges to cover
    #    the other, was 2x faster at 32 layers but ended 0.7% slower than the greedy plan
    #    on the H200 check's 8-layer stage: the search must never be slower than its start;
    #    beyond 8 layers the search ended at the same plans with one order, NOTE [Tier
    #    preference] in ``greedy.py``, so only up to 8 layers does the second run);
    #    under ``max_offload``, first fit in forward order;
    # 2. a descent (NOTE [Local search] in ``local_search.py``) by single changes from each
    #    starting plan: the greedy one; under a budget also the plan holding the fewest bytes
    #    per layer without moving any (recomputed whole or in part: no I/O whose timing it
    #    depends on, so it fits exactly where its bound says) and the plan holding the
    #    fewest bytes at all; under ``max_offload``, keep-everything. Then, from each end,
    #    best first, range moves, pairs and exchanges with single changes between;
    # 3. a branch and bound over the layers in forward order from the best plan found,
    #    each branch cut where its bounds (NOTE [Bounds before a replay], NOTE [Drain and
    #    read floors] in ``choices.py``) say no plan below it fits or beats the held one.
    #    Where it ends, the plan is the model's optimum (``proven``), and a budget no plan
    #    meets is infeasible by proof.
    # Steps 2 and 3 share a budget of work (replays, counted in the layers and sites they
    # walk): ``SEARCH_WORK``, half of it for the descent; where it runs out, the best plan
    # replayed so far is the plan. So the search costs the greedy one plus one to
    # four seconds, and is never slower than the greedy plan, which it holds from the start. (The
    # budget was once the greater of that and half what the greedy start spent: at 32 and
    # 128 layers of the H200 check's layer the extra work found no better plan and more
    # than doubled the search's time, benchmarks/results/planner-gap.json.) On 200
    # seeded 5-layer stages the greedy search alone reached the model's optimum in 65% of cases and called 2.3% of
    # feasible budgets infeasible (docs/planner.md, "How the search is checked", for what
    # this search reaches). ``PlanRequest.search = "greedy"`` keeps step 1 alone.

    def _search(self, budget: Optional[int], allow_recompute: bool) -> Trial:
        with collector_paused():  # NOTE [Collector paused]
            return self._searched(budget, allow_recompute)

    def _searched(self, budget: Optional[int], allow_recompute: bool) -> Trial:
        tiers = self.tiers
        options = [layer_options(layer, tiers, allow_recompute and budget is not None) for layer in self.stage.layers]
        local = LocalSearch(self, options, budget)
        greedy = Greedy(self.stage, self.derated, self.read_ahead, self.max_write_bytes_per_s, self.host_budget_bytes,
                        self.max_slowdown)
        built = None
        if budget is None:
            starts = [local.index_of(greedy.first_fit()), (0,) * self.n]
        else:
            built = greedy.fit_budget(budget, allow_recompute)
            starts = ([local.index_of(built)] if built is not None else []) + [local.still_plan(), local.floor_plan()]
        local.work_left = SEARCH_WORK  # NOTE [Search]
        if self.greedy_only:  # the greedy start's plan; where it found none, none (the search before this one)
            local.work_left = float("inf")
            best, self.proven = local.trial(starts[0] if budget is None or built is not None
                                            else local.floor_plan()), False
            if budget is not None and built is None:
                best = Trial(best.index, (1,) + best.key[1:], best.timeline)  # not feasible: no plan
        else:
            best, self.proven = local.bound(local.best(starts))
        self.replays = local.replays + greedy.replays
        peaks = [p for p in (greedy.smallest_peak, local.smallest_peak) if p is not None]
        self.smallest_peak = min(peaks) if peaks else None
        self._local = local
        return best

    def max_offload(self) -> Choices:
        """The plan with the lowest predicted peak whose copies and I/O the model hides
        completely (within ``max_slowdown``, NOTE [Slowdown bound]), then the fewest bytes
        written to the drives, then the fewest moved (NOTE [Search])."""
        best = self._search(None, False)
        return self._local.choices(best.index) if best.key[0] == 0 else [_KEEP] * self.n

    def meet_budget(self, budget: int, allow_recompute: bool, limit_name: str = "memory_budget") -> Choices:
        """The plan with the shortest predicted step whose peak fits ``budget`` at the
        derated and at the measured bandwidths, within the other rules (NOTE [Search]).

        Raises:
            PlanInfeasibleError: no plan the search reached meets ``budget``.
        """
        best = self._search(budget, allow_recompute)
        if best.key[0] != 0:
            keep_peak = predict(self.stage, [Placement.KEEP] * self.n).peak_bytes
            raise PlanInfeasibleError(budget, int(self.smallest_peak or keep_peak), self.stage, keep_peak,
                                      self.max_write_bytes_per_s, limit_name, drives=self.drives)
        return self._local.choices(best.index)
