"""Block checksums: one xxh3_64 digest of each offloaded block's payload.

Integrity checking is on by default (``io.checksum: on``), so it has to be cheap:
``benchmarks/checksum_cost.py`` measured xxh3_64 (the ``xxhash`` package) at about
0.06 CPU-s per GB on 4 MiB blocks, against 0.07 for a hardware CRC32C (``crc32c``) and
0.44 for ``zlib.crc32`` (``benchmarks/results/checksum_cost.json``). Its calls release
the GIL for inputs over 64 KiB, so the I/O workers digest while the training thread runs.
A block moved in several pieces feeds them to one :class:`Digest` in payload order::

    d = Digest()
    d.update(head)
    d.update(body)
    stored = d.value()
"""

from __future__ import annotations

import xxhash

__all__ = ["ALGORITHM", "Digest", "digest", "format_digest"]

ALGORITHM = "xxh3_64"
"""Name of the checksum, as error messages show it."""


class Digest:
    """Incremental xxh3_64 of the pieces of one block (seed 0)."""

    __slots__ = ("_h",)

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, data: object) -> None:
        """Add the next piece (any contiguous buffer: memoryview, numpy array, bytes)."""
        self._h.update(data)

    def value(self) -> int:
        """The 64-bit digest of everything added so far."""
        return self._h.intdigest()


def digest(data: object) -> int:
    """The xxh3_64 of one contiguous buffer: ``Digest`` fed ``data`` alone."""
    return xxhash.xxh3_64_intdigest(data)


def format_digest(value: int) -> str:
    """``0x`` and 16 hex digits, as error messages show a digest."""
    return f"{value:#018x}"
