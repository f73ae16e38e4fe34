"""Rules bound to fields: what a config field's ``Annotated`` metadata may carry.

A field's unit (:data:`Bytes`, :data:`Seconds`: what YAML and overrides accept for it)
and its rules (:class:`Positive`, :class:`AtMost`, :class:`OneOf`, ...; :class:`Number`,
:class:`Integer`, :class:`ListOf` for fields whose type code fills, not only YAML), each a
:class:`Rule` whose ``check`` returns the rule's text when a value breaks it;
:func:`~.schema.validate` runs them.
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from typing import Annotated, Any, List, Optional, Sequence, Tuple

__all__ = ["Unit", "Bytes", "Seconds", "ByteCount", "Duration", "OrAuto", "Rule", "Positive", "NonNegative", "AtLeast",
           "AtMost", "MultipleOf", "InRange", "OneOf", "Switch", "Number", "Integer", "Boolean", "ListOf", "OneOfKinds",
           "Directories", "is_int", "same_directory", "split_list", "LIST_RULE", "MAX_BYTES", "MAX_SECONDS"]


MAX_BYTES = 1 << 60
"""The largest size any field or option takes, 1 EiB (NOTE [Bounded numbers])."""

MAX_SECONDS = 7 * 24 * 3600.0
"""The longest duration any field takes, a week (NOTE [Bounded numbers])."""


# NOTE [Bounded numbers]: every count, size, rate and duration a user gives has an upper
# bound, refused in one line naming the field, the value and the bound. Without one,
# ``device_memory_cap=1e30`` was accepted (and printed as 931322574615478534144.00 GiB),
# ``rok --rounds 1000000000`` started to run, and ``1e30`` seconds overflows a thread's
# wait. A count's bound is declared on its field (``AtMost``, ``InRange``), or, where
# nothing but memory limits it (steps, micro-batches, the model's sizes), is the
# machine's (NOTE [Bounds from the machine] in ``tree.py``); a size or a duration takes
# its unit's (:data:`MAX_BYTES`, 1 EiB: within a signed 64-bit integer, as torch and the
# kernel take sizes; :data:`MAX_SECONDS`) unless its field declares a tighter one. A size is read the same way whatever its spelling: ``1PiB``, ``2**50`` as
# digits and ``1.1259e15`` are one number, judged by one bound (``1e30`` and ``2EiB``
# alike are over it). rok's options are parsed by the same functions
# (:func:`~.schema.parse_size_option`, :func:`~.schema.parse_count_option`).


@dataclass(frozen=True)
class Unit:
    """What a number field counts, so that YAML and overrides accept it in that unit:
    :data:`Bytes` (``4MiB``, ``2GiB``) on an int, :data:`Seconds` (``500ms``, ``2min``)
    on a float. A field without one is a plain count or number. ``most`` bounds every
    field in the unit that declares no tighter bound (NOTE [Bounded numbers])."""

    word: str
    most: Optional[float] = None
    most_shown: str = ""

    def __repr__(self) -> str:
        return self.word.capitalize()

    def bound(self) -> Optional["AtMost"]:
        """The rule of :attr:`most`: ``must be <= 1152921504606846976 bytes (1 EiB)``."""
        return None if self.most is None else AtMost(self.most, f"{self.word} ({self.most_shown})")


Bytes = Unit("bytes", MAX_BYTES, "1 EiB")
"""An int field holding bytes: sizes such as ``4MiB`` are accepted."""
Seconds = Unit("seconds", MAX_SECONDS, "a week")
"""A float field holding seconds: durations such as ``500ms`` or ``2min`` are accepted."""

ByteCount = Annotated[int, Bytes]
Duration = Annotated[float, Seconds]


@dataclass(frozen=True)
class OrAuto:
    """Field metadata: besides the values of its type, the field takes the word ``auto``
    (any case), kept as the string ``"auto"`` and resolved where the value is used; the
    field's rules judge every other value (``host_pool_bytes``: ``auto``, ``16GiB`` or 0)."""

    word = "auto"


