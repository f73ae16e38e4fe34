"""95% bootstrap intervals of the step-time measurements ``train`` and ``rok`` report.

Measurement statistics, not the planner's: its profile takes medians
(:func:`~megatron_ssd.planner.measured_profile.median_or_zero`); how sure a comparison
of two placements' step times is belongs to the commands that compare them.
"""

from __future__ import annotations

import random
from typing import Callable, List, Sequence

from ..planner.measured_profile import median_or_zero

__all__ = ["bootstrap_ci95", "median_ci95", "ratio_ci95"]


def bootstrap_ci95(statistic: Callable[[random.Random], float], resamples: int = 2000, seed: int = 0) -> List[float]:
    """The 2.5th and 97.5th percentiles of ``statistic(rng)`` over ``resamples`` calls.

    ``statistic`` draws its own resample from ``rng`` (with replacement) and returns the
    statistic of it. The seed is fixed, so the same measurements always give the same
    interval.
    """
    rng = random.Random(seed)
    values = sorted(statistic(rng) for _ in range(resamples))
    return [values[int(0.025 * (resamples - 1))], values[int(round(0.975 * (resamples - 1)))]]


def median_ci95(xs: List[float]) -> List[float]:
    """95% bootstrap interval of the median of ``xs`` (resampled whole, with replacement)."""
    return bootstrap_ci95(lambda rng: median_or_zero(rng.choices(xs, k=len(xs))))


def ratio_ci95(num_rounds: Sequence[Sequence[float]], den_rounds: Sequence[Sequence[float]],
               resamples: int = 2000, seed: int = 0) -> List[float]:
    """95% interval of ``median(num) / median(den)`` (steps pooled over rounds).

    NOTE [Stratified bootstrap]: each resample draws, round by round, as many steps as
    the round has, with replacement, from that round's own steps, for the numerator and
    the denominator alike; the pooled medians' ratio is recorded, and the 2.5th and
    97.5th percentiles of ``resamples`` ratios are the interval. Resampling within rounds
    keeps every resample's mix of rounds (and so of machine drift) equal to the
    measurement's. The seed is fixed so the same steps always give the same interval.
    Rounds with no steps are skipped; with none at all the interval is ``[nan, nan]``.
    """
    pairs = [(list(a), list(b)) for a, b in zip(num_rounds, den_rounds) if a and b]
    if not pairs:
        return [float("nan"), float("nan")]

    def resampled_ratio(rng: random.Random) -> float:
        num: List[float] = []
        den: List[float] = []
        for a, b in pairs:
            num.extend(rng.choices(a, k=len(a)))
            den.extend(rng.choices(b, k=len(b)))
        return median_or_zero(num) / median_or_zero(den)

    return bootstrap_ci95(resampled_ratio, resamples, seed)
