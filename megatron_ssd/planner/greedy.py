"""The greedy search: the starting plan the placement search improves on.

:class:`Greedy` is the search megatron-ssd planned with before the local search and branch
and bound of :mod:`~megatron_ssd.planner.search` (NOTE [Search] there): it builds a good
plan quickly from structure the model rewards, and the search starts from it, so the plan
chosen is never slower than the greedy one. Two constructions:

- :meth:`Greedy.first_fit` (:class:`~.first_fit.FirstFit`'s): first fit in forward order, the host pool first and then the
  SSDs, no stall, no forwarding and no more predicted step time than ``max_slowdown``
  allows (NOTE [Slowdown bound] in ``judge.py``); a layer whose sites do not all fit moves
  the longest prefix of them that does (NOTE [Sites]); then layers the host tier could not
  take are given to it in exchange for a hosted layer the SSDs can take (NOTE [Tier
  preference]);
- :meth:`Greedy.fit_budget`: greedy single-layer moves (KEEP -> HOST, KEEP -> OFFLOAD,
  KEEP -> RECOMPUTE, HOST or OFFLOAD -> RECOMPUTE, a module recomputed inside a layer) by
  memory benefit per second of step time, until the predicted peak fits, then undoing the
  moves the budget does not need (a recomputed layer turned kept, hosted or offloaded where
  that is no slower), hosting what the SSDs carry where the pool allows, and trimming each
  OFFLOAD or HOST layer to the fewest sites that still meet it (less wear).

Both return one :class:`~megatron_ssd.placement.LayerChoice` per layer in forward order.
Measured against the exhaustive optimum of the model, it alone reached it on 65% of seeded
5-layer stages and called 2.3% of feasible budgets infeasible (docs/planner.md, "How the
search is checked"): the search's own moves close that gap.
"""

from __future__ import annotations

import heapq
import itertools
from typing import List, Optional, Sequence, Tuple

from ..placement import MOVED, LayerChoice, Placement
from .first_fit import _KEEP, FirstFit, _largest, _smallest
from .judge import Choices, replaced
from .module_recompute import MODULE_MOVE, ModuleMoves
from .step_timeline import Timeline

__all__ = ["Greedy"]

_TOP = (-1, 0.0, 0.0, -1, -1)
"""Heap key of a move never evaluated: ahead of every evaluated one."""
_NO_BENEFIT = 2
"""First element of the heap key of a move that lowers neither peak nor byte-seconds."""
_EAGER_LAYERS = 8
"""Up to this many layers per stage the budget search re-scores every move after each step
(NOTE [Search time] in ``adaptive.py``: beyond, the local search that follows repairs what
lazy scoring misses)."""