class Rule(abc.ABC):
    """A check on one field's value, declared in the field's ``Annotated`` metadata.

    A rule says what it asks (:attr:`text`, the error's rule part: ``must be > 0``) and
    whether a value keeps it (:meth:`holds`); :meth:`check` joins the two. A value of a
    type the rule cannot compare (a string against ``> 0``) breaks it."""

    @property
    @abc.abstractmethod
    def text(self) -> str:
        """The rule as an error states it, starting ``must be``."""

    @abc.abstractmethod
    def holds(self, value: Any) -> bool:
        """Whether ``value`` keeps the rule."""

    def check(self, value: Any) -> Optional[str]:
        """None when ``value`` keeps the rule, else the rule's text for the error."""
        try:
            kept = self.holds(value)
        except TypeError:
            kept = False
        return None if kept else self.text


def _tail(rule: Optional[Rule]) -> str:
    """`` > 0`` for a rule whose text is ``must be > 0``; empty for none."""
    return "" if rule is None else " " + rule.text[len("must be "):]


@dataclass(frozen=True)
class Positive(Rule):
    text = "must be > 0"

    def holds(self, value: Any) -> bool:
        return value > 0


@dataclass(frozen=True)
class NonNegative(Rule):
    text = "must be >= 0"

    def holds(self, value: Any) -> bool:
        return value >= 0


@dataclass(frozen=True)
class AtLeast(Rule):
    low: Any

    @property
    def text(self) -> str:
        return f"must be >= {self.low}"

    def holds(self, value: Any) -> bool:
        return value >= self.low


@dataclass(frozen=True)
class AtMost(Rule):
    high: Any
    unit: str = ""
    """Said after the bound: ``bytes (1 EiB)``."""

    @property
    def text(self) -> str:
        return f"must be <= {self.high:g} {self.unit}" if self.unit and isinstance(self.high, float) else (
            f"must be <= {self.high} {self.unit}" if self.unit else f"must be <= {self.high}")

    def holds(self, value: Any) -> bool:
        return not value > self.high


@dataclass(frozen=True)
class MultipleOf(Rule):
    step: int

    @property
    def text(self) -> str:
        return f"must be a multiple of {self.step}"

    def holds(self, value: Any) -> bool:
        return not value % self.step


@dataclass(frozen=True)
class InRange(Rule):
    """``lo <= value <= hi``, either end open (excluded) when asked: ``[0, 1)`` is
    ``InRange(0, 1, hi_open=True)``."""

    lo: Any
    hi: Any
    lo_open: bool = False
    hi_open: bool = False

    @property
    def text(self) -> str:
        return f"must be in {'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"

    def holds(self, value: Any) -> bool:
        above = self.lo < value if self.lo_open else self.lo <= value
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below


@dataclass(frozen=True, init=False)
class OneOf(Rule):
    choices: Tuple[Any, ...]

    def __init__(self, *choices: Any) -> None:
        object.__setattr__(self, "choices", choices)

    @property
    def text(self) -> str:
        return f"must be one of {list(self.choices)}"

    def holds(self, value: Any) -> bool:
        return value in self.choices


