"""Helpers that touch offloaded bytes on disk behind the engine's back (fault tests)."""

from __future__ import annotations

import os

from megatron_ssd.io.base import Extent


def flip_payload_bits(extent: Extent, at: int, mask: int) -> None:
    """XOR ``mask`` into payload byte ``at`` of ``extent`` on disk (after its skew) and sync."""
    fd = os.open(extent.file, os.O_RDWR)
    try:
        where = extent.offset + extent.skew + at
        byte = os.pread(fd, 1, where)
        os.pwrite(fd, bytes([byte[0] ^ mask]), where)
        os.fsync(fd)
    finally:
        os.close(fd)
