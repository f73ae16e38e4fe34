"""Just-in-time reads: each offloaded layer's, then each site's, read issued as late as
it still arrives in time (``make_plan(stage, PlanRequest(read_ahead_mode="auto"))``).

:func:`just_in_time` plans placements at each read-ahead of a ladder, keeps the best, then
lowers each layer's and each site's read-ahead while the timeline model
(:func:`~megatron_ssd.planner.step_timeline.predict`) predicts no longer step, stall,
forwarding or higher peak; NOTE [Just-in-time reads] below says why and in what order.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional, Tuple

from .module_recompute import recomputed_layer
from .profile import StageProfile
from .search import GOAL_MAX_OFFLOAD, Choices, PlanInfeasibleError, replaced, replay
from .step_timeline import Timeline, use_order

__all__ = ["just_in_time"]


# NOTE [Just-in-time reads]
# With one read-ahead for every layer, a layer's read must fit in the backward of the
# read-ahead layers after it, which at GPU speed is far less than a large layer's read
# takes; with every read issued at the first backward, read buffers pile up early and
# the peak grows. ``read_ahead_mode="auto"`` chooses in three passes. (1) Placements are
# planned at each read-ahead of a geometric ladder (1, 2, 4, ... up to the layer count,
# and the configured default) by the greedy start of the search (where it finds no plan
# at any, by the whole search), and the best kept: the plan with the smallest predicted
# peak among those that hide all I/O, or with no such plan (a budget or the device's
# capacity binds), the one with the shortest predicted step, then the fewest bytes
# written (least drive wear), then the smallest peak; the whole search then plans at
# that read-ahead, its plan kept where it is better by the same order (one whole search,
# not one per rung: NOTE [Search time] in ``adaptive.py``). (2) Each offloaded layer's read is then issued as late as it can be
# (the smallest read-ahead, needed-first layer first) without a longer predicted step, a
# stall, forwarding or a higher peak, at the derated and at the measured bandwidths: a
# read buffer allocated later holds its bytes for less time. (3) Then each moved site of
# those layers, needed-first layer first and within a layer in the order backward uses
# them (NOTE [Site use times] in ``profile.py``), gets the smallest read-ahead below its
# layer's, down to 0 (issued when its own layer's backward starts), that passes the
# same test: a small site or one used late in its layer's backward need not be read as
# early as the layer's largest (``LayerPlan.site_read_ahead``). Under the max_offload
# goal, a layer the search cut to a prefix of its sites (its next site lowered no peak
# when read with the layer) then gets its next sites back, one at a time at the
# smallest read-ahead that passes, while each lowers the predicted peak. The cache
# issues each site's read at its read-ahead (``LayerChoice.read_ahead`` in
# ``TensorCache.set_plan``).


def _read_ahead_ladder(first: int, n: int) -> List[int]:
    ladder, d = {min(first, max(n, 1))}, 1
    while d < n:
        ladder.add(d)
        d *= 2
    ladder.add(max(n, 1))
    return sorted(ladder)


def just_in_time(
    stage: StageProfile,
    choose: Callable[[int], Tuple[Choices, str, Timeline]],
    default_read_ahead: int,
    safety_margin: float,
    allowed: Callable[[Choices, Timeline], bool],
) -> Tuple[Choices, str]:
    """The choices, each with its read-ahead, and the goal for ``read_ahead_mode="auto"``
    (NOTE [Just-in-time reads]).

    Args:
        stage: The stage planned.
        choose: Plans placements at one read-ahead for every layer, ``choose(ahead, full)``:
            ``(choice, goal, timeline)``, or raises :class:`PlanInfeasibleError`; ``full``
            False: the greedy start alone (NOTE [Search] in ``search.py``).
        default_read_ahead: The configured read-ahead, tried with the ladder's.
        safety_margin: Bandwidth derating of the second judgement.
        allowed: Whether a trial's choices and derated timeline keep the plan's other
            bounds (wear, capacity).
    """
    n = len(stage.layers)
    ladder = _read_ahead_ladder(default_read_ahead, n)
    candidates = []
    failure: Optional[PlanInfeasibleError] = None
    for full in (False, True):  # the greedy start at every rung; the whole search only where it found nothing
        for ahead in ladder:
            try:
                choice, goal, tl = choose(ahead, full)
            except PlanInfeasibleError as err:
                if failure is None or err.smallest_peak < failure.smallest_peak:
                    failure = err
                continue
            candidates.append((choice, goal, tl, tl.offloaded_bytes, ahead, full))
        if candidates:
            break
    if not candidates:
        assert failure is not None
        raise failure

    def best_of(found: List[Tuple]) -> Tuple:
        hidden = [c for c in found if c[1] == GOAL_MAX_OFFLOAD]
        if hidden:
            return min(hidden, key=lambda c: (c[2].peak_bytes, c[3], c[4]))
        return min(found, key=lambda c: (round(c[2].step_s, 12), c[3], c[2].peak_bytes, c[4]))

    best = best_of(candidates)
    if not best[5]:  # the whole search at the rung the greedy starts chose (NOTE [Search time] in adaptive.py)
        choice, goal, tl = choose(best[4], True)
        best = best_of([best, (choice, goal, tl, tl.offloaded_bytes, best[4], True)])
    chosen, goal, tl, _, ahead, _ = best
    choices = [dataclasses.replace(c, read_ahead=ahead) for c in chosen]
    derated = stage.io.derated(safety_margin)
    judged = [tl, replay(stage, choices, io=derated)]

    def no_worse(trial: Choices, lower: bool = False) -> bool:
        """Whether ``trial`` adds no stall, forwarding or step time and no peak
        (``lower``: lowers it) at both bandwidths, within ``allowed``; then it is the new
        reference."""
        nonlocal judged
        trials = [replay(stage, trial), replay(stage, trial, io=derated)]
        if all(not t.forwarded and t.exposed_s <= j.exposed_s + 1e-12 and t.step_s <= j.step_s + 1e-12
               and (t.peak_bytes < j.peak_bytes if lower else t.peak_bytes <= j.peak_bytes)
               for t, j in zip(trials, judged)) and allowed(trial, trials[1]):
            judged = trials
            return True
        return False

    def changed(i: int, **change: Any) -> Choices:
        """``choices`` with layer ``i``'s choice changed."""
        return replaced(choices, i, dataclasses.replace(choices[i], **change))

    for i in range(n - 1, -1, -1):  # whole layers
        if not choices[i].moved:
            continue
        for later in range(1, ahead):
            trial = changed(i, read_ahead=later)
            if no_worse(trial):
                choices = trial
                break
    for i in range(n - 1, -1, -1):  # then site by site, in the order backward uses them
        layer = recomputed_layer(stage.layers[i], choices[i].recompute)  # the sites it saves (NOTE [Sites])
        if not choices[i].moved or not layer.sites:
            continue
        whole = choices[i].read_ahead
        assert isinstance(whole, int)
        m = len(layer.sites)
        per_site: Tuple[int, ...] = (whole,) * m
        moved = m if choices[i].sites is None else choices[i].sites
        for s in use_order(layer, moved):
            for later in range(0, whole):
                trial_sites = per_site[:s] + (later,) + per_site[s + 1:]
                trial = changed(i, read_ahead=trial_sites)
                if no_worse(trial):
                    per_site, choices = trial_sites, trial
                    break
        # a site the placement search cut because, read a whole layer's read-ahead early,
        # it lowered no peak, may lower it read later: move it back if it now does (only
        # when the goal is the lowest peak; under a budget fewer bytes written wins)
        while goal == GOAL_MAX_OFFLOAD and moved < m:
            for later in range(0, whole + 1):
                trial_sites = per_site[:moved] + (later,) + per_site[moved + 1:]
                trial = changed(i, sites=None if moved + 1 == m else moved + 1, read_ahead=trial_sites)
                if no_worse(trial, lower=True):
                    per_site, choices, moved = trial_sites, trial, moved + 1
                    break
            else:
                break
        if len(set(per_site)) == 1 and per_site[0] >= 1:
            choices[i] = dataclasses.replace(choices[i], read_ahead=per_site[0])  # one read-ahead for all its sites
    return choices, goal
