"""Per-layer choices for :func:`~megatron_ssd.planner.step_timeline.predict` from the
placements, read-aheads and site counts a test writes side by side."""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

from megatron_ssd.placement import LayerChoice, Placement


def choices_of(placements: Sequence[Placement], read_ahead: Union[int, Sequence] = 1,
               sites: Optional[Sequence[Optional[int]]] = None) -> List[LayerChoice]:
    """One choice per placement: ``read_ahead`` for every layer or one per layer (a list
    per site), ``sites`` one per layer (None: all sites everywhere)."""
    n = len(placements)
    aheads = list(read_ahead) if isinstance(read_ahead, (list, tuple)) else [read_ahead] * n
    counts = list(sites) if sites is not None else [None] * n
    assert len(aheads) == len(counts) == n, "one read-ahead and one site count per layer"
    return [LayerChoice(p, k, a) for p, k, a in zip(placements, counts, aheads)]
