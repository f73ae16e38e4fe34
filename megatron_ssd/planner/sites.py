"""A plan's per-layer site arguments: how many of a layer's sites move, each site's
read-ahead, the order in which backward uses them, and when their writes can be done
(NOTE [Sites], NOTE [Site use times] and NOTE [Site save times] in ``profile.py``, NOTE
[Write and read issue points]); :func:`predict
<megatron_ssd.planner.step_timeline.predict>` reads them through here."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

from ..config import is_int
from ..errors import ConfigError
from .profile import LayerProfile

__all__ = ["ReadAhead", "read_ahead_list", "site_read_aheads", "site_list", "site_write_ends", "use_order", "write_order"]

ReadAhead = Union[int, Sequence[int]]
"""One layer's read-issue point: a read-ahead in layers (>= 1) for all its sites, or one
per site (>= 0; NOTE [Write and read issue points])."""


def read_ahead_list(read_ahead: Union[int, Sequence[ReadAhead]], n: int) -> List[ReadAhead]:
    """One read-ahead per layer (:data:`ReadAhead`) from one for every layer or a per-layer sequence.

    Raises:
        ConfigError: a read-ahead below 1, a per-site read-ahead below 0, or a sequence whose
            length is not ``n``.
    """
    rule = f"must be an integer >= 1, or one per layer ({n}), each an integer >= 1 or a list of integers >= 0"
    if is_int(read_ahead, 1):
        return [read_ahead] * n  # type: ignore[list-item]
    if not isinstance(read_ahead, (list, tuple)) or len(read_ahead) != n:
        raise ConfigError(f"read_ahead = {read_ahead!r}: {rule}")
    out: List[ReadAhead] = []
    for d in read_ahead:
        if is_int(d, 1):
            out.append(d)
        elif isinstance(d, (list, tuple)) and all(is_int(x, 0) for x in d):
            out.append(list(d))
        else:
            raise ConfigError(f"read_ahead = {read_ahead!r}: {rule}")
    return out


def site_read_aheads(read_ahead: ReadAhead, layer: LayerProfile) -> List[int]:
    """Each site's read-ahead from a layer's :data:`ReadAhead`.

    Raises:
        ConfigError: a per-site list whose length is not the layer's site count.
    """
    m = len(layer.sites)
    if isinstance(read_ahead, int):
        return [read_ahead] * m
    if len(read_ahead) != m:
        raise ConfigError(f"read_ahead[{layer.layer_id!r}] = {list(read_ahead)!r}: must have one read-ahead per "
                          f"site ({m})")
    return list(read_ahead)


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
    if layer.site_use is None:  # every site used at 0: last saved first
        return list(reversed(moved))
    return sorted(moved, key=lambda s: (layer.use_at(s), -s))


def write_order(layer: LayerProfile, moved: Sequence[int]) -> List[int]:
    """The moved sites that write bytes, in the order the forward saves them (NOTE [Site
    save times] in ``profile.py``): a site of no bytes, saved first by another layer,
    writes nothing (NOTE [Sites])."""
    sites = layer.sites
    return [s for s in sorted(moved, key=layer.saved_at) if sites[s]]


def site_write_ends(layer: LayerProfile, moved: Sequence[int], first: float, start: float, computed: float,
                    bandwidth: float) -> List[Tuple[float, int]]:
    """(end, bytes) of each moved site's write, in save order, one at a time from ``first``
    on, each no earlier than its save point (NOTE [Site save times] in ``profile.py``) on
    the forward's replayed span ``start`` to ``computed``; sites of no bytes write
    nothing and are left out."""
    done, span, sites = first, computed - start, layer.sites
    ends: List[Tuple[float, int]] = []
    for s in write_order(layer, moved):
        done = max(done, start + layer.saved_at(s) * span) + sites[s] / bandwidth
        ends.append((done, sites[s]))
    return ends
