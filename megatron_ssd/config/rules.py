"""Rules bound to fields: what a config field's ``Annotated`` metadata may carry.

A field's unit (:data:`Bytes`, :data:`Seconds`: what YAML and overrides accept for it)
and its rules (:class:`Positive`, :class:`AtMost`, :class:`OneOf`, ...), each a
:class:`Rule` whose ``check`` returns the rule's text when a value breaks it;
:func:`~.schema.validate` runs them.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Annotated, Any, Optional, Tuple

__all__ = ["Unit", "Bytes", "Seconds", "ByteCount", "Duration", "Rule", "Positive", "NonNegative", "AtLeast",
           "AtMost", "MultipleOf", "InRange", "OneOf", "Switch", "is_int"]


@dataclass(frozen=True)
class Unit:
    """What a number field counts, so that YAML and overrides accept it in that unit:
    :data:`Bytes` (``4MiB``, ``2GiB``) on an int, :data:`Seconds` (``500ms``, ``2min``)
    on a float. A field without one is a plain count or number."""

    word: str

    def __repr__(self) -> str:
        return self.word.capitalize()


Bytes = Unit("bytes")
"""An int field holding bytes: sizes such as ``4MiB`` are accepted."""
Seconds = Unit("seconds")
"""A float field holding seconds: durations such as ``500ms`` or ``2min`` are accepted."""

ByteCount = Annotated[int, Bytes]
Duration = Annotated[float, Seconds]


class Rule(abc.ABC):
    """A check on one field's value, declared in the field's ``Annotated`` metadata."""

    @abc.abstractmethod
    def check(self, value: Any) -> Optional[str]:
        """None when ``value`` keeps the rule, else the rule's text for the error."""


@dataclass(frozen=True)
class Positive(Rule):
    def check(self, value: Any) -> Optional[str]:
        return None if value > 0 else "must be > 0"


@dataclass(frozen=True)
class NonNegative(Rule):
    def check(self, value: Any) -> Optional[str]:
        return None if value >= 0 else "must be >= 0"


@dataclass(frozen=True)
class AtLeast(Rule):
    low: Any

    def check(self, value: Any) -> Optional[str]:
        return None if value >= self.low else f"must be >= {self.low}"


@dataclass(frozen=True)
class AtMost(Rule):
    high: Any

    def check(self, value: Any) -> Optional[str]:
        return None if not value > self.high else f"must be <= {self.high}"


@dataclass(frozen=True)
class MultipleOf(Rule):
    step: int

    def check(self, value: Any) -> Optional[str]:
        return None if not value % self.step else f"must be a multiple of {self.step}"


@dataclass(frozen=True)
class InRange(Rule):
    """``lo <= value <= hi``, either end open (excluded) when asked: ``[0, 1)`` is
    ``InRange(0, 1, hi_open=True)``."""

    lo: Any
    hi: Any
    lo_open: bool = False
    hi_open: bool = False

    def check(self, value: Any) -> Optional[str]:
        above = self.lo < value if self.lo_open else self.lo <= value
        below = value < self.hi if self.hi_open else value <= self.hi
        if above and below:
            return None
        return f"must be in {'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"


@dataclass(frozen=True, init=False)
class OneOf(Rule):
    choices: Tuple[Any, ...]

    def __init__(self, *choices: Any) -> None:
        object.__setattr__(self, "choices", choices)

    def check(self, value: Any) -> Optional[str]:
        return None if value in self.choices else f"must be one of {list(self.choices)}"


@dataclass(frozen=True, init=False)
class Switch(OneOf):
    """A string field that is ``on`` or ``off`` and also takes YAML booleans
    (``true`` / ``false``, ``yes`` / ``no``, ``1`` / ``0``) and ``auto`` (``on``)."""

    def __init__(self) -> None:
        super().__init__("on", "off")

    @staticmethod
    def convert(value: Any) -> Any:
        return _switch(value)


_ON, _OFF = ("true", "yes", "1"), ("false", "no", "0")


def _switch(value: Any) -> Any:
    """Map ``True`` / ``"true"`` to ``"on"`` and ``False`` / ``"false"`` to ``"off"``;
    ``"auto"`` (the old measured default) is ``"on"``: checksums are cheap enough to keep.
    Anything else is returned as is for validation to judge."""
    if isinstance(value, bool):
        return "on" if value else "off"
    low = value.strip().lower() if isinstance(value, str) else None
    if low in _ON:
        return "on"
    if low in _OFF:
        return "off"
    if low == "auto":
        return "on"
    return low if low in ("on", "off") else value


def is_int(value: Any, low: int) -> bool:
    """Whether ``value`` is an integer (not a bool) of at least ``low``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low