class Greedy(FirstFit, ModuleMoves):
    """The greedy constructions (see the module docstring): :meth:`first_fit` is
    :class:`~.first_fit.FirstFit`'s, the module moves :class:`ModuleMoves`'."""

    # NOTE [Tier preference]
    # Where the host pool and the SSDs would both hide a layer's bytes, the layer is
    # hosted: a host copy costs no drive wear and, at a link faster than the drives, less
    # time, and on a shared link an SSD request spends as much link time as a host copy
    # of the same bytes (NOTE [Shared link] in ``step_timeline.py``). The SSDs take what
    # the pool cannot: bytes beyond its budget, or, where the link is the host tier's own,
    # copies it is too busy to hide. But the pool is bytes and the SSDs are time: a pool
    # filled with the earliest layers, which the SSDs would also hide, can leave a later
    # layer that only the faster copy hides with nowhere to go. So the tiers are ranked
    # by what the plan costs, not by a fixed order:
    # - ``max_offload`` fills the pool first, then the SSDs, each first fit in forward
    #   order; then, forward, each layer still kept is offered to the pool in exchange for
    #   a hosted layer moved to the SSDs (earliest first: the SSDs hide early layers best),
    #   taken when the predicted peak drops with everything still hidden; the first layer
    #   no exchange helps ends the pass (hiding only gets harder for later layers). The
    #   plan that fills the SSDs first and the pool after (the order this goal used
    #   before) is built too, and kept only when its predicted peak is lower, or equal
    #   with fewer bytes written to the SSDs;
    # - ``meet_budget`` scores every move by the peak it removes per second of step time
    #   it adds; of two moves with equal score the host one comes first. A recompute costs
    #   its forward, a move that hides costs nothing, so recompute is chosen only where
    #   moving would expose more time. The clean-up then turns each recomputed layer kept,
    #   hosted or offloaded (in that order) where the step is no slower and the budget
    #   still holds, hosted through the same exchange where the pool is full, and turns
    #   offloaded layers hosted where the pool has room and the step is no slower. The
    #   same search with ties going to the SSDs runs too, and the plan with the shorter
    #   predicted step is kept, on equal steps the one writing fewer SSD bytes.
    # Each alternative costs one more search, run only when both tiers are there, and
    # under a budget only up to ``_EAGER_LAYERS`` layers: beyond, the search ended at the
    # same plan without it at 32 and 128 layers of the H200 check's layer (budgets 0.3, 0.5
    # and 0.7 of keep's peak), on 80 seeded 9-16-layer stages with both tiers and on the
    # measured gpt-deep-cpu and gpt-ref-cpu profiles (budgets 0.3-0.8), and it was 11-43%
    # of a 128-layer search's time (docs/planner.md, "How the search is checked").

    def fit_budget(self, budget: int, allow_recompute: bool) -> Optional[Choices]:
        """Greedy moves until the predicted peak fits ``budget``, then the clean-up; see
        the module docstring. With both tiers, up to ``_EAGER_LAYERS`` layers, the
        search runs twice, ties going to the host tier and then to the SSDs, and keeps
        the plan with the shorter predicted step, on equal steps the one writing fewer SSD
        bytes (NOTE [Tier preference]). None where the moves do not reach ``budget``."""
        choices = self._greedy(budget, allow_recompute, host_first=True)
        if choices is None:
            return None
        tl = self.judge(choices)
        eps = 1e-9 * tl.compute_s + 1e-12
        if not self.both_tiers or self.n > _EAGER_LAYERS or (
                tl.step_s <= self._shortest_step_s + eps and tl.offloaded_bytes == 0):
            return choices  # one tier, a deep stage (NOTE [Tier preference]), or a plan no other can beat
        other = self._greedy(budget, allow_recompute, host_first=False)
        if other is None:
            return choices
        tl_other = self.judge(other)
        if tl_other.step_s < tl.step_s - eps or (
                tl_other.step_s <= tl.step_s + eps and tl_other.offloaded_bytes < tl.offloaded_bytes):
            return other
        return choices

    def _greedy(self, budget: int, allow_recompute: bool, host_first: bool) -> Optional[Choices]:
        """One greedy search and its clean-up, ties going to the host tier or to the SSDs.

        A layer's moves (:func:`_moves`): to HOST or OFFLOAD whole, to HOST or OFFLOAD the
        longest prefix of its sites that adds no predicted step time (``part``, NOTE
        [Sites]; the share of the layer its window carries, and under a wear bound the
        share the drives can take), and to RECOMPUTE. Each step takes the move with the best score
        (:meth:`_score`) against the current placement. Up to ``_EAGER_LAYERS`` layers
        every move is scored again after each step: O(n) timeline replays per step,
        O(n^3) work in all. Beyond, scoring is lazy (as in lazy greedy submodular
        maximization): a move keeps the score it had when last evaluated, the best
        stored one is scored again and taken if it still beats every other stored score,
        and when no stored move helps all are scored afresh once. On 200 random stages
        of 8-32 layers the lazy search chose the same plan as the eager one in 97% of
        cases and was never more than 8% slower in predicted step time, at a seventh of
        the planning time.
        """
        choices: Choices = [_KEEP] * self.n
        tl = self.judge(choices)
        eps = 1e-9 * tl.compute_s + 1e-12
        area = _byte_seconds(tl, self.stage)
        # (key, version, layer, rank, move, tick, target, resolved): ``tick`` orders entries
        # equal in all before it (a site of no bytes makes two prefixes score alike, NOTE
        # [Sites]), so targets are never compared
        heap: List[Tuple[Tuple[int, float, float, int, int], int, int, int, str, int, Optional[LayerChoice], bool]] = []
        version = 0
        tick = itertools.count()

        def moves(i: int) -> List[str]:
            layer = self.layer_at(i, choices[i])
            return _moves(choices[i], len(layer.sites), allow_recompute and layer.recomputable,
                          self.host_budget_bytes > 0, self.drives, host_first, self.extra_tiers
                          ) + self._module_moves(i, choices[i], allow_recompute)

        def push_moves(i: int) -> None:
            for rank, move in enumerate(moves(i)):
                heapq.heappush(heap, (_TOP, -1, i, rank, move, next(tick), None, False))

        lazy = self.n > _EAGER_LAYERS

        def rescore_all() -> None:  # lazily, each part move from the prefix it found (NOTE [Lazy prefixes])
            heap[:] = [(_TOP, -1, e[2], e[3], e[4], next(tick), e[6] if lazy else None, False) for e in heap]
            heapq.heapify(heap)

        for i in range(self.n):
            push_moves(i)
        refreshed = -1
        while not self.fits(choices, tl, budget):
            taken = False
            while heap:
                key, seen, i, rank, move, _, target, resolved = heapq.heappop(heap)
                if move not in moves(i):
                    continue  # the layer moved since this entry was stored
                if seen != version:
                    resolved = not (lazy and self._still_extends(choices, i, move, target))  # NOTE [Lazy prefixes]
                    if resolved:
                        target = self._resolve(choices, tl, eps, i, move)
                    key = self._score(tl, area, choices, target, eps, i, rank)
                    heapq.heappush(heap, (key, version, i, rank, move, next(tick), target, resolved))
                    continue
                if key[0] < _NO_BENEFIT and not resolved:  # about to be taken: its longest free prefix now
                    target = self._resolve(choices, tl, eps, i, move)
                    key = self._score(tl, area, choices, target, eps, i, rank)
                    heapq.heappush(heap, (key, version, i, rank, move, next(tick), target, True))
                    continue
                if key[0] < _NO_BENEFIT:
                    choices = replaced(choices, i, target)
                    tl = self.judge(choices)
                    area = _byte_seconds(tl, self.stage)
                    version += 1
                    push_moves(i)
                    taken = True
                    if self.n <= _EAGER_LAYERS:
                        rescore_all()
                elif refreshed != version:
                    # the best fresh move does not help: stored scores may be stale
                    # the other way, so score every move against the current placements
                    heapq.heappush(heap, (key, seen, i, rank, move, next(tick), target, resolved))
                    refreshed = version
                    rescore_all()
                    continue
                else:
                    heapq.heappush(heap, (key, seen, i, rank, move, next(tick), target, resolved))
                break
            if not taken:
                uniform = self._uniform_fit(budget, allow_recompute)  # NOTE [Uniform fallback]
                if uniform is not None:
                    choices, tl = uniform
                    continue
                return None
        choices = self._relax(choices, tl, budget, eps)
        if self.host_budget_bytes:  # NOTE [Tier preference]
            choices = self._to_host(choices, budget, eps)
        choices = self._trim(choices, budget, eps)
        return self._modules_finish(choices, lambda c, t: self.fits(c, t, budget) and self.allowed(c, t), eps)

    # NOTE [Uniform fallback]
    # The greedy search stops where no single move lowers the predicted peak, and a peak
    # can be a plateau for every single move (moving one layer's bytes, or recomputing
    # one module, shifts when another layer's bytes are held rather than how many are
    # held at the peak) while moving the whole stage at once fits. Which stages plateau
    # depends on the measured times: a 2-layer GPT's profile measured on a loaded machine
    # (tests/planner/test_planner_plan.py keeps it) found no plan for a budget
    # that recomputing every layer meets, its own message naming that smaller peak. Before raising,
    # the search therefore tries the uniform placements (recompute where a layer may,
    # then every layer to the SSDs) and goes on from the first that fits and is allowed;
    # the clean-up then hands back what the budget does not need.

    def _uniform_fit(self, budget: int, allow_recompute: bool) -> Optional[Tuple[Choices, Timeline]]:
        """The first uniform placement that fits ``budget`` and is allowed, with its
        timeline, or None (NOTE [Uniform fallback]): no module recomputed (the search's
        module moves are dropped when one fits)."""
        candidates: List[Choices] = []
        if allow_recompute:
            candidates.append([LayerChoice(Placement.RECOMPUTE) if layer.recomputable else _KEEP
                               for layer in self.stage.layers])
        if self.drives:
            candidates.append([LayerChoice(Placement.OFFLOAD) if layer.sites else _KEEP
                               for layer in self.stage.layers])
        for choices in candidates:
            tl = self.judge(choices)
            if self.fits(choices, tl, budget) and self.allowed(choices, tl):
                return choices, tl
        return None

    # NOTE [Lazy prefixes]
    # A part move's target is the longest prefix of the layer's sites that adds no step
    # time, found by bisection (three or four replays at 9 sites). Under lazy scoring
    # (beyond ``_EAGER_LAYERS``) a stale entry, and every entry when all are scored
    # afresh, is scored again at the prefix it found before, one replay, while that
    # prefix still extends what the layer moves; the bisection runs again only for the
    # entry about to be taken, which is then scored at its new prefix and taken only if
    # it still leads. On the H200 check's layer at 64 layers the bisections were 57% of
    # the greedy start's time.

    @staticmethod
    def _still_extends(choices: Choices, i: int, move: str, target: Optional[LayerChoice]) -> bool:
        """Whether ``target``, a part move's earlier prefix, still moves more of layer
        ``i``'s sites than it moves now (NOTE [Lazy prefixes])."""
        if target is None or not move.endswith("-part") or target.sites is None:
            return False
        now, placement = choices[i], _target_placement(move)
        current = now.sites if now.placement is placement and now.sites is not None else 0
        return target.placement is placement and target.sites > current and target.recompute == now.recompute

    def _resolve(self, choices: Choices, tl: Timeline, eps: float, i: int, move: str) -> Optional[LayerChoice]:
        """The choice a move gives layer ``i`` (None: a part move with no admissible
        prefix)."""
        if move.startswith(MODULE_MOVE):
            return self._resolve_module(choices, i, move)
        target, now = _target_placement(move), choices[i]
        modules = now.recompute
        if not move.endswith("-part"):
            return LayerChoice(target, recompute=modules)
        m = len(self.layer_at(i, now).sites)
        current = now.sites if now.placement is target and now.sites is not None else 0

        def free(k: int) -> bool:
            trial = replaced(choices, i, LayerChoice(target, k, recompute=modules))
            ttl = self.judge(trial)
            return self.allowed(trial, ttl) and ttl.step_s <= tl.step_s + eps

        k = _largest(current + 1, m - 1, free)
        return None if k is None else LayerChoice(target, k, recompute=modules)

    def _score(
        self, tl: Timeline, area: float, choices: Choices, target: Optional[LayerChoice], eps: float, i: int,
        rank: int,
    ) -> Tuple[int, float, float, int, int]:
        """Heap key of a move (smallest is best): its benefit per second of cost.

        Benefit is the drop of the predicted peak; when a move does not lower it (two
        equal peaks), the drop of resident byte-seconds, so the next move can. Cost is
        the rise of the step time. Ties go to the earlier layer, then to the move listed
        first by :func:`_moves`.
        """
        if target is None:
            return (_NO_BENEFIT, 0.0, 0.0, i, rank)
        trial = replaced(choices, i, target)
        ttl = self.judge(trial)
        cost = max(ttl.step_s - tl.step_s, 0.0) + eps
        peak_drop = tl.peak_bytes - ttl.peak_bytes
        area_drop = area - _byte_seconds(ttl, self.stage)
        if not self.allowed(trial, ttl):
            return (_NO_BENEFIT, 0.0, 0.0, i, rank)
        if peak_drop > 0:
            return (0, -peak_drop / cost, -float(peak_drop), i, rank)
        if area_drop > 0:
            return (1, -area_drop / cost, -area_drop, i, rank)
        return (_NO_BENEFIT, 0.0, 0.0, i, rank)

    def _relax(self, choices: Choices, tl: Timeline, budget: int, eps: float) -> Choices:
        """Undo changes the budget does not need, when that does not slow the step: a
        moved layer back to KEEP, a recomputed one to KEEP, HOST or OFFLOAD (NOTE [Tier
        preference])."""
        changed = True
        while changed:
            changed = False
            for i in range(self.n - 1, -1, -1):
                for target in _weaker(choices[i].placement, self.extra_tiers):
                    if target is not Placement.KEEP and target not in self.tiers:
                        continue
                    trial = replaced(choices, i, LayerChoice(target, recompute=choices[i].recompute))
                    ttl = self.judge(trial)
                    if (ttl.step_s > tl.step_s + eps or not self.fits(trial, ttl, budget)
                            or not self.allowed(trial, ttl)):
                        continue
                    choices, tl, changed = trial, ttl, True
                    break
        return choices

    def _to_host(self, choices: Choices, budget: int, eps: float) -> Choices:
        """The clean-up's host passes (NOTE [Tier preference]): each recomputed layer
        still left hosted through an exchange where the pool is full, then each OFFLOAD
        layer hosted (its sites kept) where the pool has room; each change only where
        the step is no slower and the budget still holds."""
        step = [self.judge(choices).step_s]

        def no_slower(trial: Choices, tl: Timeline) -> bool:
            if not self.allowed(trial, tl) or tl.step_s > step[0] + eps or not self.fits(trial, tl, budget):
                return False
            step[0] = tl.step_s
            return True

        if self.both_tiers:
            recomputed = [i for i, c in enumerate(choices) if c.placement is Placement.RECOMPUTE]
            choices = self._exchange(choices, recomputed, Placement.RECOMPUTE, no_slower)
        for i, c in enumerate(choices):
            if c.placement is Placement.OFFLOAD:
                trial = replaced(choices, i, LayerChoice(Placement.HOST, c.sites, recompute=c.recompute))
                if no_slower(trial, self.judge(trial)):
                    choices = trial
        return choices

    def _trim(self, choices: Choices, budget: int, eps: float) -> Choices:
        """Each OFFLOAD layer cut to the fewest sites (a prefix, NOTE [Sites]) with which
        the budget is still met at no longer a predicted step: fewer bytes written for
        the same time and memory, so less drive wear. Last layer first."""
        choices = list(choices)
        step = self.judge(choices).step_s
        for i in range(self.n - 1, -1, -1):
            m = len(self.layer_at(i, choices[i]).sites)
            placement, modules = choices[i].placement, choices[i].recompute
            if placement not in MOVED or m < 2:
                continue
            current = m if choices[i].sites is None else choices[i].sites

            def ok(k: int) -> bool:
                trial = replaced(choices, i, LayerChoice(placement, None if k == m else k, recompute=modules))
                ttl = self.judge(trial)
                return (not ttl.forwarded and ttl.step_s <= step + eps
                        and ttl.peak_bytes <= budget and self.check(trial).peak_bytes <= budget)

            k = _smallest(1, current, ok)
            if k < current:
                choices[i] = LayerChoice(placement, None if k == m else k, recompute=modules)
                step = self.judge(choices).step_s
        return choices


