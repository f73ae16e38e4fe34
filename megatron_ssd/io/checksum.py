"""Block checksums: one xxh3_64 digest of each offloaded block's payload.

Integrity checking is on by default (``io.checksum: on``), so it has to be cheap: of the
digests ``benchmarks/checksum_cost.py`` compares, xxh3_64 (the ``xxhash`` package) costs
the least CPU per byte (measured: docs/io.md#checksums). Its calls release the GIL for
inputs over 64 KiB, so the I/O workers digest while the training thread runs.
A block moved in several pieces feeds them to one :class:`Digest` in payload order::

    d = Digest()
    d.update(head)
    d.update(body)
    stored = d.value()

NOTE [Device checksums]: a block that GPUDirect Storage moves straight between device
memory and the drive never passes through host memory, and digesting it with xxh3 would
cost a device-to-host copy of every block. Those blocks get a checksum computed where the
bytes are, with torch ops on the device: ``wsum64``, the sum modulo 2^64 of the block's
little-endian 64-bit words (zero-padded) each times an odd weight that depends on its
position. Any change confined to one word changes it (an odd weight is invertible modulo
2^64), and a random corruption goes unnoticed with probability about 2^-64, as with
xxh3; it is weaker than xxh3 only against corruptions built to cancel out. The same
function runs on CPU tensors, so a ``wsum64`` block read back through host memory is
verified there as well. Each extent records its algorithm (``Extent.checksum_algo``).
"""

from __future__ import annotations

from typing import Union

import torch
import xxhash

__all__ = ["ALGORITHM", "DEVICE_ALGORITHM", "Digest", "WeightedSum", "digest", "format_digest", "new_digest",
           "wsum64"]

ALGORITHM = "xxh3_64"
"""Name of the host checksum, as error messages and extents show it."""

DEVICE_ALGORITHM = "wsum64"
"""Name of the checksum computed on the device (NOTE [Device checksums])."""

_MASK = (1 << 64) - 1
_K1 = 0x9E3779B97F4A7C15 - (1 << 64)  # the 64-bit constants as int64 (torch scalars are signed)
_K2 = 0xBF58476D1CE4E5B9 - (1 << 64)


class Digest:
    """Incremental xxh3_64 of the pieces of one block (seed 0)."""

    __slots__ = ("_h",)
    algorithm = ALGORITHM

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, data: object, offset: int = 0) -> None:
        """Add the next piece (any contiguous buffer: memoryview, numpy array, bytes);
        ``offset`` (its place in the block) is implied by the order of the calls."""
        self._h.update(data)

    def value(self) -> int:
        """The 64-bit digest of everything added so far."""
        return self._h.intdigest()


def _weights(first: int, n: int, device: torch.device) -> torch.Tensor:
    """The odd int64 weights of words ``first .. first + n - 1`` (a mixing function of the
    position, computed on ``device``: no table to copy there)."""
    z = torch.arange(first + 1, first + n + 1, dtype=torch.int64, device=device) * _K1
    z = z ^ (z >> 31)
    z = z * _K2
    z = z ^ (z >> 29)
    return z | 1


def wsum64(data: torch.Tensor, first_word: int = 0) -> torch.Tensor:
    """``wsum64`` of the ``uint8`` tensor ``data`` taken as words ``first_word`` on of a
    block (NOTE [Device checksums]); a 0-d int64 tensor on ``data``'s device, computed
    with torch ops queued on the current stream (no copy to the host)."""
    n = data.numel()
    words, tail = divmod(n, 8)
    if data.storage_offset() % 8:
        data = data.clone()  # a fresh, aligned storage: int64 words need 8-byte alignment
    w = _weights(first_word, words + (1 if tail else 0), data.device)
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    if words:
        total = (data[: words * 8].view(torch.int64) * w[:words]).sum()
    if tail:
        shifts = torch.arange(0, 8 * tail, 8, dtype=torch.int64, device=data.device)
        last = (data[words * 8 :].to(torch.int64) << shifts).sum()
        total = total + last * w[words]
    return total


class WeightedSum:
    """Incremental ``wsum64`` of the pieces of one block (NOTE [Device checksums]);
    pieces may come in any order, each at a multiple of 8 bytes into the block."""

    __slots__ = ("_total",)
    algorithm = DEVICE_ALGORITHM

    def __init__(self) -> None:
        self._total = 0

    def update(self, data: Union[torch.Tensor, memoryview], offset: int = 0) -> None:
        """Add the piece ``data`` (host bytes) found ``offset`` bytes into the block."""
        if offset % 8:
            raise ValueError(f"megatron_ssd: {DEVICE_ALGORITHM} piece at offset {offset}: must be a multiple of 8")
        t = data if isinstance(data, torch.Tensor) else torch.frombuffer(data, dtype=torch.uint8)
        self._total += int(wsum64(t, offset // 8).item())

    def value(self) -> int:
        """The 64-bit sum of every piece added so far."""
        return self._total & _MASK


def new_digest(algorithm: str) -> Union[Digest, WeightedSum]:
    """An empty incremental digest of ``algorithm`` (``xxh3_64`` or ``wsum64``)."""
    if algorithm == ALGORITHM:
        return Digest()
    if algorithm == DEVICE_ALGORITHM:
        return WeightedSum()
    raise ValueError(f"megatron_ssd: unknown checksum algorithm {algorithm!r}")


def digest(data: object) -> int:
    """The xxh3_64 of one contiguous buffer: ``Digest`` fed ``data`` alone."""
    return xxhash.xxh3_64_intdigest(data)


def format_digest(value: int) -> str:
    """``0x`` and 16 hex digits, as error messages show a digest."""
    return f"{value:#018x}"
