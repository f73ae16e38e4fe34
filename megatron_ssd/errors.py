"""Errors raised by megatron-ssd.

Every library error derives from :class:`MegatronSSDError` and its message starts with
``megatron_ssd:`` so a user can tell our failures from Megatron's or PyTorch's.
"""

from __future__ import annotations

__all__ = [
    "MegatronSSDError",
    "ConfigError",
    "OffloadIOError",
    "ChecksumError",
    "WriteCancelled",
    "CacheStateError",
]

_PREFIX = "megatron_ssd: "


def _prefixed(message: str) -> str:
    return message if message.startswith(_PREFIX) else _PREFIX + message


class MegatronSSDError(Exception):
    """Base class of every error raised by megatron-ssd."""

    def __init__(self, message: str) -> None:
        super().__init__(_prefixed(message))


class ConfigError(MegatronSSDError, ValueError):
    """A configuration value breaks a rule; the message names field, value and rule."""


class OffloadIOError(MegatronSSDError, OSError):
    """A read or write to an offload path failed (short transfer, ENOSPC, EIO, ...)."""


class ChecksumError(OffloadIOError):
    """Data read back from an offload path does not match what was written."""


class WriteCancelled(OffloadIOError):
    """A write was cancelled before all its bytes reached the disk (NOTE [Cancelled
    writes] in ``io/striped.py``); nothing of it stays allocated."""


class CacheStateError(MegatronSSDError, RuntimeError):
    """The tensor cache was used out of order (e.g. backward of a closed record)."""
