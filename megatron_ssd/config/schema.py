"""The configuration schema: validation, the dict / YAML round trip and the field
docstrings, for any tree of config dataclasses.

A config class is a dataclass whose fields carry their rules and unit in
:data:`typing.Annotated` metadata (:mod:`.rules`), whose
``__post_init__`` calls :func:`_settle`, and which may add a ``_check`` method for rules
that compare several fields and a ``_check_file`` classmethod for what a config file of
it must hold. :mod:`.tree` is the tree megatron-ssd reads, :mod:`.files` reads a config
file; :mod:`megatron_ssd.config` says why the schema is built this way.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import enum
import functools
import inspect
import logging
import math
import re
import textwrap
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Type, TypeVar

from ..errors import ConfigError, shown
from .files import read_config_file
from .rules import (LIST_RULE, MAX_BYTES, AtMost, Boolean, Directories, InRange, Integer, Number, OneOf, OneOfKinds,
                    OrAuto, Rule, Seconds, Switch, Unit, Bytes, split_list)

__all__ = [
    "load_config",
    "from_dict",
    "to_dict",
    "apply_overrides",
    "validate",
    "field_docs",
    "is_size_field",
    "is_duration_field",
    "takes_auto",
    "renamed_keys",
    "warn_renamed",
    "parse_size_option",
    "parse_count_option",
    "parse_list_option",
]

T = TypeVar("T")

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- validation

def _fail(cls_name: str, name: str, value: Any, rule: str) -> ConfigError:
    return ConfigError(f"{cls_name}.{name} = {shown(value)}: {rule}")


def _owner(obj: Any) -> str:
    """How errors name ``obj``: its class, or what its ``_error_owner`` method says
    (``LayerProfile(layer_id=3)``, where the class alone would not say which one)."""
    named = getattr(obj, "_error_owner", None)
    return named() if named is not None else type(obj).__name__


def _broken(obj: Any, name: str, rule: str) -> ConfigError:
    """The error for field ``name`` of ``obj``, its value read from ``obj`` (a ``_check``
    naming a field that is gone fails loudly instead of passing)."""
    return _fail(_owner(obj), name, getattr(obj, name), rule)


@functools.lru_cache(maxsize=None)
def _type_hints(cls: type) -> Dict[str, Any]:
    """The resolved annotations of ``cls``, ``Annotated`` metadata kept (cached per class:
    with ``from __future__ import annotations`` they are strings until resolved)."""
    return typing.get_type_hints(cls, include_extras=True)


@dataclass(frozen=True)
class _Spec:
    """A field's annotation taken apart: its type without ``Optional`` and ``Annotated``,
    whether None is allowed, its unit, its rules (in the order declared) and whether it
    also takes ``auto`` (:class:`~.rules.OrAuto`)."""

    base: Any
    optional: bool
    unit: Optional[Unit]
    rules: Tuple[Rule, ...]
    auto: bool = False


def _unwrap(hint: Any) -> Tuple[Any, bool, List[Any]]:
    """``hint`` without ``Optional`` and ``Annotated``: its type, whether None is allowed,
    and the ``Annotated`` metadata in the order declared."""
    meta: List[Any] = []
    optional = False
    while True:
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin is Annotated:
            hint, meta = args[0], meta + list(hint.__metadata__)
        elif origin is typing.Union and type(None) in args:
            hint, optional = next(a for a in args if a is not type(None)), True
        else:
            return hint, optional, meta


def _spec(hint: Any) -> _Spec:
    hint, optional, meta = _unwrap(hint)
    units = [m for m in meta if isinstance(m, Unit)]
    unit = units[0] if units else None
    rules = tuple(m for m in meta if isinstance(m, Rule))
    if unit is not None and unit.bound() is not None and not any(isinstance(r, (AtMost, InRange)) for r in rules):
        rules += (unit.bound(),)  # NOTE [Bounded numbers]: the unit's bound where the field declares none
    return _Spec(hint, optional, unit, rules, any(isinstance(m, OrAuto) for m in meta))


@functools.lru_cache(maxsize=None)
def _specs(cls: type) -> Dict[str, _Spec]:
    hints = _type_hints(cls)
    return {f.name: _spec(hints[f.name]) for f in dataclasses.fields(cls)}


def is_size_field(cls: type, name: str) -> bool:
    """Whether field ``name`` of ``cls`` is declared in :data:`Bytes` (so ``4MiB`` is
    accepted); other integer fields are counts."""
    return _specs(cls)[name].unit == Bytes


def is_duration_field(cls: type, name: str) -> bool:
    """Whether field ``name`` of ``cls`` is declared in :data:`Seconds` (so ``500ms`` or
    ``2min`` is accepted)."""
    return _specs(cls)[name].unit == Seconds


def takes_auto(cls: type, name: str) -> bool:
    """Whether field ``name`` of ``cls`` also takes the word ``auto`` (:class:`~.rules.OrAuto`)."""
    return _specs(cls)[name].auto


def _settle(obj: Any) -> None:
    """What every config's ``__post_init__`` does: normalise :class:`Switch` fields
    (``true`` -> ``on``), then :func:`validate`."""
    for name, spec in _specs(type(obj)).items():
        for rule in spec.rules:
            if isinstance(rule, Switch):
                setattr(obj, name, rule.convert(getattr(obj, name)))
    validate(obj)


def validate(obj: Any) -> None:
    """Check the rules of one config object (not its children); raise ConfigError.

    First each field's own rules, read from its ``Annotated`` metadata, in field order (a
    None in an ``Optional`` field skips them; on an ``Optional`` field the rule's text
    adds the unit and ``or null``: ``must be > 0 bytes or null``; ``auto`` in a field that
    takes it skips them too, and their text adds ``or auto``), then the class's ``_check``
    for rules that compare several fields."""
    cls_name = _owner(obj)
    specs = _specs(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        spec = specs[f.name]
        if isinstance(value, float) and not math.isfinite(value):
            raise _fail(cls_name, f.name, value, "must be a finite number")
        if value is None and spec.optional:
            continue
        if spec.auto and value == OrAuto.word:
            continue
        kind = None if any(isinstance(r, (Number, Boolean, OneOf, OneOfKinds)) for r in spec.rules) else \
            _kind_error(spec.base, value)  # a rule that judges the kind says it in its own words
        if kind is not None:
            raise _fail(cls_name, f.name, value, f"{kind} or null" if spec.optional else kind)
        for rule in spec.rules:
            text = rule.check(value)
            if text is not None:
                if spec.optional:
                    in_unit = spec.unit and spec.unit.word not in text
                    text = f"{text} {spec.unit.word} or null" if in_unit else f"{text} or null"
                if spec.auto:
                    text = f"{text} or {OrAuto.word}"
                raise _fail(cls_name, f.name, value, text)
    check = getattr(obj, "_check", None)
    if check is not None:
        check()


_KIND_RULES: Dict[Any, Rule] = {int: Integer(), float: Number(), bool: Boolean()}
"""The rule a field's declared type implies where none of its own judges the kind."""


