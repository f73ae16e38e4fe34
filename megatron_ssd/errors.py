"""Errors raised by megatron-ssd.

Every library error derives from :class:`MegatronSSDError` and its message starts with
``megatron_ssd:`` so a user can tell our failures from Megatron's or PyTorch's. A message
prints a value with :func:`shown` and a reason quoted from elsewhere with
:func:`clipped`, so it stays one short line however large the value.
"""

from __future__ import annotations

from typing import Any, Iterator

__all__ = [
    "MegatronSSDError",
    "ConfigError",
    "OffloadIOError",
    "ChecksumError",
    "WriteCancelled",
    "CacheStateError",
    "shown",
    "clipped",
]

_PREFIX = "megatron_ssd: "

SHOWN_CHARS = 200
"""The most characters of a value an error message prints: room for a list of a few
long paths, short enough that a message stays a line or two."""


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` as an error message prints it: whole when it has at most ``limit``
    characters, else its first ``limit``, an ellipsis and the value's length
    (``'xxxx...' (1048576 characters)``, ``[[1, 1, ...] (9 items)``), so no message grows
    with the value it names. Only those first characters are computed: a list of a
    billion shared items costs as little as a short one."""
    text = ""
    for chunk in _repr_chunks(value, limit):
        text += chunk
        if len(text) > limit:
            return f"{text[:limit]}... ({_length(value)})"
    return text


def clipped(text: str, limit: int = 200) -> str:
    """``text`` (a reason quoted from elsewhere), cut to its first ``limit`` characters
    with an ellipsis and its length when longer."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _repr_chunks(value: Any, limit: int) -> Iterator[str]:
    """``repr(value)`` in pieces, lazily, so a caller can stop after the first ``limit``
    characters; a string longer than that is cut before it is quoted."""
    if type(value) in (list, tuple, set, dict):
        if not value:
            yield repr(value)
            return
        opening, closing = {list: "[]", tuple: "()", dict: "{}"}.get(type(value), "{}")
        yield opening
        for i, item in enumerate(value.items() if isinstance(value, dict) else value):
            if i:
                yield ", "
            if isinstance(value, dict):
                yield from _repr_chunks(item[0], limit)
                yield ": "
                item = item[1]
            yield from _repr_chunks(item, limit)
        yield "," + closing if type(value) is tuple and len(value) == 1 else closing
    elif isinstance(value, (str, bytes)) and len(value) > limit:
        yield repr(value[: limit + 1])
    else:
        try:
            yield repr(value)
        except ValueError:  # an int past Python's digit limit for str()
            yield f"<an integer of {value.bit_length()} bits>"


def _length(value: Any) -> str:
    """How :func:`shown` states the full length of a value it cut."""
    if isinstance(value, str):
        return f"{len(value)} characters"
    if isinstance(value, bytes):
        return f"{len(value)} bytes"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"{len(value)} item{'' if len(value) == 1 else 's'}"
    try:
        return f"{len(repr(value))} characters"
    except ValueError:
        return f"{value.bit_length()} bits"


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
    writes] in ``io/recovery.py``); nothing of it stays allocated."""


class CacheStateError(MegatronSSDError, RuntimeError):
    """The tensor cache was used out of order (e.g. backward of a closed record)."""
