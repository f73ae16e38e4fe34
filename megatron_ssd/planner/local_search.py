"""The improvement and the proof behind the placement search: a local search over the
whole choice set, then a branch and bound, each plan judged by a timeline replay.

:class:`LocalSearch` holds one stage's choice sets (one list of
:class:`~megatron_ssd.planner.choices.Option` per layer), replays the plans it considers
(each once), keys them by its goal, descends from starting plans through single-layer
changes, range moves, pairs and exchanges (NOTE [Local search]) and then searches every
plan by branch and bound (:meth:`LocalSearch.bound`), all within one budget of work
(NOTE [Search] in ``search.py``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..placement import LayerChoice, Placement
from ..tier import HOST_LINK, TIERS
from .choices import Floors, Option
from .step_timeline import Timeline, predict

__all__ = ["LocalSearch", "Trial"]

Index = Tuple[int, ...]
"""A plan: per layer, the index of its option in that layer's choice set."""

_INFEASIBLE = 2
"""Rank of a plan the search may not choose whatever its peak (forwarded, wear, host pool,
or under ``max_offload`` not hidden)."""


class _OutOfWork(Exception):
    """The search spent its work (NOTE [Search] in ``search.py``)."""


# NOTE [Local search]
# The timeline model is a replay, not a formula: queues, the link, the in-flight bound and
# the slowdown couple the layers, and the peak is not monotone in the bytes moved. So the
# search moves between whole plans and replays each one it considers (once: every replay
# is remembered):
# - a plan's key is what the goal minimises, lexicographically. Under a budget: first
#   whether it is allowed (where not, by its forwarded layers and the bytes over the host
#   pool and the wear bound, so a descent can leave it) and within the budget (where not,
#   by how many bytes it is over), then its derated step, then the bytes it writes to the
#   drives (wear), then the bytes it moves at all. Under ``max_offload``: first whether
#   every copy hides (NOTE [Slowdown bound] in ``judge.py``), then its derated peak, then
#   its measured peak, then the bytes written and moved (so a byte is moved only where it
#   lowers a peak at the derated or at the measured rates: NOTE [Every offloaded byte buys
#   memory] in ``greedy.py``);
# - single changes: each layer in turn takes its best option given the others, until a
#   sweep changes none;
# - then the first better plan of: a range move (every layer of a run of consecutive
#   layers given the same kind of option: placement, sites moved and modules recomputed;
#   uniform stages want uniform runs, which no single change reaches when each step alone
#   breaks the budget); a pair (two layers' options changed together, among their options
#   that move all sites or none); an exchange (one layer given an option with less
#   compute, the budget then repaired one change at a time by the most excess removed per
#   second added); and single changes again;
# - a trial whose bounds (NOTE [Bounds before a replay], NOTE [Drain and read floors] in
#   ``choices.py``) cannot beat the plan held is not replayed.
# Ties go to the earlier layer and to the option listed first (KEEP, then the tiers in
# preference order, then RECOMPUTE), so the search is deterministic.


@dataclass(frozen=True)
class Trial:
    """A replayed plan and its key."""

    index: Index
    key: Tuple
    timeline: Timeline
    """The derated replay."""


