"""The YAML presets shipped with the package, found by name (NOTE [Shipped presets]).

``--config gpt-tiny`` (or ``gpt-tiny.yaml``, or ``configs/gpt-tiny.yaml`` where no such file
is) reads the preset ``gpt-tiny``; ``megatron-ssd presets`` (:mod:`megatron_ssd.commands.presets`)
lists them, one line each.
"""

from __future__ import annotations

import os
import re
from typing import List, Optional

__all__ = ["PRESET_SUFFIX", "presets_dir", "preset_names", "find_preset", "resolve_config_path"]

PRESET_SUFFIX = ".yaml"

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# NOTE [Shipped presets]
# The presets live at the top of the repository, ``configs/*.yaml`` (where the docs and
# the make targets name them), and setup.py maps them into the wheel as package data,
# ``megatron_ssd/presets/*.yaml``. An installed wheel has no ``configs/`` beside the user's
# working directory, so ``megatron-ssd train`` (whose default is ``configs/gpt-tiny.yaml``)
# stopped with "config file 'configs/gpt-tiny.yaml': does not exist". Now a ``--config``
# (and ``--ssd-offload-config``) that names no existing file but a preset, as ``NAME``,
# ``NAME.yaml`` or ``configs/NAME.yaml``, reads the preset: from ``megatron_ssd/presets``
# in a wheel, from the checkout's ``configs/`` in an editable install. A path that exists
# always wins, so a file of the user's own is never shadowed; an absolute path or one in
# another directory is never taken for a name.


def presets_dir() -> Optional[str]:
    """The directory of the shipped presets: the wheel's ``megatron_ssd/presets``, else the
    checkout's ``configs/`` (an editable install); None when neither is there."""
    for d in (os.path.join(_PACKAGE, "presets"), os.path.join(os.path.dirname(_PACKAGE), "configs")):
        if os.path.isdir(d):
            return d
    return None


def preset_names() -> List[str]:
    """The names of the shipped presets, sorted (``gpt-tiny`` for ``gpt-tiny.yaml``)."""
    d = presets_dir()
    if d is None:
        return []
    return sorted(n[: -len(PRESET_SUFFIX)] for n in os.listdir(d) if n.endswith(PRESET_SUFFIX))


def _name_of(path: str) -> Optional[str]:
    """The preset a ``--config`` value may name: ``NAME``, ``NAME.yaml``, ``configs/NAME.yaml``."""
    head, tail = os.path.split(os.path.normpath(path))
    if head not in ("", "configs") or not tail:
        return None
    return tail[: -len(PRESET_SUFFIX)] if tail.endswith(PRESET_SUFFIX) else tail


def find_preset(path: str) -> Optional[str]:
    """The shipped preset that ``path`` names (NOTE [Shipped presets]), or None."""
    name = _name_of(path)
    d = presets_dir()
    if name is None or d is None or name not in preset_names():
        return None
    return os.path.join(d, name + PRESET_SUFFIX)


def resolve_config_path(path: str) -> str:
    """``path`` where it exists, else the preset it names, else ``path`` (whose reading then
    says it does not exist)."""
    if os.path.lexists(path):
        return path
    return find_preset(path) or path