def _kind_error(base: Any, value: Any) -> Optional[str]:
    """The rule ``value`` breaks by its kind alone, or None: a config built in Python
    (``PlannerConfig(profile_steps=1.5)``) is held to the kinds a YAML file or an
    override is converted to. Numbers and bools are judged by the kind rules of
    :mod:`.rules` (an integer is a number; a bool is neither)."""
    if base in _KIND_RULES:
        return _KIND_RULES[base].check(value)
    if base is str:
        return None if isinstance(value, str) else "must be a string"
    if typing.get_origin(base) in (list, List):
        return None if isinstance(value, (list, tuple)) else "must be a list"
    return None


# ----------------------------------------------------------------- dict / YAML round trip


def _split_list(cls_name: str, name: str, spec: _Spec, value: str) -> List[str]:
    """A list given as text (an override, a YAML string): ``a,b``, ``[a,b]`` or ``[]``; an
    empty entry is refused naming the value as given (NOTE [One list syntax] in
    ``rules.py``), in a list of directories with that rule's words."""
    items = split_list(value)
    if items is None:
        dirs = next((r for r in spec.rules if isinstance(r, Directories)), None)
        brackets = value.strip().startswith("[") == value.strip().endswith("]")
        raise _fail(cls_name, name, value, dirs.text if dirs is not None and brackets else LIST_RULE)
    return items


