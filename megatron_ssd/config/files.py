"""Reading a config file: what ``--config FILE`` (and ``--ssd-offload-config``) may
name, and the YAML document in it, bounded before any Python object is built.

:func:`read_config_file` is the one place a config file is opened;
:func:`~.schema.load_config` turns what it returns into a config tree.
"""

from __future__ import annotations

import functools
import os
import re
import stat
import sys
from typing import Any, Dict, Tuple

from ..errors import ConfigError, clipped, shown
from ..units import MiB
from .presets import _name_of, preset_names, resolve_config_path

__all__ = ["MAX_CONFIG_BYTES", "MAX_CONFIG_DEPTH", "MAX_CONFIG_NODES", "read_config_file"]

# NOTE [Config file bounds]: YAML lets a short file describe a huge value. An alias
# (``*a``) names a node written earlier, so nine lines of nine aliases each describe 9**9
# (387 million) items; PyYAML builds them as shared lists in a blink, but anything that
# walks the value (an error message's repr, a type check of each item) pays for every
# one: such a config once wrote 2 GiB to stderr in 57 s at 7.1 GB RSS. A long file costs
# too (PyYAML reads about 1 MB a second), and a deep one overflows PyYAML's recursion.
# So a config file is bounded three ways before any Python object is built from it:
# its size in bytes (checked before it is parsed), how deep it nests, and how many nodes
# it expands to with each alias counted as the nodes it names, every time it is used.
# The last two are measured while the document is composed into nodes, each node's
# expanded size and depth recorded as it completes, so an alias costs one lookup and
# nothing is ever expanded; an alias inside the node it names (``&a [*a]``) expands
# without end and is refused too. A config is a few KB, a few hundred nodes and five
# levels deep, so the bounds refuse only what no config needs.

MAX_CONFIG_BYTES = 1 * MiB
"""The largest config file read, in bytes (the shipped presets are under 4 KiB)."""
MAX_CONFIG_DEPTH = 32
"""The deepest nesting of lists and mappings in a config file, aliases expanded (the
shipped presets nest four levels)."""
MAX_CONFIG_NODES = 100_000
"""The most YAML nodes (scalars, lists and mappings, keys included) a config file may
expand to, each alias counted as the nodes it names wherever it is used."""

_FILE_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
               (stat.S_ISSOCK, "a socket"))


def _named(path: str) -> str:
    return f"config file {shown(path)}"


class _Refused(Exception):
    """The YAML in a config file breaks a rule; the message is the part after the file."""


def read_config_file(path: str) -> Any:
    """The YAML document in the config file ``path`` (where no file is there, the shipped
    preset it names: NOTE [Shipped presets] in ``presets.py``): plain YAML only (safe tags,
    no ``!!python``), each key at most once per mapping, within the bounds of NOTE [Config
    file bounds].

    Raises:
        ConfigError: ``path`` is missing, a directory or not a regular file (a device, a
            FIFO, a socket), cannot be read, is not UTF-8, is not valid YAML, or breaks a
            bound; one line naming the file, what is wrong and the rule.
    """
    given, path = path, resolve_config_path(path)  # a preset by name (NOTE [Shipped presets])
    try:
        info = os.stat(path)
    except FileNotFoundError:
        hint = ("" if _name_of(given) is None else
                f", and no preset is named so: `megatron-ssd presets` lists them ({', '.join(preset_names())})")
        raise ConfigError(f"{_named(path)}: does not exist{hint}") from None
    except OSError as e:
        raise ConfigError(f"{_named(path)}: cannot be read ({e.strerror}): --config must name a readable YAML "
                          "file") from None
    if stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{_named(path)}: is a directory: --config must name a YAML file")
    if not stat.S_ISREG(info.st_mode):
        kind = next((word for test, word in _FILE_KINDS if test(info.st_mode)), "not a file")
        raise ConfigError(f"{_named(path)}: is not a regular file ({kind}): --config must name a YAML file")
    try:
        with open(path, "rb") as fh:  # the size read, not stat's: the file may change in between
            data = fh.read(MAX_CONFIG_BYTES + 1)
            size = max(os.fstat(fh.fileno()).st_size, len(data))
    except OSError as e:
        raise ConfigError(f"{_named(path)}: cannot be read ({e.strerror}): --config must name a readable YAML "
                          "file") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{_named(path)}: is {size} bytes: must be at most {MAX_CONFIG_BYTES} bytes (1 MiB; a "
                          "config file is a few KB)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{_named(path)}: byte {e.object[e.start]:#04x} at offset {e.start} is not "
                          "valid UTF-8: config files must be UTF-8 text") from None
    return _load(path, text)