class LocalSearch:
    """The descent and the branch and bound over one stage's choice sets (see the module
    docstring).

    Args:
        search: The rules (a :class:`~megatron_ssd.planner.judge.Judge`: ``within_bound``,
            ``hosts_ok``, the derated and measured bandwidths, the read-ahead, the wear and
            pool bounds).
        options: Per layer, its choice set (:func:`~megatron_ssd.planner.choices.layer_options`).
        budget: The peak limit in bytes; None: the ``max_offload`` goal.
        work: What the search may spend, in layers and sites walked by its replays (a
            replay walks each once: :attr:`replay_cost`); None: no limit.
    """

    def __init__(self, search, options: Sequence[Sequence[Option]], budget: Optional[int],
                 work: Optional[float] = None) -> None:
        self.search = search
        self.stage = search.stage
        self.options = [list(o) for o in options]
        self.budget = budget
        self.n = len(self.options)
        keep_compute = sum(layer.forward_s + layer.backward_s for layer in self.stage.layers) + self.stage.other_s
        self.quantum = 1e-9 * keep_compute + 1e-12
        """Step times closer than this are equal (float noise of the replay's sums)."""
        self.replay_cost = self.n + sum(len(layer.sites) for layer in self.stage.layers)
        """What one replay walks: its layers and sites (the unit of ``work``)."""
        self.work_left = float("inf") if work is None else float(work)
        self.replays = 0
        """Replays so far (each plan's derated one, and its measured one where needed)."""
        self.smallest_peak: Optional[int] = None
        """The smallest derated peak of an allowed plan replayed (for the infeasible error)."""
        self.best_seen: Optional[Trial] = None
        """The plan of the smallest key replayed so far: what the search returns when its
        work runs out."""
        self._seen: Dict[Index, Trial] = {}
        self.floors = Floors(self.stage, search.derated)
        self._held = [[w * o.held for o in opts] for w, opts in zip(self.floors.weights, self.options)]
        slowdowns = search.derated.link_slowdowns()
        self._slowest_link = max(slowdowns.items(), key=lambda item: item[1])  # the drives' queue's on a tie
        """The link whose transfers slow compute most and that slowdown (:meth:`_io_floor_s`)."""
        self._cost = [[o.compute_s + self._io_floor_s(o) for o in opts] for opts in self.options]
        slot_of = {p: x for x, p in enumerate(self.floors.slots)}
        self._slot = [[slot_of[o.placement] if o.moved else -1 for o in opts] for opts in self.options]
        """Per layer and option, the slot of its tier in ``floors.slots`` (-1: moves nothing)."""
        self._drive_slots = [x for x, p in enumerate(self.floors.slots) if TIERS[p].drives]
        self._drive_tiers = [self.floors.slots[x] for x in self._drive_slots]
        self._steady = all(not search.derated.rates(p).compute_slowdown for p in self.floors.slots)
        """Whether a hidden plan's forward runs at compute speed, so the drain bound holds
        at d = 0 under ``max_offload`` (NOTE [Drain and read floors])."""
        self._replayed = [[LayerChoice(o.placement, o.choice.sites, search.read_ahead) for o in opts]
                          for opts in self.options]
        self._whole = [[k for k, o in enumerate(opts) if o.choice.sites is None] for opts in self.options]
        """Per layer, its options that move all their sites or none (pairs and exchanges
        try these)."""
        self._kinds: Dict[Tuple, Dict[int, int]] = {}
        """Per kind of option (placement, sites, modules), each layer's option of that kind."""
        for i, opts in enumerate(self.options):
            for k, o in enumerate(opts):
                self._kinds.setdefault((o.placement, o.choice.sites, o.choice.recompute), {})[i] = k

    # ------------------------------------------------------------------ plans

    def choices(self, index: Index) -> List[LayerChoice]:
        """The plan's choices, modules recomputed included, read-ahead unset."""
        return [self.options[i][k].choice for i, k in enumerate(index)]

    def index_of(self, choices: Sequence[LayerChoice]) -> Index:
        """The plan of ``choices`` (another search's result; read-ahead ignored)."""
        out = []
        for opts, c in zip(self.options, choices):
            key = (c.placement, c.sites if c.moved else None, tuple(c.recompute))
            out.append(next(k for k, o in enumerate(opts)
                            if (o.placement, o.choice.sites if o.choice.moved else None, o.choice.recompute) == key))
        return tuple(out)

    def _io_floor_s(self, option: Option) -> float:
        """Step time an option's traffic on one channel adds at least (NOTE [Bounds before a
        replay] in ``choices.py``): with one micro-batch in flight, every second that
        channel is busy either slows compute by ``s / (1 + s)`` of it or stalls it whole.
        One channel only, the one whose slowdown is larger (the drives' queue, or the host
        link, which a shared link's SSD requests cross too): while both are busy compute
        slows by ``1 + s + s_host``, less than the two bounds summed."""
        io = self.search.derated
        if not option.moved or (self.stage.microbatches_in_flight or 1) > 1:
            return 0.0
        link, s = self._slowest_link
        if not s:
            return 0.0
        tier, rates = TIERS[option.placement], io.rates(option.placement)
        if tier.link == link:
            return s / (1 + s) * (option.moved / rates.write_bytes_per_s + option.moved / rates.read_bytes_per_s)
        if link == HOST_LINK and tier.crosses_host_link and io.shared_host_link:
            return s / (1 + s) * 2 * option.moved / io.host_bytes_per_s
        return 0.0

    def _replay(self, index: Index, io=None) -> Timeline:
        if self.work_left <= 0:
            raise _OutOfWork
        self.work_left -= self.replay_cost
        self.replays += 1
        layers = [self.options[i][k].layer for i, k in enumerate(index)]
        choices = [self._replayed[i][k] for i, k in enumerate(index)]
        return predict(self.stage, choices, io=io, layers=layers)

    def _violation(self, tl: Timeline) -> Tuple[int, int]:
        """How far a plan that is not allowed is from being so: its forwarded layers, then
        the bytes over the host pool and over the drive-wear bound."""
        search = self.search
        m = self.stage.microbatches_in_flight or 1
        over = sum(max(0, tl.moved_to(p) * m - budget) for p, budget in search.tier_budgets.items())
        excess = tl.offloaded_bytes - search.written_limit()
        over += max(1, int(excess)) if excess > 0 else 0
        return len(tl.forwarded), over

    def trial(self, index: Index) -> Trial:
        """The plan replayed and keyed (NOTE [Local search]); each plan once.

        Raises:
            _OutOfWork: the work is spent.
        """
        known = self._seen.get(index)
        if known is not None:
            return known
        tl = self._replay(index, self.search.derated)
        moved = (sum(tl.moved_to(p) for p in self._drive_tiers), sum(lt.moved_bytes for lt in tl.layers))
        violation = self._violation(tl)
        allowed = not any(violation)
        if allowed and (self.smallest_peak is None or tl.peak_bytes < self.smallest_peak):
            self.smallest_peak = tl.peak_bytes
        if not allowed:
            key: Tuple = (_INFEASIBLE,) + violation
        elif self.budget is None:
            measured = self._replay(index) if self.search.within_bound(tl) else None
            key = ((0, tl.peak_bytes, measured.peak_bytes) + moved
                   if measured is not None and self.search.within_bound(measured) else (_INFEASIBLE, 0, 0))
        else:
            over = tl.peak_bytes - self.budget
            if over <= 0:
                over = max(self._replay(index).peak_bytes - self.budget, 0)
            key = (0 if over <= 0 else 1, max(over, 0), round(tl.step_s / self.quantum)) + moved
        out = Trial(index, key, tl)
        self._seen[index] = out
        if self.best_seen is None or key < self.best_seen.key:
            self.best_seen = out
        return out

    def bounds(self, index: Index) -> Tuple[int, float]:
        """The plan's peak and step bounds for its goal (NOTE [Bounds before a replay],
        NOTE [Drain and read floors] in ``choices.py``)."""
        held = 0
        cost = 0.0
        moved = [0] * len(self.floors.slots)
        first = [-1] * len(moved)
        for i, k in enumerate(index):
            held += self._held[i][k]
            cost += self._cost[i][k]
            x = self._slot[i][k]
            if x >= 0:
                moved[x] += self.options[i][k].moved
                first[x] = i if first[x] < 0 else first[x]
        plain, drained, step = self.floors.bound(held, cost + self.stage.other_s, moved, first, self.budget)
        return (plain if self.budget is not None or not self._steady else drained), step

    def promising(self, index: Index, held: Trial) -> bool:
        """Whether ``index`` may beat ``held`` by its bounds (its key is at least the key of
        its bounds); always where ``held`` is not feasible."""
        if held.key[0] != 0:
            return True
        peak, step = self.bounds(index)
        if self.budget is None:
            return peak <= held.key[1]
        return peak <= self.budget and round(step / self.quantum) <= held.key[2]

    # ------------------------------------------------------------------ starting plans

    def floor_plan(self) -> Index:
        """Per layer the option holding the fewest bytes (then the least compute, then the
        fewest moved): the plan most likely to fit."""
        return tuple(min(range(len(opts)), key=lambda k, o=opts: (o[k].held, o[k].compute_s, o[k].moved))
                     for opts in self.options)

    def still_plan(self) -> Index:
        """Per layer the option holding the fewest bytes without moving any (KEEP, modules
        recomputed inside it, RECOMPUTE): no I/O, so no timing it depends on."""
        return tuple(min((k for k in range(len(opts)) if opts[k].moved == 0),
                         key=lambda k, o=opts: (o[k].held, o[k].compute_s)) for opts in self.options)

    # ------------------------------------------------------------------ the descent

    def best(self, starts: Sequence[Index]) -> Trial:
        """The best plan the descent reaches within half the work (the branch and bound
        has the rest): single changes from each of ``starts`` in turn, then the whole
        descent (NOTE [Local search]) from each of those ends, best first."""
        total = self.work_left
        self.work_left = total / 2
        try:
            ends = [self._singles(self.trial(s)) for s in dict.fromkeys(starts)]
            for end in sorted(dict((t.index, t) for t in ends).values(), key=lambda t: t.key):
                self.descend(end)
        except _OutOfWork:
            pass
        self.work_left += total / 2
        return self.best_seen  # type: ignore[return-value]

    def descend(self, held: Trial) -> Trial:
        """Single changes until none helps, then the first better range move, pair or
        exchange, again (NOTE [Local search])."""
        while True:
            held = self._singles(held)
            better = self._ranges(held) or self._pairs(held)
            if better is None and self.budget is not None:
                better = self._exchanges(held)
            if better is None:
                return held
            held = better

    def _singles(self, held: Trial) -> Trial:
        changed = True
        while changed:
            changed = False
            for i in range(self.n):
                best = held
                for k in range(len(self.options[i])):
                    if k == held.index[i]:
                        continue
                    index = held.index[:i] + (k,) + held.index[i + 1:]
                    if self.promising(index, best):
                        t = self.trial(index)
                        best = t if t.key < best.key else best
                if best is not held:
                    held, changed = best, True
        return held

    def _better(self, held: Trial, index: Index) -> Optional[Trial]:
        if index == held.index or not self.promising(index, held):
            return None
        t = self.trial(index)
        return t if t.key < held.key else None

    def _ranges(self, held: Trial) -> Optional[Trial]:
        """The first better plan giving a run of at least two consecutive layers the same
        kind of option."""
        for at in self._kinds.values():
            for i in range(self.n):
                index = list(held.index)
                changed = 0
                for j in range(i, self.n):
                    if j not in at:
                        break
                    changed += index[j] != at[j]
                    index[j] = at[j]
                    if changed >= 2:
                        t = self._better(held, tuple(index))
                        if t is not None:
                            return t
        return None

    def _pairs(self, held: Trial) -> Optional[Trial]:
        """The first better plan changing two layers, among their whole options."""
        for i, j in itertools.combinations(range(self.n), 2):
            for a in self._whole[i]:
                for b in self._whole[j]:
                    if a != held.index[i] and b != held.index[j]:
                        index = list(held.index)
                        index[i], index[j] = a, b
                        t = self._better(held, tuple(index))
                        if t is not None:
                            return t
        return None

    def _exchanges(self, held: Trial) -> Optional[Trial]:
        """The first better plan made by giving one layer a whole option with less compute
        (or as much and fewer bytes moved), then repairing the budget (:meth:`_repair`),
        then single changes."""
        if held.key[0] != 0:
            return None
        for i in range(self.n):
            now = self.options[i][held.index[i]]
            for k in self._whole[i]:
                o = self.options[i][k]
                if (o.compute_s, o.moved) >= (now.compute_s, now.moved):
                    continue
                t = self._repair(self.trial(held.index[:i] + (k,) + held.index[i + 1:]), frozen=i)
                if t is not None and t.key < held.key:
                    t = self._singles(t)
                    if t.key < held.key:
                        return t
        return None

    def _repair(self, t: Trial, frozen: int) -> Optional[Trial]:
        """From an over-budget ``t``, the whole-option change (of any layer but ``frozen``)
        that removes the most excess per second of step added, until within the budget;
        None where no change removes any."""
        while t.key[0] == 1:
            best, score = None, 0.0
            for i in range(self.n):
                for k in (self._whole[i] if i != frozen else ()):
                    if k == t.index[i]:
                        continue
                    c = self.trial(t.index[:i] + (k,) + t.index[i + 1:])
                    gain = t.key[1] - (c.key[1] if c.key[0] == 1 else 0)
                    if c.key[0] == _INFEASIBLE or gain <= 0:
                        continue
                    cost = max(c.timeline.step_s - t.timeline.step_s, 0.0) + self.quantum
                    if gain / cost > score:
                        best, score = c, gain / cost
            if best is None:
                return None
            t = best
        return t if t.key[0] == 0 else None

    # ------------------------------------------------------------------ branch and bound

    def bound(self, held: Trial) -> Tuple[Trial, bool]:
        """Branch and bound over every plan from ``held``, layers in forward order: the best
        plan, and whether the search ended within the work left (so the plan is the
        model's optimum, and where it is not feasible, no plan is). A branch is cut where
        no plan below it can be feasible or have a smaller key by its bounds, the layers
        not yet chosen counted at their fewest held bytes and least compute, moving
        nothing."""
        n = self.n
        moved = [[o.moved for o in opts] for opts in self.options]
        suffix_held = [0] * (n + 1)
        suffix_cost = [0.0] * (n + 1)
        for i in range(n - 1, -1, -1):
            suffix_held[i] = suffix_held[i + 1] + min(self._held[i])
            suffix_cost[i] = suffix_cost[i + 1] + min(self._cost[i])
        orders = [sorted(range(len(opts)), key=lambda k, i=i: (k != held.index[i], self._cost[i][k], self._held[i][k]))
                  for i, opts in enumerate(self.options)]
        budget, floors, other_s = self.budget, self.floors, self.stage.other_s
        node_cost = 2.0  # a node's bounds, in a replay's units

        drive_slots = self._drive_slots
        one_drive = len(drive_slots) == 1

        def beaten(held_sum: int, cost_sum: float, by_slot: Tuple[int, ...], first: Tuple[int, ...],
                   moved_sum: int) -> bool:
            plain, drained, step = floors.bound(held_sum, cost_sum + other_s, by_slot, first, budget)
            key = self.best_seen.key  # type: ignore[union-attr]
            drives = by_slot[drive_slots[0]] if one_drive else sum(by_slot[x] for x in drive_slots)
            if budget is not None:
                if plain > budget or step == float("inf"):
                    return True
                return (0, 0, round(step / self.quantum), drives, moved_sum) >= key
            peak = drained if self._steady else plain
            return (0, peak, plain, drives, moved_sum) >= key  # no key below is smaller (measured: no drain bound)

        def visit(d: int, prefix: List[int], held_sum: int, cost_sum: float, by_slot: Tuple[int, ...],
                  first: Tuple[int, ...], moved_sum: int) -> None:
            for k in orders[d]:
                self.work_left -= node_cost
                if self.work_left <= 0:
                    raise _OutOfWork
                h, c, mv = held_sum + self._held[d][k], cost_sum + self._cost[d][k], moved_sum + moved[d][k]
                x = self._slot[d][k]
                slots, firsts = by_slot, first
                if x >= 0:
                    slots = by_slot[:x] + (by_slot[x] + moved[d][k],) + by_slot[x + 1:]
                    if first[x] < 0:
                        firsts = first[:x] + (d,) + first[x + 1:]
                if beaten(h + suffix_held[d + 1], c + suffix_cost[d + 1], slots, firsts, mv):
                    continue
                prefix.append(k)
                if d + 1 == n:
                    self.trial(tuple(prefix))
                else:
                    visit(d + 1, prefix, h, c, slots, firsts, mv)
                prefix.pop()

        try:
            self.trial(held.index)
            none = (0,) * len(floors.slots)
            visit(0, [], 0, 0.0, none, (-1,) * len(none), 0)
            done = True
        except _OutOfWork:
            done = False
        return self.best_seen, done  # type: ignore[return-value]
