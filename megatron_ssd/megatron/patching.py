"""The one registry of attributes megatron-ssd replaces in Megatron-LM's modules.

Every replacement goes through :func:`patch`, so :func:`restore` can undo all of them (or
those made after a mark) in reverse order. Used by :mod:`.integration` (the
``pretrain_gpt.py`` hooks) and :mod:`.cpu_pretrain` (the CPU development mode).
"""

from __future__ import annotations

from typing import Any, List, Tuple

__all__ = ["is_patched", "mark", "patch", "restore"]

_PATCHES: List[Tuple[Any, str, Any]] = []
"""(module, attribute, original value) of every patch in force, in the order made."""


def patch(module: Any, name: str, replacement: Any) -> None:
    """Set ``module.name`` to ``replacement``, remembering the original for :func:`restore`."""
    _PATCHES.append((module, name, getattr(module, name)))
    setattr(module, name, replacement)


def is_patched(module: Any, name: str) -> bool:
    """Whether ``module.name`` was replaced and not yet restored."""
    return any(m is module and n == name for m, n, _ in _PATCHES)


def mark() -> int:
    """A position to :func:`restore` down to."""
    return len(_PATCHES)


def restore(down_to: int = 0) -> None:
    """Undo the patches made after ``down_to`` (default: all), newest first."""
    while len(_PATCHES) > down_to:
        module, name, original = _PATCHES.pop()
        setattr(module, name, original)
