"""A plan's per-layer site arguments: how many of a layer's sites move, each site's
read-ahead, and the order in which backward uses them (NOTE [Sites] in ``profile.py``,
NOTE [Write and read issue points] and NOTE [Site use times]); :func:`predict
<megatron_ssd.planner.step_timeline.predict>` reads them through here."""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

from ..config import is_int
from ..errors import ConfigError
from .profile import LayerProfile

__all__ = ["ReadAhead", "read_ahead_list", "site_depths", "site_list", "use_order"]

ReadAhead = Union[int, Sequence[int]]
"""One layer's read-issue point: a read-ahead in layers (>= 1) for all its sites, or one
per site (>= 0; NOTE [Write and read issue points])."""


def read_ahead_list(prefetch_depth: Union[int, Sequence[ReadAhead]], n: int) -> List[ReadAhead]:
    """One read-ahead per layer (:data:`ReadAhead`) from a depth or a per-layer sequence.

    Raises:
        ConfigError: a depth below 1, a per-site depth below 0, or a sequence whose
            length is not ``n``.
    """
    rule = f"must be an integer >= 1, or one per layer ({n}), each an integer >= 1 or a list of integers >= 0"
    if is_int(prefetch_depth, 1):
        return [prefetch_depth] * n  # type: ignore[list-item]
    if not isinstance(prefetch_depth, (list, tuple)) or len(prefetch_depth) != n:
        raise ConfigError(f"prefetch_depth = {prefetch_depth!r}: {rule}")
    out: List[ReadAhead] = []
    for d in prefetch_depth:
        if is_int(d, 1):
            out.append(d)
        elif isinstance(d, (list, tuple)) and all(is_int(x, 0) for x in d):
            out.append(list(d))
        else:
            raise ConfigError(f"prefetch_depth = {prefetch_depth!r}: {rule}")
    return out


def site_depths(depth: ReadAhead, layer: LayerProfile) -> List[int]:
    """Each site's read-ahead from a layer's :data:`ReadAhead`.

    Raises:
        ConfigError: a per-site list whose length is not the layer's site count.
    """
    m = len(layer.sites)
    if isinstance(depth, int):
        return [depth] * m
    if len(depth) != m:
        raise ConfigError(f"prefetch_depth[{layer.layer_id!r}] = {list(depth)!r}: must have one read-ahead per "
                          f"site ({m})")
    return list(depth)


def site_list(sites: Optional[Sequence[Optional[int]]], layers: Sequence[LayerProfile]) -> List[Optional[int]]:
    """One site count per layer (None: all its sites) from ``sites`` (None: all, everywhere).

    Raises:
        ConfigError: a sequence whose length is not the layer count, or a count outside
            [0, the layer's number of sites].
    """
    n = len(layers)
    if sites is None:
        return [None] * n
    if not isinstance(sites, (list, tuple)) or len(sites) != n:
        raise ConfigError(f"sites = {sites!r}: must be None or one entry per layer ({n})")
    out: List[Optional[int]] = []
    for layer, k in zip(layers, sites):
        if k is not None and not (is_int(k, 0) and k <= len(layer.sites)):
            raise ConfigError(
                f"sites[{layer.layer_id!r}] = {k!r}: must be None or an integer in [0, {len(layer.sites)}] "
                "(the layer's site count)"
            )
        out.append(k)
    return out


def use_order(layer: LayerProfile, count: Optional[int]) -> List[int]:
    """The first ``count`` (None: all) sites of ``layer`` in the order its backward uses
    them: by use point (NOTE [Site use times]), ties last saved first."""
    moved = range(len(layer.sites) if count is None else count)
    return sorted(moved, key=lambda s: (layer.use_at(s), -s))