@dataclass(frozen=True)
class Number(Rule):
    """An int or a float, not a bool, that keeps ``rule`` too: ``Number(Positive())``
    reads ``must be a number > 0``. Fields that code (not only YAML) fills, whose type
    the dataclass itself does not enforce, declare it."""

    rule: Optional[Rule] = None
    noun = "a number"
    plural = "numbers"

    @property
    def text(self) -> str:
        return f"must be {self.noun}{_tail(self.rule)}"

    def is_kind(self, value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    def holds(self, value: Any) -> bool:
        return self.is_kind(value) and (self.rule is None or self.rule.holds(value))


@dataclass(frozen=True)
class Integer(Number):
    """An int, not a bool, that keeps ``rule`` too: ``must be an integer >= 0``."""

    noun = "an integer"
    plural = "integers"

    def is_kind(self, value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Boolean(Rule):
    """``True`` or ``False`` (not 0 / 1)."""

    text = "must be true or false"

    def holds(self, value: Any) -> bool:
        return isinstance(value, bool)


@dataclass(frozen=True)
class ListOf(Rule):
    """A list whose every item keeps ``item``: ``ListOf(Integer(Positive()))`` reads
    ``must be a list of integers > 0``."""

    item: Number

    @property
    def text(self) -> str:
        return f"must be a list of {self.item.plural}{_tail(self.item.rule)}"

    def holds(self, value: Any) -> bool:
        return isinstance(value, list) and all(self.item.check(v) is None for v in value)


@dataclass(frozen=True, init=False)
class OneOfKinds(Rule):
    """An instance of one of ``kinds`` (a bool is not an int): ``OneOfKinds(str, int,
    noun="a string or an integer")``."""

    kinds: Tuple[type, ...]
    noun: str

    def __init__(self, *kinds: type, noun: str) -> None:
        object.__setattr__(self, "kinds", kinds)
        object.__setattr__(self, "noun", noun)

    @property
    def text(self) -> str:
        return f"must be {self.noun}"

    def holds(self, value: Any) -> bool:
        return isinstance(value, self.kinds) and not isinstance(value, bool)


@dataclass(frozen=True)
class Directories(Rule):
    """A list of directory names, none of them empty (NOTE [One list syntax]): a YAML
    list or a list built in code is held to it as a string is by :func:`split_list`."""

    text = "must not hold an empty entry: each entry names an offload directory"

    def holds(self, value: Any) -> bool:
        return isinstance(value, (list, tuple)) and all(isinstance(p, str) and p for p in value)


LIST_RULE = "must be a list written a,b or [a,b] ([] for none), without an empty entry"
"""What :func:`split_list` asks of a list given as text."""


def split_list(text: str) -> Optional[List[str]]:
    """A list given as text (an override, a YAML string, a command-line option), read one
    way for every key (NOTE [One list syntax]): ``a,b`` and ``[a,b]`` are ``["a", "b"]``,
    ``[]`` is the empty list, each entry's surrounding blanks are dropped (``[a, b]``).

    Returns:
        The entries; None when the text breaks :data:`LIST_RULE` (an empty entry, as in
        ``,``, ``a,,b``, ``[a,]`` or an empty text; a bracket on one side only).
    """
    s = text.strip()
    opened, closed = s.startswith("["), s.endswith("]")
    if opened != closed:
        return None
    if opened:
        s = s[1:-1].strip()
        if not s:
            return []
    items = [item.strip() for item in s.split(",")]
    return None if any(not item for item in items) else items


# NOTE [One list syntax]: a list given as text has one syntax for every key and every
# option: ``a,b`` or ``[a,b]``, and ``[]`` for the empty list. Before, list fields dropped
# empty entries (``compare=,`` was no comparison) while ``offload.paths`` refused them and
# read ``[]`` as the empty list, ``compare=[]`` became the entry ``'[]'``,
# ``offload.paths=[/x]`` the path ``'[/x]'``, and ``rok --placements ,`` ran every default
# placement. An empty entry is a mistake, never a wish (``offload.paths=$DIRS`` with the
# variable empty used to train into the default directory), so it is refused wherever a
# list is read: overrides, YAML strings and lists of paths, the Megatron flags, rok's
# options; only ``[]`` (or leaving the key out) asks for an empty list.


def _directory_key(path: str) -> Tuple[Any, ...]:
    """What makes two paths one directory: device and inode where the path exists (a bind
    mount, ``A/../A``, a second spelling), else the normalised absolute path."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return ("path", os.path.normpath(os.path.abspath(path)))
    return ("inode", st.st_dev, st.st_ino)


def same_directory(paths: Sequence[str]) -> Optional[Tuple[int, int]]:
    """Indices ``(i, j)``, ``i < j``, of the first two of ``paths`` that are one directory
    (compared by device and inode where they exist, by absolute path where they do not);
    None when all differ."""
    seen = {}
    for j, path in enumerate(paths):
        key = _directory_key(path)
        if key in seen:
            return seen[key], j
        seen[key] = j
    return None


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

