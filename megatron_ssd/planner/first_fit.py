"""First fit in forward order: the greedy start of the ``max_offload`` goal (see
:mod:`~megatron_ssd.planner.greedy`, whose :class:`~.greedy.Greedy` extends it with the
budget search)."""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

from ..placement import MOVED, LayerChoice, Placement
from .judge import Choices, Judge, replaced
from .step_timeline import Timeline

__all__ = ["FirstFit"]

_KEEP = LayerChoice(Placement.KEEP)


def _largest(lo: int, hi: int, ok: Callable[[int], bool]) -> Optional[int]:
    """The largest k in [lo, hi] with ``ok(k)``, assuming ok holds up to some k and not
    beyond (None when not even ``lo``)."""
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        if ok(mid):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def _smallest(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """The smallest k in [lo, hi] with ``ok(k)``, assuming ok holds from some k on and
    ``ok(hi)``."""
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi



class FirstFit(Judge):
    """The ``max_offload`` goal's construction, :meth:`first_fit`, and the exchange and
    trim it shares with :class:`~.greedy.Greedy`'s budget search (NOTE [Tier preference]
    in ``greedy.py``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.both_tiers = bool(self.host_budget_bytes) and self.drives and any(
            layer.sites and self.wears_ok(replaced([_KEEP] * self.n, i, LayerChoice(Placement.OFFLOAD, 1)))
            for i, layer in enumerate(self.stage.layers))
        """Whether the host pool and the SSDs can each take bytes: the pool has a budget and
        the drives, measured, can take at least one layer's first site within the wear
        bound; only then is there a choice between them (NOTE [Tier preference])."""

    def first_fit(self) -> Choices:
        """The most HOST, then OFFLOAD, bytes whose copies and I/O the model hides
        completely (within ``max_slowdown``, NOTE [Slowdown bound]), exchanged where a full
        pool keeps the SSDs from hiding more (NOTE [Tier preference]), less those that do
        not lower the predicted peak (:meth:`without_idle_writes`)."""
        # First fit in forward order: an earlier layer's write has the most forward
        # compute left to drain behind and its read is needed last, so for layers of
        # equal size and time the admitted set is the longest admissible prefix; with
        # unequal layers a layer that does not fit is skipped and later ones still tried.
        # A layer that does not fit whole moves the longest prefix of its sites that
        # does (NOTE [Sites]): hiding shrinks as a layer's bytes grow, so it is found by
        # bisection.
        choices: Choices = [_KEEP] * self.n
        if self.host_budget_bytes:
            self._first_fit(choices, Placement.HOST)
        if self.drives:  # what the pool could not take goes to the SSDs
            self._first_fit(choices, Placement.OFFLOAD)
        for tier in self.extra_tiers:  # then to each tier registered after them (NOTE [Tiers] in tier.py)
            self._first_fit(choices, tier)
        if not self.both_tiers:
            return self.without_idle_writes(choices)
        peaks = [self.judge(choices).peak_bytes, self.check(choices).peak_bytes]

        def lower(trial: Choices, tl: Timeline) -> bool:
            if not (self.within_bound(tl) and self.allowed(trial, tl)) or tl.peak_bytes >= peaks[0]:
                return False
            checked = self.check(trial)
            if not self.within_bound(checked) or checked.peak_bytes > peaks[1]:
                return False
            peaks[:] = [tl.peak_bytes, checked.peak_bytes]
            return True

        kept = [i for i, layer in enumerate(self.stage.layers) if layer.saved_bytes]
        hosted_first = self.without_idle_writes(self._exchange(choices, kept, Placement.KEEP, lower))
        by_order: Choices = [_KEEP] * self.n  # the SSDs first, then the pool
        self._first_fit(by_order, Placement.OFFLOAD)
        self._first_fit(by_order, Placement.HOST)
        for tier in self.extra_tiers:
            self._first_fit(by_order, tier)
        by_order = self.without_idle_writes(by_order)

        def price(c: Choices) -> Tuple[int, int, int]:
            tl = self.judge(c)
            return tl.peak_bytes, self.check(c).peak_bytes, tl.offloaded_bytes

        return by_order if price(by_order) < price(hosted_first) else hosted_first

    def _exchange(self, choices: Choices, layers: Sequence[int], placed: Placement,
                  better: Callable[[Choices, Timeline], bool]) -> Choices:
        """Forward through ``layers``, each still ``placed``: host it whole where
        ``better`` says so, alone or with one hosted layer moved to the SSDs (its sites
        kept, the earliest that works); stop at the first layer neither helps (NOTE [Tier
        preference])."""
        for i in layers:
            if choices[i].placement is not placed:
                continue
            alone = replaced(choices, i, LayerChoice(Placement.HOST, recompute=choices[i].recompute))
            if better(alone, self.judge(alone)):
                choices = alone
                continue
            for j, c in enumerate(choices):
                if c.placement is not Placement.HOST:
                    continue
                trial = replaced(alone, j, LayerChoice(Placement.OFFLOAD, c.sites, recompute=c.recompute))
                if better(trial, self.judge(trial)):
                    choices = trial
                    break
            else:
                break
        return choices

    def _first_fit(self, choices: Choices, target: Placement) -> None:
        """Move KEEP layers to ``target`` in forward order, each whole or the longest prefix
        of its sites that hides within the limits, then drop the latest moved until the
        measured bandwidths hide them too (in place)."""
        for i in range(self.n):
            layer, modules = self.layer_at(i, choices[i]), choices[i].recompute
            if layer.saved_bytes == 0 or choices[i].placement is not Placement.KEEP:
                continue
            m = len(layer.sites)

            def fits_with(k: int) -> bool:
                trial = replaced(choices, i, LayerChoice(target, None if k == m else k, recompute=modules))
                tl = self.judge(trial)
                return self.within_bound(tl) and self.allowed(trial, tl)

            k = m if fits_with(m) else _largest(1, m - 1, fits_with)
            if k:
                choices[i] = LayerChoice(target, None if k == m else k, recompute=modules)
        # Derating makes I/O slower, so the measured bandwidths normally agree; if
        # they do not (slowdown interplay), drop the latest admitted layers until they do.
        while not self.within_bound(self.check(choices)) and any(c.placement is target for c in choices):
            last = max(i for i, c in enumerate(choices) if c.placement is target)
            choices[last] = _KEEP

    def without_idle_writes(self, choices: Sequence[LayerChoice]) -> Choices:
        """``choices`` less every offloaded site whose write buys no memory.

        NOTE [Every offloaded byte buys memory]: a layer whose write completes after the
        peak, or whose read buffer is allocated before it, costs bandwidth and drive
        wear and lowers nothing. Last-admitted first, each OFFLOAD layer is cut to the
        fewest sites (none: back to KEEP) with which the predicted peak rises neither at
        the derated nor at the measured bandwidths (the I/O still hidden), until every
        remaining offloaded site lowers it.
        """
        choices = list(choices)
        peaks = (self.judge(choices).peak_bytes, self.check(choices).peak_bytes)

        def trial(i: int, k: int) -> Choices:
            if k == 0:
                return replaced(choices, i, _KEEP)
            now = choices[i]
            return replaced(choices, i, LayerChoice(now.placement, None if k == len(self.layer_at(i, now).sites) else k,
                                                    recompute=now.recompute))

        def no_higher(i: int, k: int) -> bool:
            c = trial(i, k)
            judged, checked = self.judge(c), self.check(c)
            return judged.peak_bytes <= peaks[0] and checked.peak_bytes <= peaks[1] and self.within_bound(judged)

        changed = True
        while changed:
            changed = False
            for i in range(self.n - 1, -1, -1):
                if choices[i].placement not in MOVED:
                    continue
                sites = choices[i].sites
                current = self.layer_at(i, choices[i]).sites[: sites]  # all of them when sites is None
                k = _smallest(0, len(current), lambda k: no_higher(i, k))
                if k < len(current):
                    choices = trial(i, k)
                    peaks = (self.judge(choices).peak_bytes, self.check(choices).peak_bytes)
                    changed = True
        return choices
