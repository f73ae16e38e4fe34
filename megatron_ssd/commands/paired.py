"""Paired steps (NOTE [Paired steps]): keep-everything and a placement back to back in one
process, so the machine's drift cancels out of their step-time ratio; ``train``'s
``paired_steps`` and ``rok --paired`` run them after the offload phase."""

from __future__ import annotations

import statistics
from typing import Any, Callable, Dict, List

from ..cache import StepStats, TensorCache
from ..placement import Placement
from .intervals import median_ci95
from .output import Progress
from .steps import step_line
from .timing import StepTimer

__all__ = ["run_pairs"]


def run_pairs(cache: TensorCache, run_step: Callable[[int], float], first_step: int, pairs: int,
              sink: List[StepStats], timer: StepTimer, settle: int, out: Any = None) -> Dict[str, Any]:
    """``pairs`` pairs of steps, keep-everything against the cache's final placement:
    ``run_step(step)`` runs one step and appends its :class:`StepStats` to ``sink``; each
    timed step follows ``settle`` untimed ones of its kind (``paired_settle_steps``);
    progress goes to ``out``.

    NOTE [Paired steps]: the two steps of a pair run back to back in one process, so
    a drift of the machine's speed over minutes hits both alike and cancels out of
    their ratio; which step goes first alternates (keep first in even pairs), so a
    drift within a pair cancels over two pairs. The keep step sets every layer to
    KEEP; the other restores the plan and the default placement the offload phase
    ended with. Each timed step follows ``paired_settle_steps`` (default 2) untimed
    steps of its own kind: a step right after a switch inherits the other kind's
    memory state (keep's backward leaves glibc's heap full of resident free pages
    that the plan's trims would otherwise have given back and faulted in again), so
    unsettled pairs understate the plan's cost, and one settle step is not always
    enough (measured: docs/performance.md#run-2026-11-24-paired-settle). The planner
    sees none of these steps: it neither re-plans nor profiles. Where keep-everything
    does not fit the planner's capacity (its ``fits``), no pair runs: the keep step
    would run under the capacity guard, which offloads (``paired_not_run`` says so;
    on the H200 such "keep" steps wrote 2.3 GB and the pairs read 0.21x). They continue
    training, so the model after them differs from the offload phase's
    (``final_loss`` stays the offload phase's). On a GPU each timed step's time is its
    CUDA-event time (NOTE [Device step time]), elsewhere its ``wall_s``.
    """
    plan = cache.plan()
    keep_s: List[float] = []
    offload_s: List[float] = []
    written = {True: 0, False: 0}
    cancelled = {True: 0, False: 0}
    step = first_step
    progress = Progress("paired keep/offload", pairs, out)
    recorded = len(sink)
    for i in range(pairs):
        for keep in ((True, False) if i % 2 == 0 else (False, True)):
            if keep:
                cache.set_plan({}, Placement.KEEP)
            else:
                cache.set_plan(plan.choices, plan.default)
            cache.policy.rule_active = not keep  # a peer's rule too (OffloadConfig.peer)
            for _ in range(settle + 1):  # the last one is timed
                loss = run_step(step)
                step += 1
            (keep_s if keep else offload_s).append(timer.last_s if timer.enabled else sink[-1].wall_s)
            written[keep] += sink[-1].bytes_offloaded
            cancelled[keep] += sink[-1].bytes_write_cancelled
        progress.step(step_line("pair", loss, sink[-1]))
    progress.close()
    cache.set_plan(plan.choices, plan.default)
    cache.policy.rule_active = True
    ratios = [o / k for o, k in zip(offload_s, keep_s)]
    return {"pairs": pairs, "settle_steps": settle, "steps_run": len(sink) - recorded,
            "timing": "cuda_events" if timer.enabled else "wall_s",
            "keep_step_s": keep_s, "offload_step_s": offload_s, "ratios": ratios,
            "median_ratio": statistics.median(ratios), "ratio_ci95": median_ci95(ratios),
            "keep_bytes_written": written[True], "offload_bytes_written_per_step": written[False] / pairs,
            "offload_bytes_write_cancelled_per_step": cancelled[False] / pairs}