def _load(path: str, text: str) -> Any:
    import yaml

    loader = _loader()(text)
    try:
        return loader.get_single_data()
    except _Refused as e:
        raise ConfigError(f"{_named(path)}: {e}") from None
    except _DuplicateKey as e:
        raise ConfigError(f"{_named(path)}: key {shown(e.key)} at line {e.line} is given twice (first at line "
                          f"{e.first}): each key may appear once in a mapping") from None
    except yaml.constructor.ConstructorError as e:
        where = f" at line {e.problem_mark.line + 1}" if e.problem_mark else ""
        tag = re.search(r"tag '([^']*)'", str(e.problem))
        if tag is None:  # a safe tag whose text is wrong (!!binary that is not base64)
            raise ConfigError(f"{_named(path)}: {clipped(str(e.problem))}{where}: config files are plain YAML") from None
        raise ConfigError(f"{_named(path)}: tag {shown(tag.group(1))}{where} is not allowed: config files are plain "
                          "YAML (no !!python or other object tags)") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ConfigError(f"{_named(path)}: invalid YAML{where} ({clipped(problem)}): must be a YAML mapping "
                          "of config fields") from None
    finally:
        loader.dispose()


class _DuplicateKey(Exception):
    """A mapping of a config file names one key twice."""

    def __init__(self, key: Any, line: int, first: int) -> None:
        super().__init__(key, line, first)
        self.key, self.line, self.first = key, line, first


@functools.lru_cache(maxsize=None)
def _loader() -> type:
    """``yaml.SafeLoader`` that measures each node as it is composed (NOTE [Config file
    bounds]), refuses a key given twice in one mapping (plain YAML lets the last one win,
    silently; keys merged in with ``<<`` may still be overridden), and turns a scalar
    its tag cannot read (``!!int x``, ``2024-13-45``) into one line."""
    import yaml

    class BoundedLoader(yaml.SafeLoader):
        def __init__(self, stream: str) -> None:
            super().__init__(stream)
            self._sizes: Dict[int, Tuple[int, int]] = {}  # id(node): (nodes expanded, depth)
            self._depth = 0  # lists and mappings open around the node being composed
            self._expanded = 0  # nodes so far, each alias counted as the nodes it names

        def compose_node(self, parent: Any, index: Any) -> Any:
            line = self.peek_event().start_mark.line + 1
            if self.check_event(yaml.AliasEvent):
                node = super().compose_node(parent, index)
                if id(node) not in self._sizes:
                    raise _Refused(f"the alias at line {line} is used inside the value it names, so it expands "
                                   f"without end: must expand to at most {MAX_CONFIG_NODES} YAML nodes")
                self._count(*self._sizes[id(node)], line)
                return node
            self._count(1, 1, line)
            self._depth += 1
            try:
                node = super().compose_node(parent, index)
            finally:
                self._depth -= 1
            children = node.value if isinstance(node, yaml.SequenceNode) else \
                [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else []
            sizes = [self._sizes[id(c)] for c in children]
            self._sizes[id(node)] = (1 + sum(s[0] for s in sizes), 1 + max((s[1] for s in sizes), default=0))
            return node

        def _count(self, nodes: int, depth: int, line: int) -> None:
            """Add ``nodes`` nodes, ``depth`` deep, at the current depth (line ``line``)."""
            self._expanded += nodes
            if self._expanded > MAX_CONFIG_NODES:
                raise _Refused(f"expands to more than {MAX_CONFIG_NODES} YAML nodes ({self._expanded} by line {line}, "
                               "each alias counted as the nodes it names wherever it is used): must expand to at "
                               f"most {MAX_CONFIG_NODES} (a config has a few hundred)")
            if self._depth + depth > MAX_CONFIG_DEPTH:
                raise _Refused(f"nests {self._depth + depth} levels deep at line {line} (aliases expanded): must "
                               f"nest at most {MAX_CONFIG_DEPTH} levels")

        def construct_object(self, node: Any, deep: bool = False) -> Any:
            try:
                return super().construct_object(node, deep=deep)
            except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as e:
                kind = node.tag.rsplit(":", 1)[-1]
                raise _Refused(f"value {shown(node.value)} at line {node.start_mark.line + 1} is not a valid "
                               f"{kind} ({clipped(str(e))}): config files are plain YAML") from None

        def construct_yaml_int(self, node: Any) -> Any:
            digits = sum(c.isdigit() for c in node.value)
            if sys.get_int_max_str_digits() and digits > sys.get_int_max_str_digits():
                raise _Refused(f"the integer at line {node.start_mark.line + 1} has {digits} digits: must have "
                               f"at most {sys.get_int_max_str_digits()}")
            return super().construct_yaml_int(node)

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: Dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise _DuplicateKey(key, line, seen[key])
                    seen[key] = line
                except TypeError:  # an unhashable key: construct_mapping names it
                    continue
            return super().construct_mapping(node, deep=deep)

    BoundedLoader.add_constructor("tag:yaml.org,2002:int", BoundedLoader.construct_yaml_int)
    return BoundedLoader