def _moves(now: LayerChoice, site_count: int, allow_recompute: bool, allow_host: bool,
           allow_offload: bool = True, host_first: bool = True, others: Sequence[Placement] = ()) -> List[str]:
    """The moves that make a layer hold fewer bytes, in the order that breaks a tie of
    scores (NOTE [Tier preference]): ``host`` and ``host-part`` (into the host pool, whole
    or a longer prefix of its sites, NOTE [Sites]; with ``allow_host``), ``offload`` and
    ``offload-part`` (the same onto the SSDs; with ``allow_offload``), the SSDs' first
    without ``host_first``; the same for each tier of ``others`` (registered after them,
    NOTE [Tiers] in ``tier.py``); then ``recompute``."""
    current, sites = now.placement, now.sites
    out = []
    tiers = ((Placement.HOST, Placement.OFFLOAD) if host_first else (Placement.OFFLOAD, Placement.HOST)) + tuple(others)
    for target in tiers:
        if (target is Placement.HOST and not allow_host) or (target is Placement.OFFLOAD and not allow_offload):
            continue
        partial = current is target and sites is not None
        if site_count and (current is Placement.KEEP or partial):
            out.append(target.value)
            if site_count >= 2 and (sites if partial else 0) < site_count - 1:
                out.append(target.value + "-part")
    if allow_recompute and current is not Placement.RECOMPUTE:
        out.append("recompute")
    return out


def _target_placement(move: str) -> Placement:
    return Placement(move[: -len("-part")] if move.endswith("-part") else move)


def _weaker(current: Placement, others: Sequence[Placement] = ()) -> List[Placement]:
    """Placements that hold more bytes than ``current``, KEEP first, then HOST before
    OFFLOAD (NOTE [Tier preference]), then ``others``."""
    if current is Placement.RECOMPUTE:
        return [Placement.KEEP, Placement.HOST, Placement.OFFLOAD, *others]
    if current in MOVED:
        return [Placement.KEEP]
    return []


def _byte_seconds(tl: Timeline, stage: StageProfile) -> float:
    """Area under the micro-batch's memory curve plus the parked micro-batches' share."""
    area = 0.0
    for (t0, resident), (t1, _) in zip(tl.memory, tl.memory[1:]):
        area += resident * (t1 - t0)
    return area + ((stage.microbatches_in_flight or 1) - 1) * tl.parked_bytes * tl.step_s
