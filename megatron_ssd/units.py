"""Byte units: the one home of the binary multiples every module and report uses.

Reports print sizes in MiB (one unit family per table); ``gib`` is for the few one-line
messages about whole drives (free space, footprints of many gigabytes). Volumes written to a
drive per day are in decimal terabytes (:data:`TB`), the unit of drive endurance ratings
(TBW, and DWPD x capacity), so they can be read against a drive's data sheet.
"""

from __future__ import annotations

__all__ = ["KiB", "MiB", "GiB", "TiB", "TB", "mib", "gib"]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40
TB = 10**12
"""A decimal terabyte, as drive makers rate endurance (TBW) and capacity."""


def mib(nbytes: float) -> str:
    """``nbytes`` as ``"12.3 MiB"``."""
    return f"{nbytes / MiB:.1f} MiB"


def gib(nbytes: float) -> str:
    """``nbytes`` as ``"1.23 GiB"``."""
    return f"{nbytes / GiB:.2f} GiB"