def _coerce(cls_name: str, name: str, hint: Any, value: Any) -> Any:
    """Convert a YAML / command-line value to the field's declared type; sizes, durations
    and switches are recognised by the field's ``Annotated`` metadata."""
    spec = _spec(hint)
    if spec.optional and (value is None or (isinstance(value, str) and value.lower() in ("none", "null"))):
        return None
    if spec.auto and isinstance(value, str) and value.strip().lower() == OrAuto.word:
        return OrAuto.word
    hint = spec.base
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if not isinstance(value, Mapping):
            raise _fail(cls_name, name, value, f"must be a mapping of {hint.__name__} fields")
        return from_dict(hint, value)
    if origin in (list, List, tuple, Tuple, Sequence):
        if isinstance(value, str):
            value = _split_list(cls_name, name, spec, value)
        if not isinstance(value, (list, tuple)):
            raise _fail(cls_name, name, value, "must be a list")
        inner = args[0] if args else Any
        if any(v == "" for v in value):  # NOTE [One list syntax]: in a YAML list too
            dirs = any(isinstance(r, Directories) for r in spec.rules)
            raise _fail(cls_name, name, value, "must not hold an empty entry" + (
                ": each entry names an offload directory" if dirs else ""))
        items = [_coerce(cls_name, name, inner, v) for v in value]
        return tuple(items) if origin in (tuple, Tuple) else items
    if origin in (dict, Dict, Mapping):
        if not isinstance(value, Mapping):
            raise _fail(cls_name, name, value, "must be a mapping")
        if len(args) == 2 and dataclasses.is_dataclass(args[1]):  # a mapping of settings by name
            return {k: _coerce(cls_name, f"{name}[{k!r}]", args[1], v) for k, v in value.items()}
        return dict(value)
    if hint is Any:
        return value
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            raise _fail(cls_name, name, value, f"must be one of {[m.value for m in hint]}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise _fail(cls_name, name, value, "must be a boolean (true/false)")
    if hint is int:
        if isinstance(value, bool):
            raise _fail(cls_name, name, value, "must be an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            if spec.unit == Bytes:
                return _parse_size(cls_name, name, value, spec.auto)
            return _parse_count(cls_name, name, value)
        raise _fail(cls_name, name, value, "must be an integer")
    if hint is float:
        if isinstance(value, bool):
            raise _fail(cls_name, name, value, "must be a number")
        if isinstance(value, str) and spec.unit == Seconds:
            return _parse_duration(cls_name, name, value)
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise _fail(cls_name, name, value, "must be a number")
        if not math.isfinite(number):
            raise _fail(cls_name, name, value, "must be a finite number")
        return number
    if hint is str:
        for rule in spec.rules:
            if isinstance(rule, Switch):
                value = rule.convert(value)
        if not isinstance(value, str):
            raise _fail(cls_name, name, value, "must be a string")
        return value
    return value


_SUFFIXES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50, "e": 1 << 60}
_DURATIONS = {"ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}


def _parse_count(cls_name: str, name: str, text: str) -> int:
    """Parse ``24``, ``1_000`` or ``1e3`` into an int; sizes such as ``1KiB`` are refused."""
    s = text.strip().replace("_", "")
    try:
        number = float(s)
    except ValueError:
        raise _fail(cls_name, name, text, "must be an integer such as 24 (a count, not a size)")
    if not math.isfinite(number):
        raise _fail(cls_name, name, text, "must be a finite integer")
    if not number.is_integer():
        raise _fail(cls_name, name, text, "must be a whole number")
    return int(s) if s.lstrip("+-").isdigit() else int(number)


def _parse_duration(cls_name: str, name: str, text: str) -> float:
    """Parse ``60``, ``60s``, ``500ms``, ``2min`` or ``1h`` into seconds."""
    s = text.strip().lower().replace("_", "")
    match = re.fullmatch(r"(.*?)\s*(ms|s|min|h)", s)
    number_text, unit = (match.group(1), match.group(2)) if match else (s, "s")
    try:
        number = float(number_text)
    except ValueError:
        raise _fail(cls_name, name, text, "must be a number of seconds or a duration such as 500ms, 30s, 2min, 1h")
    seconds = number * _DURATIONS[unit]
    if not math.isfinite(seconds):
        raise _fail(cls_name, name, text, "must be a finite number")
    return seconds


def _parse_size(cls_name: str, name: str, text: str, auto: bool = False) -> int:
    """Parse ``123``, ``4MiB``, ``4M``, ``1.5GiB`` or ``1e6`` into an int (``auto``: the
    field also takes ``auto``, and the error says so)."""
    s = text.strip().lower().replace("_", "")
    for tail in ("ib", "b"):
        if s.endswith(tail) and len(s) > len(tail) and s[-len(tail) - 1] in _SUFFIXES:
            s = s[: -len(tail)]
            break
    mult = 1
    if s and s[-1] in _SUFFIXES:
        mult, s = _SUFFIXES[s[-1]], s[:-1]
    try:
        number = float(s)
    except ValueError:
        raise _fail(cls_name, name, text, "must be auto, an integer or a size such as 4MiB" if auto
                    else "must be an integer or a size such as 4MiB")
    if s.lstrip("+-").isdigit():  # exact: a float would round 2**60 + 1 to 2**60
        return int(s) * mult
    value = number * mult
    if not math.isfinite(value):
        raise _fail(cls_name, name, text, "must be a finite integer")
    if not value.is_integer():
        raise _fail(cls_name, name, text, "must be a whole number of bytes")
    return int(value)


def _option_error(owner: str, option: str, text: str, rule: str) -> ConfigError:
    return ConfigError(f"{owner}: {option} {text}: {rule}")


def parse_size_option(owner: str, option: str, text: str, noun: str = "size", example: str = "600MiB") -> int:
    """A command-line size or rate (``rok --throttle 250MiB``), read as a config field's
    size is and held to the same bound (NOTE [Bounded numbers] in ``rules.py``).

    Raises:
        ConfigError: ``rok: --throttle 1e30: must be a rate > 0 and <= 1152921504606846976
            bytes (1 EiB) per second, such as 250MiB``.
    """
    per = " per second" if noun == "rate" else ""
    rule = f"must be a {noun} > 0 and <= {MAX_BYTES} bytes (1 EiB){per}, such as {example}"
    try:
        value = _parse_size(owner, option, text)
    except ConfigError:
        raise _option_error(owner, option, text, rule) from None
    if not 0 < value <= MAX_BYTES:
        raise _option_error(owner, option, text, rule)
    return value


def parse_count_option(owner: str, option: str, text: str, low: int, high: int) -> int:
    """A command-line count (``rok --rounds 3``), read as a config field's count is
    (``1e3`` and ``1_000`` too) and held to ``[low, high]`` (NOTE [Bounded numbers]).

    Raises:
        ConfigError: ``rok: --rounds 1000000000: must be >= 1 and <= 100 (a whole number)``.
    """
    try:
        value: Optional[int] = _parse_count(owner, option, text)
    except ConfigError:
        value = None
    if value is None or not low <= value <= high:
        raise _option_error(owner, option, text, f"must be >= {low} and <= {high} (a whole number)")
    return value


def parse_list_option(owner: str, option: str, text: str) -> List[str]:
    """A command-line list (``rok --placements keep,offload-all``), read as a config
    field's list is (NOTE [One list syntax] in ``rules.py``).

    Raises:
        ConfigError: ``rok: --placements ,: must be a list written a,b or [a,b] ...``.
    """
    items = split_list(text)
    if items is None:
        raise _option_error(owner, option, text, LIST_RULE)
    return items


def _dotted_keys(cls: type, prefix: str = "") -> List[str]:
    """Every field of ``cls`` and of its sections, as dotted keys (``offload.io.threads``)."""
    keys: List[str] = []
    hints = _type_hints(cls)
    for f in dataclasses.fields(cls):
        keys.append(prefix + f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            keys.extend(_dotted_keys(hints[f.name], prefix + f.name + "."))
    return keys


def _unknown_key(cls: type, key: str, root: Optional[type] = None, prefix: str = "", rest: str = "") -> ConfigError:
    """The error for ``prefix + key``, unknown in section ``cls`` of the tree ``root``.

    The suggestion is a full dotted key: the same name in another section first
    (``paths`` at the top of a TrainConfig is ``offload.paths``), then a near name in the
    same section, then a near name anywhere in the tree.
    """
    root = root or cls
    everywhere = _dotted_keys(root)
    here = [prefix + f.name for f in dataclasses.fields(cls)]
    same_name = [k for k in everywhere if k.rsplit(".", 1)[-1] == key]
    near_here = difflib.get_close_matches(prefix + key, here, n=1)
    leaves = {k.rsplit(".", 1)[-1]: k for k in reversed(everywhere)}
    near_anywhere = [leaves[n] for n in difflib.get_close_matches(key, list(leaves), n=1)]
    best = (same_name or near_here or near_anywhere)[:1]
    if best and rest and best[0] + rest in everywhere:  # planner.mode -> offload.planner.mode
        best = [best[0] + rest]
    hint = f"; did you mean {best[0]!r}?" if best else f"; known keys: {here}"
    return ConfigError(f"{cls.__name__}: unknown key {shown(prefix + key)}{hint}")


def renamed_keys(cls: type) -> Dict[str, str]:
    """The deprecated keys of config class ``cls``, each with the field it now names: a
    class lists them as ``_renamed_keys = {"old": "new"}``; a file or an override may still
    use the old key (:func:`from_dict` maps it, with one warning)."""
    return getattr(cls, "_renamed_keys", {})


_WARNED: Set[Tuple[str, str]] = set()


def warn_renamed(old: str, new: str) -> None:
    """Log, once per process, that ``old`` (a key or a flag) is deprecated for ``new``."""
    if (old, new) not in _WARNED:
        _WARNED.add((old, new))
        logger.warning("megatron_ssd: %s is deprecated; use %s", old, new)


def _new_names(cls: type, data: Mapping[str, Any], prefix: str) -> Mapping[str, Any]:
    """``data`` with each deprecated key of ``cls`` under its new name.

    Raises:
        ConfigError: an old key and its new one are both given, with different values.
    """
    renamed = {old: new for old, new in renamed_keys(cls).items() if old in data}
    if not renamed:
        return data
    out = dict(data)
    hints = _type_hints(cls)
    for old, new in renamed.items():
        value = out.pop(old)
        if new in out and (_coerce(cls.__name__, new, hints[new], out[new])
                           != _coerce(cls.__name__, new, hints[new], value)):
            raise ConfigError(f"{cls.__name__}: {prefix}{old} = {shown(value)} and {prefix}{new} = {shown(out[new])} "
                              f"are both given: {prefix}{old} is the deprecated name of {prefix}{new}; give only "
                              f"{prefix}{new}")
        out.setdefault(new, value)
        warn_renamed(prefix + old, prefix + new)
    return out


def from_dict(cls: Type[T], data: Mapping[str, Any], _root: Optional[type] = None, _prefix: str = "") -> T:
    """Build a config dataclass from a mapping, rejecting unknown keys (a deprecated key,
    :func:`renamed_keys`, is read as its new one)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{cls.__name__}: expected a mapping, got {type(data).__name__}")
    data = _new_names(cls, data, _prefix)
    hints = _type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if not isinstance(key, str):
            raise ConfigError(f"{cls.__name__}: key {shown(key)} ({type(key).__name__}): keys must be field names, "
                              f"known keys: {sorted(names)}")
        if key not in names:
            raise _unknown_key(cls, key, _root, _prefix)
        hint = hints[key]
        if dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
            kwargs[key] = from_dict(hint, value, _root or cls, f"{_prefix}{key}.")
        else:
            kwargs[key] = _coerce(cls.__name__, key, hint, value)
    return cls(**kwargs)


def to_dict(obj: Any) -> Dict[str, Any]:
    """The plain-dict form of a config (enums as their values), YAML-ready."""

    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, enum.Enum):
            return v.value
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(obj)


def apply_overrides(cls: Type[T], data: Dict[str, Any], overrides: Sequence[str]) -> Dict[str, Any]:
    """Apply ``dotted.key=value`` strings to a config mapping (checked against ``cls``)."""
    data = dict(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {shown(item)}: must have the form key=value (e.g. io.threads=4)")
        dotted, value = item.split("=", 1)
        parts = dotted.strip().split(".")
        node, node_cls = data, cls
        for i, part in enumerate(parts):
            names = {f.name for f in dataclasses.fields(node_cls)} | set(renamed_keys(node_cls))
            if part not in names:
                raise _unknown_key(node_cls, part, cls, "".join(p + "." for p in parts[:i]),
                                   "".join("." + p for p in parts[i + 1:]))
            if i == len(parts) - 1:
                node[part] = value
            else:
                hint = _type_hints(node_cls)[part]
                if not dataclasses.is_dataclass(hint):
                    raise ConfigError(
                        f"override {shown(item)}: {node_cls.__name__}.{part} is a value, not a section: it has no "
                        f"key {shown(parts[i + 1])} (set it as {'.'.join(parts[: i + 1])}=VALUE)"
                    )
                child = node.get(part)
                child = dict(child) if isinstance(child, Mapping) else {}
                node[part] = child
                node, node_cls = child, hint
    return data


def load_config(cls: Type[T], path: Optional[str] = None, overrides: Sequence[str] = ()) -> T:
    """Load ``cls`` from a YAML file (optional) with ``key=value`` overrides on top."""
    data: Dict[str, Any] = {}
    if path is not None:
        loaded = read_config_file(path)
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, Mapping):
            raise ConfigError(f"config file {shown(path)}: top level must be a mapping")
        data = dict(loaded)
        check_file = getattr(cls, "_check_file", None)
        if check_file is not None:  # what a file of this class must hold
            check_file(data, path)
    return from_dict(cls, apply_overrides(cls, data, overrides))


def field_docs(cls: type) -> Dict[str, str]:
    """Map each field of a dataclass to the docstring written under it in the source."""
    source = textwrap.dedent(inspect.getsource(cls))
    tree = ast.parse(source)
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: Dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs
