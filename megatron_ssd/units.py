"""Byte units: the one home of the binary multiples every module and report uses.

Reports print sizes in MiB (one unit family per table); ``gib`` is for the few one-line
messages about whole drives (free space, footprints of many gigabytes).
"""

from __future__ import annotations

__all__ = ["KiB", "MiB", "GiB", "TiB", "mib", "gib"]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40


def mib(nbytes: float) -> str:
    """``nbytes`` as ``"12.3 MiB"``."""
    return f"{nbytes / MiB:.1f} MiB"


def gib(nbytes: float) -> str:
    """``nbytes`` as ``"1.23 GiB"``."""
    return f"{nbytes / GiB:.2f} GiB"
